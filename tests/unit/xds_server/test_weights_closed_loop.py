"""The weight policy in a closed loop, in simulated time: four sim engines (node_host's SimCore) behind a
model of Envoy's LEAST_REQUEST, sidecars that report every 0.5 s with a sliding latency window, and the
control loop. Deterministic (fixed seeds, no wall clock); checks the dynamics the benchmark relies on."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from node_host.backends.sim_engine import SimCore, SimParams
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.decisions import EqualWeights
from xds_server.weights import WeightPolicy

MODEL = parse_model_service({"spec": {"model": {"name": "m"}, "backend": {"type": "sim"}, "sla": {"p99_latency_ms": 2000}}})
IDS = ["a", "b", "c", "d"]


class LeastRequest:
    """Envoy's LEAST_REQUEST: power of two choices on active requests when all weights are equal, else
    earliest-deadline-first over weight / (active + 1), each host's next deadline set when it is picked."""

    def __init__(self, rng: random.Random):
        self.rng, self.weights, self.edf = rng, [100] * 4, None

    def set_weights(self, weights: list[int], active: list[int]) -> None:
        self.weights = weights
        self.edf = None if len(set(weights)) == 1 else [(self.rng.random() * (a + 1) / w, i) for i, (w, a) in enumerate(zip(weights, active))]
        if self.edf:
            heapq.heapify(self.edf)

    def pick(self, active: list[int]) -> int:
        if self.edf is None:
            x, y = self.rng.randrange(4), self.rng.randrange(4)
            return x if active[x] <= active[y] else y
        deadline, i = heapq.heappop(self.edf)
        heapq.heappush(self.edf, (deadline + (active[i] + 1) / self.weights[i], i))
        return i


@dataclass
class Instance:
    core: SimCore
    active: int = 0
    answered: int = 0
    window: list[tuple[float, float]] = field(default_factory=list)  # (finished, latency), the sidecar's 30 s
    arrivals: dict[int, float] = field(default_factory=dict)

    def record(self, iid: str, now: float, seq: int) -> TelemetryRecord:
        self.window = [s for s in self.window if s[0] >= now - 30.0][-1000:]
        lat = sorted(s[1] * 1000 for s in self.window)
        rank = lambda q: lat[max(1, math.ceil(q * len(lat))) - 1] if lat else None  # noqa: E731 (nearest rank)
        loads = self.core.loads()
        return TelemetryRecord(instance_id=iid, model_id="m", version="1", address=f"127.0.0.1:{9000 + IDS.index(iid)}",
                               node="n", state=InstanceState.READY, in_flight=self.active, max_concurrent=64,
                               kv_cache_usage=loads.token_usage, engine_running=loads.running, engine_waiting=loads.waiting,
                               latency_p50_ms=rank(0.5), latency_p99_ms=rank(0.99), requests_total=self.answered,
                               timestamp=now, seq=seq)


def simulate(policy, duration: float = 18.0, rate: float = 100.0, slow_at: float | None = 8.0, seed: int = 7):
    """Returns (requests as (arrival, latency, instance index), pushes as (time, weights))."""
    rng = random.Random(seed)
    fleet = [Instance(SimCore(SimParams())) for _ in IDS]
    envoy = LeastRequest(rng)
    events: list[tuple[float, int, str, object]] = []
    counter = iter(range(10**9))

    def at(t: float, kind: str, data: object = None) -> None:
        heapq.heappush(events, (t, next(counter), kind, data))

    t = 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        at(t, "arrive", (rng.randint(32, 256), rng.randint(16, 64)))
    for i in range(4):
        at(0.125 * (i + 1), "report", i)
    if slow_at is not None:
        at(slow_at, "slow", 1)
    done, pushes, records, seq, busy = [], [], {}, [0] * 4, [None] * 4

    def settle(i: int, now: float) -> None:
        inst = fleet[i]
        for result in inst.core.advance(now):
            start = inst.arrivals.pop(result.rid)
            inst.active, inst.answered = inst.active - 1, inst.answered + 1
            inst.window.append((now, now - start))
            done.append((start, now - start, i))
        if inst.core.busy_until is not None and busy[i] != inst.core.busy_until:
            busy[i] = inst.core.busy_until
            at(busy[i], "engine", i)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            for i in range(4):
                settle(i, now)
            i = envoy.pick([x.active for x in fleet])
            fleet[i].arrivals[fleet[i].core.submit(*data, now)] = now
            fleet[i].active += 1
            settle(i, now)
        elif kind == "engine":
            settle(data, now)
        elif kind == "slow":
            fleet[data].core.set_params(SimParams(slowdown=3.0))
        elif kind == "report" and now < duration:
            settle(data, now)
            seq[data] += 1
            records[data] = fleet[data].record(IDS[data], now, seq[data])
            at(now + 0.5, "report", data)
            at(now + 0.05, "decide")  # the control loop's debounce
        elif kind == "decide":
            decision = policy.decide(MODEL, list(records.values()), now)
            weights = [decision.endpoints[iid].weight if iid in decision.endpoints else 100 for iid in IDS]
            if weights != envoy.weights:
                pushes.append((now, weights))
                envoy.set_weights(weights, [x.active for x in fleet])
    return done, pushes


def _p99(done, since: float) -> float:
    lat = sorted(latency for start, latency, _ in done if start >= since)
    return lat[math.ceil(0.99 * len(lat)) - 1]


def test_a_3x_slower_instance_loses_its_share_within_seconds():
    done, pushes = simulate(WeightPolicy())
    # Detection waits for the sidecar's p99 over its 30 s window to move (about 1% of its samples slow):
    # here 1.8 s after the slowdown; then the weight falls 100 -> 1 within another second.
    first_cut = next((t for t, w in pushes if w[1] < 100), None)
    assert first_cut is not None and 8.0 < first_cut <= 10.0, pushes
    at_floor = next((t for t, w in pushes if w[1] <= 5), None)
    assert at_floor is not None and at_floor <= 11.0, pushes
    assert all(w[0] == w[2] == w[3] == 100 for _, w in pushes)  # the healthy ones keep full weight
    later = [i for start, _, i in done if start >= 11.0]
    share = later.count(1) / len(later)
    assert share < 0.05, share  # ~2% (weight 1 of 100 against in-flight counts), from ~12% under plain LR


def test_the_policy_beats_equal_weights_on_p99_after_a_slowdown():
    sie, _ = simulate(WeightPolicy())
    equal, _ = simulate(EqualWeights())
    assert _p99(sie, since=4.0) < 0.8 * _p99(equal, since=4.0)


def test_equal_instances_keep_equal_weights():
    done, pushes = simulate(WeightPolicy(), slow_at=None)
    assert pushes == [], pushes  # nothing to push: Envoy keeps plain least-request
    assert len(done) > 1500
