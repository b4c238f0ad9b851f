"""bench.triton's pure parts: each path's summary over its rounds, the SIE/direct ratios, the quiet rounds,
issue 39's judged targets (p99 within 1.5x of Triton called directly, nothing failed), the table, and
the spec it serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import triton
from bench.triton_report import QUIET_CORES, Measured, compare, cpu_per_request, judged, ratio, summary, table
from node_host.backends.triton_server.repository import TritonSettings
from sie.spec import ModelService


def window(latencies=(1.0, 2.0, 3.0, 4.0), sent=None, ok=None, span_s=2.0, lag=(0.1,), others=0.0) -> Measured:
    n = len(latencies)
    return Measured(tuple(latencies), n if sent is None else sent, n if ok is None else ok, span_s, tuple(lag), others)


def test_summary_pools_the_windows_of_one_path():
    s = summary([window([1.0] * 99 + [50.0], span_s=1.0), window([2.0] * 100, sent=102, span_s=1.0, others=0.5)])
    assert (s["sent"], s["ok"], s["errors"]) == (202, 200, 2)
    assert s["achieved_rps"] == 100.0  # 200 answered in the 2 s the windows took
    assert s["p50_ms"] == 2.0 and s["max_ms"] == 50.0  # pooled: the first window alone has p50 1.0
    assert 2.0 <= s["p99_ms"] < 50.0
    assert s["others_cores"] == 0.25 and s["client_lag_p99_ms"] == 0.1


def test_summary_of_nothing_answered_has_no_percentiles():
    s = summary([window([], sent=10, ok=0, lag=())])
    assert (s["errors"], s["p99_ms"], s["max_ms"], s["client_lag_p99_ms"]) == (10, None, None, None)


@pytest.mark.parametrize(
    "sie, direct, expected",
    [
        ({"p99_ms": 3.0}, {"p99_ms": 2.0}, 1.5),
        ({"p99_ms": None}, {"p99_ms": 2.0}, None),
        ({"p99_ms": 3.0}, {"p99_ms": 0}, None),
    ],
)
def test_ratio(sie, direct, expected):
    assert ratio(sie, direct) == expected


def test_compare_ratios_per_run_per_round_and_over_the_quiet_rounds():
    busy = QUIET_CORES + 0.5
    rounds = [
        {"direct": window([1.0] * 100), "sie": window([1.2] * 100)},  # quiet
        {"direct": window([1.0] * 100, others=busy), "sie": window([4.0] * 100, others=busy)},  # disturbed
    ]
    result = compare(rounds)
    assert [r["p99_ratio"] for r in result["rounds"]] == [1.2, 4.0]
    assert result["p99_ratio_median_of_rounds"] == 2.6
    assert result["direct"]["sent"] == result["sie"]["sent"] == 200
    assert result["p99_ratio"] == 4.0  # the run's p99 per path: the disturbed round's tail is in it
    assert result["quiet"]["rounds"] == 1 and result["quiet"]["p99_ratio"] == 1.2


def test_a_round_disturbed_on_one_path_is_not_quiet():
    rounds = [{"direct": window(others=QUIET_CORES), "sie": window(others=QUIET_CORES + 0.01)}]
    quiet = compare(rounds)["quiet"]
    assert quiet["rounds"] == 0 and quiet["p99_ratio"] is None


def result_for(p99_ratio=1.2, direct_errors=0, sie_errors=0):
    return {"rate_rps": 500, "p99_ratio": p99_ratio, "direct": {"errors": direct_errors}, "sie": {"errors": sie_errors}}


@pytest.mark.parametrize(
    "change, failing",
    [
        ({}, []),
        ({"p99_ratio": 1.5}, []),  # the limit itself holds
        ({"p99_ratio": 1.501}, ["p99"]),
        ({"p99_ratio": None}, ["p99"]),  # nothing to compare is no pass
        ({"direct_errors": 1}, ["failed"]),
        ({"sie_errors": 3, "p99_ratio": 2.0}, ["p99", "failed"]),
    ],
)
def test_judged(change, failing):
    checks = judged(result_for(**change))
    assert [c["limit"] for c in checks] == [1.5, 0]
    assert [
        c["target"].split()[0] if c["target"].startswith("p99") else "failed" for c in checks if not c["holds"]
    ] == failing


def test_table_names_both_paths_and_the_ratios():
    result = {**compare([{"direct": window(), "sie": window([2.0, 4.0, 6.0, 8.0])}]), "rate_rps": 500}
    text = table(result)
    assert "Triton called directly" in text and "through SIE" in text
    assert f"p99 SIE/direct x{result['p99_ratio']}" in text and "quiet rounds" in text


def test_the_served_spec_is_one_the_triton_backend_takes(tmp_path: Path):
    service = ModelService.model_validate(triton.service_doc(tmp_path / "scorer.skops"))
    assert service.model_id == triton.MODEL and service.spec.backend.type.value == "triton"
    settings = TritonSettings.from_spec(service)
    assert settings.dynamic_batching is not None and settings.dynamic_batching.max_queue_delay_microseconds == 0


def test_the_plans_alternate_short_rounds_at_500_per_second():
    for plan in triton.PLANS.values():
        assert plan.rate_rps == 500 and plan.round_s <= 3 and plan.rounds >= 8


def test_cpu_per_request_divides_each_parts_cores_by_the_answered_rate():
    windows = [({"sidecar": 0.2, "envoy": 0.1}, 500.0), ({"sidecar": 0.3}, 500.0)]
    assert cpu_per_request(windows) == {"envoy": 100.0, "sidecar": 500.0}  # a part missing from a window used 0
    assert cpu_per_request([({"sidecar": 0.2}, 0.0)]) == {} and cpu_per_request([]) == {}
