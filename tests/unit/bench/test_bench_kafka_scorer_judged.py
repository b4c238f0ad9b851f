"""The judged targets of bench.kafka and bench.scorer read the right figures, against issue 16's limits."""

from __future__ import annotations

import pytest

from bench import kafka, scorer


def kafka_result(msgs_per_s=10_400.0, p99=40.0, p50_ratio=0.7, p99_ratio=0.6, throughput=12.0, failed=0):
    return {
        "sustained": {"msgs_per_s": msgs_per_s, "p99_ms": p99},
        "compare": {"sie_vs_baseline_p50": p50_ratio, "sie_vs_baseline_p99": p99_ratio},
        "throughput": {"ratio": throughput},
        "connector_after": {"sessions_failed": failed},
    }


def test_kafka_all_hold():
    assert all(c["holds"] for c in kafka.judged(kafka_result()))


@pytest.mark.parametrize(
    "change, failing",
    [
        ({"msgs_per_s": 9_999.0}, "sustains"),
        ({"p99": 50.1}, "p99 at that rate"),
        ({"p50_ratio": 1.0}, "p50 below"),
        ({"p99_ratio": 1.2}, "p99 below"),
        ({"throughput": 2.9}, "3x"),
        ({"failed": 1}, "failed connector session"),
    ],
)
def test_kafka_each_target_can_fail(change, failing):
    judged = kafka.judged(kafka_result(**change))
    assert [c["target"] for c in judged if not c["holds"]] == [c["target"] for c in judged if failing in c["target"]]


def scorer_result(ratio=4.0, p99_ratio=0.5, errors=0, fast_form_errors=0):
    return {
        "worker_ceiling_ratio": ratio,
        "p99_at_rate_ratio": p99_ratio,
        "batching_only_worker_ceiling_ratio": 1.5,  # reported, not judged
        "batching_off": {"errors": 0},
        "batching_off_fast_form": {"errors": fast_form_errors},
        "batching_on": {"errors": errors},
    }


@pytest.mark.parametrize(
    "change, failing",
    [
        ({}, None),
        ({"ratio": 2.99}, "3x"),
        ({"p99_ratio": 1.01}, "p99 at 1,000"),
        ({"errors": 2}, "no failed request"),
        ({"fast_form_errors": 1}, "no failed request"),
    ],
)
def test_scorer_targets(change, failing):
    judged = scorer.judged(scorer_result(**change))
    assert [c["target"] for c in judged if not c["holds"]] == [
        c["target"] for c in judged if failing and failing in c["target"]
    ]
