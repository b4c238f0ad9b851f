"""The LLM side of bench.tiers: a closed-loop generation load, run as its own process.

    python -m bench.tiers_llm --url ENVOY --model MODEL --concurrency 8 --duration-s 30 --out FILE.json

Closed loop: `concurrency` clients, each sending its next request as soon as the last is answered, so
the engine is never idle (bench.tiers wants an LLM "under load", not a given rate). Each request is an
OpenAI chat completion through Envoy (routed by its "model" field) with a prompt of its own and
`max_tokens` new tokens. Its own process, so its CPU and event loop are the LLM side's, not the scorer's
load generator's. Writes one line per request to --out: wall-clock start and end, status, and the
completion tokens the answer says it generated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge each boxing match".split()


def body(model: str, client: int, n: int, prompt_words: int, max_tokens: int) -> dict:
    """A prompt that starts with its own request number (nothing for a prefix cache to hold), of plain
    words (about a token each, well inside the demo model's 512-token context), and a fixed output length."""
    words = " ".join(WORDS[k % len(WORDS)] for k in range(prompt_words))
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{client}-{n}: {words}"}],
        "max_tokens": max_tokens,
    }


async def run(args: argparse.Namespace) -> list[dict]:
    url = args.url.rstrip("/") + "/v1/chat/completions"
    deadline = time.time() + args.duration_s
    out: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=60)

    async def client(c: int, session: aiohttp.ClientSession) -> None:
        n = 0
        while time.time() < deadline:
            started, status, tokens = time.time(), 0, 0
            try:
                payload = body(args.model, c, n, args.prompt_words, args.max_tokens)
                async with session.post(url, json=payload, timeout=timeout) as resp:
                    status = resp.status
                    answer = await resp.json(content_type=None) if status == 200 else await resp.read()
                    if status == 200 and isinstance(answer, dict):
                        tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                status = 0
            out.append({"start": started, "end": time.time(), "status": status, "tokens": tokens})
            n += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(c, session) for c in range(args.concurrency)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tiers_llm", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="Envoy's ingress, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration-s", type=float, required=True)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    args.out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
