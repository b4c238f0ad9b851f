"""bench.eviction's judged targets, from a run's results: each holds or not from the figures alone."""

from __future__ import annotations

from bench.eviction import judged


def _mode(p0_errors: int, p2_lost: int, serving: float | None) -> dict:
    return {
        "p0": {"requests": 40, "errors": p0_errors},
        "p2": {"lost": p2_lost},
        "seconds_from_p0_added": {} if serving is None else {"p0_serving": serving},
    }


def test_a_good_run_holds_every_target():
    checks = judged({"drain": _mode(0, 0, 2.5), "off": _mode(40, 0, None)})
    assert len(checks) == 4 and all(c["holds"] for c in checks), checks


def test_each_failure_is_named():
    checks = {c["target"]: c for c in judged({"drain": _mode(2, 1, None), "off": _mode(0, 0, None)})}
    assert not checks["drain: P0 error ratio == 0"]["holds"]
    assert checks["drain: P0 error ratio == 0"]["value"] == 0.05
    assert not checks["drain: P2 accepted requests lost == 0"]["holds"]
    assert not checks["drain: P0 serving <= 10 s after it was added"]["holds"]
    assert not checks["off (baseline): P0 error ratio > 0.5 (eviction is what lets P0 in)"]["holds"]
