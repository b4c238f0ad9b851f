"""bench.tiers' pure parts: the stacks' cluster files load, which runs a scenario's figures count (noisy
ones only when nothing else is left), the pooled figures and ratios, and the judged targets."""

from __future__ import annotations

import pytest
import yaml

from bench.tiers_report import SCENARIOS, counted, judged, llm_figures, pooled, ratios
from bench.tiers_setup import SCENARIO, STACKS, cluster_docs
from sie.cluster import load_cluster


@pytest.mark.parametrize("stack", STACKS)
def test_each_stacks_cluster_file_loads_and_differs_only_in_tier_cores(tmp_path, stack):
    path = tmp_path / f"{stack}.yaml"
    path.write_text(yaml.safe_dump_all(cluster_docs(stack, gold="0", llm_threads=2, llm_concurrency=8)))
    cluster = load_cluster(path)
    (node,) = cluster.settings.node_specs
    assert node.tier_cpus == ("gold=0" if stack == "tiers" else "") and node.p0_only_tiers == "gold"
    scorer, llm = cluster.services
    assert (scorer.spec.model.priority_level.value, scorer.spec.scheduling.tier) == ("P0", "gold")
    assert (llm.spec.model.priority_level.value, llm.spec.backend.type.value) == ("P1", "torch")
    assert {SCENARIO[s].stack for s in SCENARIOS} == set(STACKS)


def run(scenario: str, latencies: list[float], noisy: bool = False, failed: int = 0, llm_failed: int = 0) -> dict:
    return {
        "scenario": scenario,
        "noisy": noisy,
        "scorer": {"requests": len(latencies) + failed},
        "scorer_failed": failed,
        "scorer_latencies_ms": latencies,
        "llm": None
        if SCENARIO[scenario].llm is None
        else {"requests_per_s": 10.0, "tokens_per_s": 600.0, "p50_ms": 200.0, "p99_ms": 400.0, "failed": llm_failed},
        "cpu": {"cores_busy": {"0": 0.5}, "process_cores": {"x": 0.1}, "ours_cores": 1.0, "others_cores": 0.0},
    }


def test_a_noisy_run_counts_only_when_the_scenario_has_no_clean_one():
    runs = [run("a", [1.0], noisy=True), run("a", [2.0]), run("b", [3.0], noisy=True)]
    assert [r["scorer_latencies_ms"] for r in counted(runs, "a")] == [[2.0]]
    assert [r["scorer_latencies_ms"] for r in counted(runs, "b")] == [[3.0]]


def figures(c_ms: float, failed: int = 0) -> dict:
    """Each scenario's p99 is its tail value (a tenth of the samples): a 10 ms alone, b 20 ms, c `c_ms`."""
    return {
        "a": pooled([run("a", [5.0] * 90 + [10.0] * 10)]),
        "b": pooled([run("b", [6.0] * 90 + [20.0] * 10)]),
        "c": pooled([run("c", [6.0] * 90 + [c_ms] * 10, llm_failed=failed)]),
        "c0": pooled([run("c0", [6.0] * 90 + [15.0] * 10)]),
        "a1": pooled([run("a1", [5.0] * 90 + [11.0] * 10)]),
    }


def test_the_ratio_target_holds_up_to_one_point_three_and_fails_above():
    f = figures(13.0)
    r = ratios(f)
    assert (r["scorer_p99_c_over_a"], r["scorer_p99_b_over_a"], r["scorer_p99_c0_over_a"]) == (1.3, 2.0, 1.5)
    assert (r["scorer_p99_a1_over_a"], r["scorer_p99_c_over_a1"]) == (1.1, 1.182)
    quick = {s: f[s] for s in ("a", "b", "c")}
    assert "scorer_p99_a1_over_a" not in ratios(quick)  # the diagnostics run in full runs only
    ratio, failures = judged(f, r)
    assert ratio["holds"] and ratio["limit"] == 1.3 and failures["holds"] and failures["value"] == 0
    slow = figures(13.1)
    assert not judged(slow, ratios(slow))[0]["holds"]


def test_any_failed_request_fails_the_second_target_and_a_noisy_scenario_is_noted():
    f = figures(12.0, failed=1)
    ratio, failures = judged(f, ratios(f), noisy=["b"])
    assert not failures["holds"] and failures["value"] == 1
    assert ratio["note"] == "scenarios b had no clean run: another user of the machine"


def test_llm_figures_count_the_window_and_every_failure():
    rows = [
        {"start": 0.0, "end": 0.5, "status": 200, "tokens": 64},  # before the window
        {"start": 0.5, "end": 1.5, "status": 200, "tokens": 64},
        {"start": 1.0, "end": 2.0, "status": 200, "tokens": 32},
        {"start": 2.5, "end": 3.5, "status": 503, "tokens": 0},  # after it, yet a failure of the run
    ]
    got = llm_figures(rows, start=1.0, end=3.0)
    assert (got["requests"], got["requests_per_s"], got["tokens_per_s"], got["failed"]) == (2, 1.0, 48.0, 1)
    assert got["p50_ms"] == 1000.0
