"""The torch worker as a real process: one request cannot fail or stall the others (the reviewer's
reproductions, as tests). Bad sampling parameters and token ids get a 400 naming them while the
requests beside them finish; a chat template that never ends fails its own request at the deadline
while a plain /generate is served and SIGTERM still stops the worker; a prompt that cannot fit is
refused before it is tokenized; bodies are capped at the spec's limits.max_body_bytes."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import urllib.request

import aiohttp
import pytest

from tests.integration.worker_process import running_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODULE = "node_host.backends.torch_engine"
MAX_BODY = 5 * 2**20
VICTIM = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}


def session(base: str, headers: dict[str, str]) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(base, headers=headers, timeout=aiohttp.ClientTimeout(total=120))


async def answer(http: aiohttp.ClientSession, path: str, body: dict, delay: float = 0.0) -> tuple[int, dict]:
    await asyncio.sleep(delay)
    return await post(http, path, json.dumps(body).encode())


async def post(http: aiohttp.ClientSession, path: str, raw: bytes) -> tuple[int, dict]:
    # a file object: aiohttp warns that raw bytes this large might block the client's loop
    async with http.post(path, data=io.BytesIO(raw), headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json()


async def beside_two_victims(http: aiohttp.ClientSession, bad: dict) -> tuple[int, dict]:
    """`bad` sent while two greedy 300-token generations decode; both must finish whole."""
    *victims, got = await asyncio.gather(
        *(answer(http, "/generate", {"text": f"Hello {i}", "sampling_params": VICTIM}) for i in (1, 2)),
        answer(http, "/generate", bad, delay=0.3),
    )
    for status, body in victims:
        assert status == 200, body
        assert body["meta_info"]["completion_tokens"] == 300
    return got


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch-isolation")
    spec = {
        "spec": {
            "model": {"name": "tiny", "path": str(tmp / "models" / "tiny")},
            "backend": {"type": "torch", "config": {"demo": True, "max_running_requests": 4}},
            "limits": {"max_body_bytes": MAX_BODY},
        }
    }
    with running_worker(MODULE, spec, tmp) as worker:
        yield worker


@pytest.mark.parametrize(
    "params, status, needle",
    [
        # torch.multinomial refused the batch's distribution: every request in the batch got a 503
        (
            {"max_new_tokens": 4, "temperature": 1.0, "top_p": 0.0},
            400,
            "sampling_params.top_p: 0.0 is outside (0.0, 1.0]",
        ),
        # 1e-40 made the probabilities inf/NaN: greedy now, as vLLM treats temperatures below 1e-5
        ({"max_new_tokens": 4, "temperature": 1e-40}, 200, None),
    ],
    ids=["top_p-0", "temperature-1e-40"],
)
async def test_bad_sampling_parameters_fail_at_most_their_own_request(demo, params, status, needle):
    async with session(*demo) as http:
        got, body = await beside_two_victims(http, {"text": "x", "sampling_params": params})
    assert got == status, body
    if needle:
        assert body["error"]["type"] == "bad_request" and needle in body["error"]["message"]


async def test_a_prompt_that_cannot_fit_is_refused_before_it_stalls_a_stream(demo):
    """4 MiB of text took 3 s to tokenize on the engine's only thread, stalling every stream, then got 400."""
    gaps: list[float] = []
    async with session(*demo) as http:

        async def stream() -> None:
            body = {"text": "Hello", "stream": True, "sampling_params": {**VICTIM, "max_new_tokens": 1500}}
            last = None
            async with http.post("/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        async def big() -> tuple[int, dict, float]:
            await asyncio.sleep(0.3)
            text = ("The quick brown fox jumps over the lazy dog. " * 95_000)[: 4 * 2**20]
            t0 = time.monotonic()
            status, body = await answer(http, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
            return status, body, time.monotonic() - t0

        _, (status, body, took) = await asyncio.gather(stream(), big())
    assert status == 400 and "characters, more than this model's context" in body["error"]["message"]
    assert took < 1.0, took
    assert max(gaps) < 1.0, max(gaps)


async def test_bodies_are_capped_at_the_specs_limit(demo):
    async with session(*demo) as http:
        status, body = await post(http, "/generate", b" " * (MAX_BODY + 1))
        assert status == 413 and str(MAX_BODY) in body["error"]["message"], body
        status, body = await post(http, "/generate", b" " * (MAX_BODY - 2) + b"{}")  # the limit itself is fine
        assert status == 400 and "exactly one of 'text'" in body["error"]["message"], body


# ---- a model whose tokenizer has tokens its embedding table does not ------------------------------------


def test_token_ids_past_the_embedding_table_are_400s_and_the_batch_goes_on(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

    model = ensure_tiny_qwen2(tmp_path / "models" / "tiny")
    (model / "sie-demo.json").unlink()  # now just a model directory
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_tokens([f"<extra_{i}>" for i in range(8)])  # a fine-tune that did not resize the embeddings
    tok.save_pretrained(model)
    rows = AutoConfig.from_pretrained(model).vocab_size
    assert len(AutoTokenizer.from_pretrained(model)) > rows
    spec = {"spec": {"model": {"name": "tiny", "path": str(model)}, "backend": {"type": "torch"}}}

    async def go(base: str, headers: dict[str, str]) -> None:
        async with session(base, headers) as http:
            for bad, needle in [
                ({"input_ids": [rows + 1]}, f"its embedding table has {rows} rows"),
                ({"text": "hi <extra_3>"}, "'<extra_3>'"),
            ]:
                status, body = await beside_two_victims(http, {**bad, "sampling_params": {"max_new_tokens": 2}})
                assert status == 400 and needle in body["error"]["message"], body

    with running_worker(MODULE, spec, tmp_path) as worker:
        asyncio.run(go(*worker))


# ---- a chat template that never ends ------------------------------------------------------------------


def test_an_endless_chat_template_fails_its_request_alone_and_sigterm_still_stops_the_worker(tmp_path):
    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

    model = ensure_tiny_qwen2(tmp_path / "models" / "tiny")
    (model / "sie-demo.json").unlink()
    (model / "chat_template.jinja").write_text(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}hello"
    )
    spec = {"spec": {"model": {"name": "tiny", "path": str(model)}, "backend": {"type": "torch"}}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def go(base: str, headers: dict[str, str]) -> None:
        async with session(base, headers) as http:
            alone = await stream(http)
            t0 = time.monotonic()
            pending = asyncio.create_task(answer(http, "/v1/chat/completions", chat))
            await asyncio.sleep(1.0)
            # A stream beside the template: it was held until the template stopped (10 s), or for ever.
            during = await stream(http)
            assert not pending.done()
            assert during[0] < 3 * alone[0] + 1.0 and during[1] < 1.0, (alone, during)
            async with http.get("/health") as resp:
                assert resp.status == 200
            status, body = await pending
            assert status == 500 and "its chat template ran more than 10 s" in body["error"]["message"], body
            assert time.monotonic() - t0 < 15.0

    with running_worker(MODULE, spec, tmp_path) as (base, headers):
        asyncio.run(go(base, headers))
        # One more chat, left rendering as SIGTERM comes: close() must not wait for its thread.
        request = urllib.request.Request(
            base + "/v1/chat/completions",
            data=b'{"messages": [{"role": "user", "content": "hi"}]}',
            headers={**headers, "Content-Type": "application/json"},
        )
        threading.Thread(target=lambda: _ignore_errors(request), daemon=True).start()
        time.sleep(1.0)
        t0 = time.monotonic()
    stopped = time.monotonic() - t0
    assert stopped < 8.0, stopped  # it took the SIGKILL, 15 s after the SIGTERM


async def stream(http: aiohttp.ClientSession) -> tuple[float, float]:
    """A 300-token stream: (seconds in all, the longest gap between two chunks)."""
    body = {"text": "Hello", "stream": True, "sampling_params": VICTIM}
    t0 = last = time.monotonic()
    gap = 0.0
    async with http.post("/generate", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data:"):
                now = time.monotonic()
                gap, last = max(gap, now - last), now
    return time.monotonic() - t0, gap


def _ignore_errors(request: urllib.request.Request) -> None:
    try:
        urllib.request.urlopen(request, timeout=60).read()
    except OSError:
        pass
