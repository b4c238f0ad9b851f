"""What bench/routing sends, and how much of it the fleet can serve (pure; no clock, no network).

Requests: a prompt of `prompt_words` whitespace words (the sim worker counts one token per word) and
`max_new_tokens` new tokens, both uniform over their ranges, drawn from a generator seeded by
(seed, request number), so every mode of a run gets exactly the same requests in the same order.

Capacity: requests per second one instance completes when it is never idle, measured by running the
simulator's own pure core (node_host.backends.sim.core.SimCore, the same code the sim workers run)
over a backlog of this request mix in simulated time. Deterministic, and it follows the spec's sim
parameters, so the offered load stays the same fraction of capacity if examples/routing.yaml changes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from node_host.backends.sim.core import SimCore, SimParams


@dataclass(frozen=True)
class Mix:
    prompt_words: tuple[int, int] = (64, 512)
    max_new_tokens: tuple[int, int] = (32, 128)

    def draw(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(*self.prompt_words), rng.randint(*self.max_new_tokens)

    def request(self, seed: int, i: int) -> tuple[int, int]:
        """(prompt words, max_new_tokens) of request number i of a run seeded `seed`."""
        return self.draw(random.Random(seed * 1_000_003 + i))


def body(model_id: str, mix: Mix, seed: int, i: int) -> dict:
    """The JSON body of request i: routed by its "model" field, like an OpenAI-style client's. Its words
    are its own (no two requests share a prefix), so prefix affinity has nothing to hold on to and this
    stays a test of load balancing (bench/prefix is the one with shared prefixes)."""
    words, new = mix.request(seed, i)
    text = " ".join(f"r{i}w{k}" for k in range(words))
    return {"model": model_id, "text": text, "sampling_params": {"max_new_tokens": new}}


def capacity_rps(params: SimParams, mix: Mix, requests: int = 3000, seed: int = 1) -> float:
    """Completions per second of one saturated instance, over the middle 80% of a backlog's run."""
    rng = random.Random(seed)
    core = SimCore(params)
    for _ in range(requests):
        core.submit(*mix.draw(rng), 0.0)
    finished: list[float] = []
    while core.busy_until is not None:
        finished += [r.finished_at for r in core.advance(core.busy_until)]
    finished.sort()
    first, last = finished[requests // 10], finished[9 * requests // 10]
    return (9 * requests // 10 - requests // 10) / (last - first)
