"""The autoscaler's decision (xds_server.autoscale.policy), as tables: demand in, count and reason out."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from xds_server.autoscale.policy import Demand, ScaleState, decide, fleet_shape, target_of


def spec(low: int = 1, high: int = 6, **autoscale: object):
    return parse_model_service(
        {
            "kind": "ModelService",
            "spec": {
                "model": {"name": "m"},
                "backend": {"type": "sim"},
                "resources": {"max_concurrent_requests": 10},
                "sla": {"min_replicas": low, "max_replicas": high, "p99_latency_ms": 100, "max_queue_time_ms": 200},
                "autoscale": autoscale,
            },
        },
        "m.yaml",
    ).spec


S = spec()  # target 7 in flight per instance (0.7 x 10)


# (current, demand, expected count, words in the reason)
ONE_STEP = {
    "idle: the floor": (1, Demand(1, 0.0), 1, "hold"),
    "at the target: hold": (2, Demand(2, 14.0), 2, "within 10%"),
    "noise within the tolerance: hold": (2, Demand(2, 15.3), 2, "within 10%"),
    "above the tolerance: up at once": (2, Demand(2, 16.0), 3, "up"),
    "queued requests count as demand": (1, Demand(1, 7.0, queued=14.0), 3, "up"),
    "a burst: up by at most max_step_up": (1, Demand(1, 100.0), 5, "up"),
    "never above max": (5, Demand(5, 1000.0), 6, "up"),
    "queue wait over half the SLA: one more": (2, Demand(2, 14.0, queue_time_ms=150.0), 3, "queue wait"),
    "p99 over the SLA with real demand: one more": (2, Demand(2, 12.0, p99_ms=150.0), 3, "p99 150 ms > SLA"),
    "p99 over the SLA on an idle model: no": (2, Demand(2, 1.0, p99_ms=150.0), 2, "holding 2"),
    "a fall holds for the window": (4, Demand(4, 7.0), 4, "holding 4 for the 60 s window"),
    "no room on the nodes: only what fits": (2, Demand(2, 40.0, room=1), 3, "only 1 more fit"),
}


@pytest.mark.parametrize(("current", "demand", "expected", "words"), ONE_STEP.values(), ids=ONE_STEP.keys())
def test_one_decision(current, demand, expected, words):
    state = decide(S, ScaleState(current), demand, 100.0)
    assert state.desired == expected
    assert state.last is not None and words in state.last.reason


def test_the_target_defaults_to_seventy_percent_of_the_admission_limit_and_the_spec_can_set_it():
    assert target_of(S) == 7.0
    assert target_of(spec(target_concurrency=3)) == 3.0


def test_down_only_after_a_sustained_fall_over_the_window():
    state = ScaleState(4)
    seen = []
    for t in range(0, 130, 10):  # demand falls to one instance's worth at t=0 and stays there
        state = decide(S, state, Demand(state.desired, 7.0), float(t))
        seen.append(state.desired)
    # The 4 recommended before the fall is gone from the window once 60 s passed; the count then falls.
    assert seen[:6] == [4, 4, 4, 4, 4, 4] and seen[-1] == 1
    assert sorted(seen, reverse=True) == seen, "a fall never moves the count up"


def test_no_flapping_under_noise_around_the_target():
    state = ScaleState(3)
    for t, load in enumerate([21.0, 22.5, 19.5, 21.8, 20.1, 22.9, 19.0, 21.0] * 5):
        state = decide(S, state, Demand(3, load), float(t))
        assert state.desired == 3, (t, load, state.last)


def test_a_rising_then_falling_load_moves_the_count_only_with_the_load():
    state, counts = ScaleState(1), []
    loads = [7.0] * 10 + [28.0] * 10 + [7.0] * 90  # 1x, 4x, 1x of one instance's target, 1 s apart
    for t, load in enumerate(loads):
        state = decide(S, state, Demand(state.desired, load), float(t))
        counts.append(state.desired)
    rising, falling = counts[10:20], counts[20:]
    assert max(rising) == 4 and rising == sorted(rising), "up with the load, never down while it rises"
    assert falling == sorted(falling, reverse=True) and falling[-1] == 1, "down after the window, never up"
    assert counts[20:79] == [4] * 59, "the whole window holds the peak"


def test_min_and_max_bound_every_decision():
    narrow = spec(low=2, high=3)
    assert decide(narrow, ScaleState(2), Demand(2, 0.0), 0.0).desired == 2
    assert decide(narrow, ScaleState(2), Demand(2, 1000.0), 0.0).desired == 3


def test_a_model_with_replicas_set_or_equal_bounds_is_not_autoscaled():
    assert S.autoscaled
    assert not spec(low=2, high=2).autoscaled
    fixed = parse_model_service(
        {
            "kind": "ModelService",
            "spec": {
                "model": {"name": "m"},
                "backend": {"type": "sim"},
                "sla": {"min_replicas": 1, "max_replicas": 4},
                "replicas": 2,
            },
        },
        "m.yaml",
    ).spec
    assert not fixed.autoscaled


Z = spec(low=0, high=4, idle_s=300, scale_down_window_s=0)  # may reach zero; no window, so idle_s alone rules

# (current, demand, expected count, words in the reason): rule 7, a model allowed to reach zero
ZERO = {
    "idle but not for idle_s: keeps one": (1, Demand(1, 0.0, idle_for_s=120.0), 1, "keeping 1 until 300 s idle"),
    "idle for idle_s: to zero": (1, Demand(1, 0.0, idle_for_s=300.0), 0, "to zero, asleep"),
    "unknown idleness: keeps one": (1, Demand(1, 0.0), 1, "no request seen yet"),
    "two idle instances: down to one first": (2, Demand(2, 0.0, idle_for_s=30.0), 1, "keeping 1"),
    "at zero, a request held: up": (0, Demand(0, 0.0, held=1), 1, "1 requests held for a wake"),
    "at zero, a burst held: up by demand": (0, Demand(0, 0.0, held=20), 3, "20 requests held"),
    "at zero, a request seen: up": (0, Demand(1, 0.0, requested=True), 1, "a request arrived"),
    "at zero, awake but no request (its first load): stays": (0, Demand(1, 0.0, idle_for_s=0.0), 0, "hold"),
    "at zero, nothing: stays": (0, Demand(0, 0.0, idle_for_s=1000.0), 0, "hold"),
    "short of memory: what is missing is named": (
        2,
        Demand(2, 40.0, room=0, short="m-2 on n1: pending: not enough GPU memory"),
        2,
        "only 0 more fit on the nodes (m-2 on n1: pending: not enough GPU memory)",
    ),
}


@pytest.mark.parametrize(("current", "demand", "expected", "words"), ZERO.values(), ids=ZERO.keys())
def test_zero_rule(current, demand, expected, words):
    state = decide(Z, ScaleState(current), demand, 100.0)
    assert state.desired == expected
    assert state.last is not None and words in state.last.reason, state.last.reason


# (min, max, warm_pool, desired) -> (placed, awake)
SHAPES = {
    "the default warm pool of one": ((1, 6, 1, 1), (2, 1)),
    "the warm pool never goes beyond max": ((1, 6, 3, 5), (6, 5)),
    "at max, nothing asleep": ((1, 6, 3, 6), (6, 6)),
    "no warm pool": ((1, 6, 0, 3), (3, 3)),
    "at zero, one asleep whatever warm_pool says": ((0, 4, 0, 0), (1, 0)),
    "at zero with a larger warm pool": ((0, 4, 2, 0), (2, 0)),
}


@pytest.mark.parametrize(("args", "expected"), SHAPES.values(), ids=SHAPES.keys())
def test_fleet_shape(args, expected):
    low, high, warm, desired = args
    assert fleet_shape(spec(low=low, high=high, warm_pool=warm), desired) == expected
