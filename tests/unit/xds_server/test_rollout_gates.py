"""Rollout gates (xds_server.rollout.gates): one build's figures pooled from its sidecars' windows, and each
gate judged on them against the SLA and the old build."""

from __future__ import annotations

import pytest

from sie.spec import SLA, RolloutGates
from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.rollout.gates import TrackStats, judge, track_stats

SLA_ = SLA(p99_latency_ms=1000.0, max_queue_time_ms=200.0)
ALL_GATES = ["p99_vs_sla", "p99_vs_old", "error_rate_vs_old", "queue_time_vs_sla"]


def rec(
    n: int,
    p99: float | None = None,
    errors: float = 0.0,
    queue: float | None = None,
    state: InstanceState = InstanceState.READY,
    iid: str = "m-0",
) -> TelemetryRecord:
    return TelemetryRecord(
        iid,
        "m",
        "1",
        "127.0.0.1:9000",
        "n1",
        state,
        window_requests=n,
        latency_p99_ms=p99,
        error_rate=errors,
        queue_time_ms=queue,
    )


# ---- pooling --------------------------------------------------------------------------------------

POOLS = {
    "no instance": ([], TrackStats()),
    "ready, no answers yet": ([rec(0), rec(0, iid="m-1")], TrackStats(ready=2)),
    "one instance": ([rec(100, p99=40.0, errors=0.02, queue=3.0)], TrackStats(100, 40.0, 0.02, 3.0, 1)),
    # p99: request-weighted mean (100 x 10 + 300 x 30) / 400; errors: (0 + 30) / 400; queue: the worst
    "two, weighted by answers": (
        [rec(100, p99=10.0, errors=0.0, queue=5.0), rec(300, p99=30.0, errors=0.1, queue=2.0, iid="m-1")],
        TrackStats(400, 25.0, 0.075, 5.0, 2),
    ),
    # An instance with no answers in its window has no say in the figures, whatever they read; it counts
    # as ready.
    "an idle instance does not decide": (
        [rec(100, p99=10.0, queue=1.0), rec(0, p99=9000.0, errors=1.0, queue=9000.0, iid="m-1")],
        TrackStats(100, 10.0, 0.0, 1.0, 2),
    ),
    # A draining instance's answers are the build's answers; it is not ready, it is counted as draining
    # (it still holds its memory: an old instance stopped to make room has not made it yet).
    "draining answers count, not as ready": (
        [rec(100, p99=10.0), rec(100, p99=30.0, errors=0.5, state=InstanceState.DRAINING, iid="m-1")],
        TrackStats(200, 20.0, 0.25, None, 1, draining=1),
    ),
    "loading is not ready": ([rec(0, state=InstanceState.LOADING)], TrackStats()),
}


@pytest.mark.parametrize(("records", "pooled"), POOLS.values(), ids=POOLS.keys())
def test_track_stats_pools_the_instances_windows(records, pooled):
    got = track_stats(records)
    assert (got.requests, got.ready, got.draining, got.queue_time_ms) == (
        pooled.requests,
        pooled.ready,
        pooled.draining,
        pooled.queue_time_ms,
    )
    assert got.p99_ms == pytest.approx(pooled.p99_ms)
    assert got.error_rate == pytest.approx(pooled.error_rate)


def test_track_stats_takes_any_iterable_once():
    assert track_stats(r for r in [rec(10, p99=1.0), rec(30, p99=5.0, iid="m-1")]).p99_ms == pytest.approx(4.0)


def test_figures_show_rounded():
    assert TrackStats(3, 10.123, 0.123456, None, 1).to_json() == {
        "requests": 3,
        "p99_ms": 10.12,
        "error_rate": 0.1235,
        "queue_time_ms": None,
        "ready": 1,
        "draining": 0,
    }


# ---- each gate ------------------------------------------------------------------------------------


def figures(p99: float = 10.0, errors: float = 0.0, queue: float | None = 1.0, requests: int = 200) -> TrackStats:
    return TrackStats(requests, p99, errors, queue, 1)


