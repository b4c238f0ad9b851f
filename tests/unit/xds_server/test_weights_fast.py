"""The weight policy's newer rules, one table each: the fast signal (recent mean latency, its count and
spread), no false alarms among equal instances, fading of unknown slowness, KV use counted only under
waiting, relative targets, ratio hysteresis near the floor, finishing the climb to full weight."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.policy.decisions import MAX_WEIGHT, MIN_WEIGHT
from xds_server.policy.signals import read_signals, saturation
from xds_server.policy.weights import PolicyState, WeightSettings, decide

NOW = 1_000_000.0
S = WeightSettings()
M = parse_model_service(
    {
        "spec": {
            "model": {"name": "m"},
            "backend": {"type": "sim"},
            "sla": {"p99_latency_ms": 1000.0, "max_queue_time_ms": 500.0},
        }
    }
)
LLM = parse_model_service(
    {"spec": {"model": {"name": "m"}, "backend": {"type": "sim"}, "sla": {"p99_latency_ms": 5000.0}}}
)


def _rec(iid: str, **kw) -> TelemetryRecord:
    base = dict(
        instance_id=iid,
        model_id="m",
        version="1",
        address=f"10.0.0.{ord(iid[0]) % 250}:8000",
        node="n1",
        state=InstanceState.READY,
        max_concurrent=64,
        requests_total=1000,
        latency_p50_ms=100.0,
        latency_p99_ms=200.0,
        recent_requests=25,
        recent_latency_mean_ms=100.0,
        recent_latency_std_ms=40.0,
        recent_window_s=2.0,
        timestamp=NOW,
    )
    base.update(kw)
    return TelemetryRecord(**base)


def _fleet(**overrides) -> list[TelemetryRecord]:
    return [_rec(iid, **overrides.get(iid, {})) for iid in "abcd"]


def _slowness(fleet: list[TelemetryRecord], iid: str = "b", last: dict | None = None) -> float | None:
    return next(s.slowness for s in read_signals(M, fleet, last or {}, NOW, S) if s.instance_id == iid)


def _weights(fleet: list[TelemetryRecord], state: PolicyState = PolicyState(), at: float = NOW):
    decision, state = decide(M, [dataclasses.replace(r, timestamp=at) for r in fleet], state, at, S)
    return {iid: ep.weight for iid, ep in decision.endpoints.items()}, state


# ---- the fast signal ----------------------------------------------------------------------------------


def _fast(mean: float, n: int = 25, std: float = 40.0, ref: float = 100.0, ref_n: float = 25.0) -> float:
    """(mean - 3 standard errors of its difference from the reference) / the reference."""
    return max(0.0, mean - 3 * std * math.sqrt(1 / n + 1 / ref_n)) / ref


def _all_others(**fields) -> dict[str, dict]:
    return {k: fields for k in "acd"}


@pytest.mark.parametrize(
    "case, b, others, expected",
    [
        # The reference is the fleet's lower median of recent means (100 ms on 25 requests here); the
        # spread is the fleet's typical one, the upper median of the endpoints' (40 ms here).
        ("as fast as the fleet: below 1 (read conservatively)", {}, {}, _fast(100.0)),
        ("3x now, whatever the window remembers", dict(recent_latency_mean_ms=300.0), {}, _fast(300.0)),
        # The window says 3x (a slowdown that is over); the fast signal says fine: it wins.
        ("recovered: the window still remembers", dict(latency_p50_ms=300.0, latency_p99_ms=600.0), {}, _fast(100.0)),
        (
            "too few recent requests: the window decides",
            dict(recent_requests=4, recent_latency_mean_ms=900.0, latency_p50_ms=300.0),
            {},
            3.0,
        ),
        (
            "no fleet reference (one trusted endpoint): the window decides",
            dict(recent_latency_mean_ms=900.0, latency_p50_ms=150.0),
            _all_others(recent_requests=0),
            1.5,
        ),
        (
            "three trusted endpoints are a reference",
            dict(recent_latency_mean_ms=300.0),
            {"d": dict(recent_requests=0)},
            _fast(300.0),
        ),
        # With two, the lower median is the smaller of two noisy means: too noisy a reference.
        (
            "two are not",
            dict(recent_latency_mean_ms=300.0, latency_p50_ms=150.0),
            {"c": dict(recent_requests=0), "d": dict(recent_requests=0)},
            1.5,
        ),
        (
            "a slow quarter of the fleet cannot move the lower median",
            dict(recent_latency_mean_ms=300.0),
            {"c": dict(recent_latency_mean_ms=300.0)},
            _fast(300.0),
        ),
        # Requests of very different lengths (every endpoint's spread 150 ms): 2x the mean on 6 of
        # them is within the noise of so few.
        (
            "few samples from a widely spread fleet: no alarm",
            dict(recent_requests=6, recent_latency_mean_ms=200.0, recent_latency_std_ms=150.0),
            _all_others(recent_latency_std_ms=150.0),
            _fast(200.0, n=6, std=150.0),
        ),
        # Its own spread is small by chance: the fleet's typical spread is used.
        (
            "a lucky small spread borrows the fleet's",
            dict(recent_requests=9, recent_latency_mean_ms=150.0, recent_latency_std_ms=1.0),
            {},
            _fast(150.0, n=9),
        ),
        # A slowing endpoint's own spread is wide (old fast answers next to new slow ones): that is the
        # change being measured, not noise, so it does not discount the evidence.
        (
            "a slowing endpoint's own wide spread is not noise",
            dict(recent_requests=8, recent_latency_mean_ms=160.0, recent_latency_std_ms=80.0),
            {},
            _fast(160.0, n=8),
        ),
        (
            "an older sidecar without the fast signal: the window",
            dict(recent_requests=0, recent_latency_mean_ms=None, latency_p50_ms=200.0),
            _all_others(recent_requests=0, recent_latency_mean_ms=None),
            2.0,
        ),
    ],
)
def test_fast_signal_slowness(case, b, others, expected):
    fleet = _fleet(b=b, **others)  # others: instance id -> fields of a, c or d
    assert _slowness(fleet) == pytest.approx(expected, rel=1e-6), case


def test_a_slowdown_seen_by_the_fast_signal_cuts_to_the_floor():
    weights, _ = _weights(_fleet(b=dict(recent_latency_mean_ms=300.0)))
    assert weights == {"a": MAX_WEIGHT, "b": MIN_WEIGHT, "c": MAX_WEIGHT, "d": MAX_WEIGHT}


def _noisy_fleet(rng: random.Random, requests: int, at: float) -> list[TelemetryRecord]:
    """Equal instances, each reporting the mean and spread of `requests` latencies drawn from the
    same wide distribution (LLM requests of 32-128 tokens: 0.3-1.2 s), as their sidecars would."""
    out = []
    for iid in "abcd":
        n = max(1, int(rng.gauss(requests, math.sqrt(requests))))
        lat = [rng.uniform(300.0, 1200.0) * rng.uniform(0.9, 1.1) for _ in range(n)]
        mean = sum(lat) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in lat) / n)
        out.append(
            _rec(
                iid,
                recent_requests=n,
                recent_latency_mean_ms=mean,
                recent_latency_std_ms=std,
                latency_p50_ms=750.0,
                latency_p99_ms=1200.0,
                timestamp=at,
            )
        )
    return out


@pytest.mark.parametrize("requests", [6, 10, 25, 60])
def test_no_false_alarms_among_equal_instances_with_noisy_samples(requests):
    rng = random.Random(requests)
    state = PolicyState()
    first = None
    for step in range(2000):  # 1000 s of records every 0.5 s
        at = NOW + step * 0.5
        decision, state = decide(LLM, _noisy_fleet(rng, requests, at), state, at, S)
        first = first or decision
        assert decision is first, (step, {i: (e.weight, e.reason) for i, e in decision.endpoints.items()})
    assert "saturated" not in first.reason.replace("0 saturated", "")  # not vacuous: no fail-open


def test_the_same_noise_without_the_discount_would_alarm():
    # The check above can fail: read at face value (recent_z = 0), the same samples cut weights.
    naive = dataclasses.replace(S, recent_z=0.0)
    rng = random.Random(6)
    state, pushes, first = PolicyState(), 0, None
    for step in range(400):
        at = NOW + step * 0.5
        decision, state = decide(LLM, _noisy_fleet(rng, 6, at), state, at, naive)
        first = first or decision
        pushes += decision is not first
    assert pushes > 0


# ---- overdue: a request running far past every recent answer --------------------------------------

# The fleet's recent means are 100 ms (the reference); b's window holds 200 answers, the longest 150 ms
# (1.5x its median of 100 ms: predictable durations).
_WIN = dict(window_requests=200, latency_max_ms=150.0)


@pytest.mark.parametrize(
    "case, b, expected",
    [
        ("nothing running: the fast signal alone", dict(_WIN), _fast(100.0)),
        ("running, within 1.5x its longest answer", dict(_WIN, oldest_running_ms=220.0), _fast(100.0)),
        # 240 ms > 1.5 x 150: at least 2.4x the fleet's typical latency, before the answer exists
        ("running past 1.5x its longest answer", dict(_WIN, oldest_running_ms=240.0), 2.4),
        (
            "the larger of overdue and the fast signal",
            dict(_WIN, oldest_running_ms=240.0, recent_latency_mean_ms=900.0),
            _fast(900.0),
        ),
        # LLM answers of any length: the longest is 3x the median, so one long request proves nothing
        (
            "durations too varied to judge by one request",
            dict(window_requests=200, latency_max_ms=300.0, oldest_running_ms=1000.0),
            _fast(100.0),
        ),
        # after an idle spell its window holds 3 answers: their longest says little about the usual
        (
            "a window of few answers cannot judge",
            dict(window_requests=3, latency_max_ms=80.0, oldest_running_ms=400.0),
            _fast(100.0),
        ),
        (
            "an older sidecar without the fields",
            dict(oldest_running_ms=None, latency_max_ms=None, window_requests=0),
            _fast(100.0),
        ),
    ],
)
def test_overdue_slowness(case, b, expected):
    assert _slowness(_fleet(b=b)) == pytest.approx(expected, rel=1e-6), case


def test_an_overdue_request_cuts_the_weight_on_its_own():
    weights, _ = _weights(_fleet(b=dict(_WIN, oldest_running_ms=240.0)))
    assert weights["b"] < MAX_WEIGHT // 2 and weights["a"] == weights["c"] == weights["d"] == MAX_WEIGHT
    weights, _ = _weights(_fleet(b=dict(_WIN, oldest_running_ms=220.0)))
    assert set(weights.values()) == {MAX_WEIGHT}


# ---- unknown slowness fades -------------------------------------------------------------------------


def test_an_endpoint_without_evidence_is_given_another_chance():
    quiet = dict(recent_requests=0, recent_latency_mean_ms=None, latency_p50_ms=None, latency_p99_ms=None)
    weights, state = _weights(_fleet(b=dict(recent_latency_mean_ms=300.0)))
    assert weights["b"] == MIN_WEIGHT and state.slowness["b"] == pytest.approx(_fast(300.0))
    history = []
    for step in range(1, 81):  # 40 s with no request finished at b (it sits at the floor)
        weights, state = _weights(_fleet(b=quiet), state, NOW + step * 0.5)
        history.append(weights["b"])
    # Excess slowness halves every 10 s: 2.66 -> 1.83 (10 s) -> 1.42 (20 s) -> 1.21 (30 s), below 1.3.
    assert state.slowness["b"] == pytest.approx(1 + (_fast(300.0) - 1) * 0.5**4, rel=1e-3)
    assert history[19] <= 5  # still near the floor at 10 s (1.83x)...
    assert 100 < history[39] < 300  # ...probing at 20 s (1.42x: weight ~160 of 1000)...
    assert history[-1] == MAX_WEIGHT  # ...and full weight again once no longer clearly slow
    assert history == sorted(history)


def test_evidence_stops_the_fading():
    weights, state = _weights(_fleet(b=dict(recent_latency_mean_ms=300.0)))
    for step in range(1, 81):
        weights, state = _weights(_fleet(b=dict(recent_latency_mean_ms=300.0)), state, NOW + step * 0.5)
    assert weights["b"] == MIN_WEIGHT


# ---- saturation: KV under waiting; relative targets ------------------------------------------------


@pytest.mark.parametrize(
    "case, fields, value, cause",
    [
        # p99 200 of an SLA of 1000 is the largest other term (0.2) while anything waits.
        ("KV 90% and everything admitted: the cache does its job", dict(engine_waiting=0), 0.0, "queue"),
        ("one arrival waiting for the next step: not KV pressure", dict(engine_waiting=1), 0.2, "p99/sla"),
        ("requests waiting: KV counts", dict(engine_waiting=2), 0.9 / 0.8, "kv"),
        ("waiting unknown: KV counts (as before)", dict(engine_waiting=None), 0.9 / 0.8, "kv"),
    ],
)
def test_kv_use_counts_only_while_requests_wait(case, fields, value, cause):
    got, got_cause = saturation(_rec("a", kv_cache_usage=0.9, latency_p99_ms=200.0, **fields), M, NOW, S)
    assert (got, got_cause) == (pytest.approx(value), cause), case


@pytest.mark.parametrize(
    "case, p99s, expected",
    [
        # Envoy reads weights relative to each other: a load every endpoint shares changes nothing.
        ("all at 80% of the SLA: equal weights, nothing to push", [800, 800, 800, 800], [MAX_WEIGHT] * 4),
        (
            "one worse than the rest: only the difference counts",
            [700, 900, 700, 700],
            [MAX_WEIGHT, round(MAX_WEIGHT * (1 - 0.9) / (1 - 0.7)), MAX_WEIGHT, MAX_WEIGHT],
        ),
    ],
)
def test_targets_are_relative_to_the_best_endpoint(case, p99s, expected):
    fleet = [
        _rec(iid, latency_p99_ms=float(p), latency_p50_ms=100.0, recent_requests=0, queued=1)
        for iid, p in zip("abcd", p99s)
    ]
    # the window p99s differ, so keep slowness out of it: p99 ratios against the lower median < 1.3
    decision, _ = decide(M, fleet, PolicyState(), NOW, dataclasses.replace(S, slow_start=1.9, slow_floor=2.0))
    assert [ep.weight for ep in decision.endpoints.values()] == expected, case


# ---- dynamics near the bounds ---------------------------------------------------------------------------


def test_a_weight_that_divides_by_two_is_pushed_even_when_few_points_move():
    slow = _fleet(b=dict(recent_latency_mean_ms=300.0))
    state, pushed = PolicyState(), []
    for step in range(6):
        at = NOW + step * 0.5
        before = state.published
        decision, state = decide(
            M, [dataclasses.replace(r, timestamp=at) for r in (_fleet() if step == 0 else slow)], state, at, S
        )
        pushed.append((decision.endpoints["b"].weight, decision is not before))
    # 37 -> 12 moves 25 points (under the hysteresis of 50) but divides the weight by 3.
    assert pushed == [(1000, True), (400, True), (121, True), (37, True), (12, True), (4, True)]
