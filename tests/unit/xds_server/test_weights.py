"""The weight policy's rules, one table each: saturation, slowness, smoothing, cap, hysteresis, floor,
fail-open, stale, the GPU rule and tie-breaker, draining, determinism."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.policy.decisions import MAX_WEIGHT, MIN_WEIGHT, Health
from xds_server.policy.signals import read_signals, saturation, target_weight
from xds_server.policy.weights import PolicyState, WeightPolicy, WeightSettings, decide

NOW = 1_000_000.0
S = WeightSettings()


def _model(priority: str = "P1", p99_ms: float = 1000.0, max_queue_ms: float = 500.0):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": "m", "priority_level": priority},
                "backend": {"type": "sim"},
                "sla": {"p99_latency_ms": p99_ms, "max_queue_time_ms": max_queue_ms},
            }
        }
    )


M = _model()


def _rec(iid: str = "a", **kw) -> TelemetryRecord:
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
        timestamp=NOW,
    )
    base.update(kw)
    return TelemetryRecord(**base)


def _fleet(**overrides) -> list[TelemetryRecord]:
    """Four equal endpoints a..d; overrides={"b": {...}} changes one."""
    return [_rec(iid, **overrides.get(iid, {})) for iid in "abcd"]


def _weights(decision) -> dict[str, int]:
    return {iid: ep.weight for iid, ep in decision.endpoints.items()}


# ---- saturation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, fields, value, cause",
    [
        ("idle", dict(latency_p99_ms=None, latency_p50_ms=None), 0.0, "queue"),
        ("sidecar queue over max_concurrent", dict(queued=32, latency_p99_ms=None), 0.5, "queue"),
        ("engine waiting counts too", dict(queued=16, engine_waiting=16, latency_p99_ms=None), 0.5, "queue"),
        (
            "queue_full when max_concurrent unknown",
            dict(max_concurrent=0, queued=16, latency_p99_ms=None),
            0.25,
            "queue",
        ),
        ("kv over 0.8", dict(kv_cache_usage=0.6), 0.75, "kv"),
        ("p99 over the SLA, a request waiting", dict(latency_p99_ms=900.0, queued=1), 0.9, "p99/sla"),
        ("queue time over the SLA's", dict(queue_time_ms=400.0, queued=1), 0.8, "queue time"),
        ("engine waiting counts as waiting", dict(latency_p99_ms=900.0, engine_waiting=1), 0.9, "p99/sla"),
        # The window remembers 30 s: a burst's p99 with nothing waiting now is history, not saturation.
        ("p99 over the SLA, nothing waiting", dict(latency_p99_ms=1300.0, queue_time_ms=900.0), 0.0, "queue"),
        ("errors", dict(error_rate=0.25), 0.5, "errors"),
        ("the largest term wins", dict(kv_cache_usage=0.4, latency_p99_ms=1200.0, queued=8), 1.2, "p99/sla"),
        (
            "stale is saturated, never idle",
            dict(timestamp=NOW - S.stale_after_s - 0.1, latency_p99_ms=None),
            math.inf,
            "stale 3.1s",
        ),
    ],
)
def test_saturation_is_the_largest_known_term(case, fields, value, cause):
    got, got_cause = saturation(_rec(**fields), M, NOW, S)
    assert got == pytest.approx(value), case
    assert got_cause == cause, case


# ---- target weight --------------------------------------------------------------------------------


def _target(fleet: list[TelemetryRecord], iid: str = "b", settings: WeightSettings = S) -> float:
    signals = read_signals(M, fleet, {}, NOW, settings)
    return target_weight(next(s for s in signals if s.instance_id == iid), signals, settings)


@pytest.mark.parametrize(
    "case, b, expected",
    [
        ("below the knee: full share", dict(latency_p99_ms=400.0), MAX_WEIGHT),
        ("at the knee", dict(latency_p99_ms=500.0, latency_p50_ms=100.0), MAX_WEIGHT),
        ("half way from knee to saturated", dict(kv_cache_usage=0.6), MAX_WEIGHT / 2),
        ("saturated: the floor", dict(kv_cache_usage=0.8), MIN_WEIGHT),
        ("over-saturated: still the floor, never 0", dict(queued=500), MIN_WEIGHT),
    ],
)
def test_weight_falls_as_saturation_rises(case, b, expected):
    # The other endpoints share b's p99 so only saturation, not slowness, differs.
    p99 = b.get("latency_p99_ms", 200.0)
    fleet = _fleet(**{k: {"latency_p99_ms": p99} for k in "acd"}, b=b)
    assert _target(fleet) == pytest.approx(expected), case


@pytest.mark.parametrize(
    "case, p50, p99, expected",
    [
        ("as fast as the fleet", 100.0, 200.0, MAX_WEIGHT),
        ("within the 1.3x noise band", 125.0, 250.0, MAX_WEIGHT),
        ("2x the fleet's p50: floor", 200.0, 200.0, MIN_WEIGHT),
        ("2x the fleet's p99 alone: floor", 100.0, 400.0, MIN_WEIGHT),
        ("3x slower: floor", 300.0, 600.0, MIN_WEIGHT),
        # 1.6x: log(1.6/1.3)/log(2/1.3) = 0.482 of the way from full weight to the floor on a log scale.
        (
            "in between: geometric",
            160.0,
            200.0,
            MAX_WEIGHT * (MIN_WEIGHT / MAX_WEIGHT) ** (math.log(1.6 / 1.3) / math.log(2.0 / 1.3)),
        ),
        ("faster than the fleet: no bonus", 50.0, 100.0, MAX_WEIGHT),
    ],
)
def test_slower_than_the_fleet_loses_share(case, p50, p99, expected):
    fleet = _fleet(b=dict(latency_p50_ms=p50, latency_p99_ms=p99))
    assert _target(fleet) == pytest.approx(expected, rel=1e-6), case


@pytest.mark.parametrize(
    "case, b, fleet_overrides, expected",
    [
        # Too few answered requests: its latency figures are noise and are ignored.
        ("endpoint too new", dict(latency_p50_ms=500.0, requests_total=10), {}, MAX_WEIGHT),
        # Only one endpoint has enough requests: no fleet to compare with.
        ("fleet too new", dict(latency_p50_ms=500.0), {k: dict(requests_total=5) for k in "acd"}, MAX_WEIGHT),
        # The lower median: two slow endpoints of four do not move the reference.
        ("two slow of four", dict(latency_p50_ms=300.0), {"c": dict(latency_p50_ms=300.0)}, MIN_WEIGHT),
        # The other endpoints' latency is unknown: no comparison.
        (
            "no fleet latency",
            dict(latency_p50_ms=500.0),
            {k: dict(latency_p50_ms=None, latency_p99_ms=None) for k in "acd"},
            MAX_WEIGHT,
        ),
    ],
)
def test_slowness_needs_a_trustworthy_fleet_reference(case, b, fleet_overrides, expected):
    assert _target(_fleet(b=b, **fleet_overrides)) == pytest.approx(expected), case


SERVED = dict(service_p50_ms=100.0, service_p99_ms=200.0)


@pytest.mark.parametrize(
    "case, b, others, expected",
    [
        # b served alone until the others woke: its queue waits doubled its latency, not its service time.
        (
            "queued, not slower: service time decides",
            dict(latency_p50_ms=200.0, latency_p99_ms=900.0, **SERVED),
            SERVED,
            MAX_WEIGHT,
        ),
        ("2x the fleet's service time: floor", dict(service_p50_ms=200.0, service_p99_ms=400.0), SERVED, MIN_WEIGHT),
        # One endpoint without service figures (an older sidecar): latency for everyone, as before.
        (
            "a fleet without service figures: latency",
            dict(latency_p50_ms=200.0, latency_p99_ms=900.0, **SERVED),
            {},
            MIN_WEIGHT,
        ),
    ],
)
def test_the_window_comparison_reads_service_time(case, b, others, expected):
    fleet = _fleet(b=b, **{k: others for k in "acd"})
    assert _target(fleet) == pytest.approx(expected), case


def test_an_endpoint_gone_quiet_keeps_its_last_known_slowness():
    slow = _fleet(b=dict(latency_p50_ms=300.0, latency_p99_ms=600.0))
    _, state = decide(M, slow, PolicyState(), NOW, S)
    assert state.slowness["b"] == pytest.approx(3.0)
    quiet = _fleet(b=dict(latency_p50_ms=None, latency_p99_ms=None))
    signals = read_signals(M, quiet, state.slowness, NOW, S)
    assert next(s for s in signals if s.instance_id == "b").slowness == pytest.approx(3.0)


@pytest.mark.parametrize(
    "case, util, queued, max_concurrent, factor",
    [
        ("busy GPU and a long queue: 30% moves away", 0.9, 60, 200, 0.7),
        ("busy GPU, short queue: no rule", 0.9, 40, 200, 1.0),
        ("long queue, GPU at 85%: no rule", 0.85, 60, 200, 1.0),
        ("no GPU figure: no rule", None, 60, 200, 1.0),
    ],
)
def test_the_articles_gpu_rule(case, util, queued, max_concurrent, factor):
    # Every endpoint has the same queue, so only the rule (and the small tie-breaker) can differ.
    common = dict(queued=queued, max_concurrent=max_concurrent)
    with_util = _fleet(**{k: dict(common, gpu_utilization=util) for k in "abcd"})
    without = _fleet(**{k: dict(common) for k in "abcd"})
    assert _target(with_util) == pytest.approx(_target(without) * factor), case


def test_gpu_utilisation_only_breaks_ties():
    fleet = _fleet(
        a=dict(gpu_utilization=0.2),
        b=dict(gpu_utilization=0.9),
        c=dict(gpu_utilization=0.2),
        d=dict(gpu_utilization=0.2),
    )
    busy, idle = _target(fleet, "b"), _target(fleet, "a")
    assert idle == MAX_WEIGHT and MAX_WEIGHT - S.hysteresis < busy < idle  # an order, below the hysteresis
    first, state = decide(M, _fleet(), PolicyState(), NOW, S)
    again, _ = decide(M, fleet, state, NOW + 0.5, S)
    assert again is first  # GPU utilisation alone never causes a push


# ---- dynamics: smoothing, cap, hysteresis, floor -----------------------------------------------------


def _run(
    steps: list[list[TelemetryRecord]], dt: float = 0.5, settings: WeightSettings = S, state: PolicyState | None = None
):
    state = state or PolicyState()
    out = []
    for i, fleet in enumerate(steps):
        at = NOW + i * dt
        fleet = [dataclasses.replace(r, timestamp=at) for r in fleet]
        decision, state = decide(M, fleet, state, at, settings)
        out.append(decision)
    return out, state


SLOW_B = _fleet(b=dict(latency_p50_ms=300.0, latency_p99_ms=600.0))


@pytest.mark.parametrize(
    "case, settings, expected_b",
    [
        # Down: EWMA gain 0.7 per step, capped at 600 points: 1000 -> 400 -> 120.7 -> 36.9 -> 11.9 -> 4.3.
        # 37 -> 12 moves fewer points than the hysteresis (50) but divides the weight by 3: pushed.
        ("default: fast down", S, [1000, 400, 121, 37, 12, 4]),
        # Gain 0.5: ... 126 -> 63 halves (pushed); 63 -> 32 is just short of halving: held back.
        ("gentler gain", dataclasses.replace(S, alpha_down=0.5), [1000, 501, 251, 126, 63, 63]),
        ("tighter cap", dataclasses.replace(S, max_step_down=200.0), [1000, 800, 600, 400, 200, 61]),
    ],
)
def test_weights_move_toward_the_target_smoothed_and_capped(case, settings, expected_b):
    decisions, _ = _run([_fleet()] + [SLOW_B] * 5, settings=settings)
    assert [d.endpoints["b"].weight for d in decisions] == expected_b, case
    assert all(d.endpoints["a"].weight == MAX_WEIGHT for d in decisions)


def test_recovery_is_slower_than_the_fall_and_capped():
    decisions, _ = _run([SLOW_B] + [_fleet()] * 6)
    # Up: gain 0.3 per step, at most 200 points: 1 -> 201 -> 401 -> 581 -> 706 -> 795 -> 856.
    assert [d.endpoints["b"].weight for d in decisions] == [1, 201, 401, 581, 706, 795, 856]


def test_calling_more_often_does_not_move_weights_faster():
    coarse, _ = _run([_fleet()] + [SLOW_B] * 2, dt=0.5)
    fine, _ = _run([_fleet()] + [SLOW_B] * 4, dt=0.25)
    assert abs(coarse[-1].endpoints["b"].weight - fine[-1].endpoints["b"].weight) <= 2


@pytest.mark.parametrize(
    "case, p50_b, pushed",
    [
        # 1.32x the fleet: target 783, smoothed to 848: 152 points, over the hysteresis of 50.
        ("a move of 152 points is pushed", 132.0, True),
        # 1.303x: target 965, smoothed to 976: 24 points from 1000: nothing is pushed.
        ("a move of 24 points is not", 130.3, False),
    ],
)
def test_hysteresis_small_moves_are_not_pushed(case, p50_b, pushed):
    (first, second), _ = _run([_fleet(), _fleet(b=dict(latency_p50_ms=p50_b))])
    assert (second is not first) == pushed, case
    if not pushed:
        assert second.endpoints["b"].weight == MAX_WEIGHT


def test_hysteresis_still_lets_small_moves_add_up():
    # 1.305x: target 940; smoothed 958 (a move of 42: held back), then 946 (54 from 1000: pushed).
    decisions, _ = _run([_fleet()] + [_fleet(b=dict(latency_p50_ms=130.5))] * 2)
    assert [d.endpoints["b"].weight for d in decisions] == [1000, 1000, 946]


def test_reaching_full_weight_is_pushed_even_within_the_hysteresis():
    decisions, _ = _run([SLOW_B] + [_fleet()] * 9)
    weights = [d.endpoints["b"].weight for d in decisions]
    # Near the top the smoothed weight creeps up by less than the hysteresis (856 -> 899 is held back);
    # once within the hysteresis of full weight (930 -> 951) it finishes the climb, and that is pushed:
    # equal weights again, so Envoy's LEAST_REQUEST is back to its power-of-two-choices pick.
    assert weights[-4:] == [856, 856, 930, MAX_WEIGHT]


@pytest.mark.parametrize("floor", [MIN_WEIGHT, 3])
def test_exploration_floor_keeps_a_trickle(floor):
    decisions, _ = _run([SLOW_B] * 8, settings=dataclasses.replace(S, floor=floor))
    assert decisions[-1].endpoints["b"].weight == floor
    assert decisions[-1].endpoints["b"].health is Health.HEALTHY


# ---- whole-model rules --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, fleet, expected",
    [
        (
            "all saturated: fail open to equal weights",
            _fleet(**{k: dict(kv_cache_usage=0.95) for k in "abcd"}),
            [MAX_WEIGHT] * 4,
        ),
        ("all stale: fail open", [dataclasses.replace(r, timestamp=NOW - 10) for r in _fleet()], [MAX_WEIGHT] * 4),
        (
            "one not saturated: no fail-open",
            _fleet(**{k: dict(kv_cache_usage=0.95) for k in "abc"}),
            [1, 1, 1, MAX_WEIGHT],
        ),
        ("stale is saturated", _fleet(b=dict(timestamp=NOW - 10)), [MAX_WEIGHT, 1, MAX_WEIGHT, MAX_WEIGHT]),
    ],
)
def test_fail_open_and_stale(case, fleet, expected):
    decision, _ = decide(M, fleet, PolicyState(), NOW, S)
    assert list(_weights(decision).values()) == expected, case
    if "fail open" in case:
        assert "fail-open" in decision.reason


def test_fail_open_is_immediate_not_smoothed():
    (_, after), _ = _run([SLOW_B, _fleet(**{k: dict(queued=200) for k in "abcd"})])
    assert set(_weights(after).values()) == {MAX_WEIGHT}


@pytest.mark.parametrize("state", [InstanceState.DRAINING, InstanceState.SLEEPING, InstanceState.LOADING])
def test_non_serving_endpoints_drain(state):
    decision, _ = decide(M, _fleet(b=dict(state=state)), PolicyState(), NOW, S)
    ep = decision.endpoints["b"]
    assert (ep.health, ep.weight, ep.reason) == (Health.DRAINING, S.floor, state.value)
    assert decision.endpoints["a"].health is Health.HEALTHY


def test_draining_endpoint_does_not_count_toward_fail_open_or_the_fleet():
    fleet = _fleet(
        a=dict(state=InstanceState.DRAINING, latency_p50_ms=1.0),
        b=dict(kv_cache_usage=0.95),
        c=dict(kv_cache_usage=0.95),
        d=dict(kv_cache_usage=0.95),
    )
    decision, _ = decide(M, fleet, PolicyState(), NOW, S)
    assert "fail-open" in decision.reason
    assert [ep.weight for iid, ep in decision.endpoints.items() if iid != "a"] == [MAX_WEIGHT] * 3


def test_every_endpoint_has_a_reason():
    decision, _ = decide(
        M,
        _fleet(b=dict(latency_p50_ms=300.0), c=dict(kv_cache_usage=0.7), d=dict(timestamp=NOW - 9)),
        PolicyState(),
        NOW,
        S,
    )
    reasons = {iid: ep.reason for iid, ep in decision.endpoints.items()}
    assert "3.0x fleet latency" in reasons["b"]
    assert "(kv)" in reasons["c"]
    assert "stale" in reasons["d"]
    assert all(reasons.values()) and decision.reason


def test_deterministic_whatever_the_record_order_and_duplicates():
    fleet = _fleet(b=dict(latency_p50_ms=170.0), c=dict(kv_cache_usage=0.7))
    older_b = dataclasses.replace(fleet[1], timestamp=NOW - 1, latency_p50_ms=100.0)
    other_model = dataclasses.replace(fleet[0], model_id="other", instance_id="z")
    one, _ = decide(M, fleet, PolicyState(), NOW, S)
    two, _ = decide(M, [other_model, fleet[3], older_b, fleet[2], fleet[1], fleet[0]], PolicyState(), NOW, S)
    assert one == two
    assert list(one.endpoints) == ["a", "b", "c", "d"]


def test_no_records_no_endpoints():
    decision, state = decide(M, [], PolicyState(), NOW, S)
    assert decision.endpoints == {} and decision.drop_overload_percent == 0
    assert state.published is decision


def test_new_endpoint_starts_at_its_target_and_membership_changes_are_pushed():
    (first, second), _ = _run([_fleet()[:3], _fleet()])
    assert second is not first and second.endpoints["d"].weight == MAX_WEIGHT


def test_wrapper_keeps_state_per_model_and_returns_the_same_decision_when_nothing_moves():
    policy = WeightPolicy()
    other = _model().model_copy(update={})  # the same model id: shares state
    first = policy.decide(M, _fleet(), NOW)
    assert policy.decide(other, _fleet(), NOW + 0.5) is first
    slow = [dataclasses.replace(r, timestamp=NOW + 1) for r in SLOW_B]
    assert policy.decide(M, slow, NOW + 1).endpoints["b"].weight < MAX_WEIGHT
    policy.forget("m")
    assert policy.state("m") is None


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(knee=1.0), "knee must lie in [0, 1)"),
        (dict(slow_start=2.0, slow_floor=1.5), "slow_start < slow_floor"),
        (dict(floor=0), f"floor must lie in [1, {MAX_WEIGHT})"),
        (dict(alpha_up=0.0), "alpha_up must lie in (0, 1]"),
        (dict(max_drop_percent=100.0), "max_drop_percent must lie in [0, 100)"),
    ],
)
def test_settings_are_checked(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        WeightSettings(**changes)
