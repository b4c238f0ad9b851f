"""`sie rollout status` text (sie.cli.rollout_text), read from the very document the admin API serves
(xds_server.views.rollout_json), so the two cannot drift apart."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from sie.cli import rollout_text
from sie.spec import SLA, RolloutPolicy
from xds_server.rollout.gates import TrackStats
from xds_server.rollout.machine import RolloutState, advance, start
from xds_server.views import rollout_json


def begin(**policy) -> RolloutState:
    return start(
        "m",
        from_generation=0,
        from_version="1.0",
        to_version="2.0",
        policy=RolloutPolicy.model_validate({"steps": [50, 100], "hold_s": 30} | policy),
        replicas=2,
        now=1000.0,
    )


def served(state: RolloutState, wall: float) -> dict:
    """What GET /v1/models/<id>/rollout answers, through real JSON."""
    return json.loads(json.dumps(rollout_json(state, wall)))


GOOD = TrackStats(requests=200, p99_ms=12.345, error_rate=0.00123, queue_time_ms=1.5, ready=1)
OLD = TrackStats(requests=400, p99_ms=10.0, error_rate=0.0, queue_time_ms=1.0, ready=2)


def test_a_rollout_being_prepared():
    assert rollout_text(served(begin(), 1000.0)).splitlines() == [
        "m: 1.0 -> 2.0  PROGRESSING",
        "  step 1/2 (50%, preparing); traffic new 0% / old 100%",
        "  1.0 -> 2.0: steps 50/100%, hold 30 s each",
        "  new  ready 0  requests 0  p99 -  errors -  queue -",
        "  old  ready 0  requests 0  p99 -  errors -  queue -",
    ]


def test_a_live_step_shows_its_hold_figures_and_gates():
    live = advance(begin(), GOOD, OLD, SLA(), 1000.0)  # one new instance ready: 50% live
    held = advance(live, dataclasses.replace(GOOD, requests=50), OLD, SLA(), 1012.4)
    lines = rollout_text(served(held, 1012.4)).splitlines()
    assert lines[:5] == [
        "m: 1.0 -> 2.0  PROGRESSING",
        "  step 1/2 (50%, held 12/30 s); traffic new 50% / old 50%",
        "  holding 50%: 12/30 s",
        "  new  ready 1  requests 50  p99 12.35 ms  errors 0.0012  queue 1.5 ms",
        "  old  ready 2  requests 400  p99 10.0 ms  errors 0.0  queue 1.0 ms",
    ]
    assert lines[5:] == [
        "  gate wait p99_vs_sla: 50/100 answers from the new version",
        "  gate wait p99_vs_old: 50/100 answers from the new version",
        "  gate wait error_rate_vs_old: 50/100 answers from the new version",
        "  gate wait queue_time_vs_sla: 50/100 answers from the new version",
    ]


@pytest.mark.parametrize(
    ("new", "marks", "failed"),
    [
        (GOOD, ["ok  ", "ok  ", "ok  ", "ok  "], None),
        (
            dataclasses.replace(GOOD, p99_ms=40.0),
            ["ok  ", "FAIL", "ok  ", "ok  "],
            "  failed: p99_vs_old: p99 ms 40 > 20",
        ),
    ],
    ids=["all met", "one breached"],
)
def test_gate_marks_and_the_failed_gate(new, marks, failed):
    live = advance(begin(), GOOD, OLD, SLA(), 1000.0)
    state = advance(live, new, OLD, SLA(), 1001.0)
    lines = rollout_text(served(state, 1001.0)).splitlines()
    gates = [re.fullmatch(r"  gate (ok  |FAIL|wait) (\w+): .+", line) for line in lines[5:9]]
    assert [g.group(1) for g in gates] == marks
    assert [g.group(2) for g in gates] == ["p99_vs_sla", "p99_vs_old", "error_rate_vs_old", "queue_time_vs_sla"]
    assert len(lines) == (10 if failed else 9)
    assert (lines[-1] if failed else None) == failed
    if failed:
        assert lines[0] == "m: 1.0 -> 2.0  ROLLED_BACK"
        assert "traffic new 0% / old 100%" in lines[1]


def test_a_sparse_document_still_prints():
    text = rollout_text({"model": "m", "phase": "aborted"})
    assert text.splitlines()[0] == "m: None -> None  ABORTED"


def test_the_hold_shown_stops_while_the_new_build_has_no_ready_instance():
    live = advance(begin(), GOOD, OLD, SLA(), 1000.0)  # 50% live at 1000
    short = advance(live, dataclasses.replace(GOOD, requests=50, ready=0), OLD, SLA(), 1010.0)
    assert short.unready_since == 1010.0 and short.share == 0  # withdrawn: no ready instance
    assert served(short, 1025.0)["held_s"] == 10.0  # not 25: the hold counts only the time it had them