# gate -> (new, old, gates settings, holds, limit)
GATES = {
    "p99 within the SLA": ("p99_vs_sla", figures(p99=1000.0), figures(), {}, True, 1000.0),
    "p99 over the SLA": ("p99_vs_sla", figures(p99=1000.1), figures(p99=1000.1), {}, False, 1000.0),
    "p99 at 1.5x the old + slack": ("p99_vs_old", figures(p99=155.0), figures(p99=100.0), {}, True, 155.0),
    "p99 past 1.5x the old + slack": ("p99_vs_old", figures(p99=155.5), figures(p99=100.0), {}, False, 155.0),
    "p99 ratio set": ("p99_vs_old", figures(p99=205.5), figures(p99=100.0), {"max_p99_ratio": 2.0}, False, 205.0),
    # The absolute slack keeps millisecond noise from gating: 2 ms -> 7 ms is within 2 x 1.5 + 5.
    "slack absorbs noise": ("p99_vs_old", figures(p99=7.0), figures(p99=2.0), {}, True, 8.0),
    "no slack, the same noise gates": (
        "p99_vs_old",
        figures(p99=7.0),
        figures(p99=2.0),
        {"p99_slack_ms": 0},
        False,
        3.0,
    ),
    "errors within the old + 0.01": ("error_rate_vs_old", figures(errors=0.015), figures(errors=0.01), {}, True, 0.02),
    "errors past the old + 0.01": ("error_rate_vs_old", figures(errors=0.025), figures(errors=0.01), {}, False, 0.02),
    "errors, increase set": (
        "error_rate_vs_old",
        figures(errors=0.05),
        figures(errors=0.0),
        {"max_error_rate_increase": 0.1},
        True,
        0.1,
    ),
    "queue within the SLA": ("queue_time_vs_sla", figures(queue=200.0), figures(), {}, True, 200.0),
    "queue over the SLA": ("queue_time_vs_sla", figures(queue=200.5), figures(), {}, False, 200.0),
    "no queue figure reads as none": ("queue_time_vs_sla", figures(queue=None), figures(), {}, True, 200.0),
}


@pytest.mark.parametrize(("gate", "new", "old", "settings", "holds", "limit"), GATES.values(), ids=GATES.keys())
def test_each_gate(gate, new, old, settings, holds, limit):
    results = {g.name: g for g in judge(new, old, RolloutGates(**settings), SLA_)}
    assert list(results) == ALL_GATES
    got = results[gate]
    assert got.holds is holds and got.limit == pytest.approx(limit)
    assert ("<=" if holds else ">") in got.detail
    json = got.to_json()
    assert (json["name"], json["holds"]) == (gate, holds)


DISABLED = {
    "p99 vs SLA off": ({"p99_within_sla": False}, ["p99_vs_old", "error_rate_vs_old", "queue_time_vs_sla"]),
    "p99 ratio off": ({"max_p99_ratio": None}, ["p99_vs_sla", "error_rate_vs_old", "queue_time_vs_sla"]),
    "error rate off": ({"max_error_rate_increase": None}, ["p99_vs_sla", "p99_vs_old", "queue_time_vs_sla"]),
    "queue off": ({"queue_time_within_sla": False}, ["p99_vs_sla", "p99_vs_old", "error_rate_vs_old"]),
    "all off": (
        {
            "p99_within_sla": False,
            "max_p99_ratio": None,
            "max_error_rate_increase": None,
            "queue_time_within_sla": False,
        },
        [],
    ),
}


@pytest.mark.parametrize(("settings", "judged"), DISABLED.values(), ids=DISABLED.keys())
def test_a_disabled_gate_is_not_judged_even_when_it_would_breach(settings, judged):
    terrible = figures(p99=1e6, errors=1.0, queue=1e6)
    results = judge(terrible, figures(), RolloutGates(**settings), SLA_)
    assert [g.name for g in results] == judged
    assert all(g.holds is False for g in results)


# ---- enough answers -------------------------------------------------------------------------------

# (new answers, old answers) -> the gates with a verdict; min_requests 100, every figure a breach
SAMPLES = {
    "both enough": (100, 100, set(ALL_GATES)),
    "new one short": (99, 500, set()),
    "old one short: only the SLA gates": (500, 99, {"p99_vs_sla", "queue_time_vs_sla"}),
    "neither": (0, 0, set()),
}


@pytest.mark.parametrize(("new_n", "old_n", "judged"), SAMPLES.values(), ids=SAMPLES.keys())
def test_a_gate_waits_for_min_requests_answers(new_n, old_n, judged):
    new = figures(p99=5000.0, errors=0.5, queue=5000.0, requests=new_n)
    old = figures(p99=10.0, errors=0.0, requests=old_n)
    results = judge(new, old, RolloutGates(min_requests=100), SLA_)
    assert {g.name for g in results if g.holds is not None} == judged
    assert all(g.holds is False for g in results if g.name in judged)
    for g in results:
        if g.holds is None:
            short, side = (new_n, "new") if new_n < 100 else (old_n, "old")
            assert g.detail == f"{short}/100 answers from the {side} version"


def test_min_requests_is_configurable():
    new, old = figures(requests=5), figures(requests=5)
    assert all(g.holds is None for g in judge(new, old, RolloutGates(min_requests=6), SLA_))
    assert all(g.holds is True for g in judge(new, old, RolloutGates(min_requests=5), SLA_))


def test_an_old_build_with_answers_but_no_p99_leaves_the_ratio_unjudged():
    old = TrackStats(requests=500, p99_ms=None, error_rate=0.0, queue_time_ms=None, ready=1)
    results = {g.name: g for g in judge(figures(), old, RolloutGates(), SLA_)}
    assert results["p99_vs_old"].holds is None and results["error_rate_vs_old"].holds is True
