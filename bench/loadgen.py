"""An open-loop Poisson load generator (asyncio + aiohttp).

Open loop: arrivals follow a schedule fixed in advance (exponential gaps at the target rate), whatever
the server does, so queueing shows up as latency instead of silently lowering the offered load. Latency
is measured from the SCHEDULED send time, so the generator's own lag counts against it, never for it.
FACTS.md: one Python process holds ~1000 req/s with a p99 send lag of ~14 ms; at LLM-scale latencies
(tens to hundreds of ms) that is fine, for sub-millisecond hop costs it is not.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from bench.stats import Sample


@dataclass(frozen=True)
class Load:
    url: str
    rate_rps: float
    duration_s: float
    body: Callable[[int], dict]  # request number -> JSON body
    headers: dict[str, str] | None = None
    timeout_s: float = 60.0
    seed: int = 0


def _error_type(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return data[:40].decode(errors="replace").strip() or "(empty)"


def schedule(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, duration)."""
    rng = random.Random(seed)
    t = 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(rate_rps)
        if t >= duration_s:
            return out
        out.append(t)


async def run_load(
    load: Load,
    session: aiohttp.ClientSession,
    on_tick: Callable[[float], None] | None = None,
    errors: Counter[str] | None = None,
) -> list[Sample]:
    """Send the schedule; return one Sample per request (transport errors are status 0). With `errors`,
    count each failed answer there as "STATUS TYPE": the `error.type` of SIE's error body, or the start
    of any other body (Envoy's own answers are plain text: "no healthy upstream"); a transport error as
    "0 EXCEPTION"."""
    times = schedule(load.rate_rps, load.duration_s, load.seed)
    samples: list[Sample] = []
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=load.timeout_s)

    async def one(i: int, at: float) -> None:
        status, instance = 0, ""
        try:
            async with session.post(load.url, json=load.body(i), headers=load.headers, timeout=timeout) as resp:
                data = await resp.read()
                status = resp.status
                instance = resp.headers.get("x-sie-instance", "")
            if errors is not None and status != 200:
                errors[f"{status} {_error_type(data)}"] += 1
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = 0
            if errors is not None:
                errors[f"0 {type(exc).__name__}"] += 1
        samples.append(Sample(at, time.perf_counter() - start - at, status, instance))

    tasks = []
    for i, at in enumerate(times):
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        if on_tick is not None:
            on_tick(at)
        tasks.append(asyncio.create_task(one(i, at), name=f"load-{i}"))
    await asyncio.gather(*tasks)
    samples.sort(key=lambda s: s.scheduled_s)
    return samples
