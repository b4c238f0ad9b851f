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


# (current, demand, expected count, words in the reason). T = 7; with n instances the band is
# [(n - 1) x 7 x 0.9, n x 7 x 1.1]: for 2, [6.3, 15.4].
ONE_STEP = {
    "idle: the floor": (1, Demand(1, 0.0), 1, "hold"),
    "at the target: hold": (2, Demand(2, 14.0), 2, "within the band of 2 x 7"),
    "noise within the band: hold": (2, Demand(2, 15.3), 2, "within the band"),
    "half an instance below the target: still hold (the bands overlap)": (2, Demand(2, 7.5), 2, "within the band"),
    "above the band: up at once": (2, Demand(2, 16.0), 3, "> 2 x 7 x 1.1"),
    "queued requests count as demand": (2, Demand(2, 7.0, queued=14.0), 3, "up"),
    "a burst: up by at most a doubling": (1, Demand(1, 100.0), 2, "(a burst)"),
    "never above max": (5, Demand(5, 1000.0), 6, "up"),
    "queue wait over half the SLA with requests queued: one more": (
        2,
        Demand(2, 12.0, queued=2.0, queue_time_ms=150.0),
        3,
        "queue wait",
    ),
    "queue wait over half the SLA, a window's memory (nothing queued now): no": (
        2,
        Demand(2, 14.0, queue_time_ms=150.0),
        2,
        "hold",
    ),
    "p99 over the SLA at the target: one more": (2, Demand(2, 14.0, p99_ms=150.0), 3, "p99 150 ms > SLA"),
    "p99 over the SLA on an idle model: no": (2, Demand(2, 1.0, p99_ms=150.0), 2, "holding 2"),
    "below the band: a fall holds for the window": (4, Demand(4, 7.0), 4, "holding 4 for the 60 s window"),
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
    for t in range(0, 130, 10):  # demand falls below one instance's worth at t=0 and stays there
        state = decide(S, state, Demand(state.desired, 4.0), float(t))
        seen.append(state.desired)
    # The 4 recommended before the fall is gone from the window once 60 s passed; the count then falls.
    assert seen[:6] == [4, 4, 4, 4, 4, 4] and seen[-1] == 1
    assert sorted(seen, reverse=True) == seen, "a fall never moves the count up"


def test_after_the_window_the_count_is_for_the_demand_now_not_the_six_seconds_mean():
    short = spec(scale_down_window_s=5)
    state = ScaleState(6)
    for i in range(40):  # 0.1 s decisions at 40 in flight: six at the target (7)
        state = decide(short, state, Demand(6, 40.0), i / 10)
    counts = []
    for i in range(40, 120):  # demand falls to 5 at 4 s: two instances' worth with the headroom
        state = decide(short, state, Demand(6, 5.0), i / 10)
        counts.append(state.desired)
    assert counts[:40] == [6] * 40, "the window holds the count"
    assert counts[-1] == 2 and len(set(counts)) == 2, f"then one step to the count for 5: {counts}"


def test_no_flapping_under_noise_around_the_target():
    state = ScaleState(3)
    for t, load in enumerate([21.0, 22.5, 19.5, 21.8, 20.1, 22.9, 19.0, 21.0] * 5):
        state = decide(S, state, Demand(3, load), float(t))
        assert state.desired == 3, (t, load, state.last)


def test_a_rising_then_falling_load_moves_the_count_only_with_the_load():
    state, counts = ScaleState(1), []
    loads = [4.0] * 10 + [28.0] * 10 + [4.0] * 90  # 1x, 4x, 1x of (a little below) one instance's target
    for t, load in enumerate(loads):
        state = decide(S, state, Demand(state.desired, load), float(t))
        counts.append(state.desired)
    rising, falling = counts[10:20], counts[20:]
    assert max(rising) == 4 and rising == sorted(rising), "up with the load, never down while it rises"
    assert falling == sorted(falling, reverse=True) and falling[-1] == 1, "down after the window, never up"
    assert counts[20:79] == [4] * 59, "the whole window holds the peak"


def test_noise_of_half_an_instance_either_side_of_a_band_edge_never_moves_the_count_back():
    """Demand hovering at 2 x 7 x 1.1 = 15.4 may take the count to 3 once; it never comes back to 2, since
    3's band reaches down to 2 x 7 x 0.9 = 12.6."""
    state, counts = ScaleState(2), []
    for t, load in enumerate([15.0, 16.5, 14.0, 17.5, 13.5, 16.0, 14.5, 17.0] * 20):
        state = decide(S, state, Demand(state.desired, load), float(t))
        counts.append(state.desired)
    assert set(counts) <= {2, 3} and counts == sorted(counts), counts


def test_demand_is_averaged_over_the_last_second_so_one_spike_moves_nothing():
    state = ScaleState(1)
    for t in (0.0, 0.1, 0.2, 0.3, 0.4):
        state = decide(S, state, Demand(1, 5.0), t)
    state = decide(S, state, Demand(1, 12.0), 0.45)  # one sample far above 1 x 7 x 1.1; the mean is 6.2
    assert state.desired == 1, state.last
    for t in (0.6, 0.8, 1.0):
        state = decide(S, state, Demand(1, 12.0), t)  # sustained: the mean passes 7.7
    assert state.desired == 2, state.last


def test_after_a_step_up_the_next_waits_for_its_instances_to_serve_and_settle():
    wide = spec(high=12)
    state = decide(wide, ScaleState(3), Demand(3, 45.0), 0.0)
    assert state.desired == 6, "a burst: a doubling"
    state = decide(wide, state, Demand(3, 90.0), 0.25)  # the backlog grows while the three wake
    assert state.desired == 6 and "waiting for the last step up to serve (3 of 6 ready)" in state.last.reason
    state = decide(wide, state, Demand(6, 60.0, queued=20.0), 1.0)  # they serve; the backlog drains into them
    assert state.desired == 6, state.last
    state = decide(wide, state, Demand(6, 50.0, queued=3.0), 1.5)  # drained: at most one queued per instance
    state = decide(wide, state, Demand(6, 50.0, queued=3.0), 2.4)
    assert state.desired == 6, "a second after they served and drained, not before"
    state = decide(wide, state, Demand(6, 50.0, queued=3.0), 3.1)  # above 6 x 7 x 1.1 after the settle: up
    assert state.desired == 8, state.last


def test_a_backlog_that_does_not_drain_lets_the_next_step_go_ahead():
    wide = spec(high=12)
    state = decide(wide, ScaleState(3), Demand(3, 45.0), 0.0)
    assert state.desired == 6, "a burst: a doubling"
    state = decide(wide, state, Demand(6, 60.0, queued=20.0), 0.5)  # they serve, 80 in flight and queued
    for t in (0.8, 1.1, 1.4):  # a second later it has not fallen: six cannot absorb it
        state = decide(wide, state, Demand(6, 60.0, queued=22.0), t)
    assert state.desired == 6, "not before a second after they served"
    for t in (1.6, 1.8, 2.0, 2.2):  # seen for half a second at this size
        state = decide(wide, state, Demand(6, 60.0, queued=22.0), t)
    assert state.desired == 10, state.last  # a burst (82 >= 1.5 x 6 x 7): max_step_up (4), not STABLE_S later
    # The same backlog falling as it drains holds the count instead.
    state = decide(wide, ScaleState(3), Demand(3, 45.0), 0.0)
    state = decide(wide, state, Demand(6, 60.0, queued=20.0), 0.5)
    for t, queued in ((0.8, 18.0), (1.1, 15.0), (1.4, 12.0), (1.6, 10.0), (1.8, 9.0), (2.0, 8.0), (2.2, 7.5)):
        state = decide(wide, state, Demand(6, 50.0, queued=queued), t)
    assert state.desired == 6 and "takes the backlog" in state.last.reason, state.last


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
    "at zero, awake but no request (its first load): stays": (0, Demand(1, 0.0, idle_for_s=0.0), 0, "at zero"),
    "at zero, nothing: stays": (0, Demand(0, 0.0, idle_for_s=1000.0), 0, "hold: at zero: asleep"),
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
