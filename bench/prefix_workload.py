"""bench/prefix's workloads and its streaming open-loop client.

Shared-prefix (llm-d's shape): G groups, each with a long system prompt of its own (`prefix_words`
words, at least 75% of every prompt's tokens), U users per group, each request a short question of
`query_words` fresh words from one user of one group. The control workload has the same sizes with
nothing shared: every system prompt is fresh words too.

Tokens: the sim worker counts one token per whitespace word and one per chat message's role marker
(node_host/backends/sim/worker.py: prompt_token_ids), so a prompt's token count is exact here. For a
real engine (`engine="vllm"`) the model's tokenizer decides, so there the text is drawn from a
`vocabulary` of words that are one token each in it (bench/prefix_vllm.py picks them and counts the
prompts' tokens with the tokenizer): a group's system prompt is `prefix_words` of them drawn from the
group's seed, a question `query_words` drawn from the request's, and the control's system prompts are
drawn from the request's seed too.

The client sends chat completions with `"stream": true`, open loop (Poisson arrivals fixed in advance),
and measures from the scheduled send time: time to the first streamed chunk (TTFT) and to the end of the
answer; the instance that answered is the sidecar's `x-sie-instance` header.

With `engine="vllm"` a request also asks for exactly `max_tokens` tokens (`ignore_eos`: a random-weight
model may end at once, and every mode must do the same work) and for the usage in the last chunk, which
is where the output token count comes from; and TTFT is to the first chunk that carries a choice: vLLM
sends its first (the assistant's role) with its first token, after the prefill, and the text of a token
of a random model can be empty (a special token, part of a UTF-8 character), which would put TTFT a
token late.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from bench.loadgen import schedule


@dataclass(frozen=True)
class Workload:
    shared: bool  # False: the control workload, no prefix shared between requests
    groups: int = 16
    users: int = 8
    # 16 prefixes of 1,200 tokens (19,200) do not fit one instance's KV budget (bench/prefix: 12,288) but
    # four of them do: a cache-blind balancer makes every instance cycle through all of them.
    prefix_words: int = 1200
    query_words: int = 100
    max_tokens: int = 16
    seed: int = 7
    engine: str = "sim"  # "vllm": the request and TTFT as the module docstring says
    vocabulary: tuple[str, ...] = ()  # words of one token each to draw text from (a real engine's tokenizer)

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_words + self.query_words + 2  # two role markers

    @property
    def shared_fraction(self) -> float:
        return (self.prefix_words + 1) / self.prompt_tokens if self.shared else 0.0

    def _drawn(self, what: str, n: int) -> str:
        rng = random.Random(f"{self.seed}-{what}")
        return " ".join(rng.choice(self.vocabulary) for _ in range(n))

    def group_prefix(self, group: int) -> str:
        if self.vocabulary:
            return self._drawn(f"g{group}", self.prefix_words)
        return " ".join(f"g{group}s{k}" for k in range(self.prefix_words))

    def body(self, model: str, i: int) -> dict:
        """Request number i of a run: its group and user drawn from the seed, its question fresh."""
        rng = random.Random(self.seed * 1_000_003 + i)
        group, user = rng.randrange(self.groups), rng.randrange(self.users)
        if self.shared:
            system = self.group_prefix(group)
        elif self.vocabulary:
            system = self._drawn(f"c{i}", self.prefix_words)
        else:
            system = " ".join(f"c{i}x{k}" for k in range(self.prefix_words))
        if self.vocabulary:
            question = self._drawn(f"q{i}", self.query_words)
        else:
            question = " ".join(f"u{group}.{user}q{i}w{k}" for k in range(self.query_words))
        body = {
            "model": model,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        if self.engine == "vllm":
            body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
        return body


@dataclass(frozen=True)
class Sample:
    scheduled_s: float
    ttft_s: float | None  # None: no chunk arrived
    e2e_s: float
    status: int  # HTTP status; 0: transport error
    tokens: int  # output tokens streamed (the sim's text is a word per token)
    instance: str


def _chunk_text(data: bytes) -> str:
    """The text a streamed chat chunk carries ("" for the role chunk or anything else)."""
    try:
        choice = json.loads(data)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return str((choice.get("delta") or {}).get("content") or choice.get("text") or "")


def _chunk_choice_and_usage(data: bytes) -> tuple[bool, int | None]:
    """Whether a streamed chunk carries a choice, and the completion tokens of its usage (the last chunk
    of a stream asked with include_usage), if it has one."""
    try:
        doc = json.loads(data)
    except ValueError:
        return False, None
    if not isinstance(doc, dict):
        return False, None
    usage = doc.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return bool(doc.get("choices")), tokens if isinstance(tokens, int) else None


async def stream_load(
    session: aiohttp.ClientSession, url: str, model: str, workload: Workload, rate: float, duration_s: float, first: int
) -> list[Sample]:
    """Open-loop streamed chat completions at `rate` for `duration_s`; request numbers from `first`."""
    samples: list[Sample] = []
    start = time.perf_counter()

    async def one(i: int, at: float) -> None:
        ttft, status, tokens, instance = None, 0, 0, ""
        try:
            async with session.post(
                url + "/v1/chat/completions", json=workload.body(model, i), timeout=aiohttp.ClientTimeout(total=120)
            ) as resp:
                status, instance = resp.status, resp.headers.get("x-sie-instance", "")
                async for line in resp.content:
                    if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                        continue
                    if workload.engine == "vllm":
                        choice, usage = _chunk_choice_and_usage(line[5:])
                        if choice and ttft is None:
                            ttft = time.perf_counter() - start - at
                        tokens = usage if usage is not None else tokens
                        continue
                    text = _chunk_text(line[5:])
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - start - at
                        tokens += len(text.split())  # the sim sends a word per token, several per chunk
        except (TimeoutError, aiohttp.ClientError):
            status = 0
        samples.append(Sample(at, ttft, time.perf_counter() - start - at, status, tokens, instance))

    tasks = []
    for n, at in enumerate(schedule(rate, duration_s, seed=first)):
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(first + n, at)))
    await asyncio.gather(*tasks)
    samples.sort(key=lambda s: s.scheduled_s)
    return samples


async def closed_loop(
    session: aiohttp.ClientSession, url: str, model: str, workload: Workload, clients: int, duration_s: float
) -> float:
    """Requests per second completed by `clients` back-to-back callers (a saturation probe)."""
    done = 0
    stop = time.perf_counter() + duration_s
    counter = iter(range(10**9))

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            body = workload.body(model, 500_000 + next(counter))
            try:
                async with session.post(
                    url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)
                ) as resp:
                    async for _ in resp.content:
                        pass
                    if resp.status == 200 and time.perf_counter() < stop:
                        done += 1
            except (TimeoutError, aiohttp.ClientError):
                pass

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(clients)))
    return done / max(1e-9, min(duration_s, time.perf_counter() - started))
