import math

import pytest

from bench.loadgen import schedule
from bench.stats import Sample, cdf_points, percentile, summarize


@pytest.mark.parametrize(
    "values, q, expected",
    [
        ([1.0], 99, 1.0),
        ([1.0, 2.0], 50, 1.5),
        ([1, 2, 3, 4, 5], 0, 1),
        ([1, 2, 3, 4, 5], 100, 5),
        (list(range(1, 101)), 99, 99.01),
    ],
)
def test_percentile(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


def test_summary_counts_errors_against_sla_attainment():
    samples = [Sample(0, 0.010, 200, "a"), Sample(0, 0.020, 200, "b"), Sample(0, 0.5, 200, "a"), Sample(0, 0.01, 503)]
    s = summarize(samples, sla_ms=100, duration_s=2)
    assert (s.requests, s.ok, s.errors) == (4, 3, 1)
    assert s.sla_attainment == pytest.approx(2 / 4)
    assert s.throughput_rps == pytest.approx(1.5)
    assert s.share == {"a": pytest.approx(2 / 3), "b": pytest.approx(1 / 3)}


def test_schedule_is_poisson_at_the_rate_and_repeatable():
    times = schedule(200, 10, seed=3)
    assert times == schedule(200, 10, seed=3)
    assert 1800 < len(times) < 2200
    assert all(0 <= t < 10 for t in times) and times == sorted(times)


def test_cdf_ends_at_one():
    pts = cdf_points([5, 1, 3, 2, 4])
    assert pts[-1] == (5, 1.0) and pts[0][0] == 1
