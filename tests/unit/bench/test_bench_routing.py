"""bench/routing's pure parts: the request mix, the capacity estimate, and the figures of its report."""

from __future__ import annotations

import json

import pytest

from bench.routing_report import (
    Run,
    judged,
    median_figures,
    per_instance,
    plot,
    ratios,
    share_after,
    share_series,
    table,
    weight_reaction,
)
from bench.routing_workload import Mix, body, capacity_rps
from bench.stats import Sample
from node_host.backends.sim.core import SimParams


def test_every_mode_gets_the_same_requests():
    mix = Mix()
    assert [mix.request(1, i) for i in range(50)] == [mix.request(1, i) for i in range(50)]
    assert [mix.request(1, i) for i in range(50)] != [mix.request(2, i) for i in range(50)]
    words, new = mix.request(1, 7)
    doc = body("chat", mix, 1, 7)
    assert (
        doc["model"] == "chat" and len(doc["text"].split()) == words and doc["sampling_params"]["max_new_tokens"] == new
    )


@pytest.mark.parametrize("changes, ratio", [({"slowdown": 3.0}, 1 / 3), ({"kv_tokens": 4096}, 0.69)])
def test_capacity_follows_the_sim_parameters(changes, ratio):
    base = capacity_rps(SimParams(), Mix())
    assert 20 < base < 35  # ~26 req/s of this mix on the default simulated engine
    assert capacity_rps(SimParams().changed(changes), Mix()) == pytest.approx(base * ratio, rel=0.05)


def _run(mode: str, scenario: str, latencies_ms: list[float], instances: list[str], repeat: int = 0, status: int = 200):
    samples = [Sample(i * 0.1, lat / 1000, status, inst) for i, (lat, inst) in enumerate(zip(latencies_ms, instances))]
    return Run(mode, scenario, repeat, samples, duration_s=10.0)


def test_figures_are_medians_over_repeats_and_ratios_and_targets_follow():
    fast = _run("sie", "b", [100.0] * 100, ["x"] * 100)
    runs = [
        fast,
        _run("sie", "b", [100.0] * 99 + [5000.0], ["x"] * 100, 1),
        _run("sie", "b", [120.0] * 100, ["y"] * 100, 2),
        _run("lr", "b", [100.0] * 90 + [1000.0] * 10, ["x"] * 100),
        _run("rr", "b", [100.0] * 80 + [9000.0] * 20, ["x"] * 100),
    ]
    results = {"b": {m: median_figures([r for r in runs if r.mode == m], sla_ms=500.0) for m in ("rr", "lr", "sie")}}
    assert results["b"]["sie"]["repeats"] == 3 and results["b"]["sie"]["p50_ms"] == pytest.approx(100.0)
    assert results["b"]["sie"]["share"] == {"x": 1.0, "y": 0.0}  # medians of 1, 1, 0 and 0, 0, 1
    r = ratios(results)
    assert r["b: SIE/LR p99"] < 0.5 and r["b: SIE/RR p99"] < 0.1
    checks = {c["target"]: c["holds"] for c in judged(results, r)}
    assert checks == {
        "b: SIE p99 <= 0.5 x ROUND_ROBIN's": True,
        "b: SIE p99 <= 0.8 x LEAST_REQUEST's": True,
        "b: SIE SLA attainment >= 99%": True,
    }
    assert "sie" in table(results, 500.0)
    json.dumps({"results": results, "ratios": r})  # what routing.json holds


def test_a_failing_target_is_reported_as_such():
    results = {"a": {"lr": {"p99_ms": 100.0, "p50_ms": 50.0}, "sie": {"p99_ms": 110.0, "p50_ms": 50.0}}}
    checks = judged(results, ratios(results))
    assert checks == [
        {"target": "a: SIE p99 within 5% of LEAST_REQUEST's", "value": 1.1, "limit": [0.95, 1.05], "holds": False}
    ]


def test_per_instance_share_and_weight_reaction():
    run = _run("sie", "b", [100.0] * 60, ["s"] * 20 + ["t"] * 40)
    assert per_instance(run)["s"]["n"] == 20 and per_instance(run)["t"]["p50_ms"] == 100.0
    assert share_after(run, "s", since_s=2.0) == 0.0 and share_after(run, "t", since_s=0.0) == pytest.approx(2 / 3)
    assert share_series(run, "s", bin_s=1.0)[:3] == [(0.0, 1.0), (1.0, 1.0), (2.0, 0.0)]
    run.timeline = [(t / 4, {"s": {"weight": 1000 if t < 22 else 1}}) for t in range(40)]
    assert weight_reaction(run, "s", since_s=5.0) == {
        "weight_before": 1000,
        "first_drop_after_s": 0.5,
        "lowest_weight": 1,
    }


def test_the_plot_is_written(tmp_path):
    runs = [_run(m, sc, [100.0 + i for i in range(50)], ["x"] * 50) for m in ("rr", "lr", "sie") for sc in ("a", "b")]
    plot(tmp_path / "routing.png", runs, 500.0, "x", 2.0, "test")
    assert (tmp_path / "routing.png").stat().st_size > 10_000
