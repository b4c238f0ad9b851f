"""Shedding under overload through EDS drop_overloads: P2 first, then P1, never P0; only when sustained;
growing with the overload; fading when it ends."""

from __future__ import annotations

import dataclasses

import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.policy.decisions import MAX_WEIGHT
from xds_server.policy.weights import PolicyState, WeightSettings, decide

NOW = 2_000_000.0
S = WeightSettings()


def _model(priority: str):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": "m", "priority_level": priority},
                "backend": {"type": "sim"},
                "sla": {"p99_latency_ms": 1000.0, "max_queue_time_ms": 500.0},
            }
        }
    )


def _fleet(p99_ms: float, at: float, stale: bool = False) -> list[TelemetryRecord]:
    """Two endpoints equally loaded, requests waiting at each: saturation = p99 / 1000 ms on both."""
    return [
        TelemetryRecord(
            instance_id=iid,
            model_id="m",
            version="1",
            address=f"10.0.0.{n}:8000",
            node="n",
            state=InstanceState.READY,
            requests_total=1000,
            queued=1,
            latency_p50_ms=p99_ms / 2,
            latency_p99_ms=p99_ms,
            timestamp=at - (10.0 if stale else 0.0),
        )
        for n, iid in enumerate("ab", start=1)
    ]


def _drops(priority: str, overloads: list[float], dt: float = 0.5, stale_from: int | None = None) -> list[float]:
    """The published drop percent after each step; overloads are saturations (p99 / SLA) per step."""
    state, out = PolicyState(), []
    for i, overload in enumerate(overloads):
        at = NOW + i * dt
        stale = stale_from is not None and i >= stale_from
        decision, state = decide(_model(priority), _fleet(overload * 1000.0, at, stale), state, at, S)
        out.append(decision.drop_overload_percent)
    return out


@pytest.mark.parametrize(
    "case, priority, overloads, expected",
    [
        # Overload 1.5 for P2 (threshold 1.0): nothing for the first 2 s (steps 0..3), then +40 * 0.5 = 20
        # points per step.
        ("P2 sheds once the overload has lasted 2 s", "P2", [1.5] * 7, [0, 0, 0, 0, 20, 40, 60]),
        # The same overload is below P1's threshold (1.5 is not over it): P1 does not shed yet.
        ("P1 holds at an overload that sheds P2", "P1", [1.5] * 7, [0] * 7),
        # Deeper overload (2.0): P1 sheds too, more slowly than P2 would (20 vs 40 points per step).
        ("P1 sheds under a deeper overload", "P1", [2.0] * 7, [0, 0, 0, 0, 20, 40, 60]),
        ("P0 never sheds", "P0", [5.0] * 12, [0] * 12),
        # An overload that does not last resets the clock.
        ("a short overload sheds nothing", "P2", [1.5, 1.5, 1.5, 0.8, 1.5, 1.5, 1.5], [0] * 7),
    ],
)
def test_who_sheds_and_when(case, priority, overloads, expected):
    assert _drops(priority, overloads) == expected, case


def test_p2_sheds_before_p1_and_more():
    overloads = [2.0] * 7
    p2, p1 = _drops("P2", overloads), _drops("P1", overloads)
    assert p2 == [0, 0, 0, 0, 40, 80, 80]  # 40 points per step up to the cap
    assert p1 == [0, 0, 0, 0, 20, 40, 60]


def test_drop_grows_with_the_overload_and_is_capped():
    mild, heavy = _drops("P2", [1.2] * 10), _drops("P2", [2.0] * 10)
    assert 0 < mild[-1] < heavy[-1]
    assert max(_drops("P2", [4.0] * 20)) == S.max_drop_percent  # some traffic always passes


def test_drop_fades_once_the_overload_ends():
    drops = _drops("P2", [1.5] * 7 + [0.5] * 6)
    assert drops[:7] == [0, 0, 0, 0, 20, 40, 60]
    # Each step under the threshold takes 40 * (1.0 - 0.5) = 20 points off.
    assert drops[7:] == [40, 20, 0, 0, 0, 0]


def test_no_fresh_telemetry_starts_no_shedding_and_decays_any():
    assert _drops("P2", [3.0] * 8, stale_from=0) == [0] * 8
    drops = _drops("P2", [2.0] * 6 + [2.0] * 3, stale_from=6)
    assert drops[5] > 0 and drops[6] < drops[5] and drops[-1] == 0


def test_shedding_is_explained_and_fails_open_together():
    state = PolicyState()
    for i in range(6):
        at = NOW + i * 0.5
        decision, state = decide(_model("P2"), _fleet(1500.0, at), state, at, S)
    assert "shedding P2" in decision.reason and "fail-open" in decision.reason
    assert {ep.weight for ep in decision.endpoints.values()} == {MAX_WEIGHT}


def test_calling_more_often_does_not_shed_faster():
    coarse = _drops("P2", [2.0] * 7, dt=0.5)
    fine = _drops("P2", [2.0] * 13, dt=0.25)
    assert coarse[-1] == pytest.approx(fine[-1], abs=1.0)


def test_drop_settings_apply():
    settings = dataclasses.replace(S, shed_after_s=0.0, shed_gain=10.0)
    state, out = PolicyState(), []
    for i in range(3):
        at = NOW + i * 0.5
        decision, state = decide(_model("P2"), _fleet(2000.0, at), state, at, settings)
        out.append(decision.drop_overload_percent)
    assert out == [10.0, 20.0, 30.0]
