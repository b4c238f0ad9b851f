"""Sliding-window percentiles and error rate."""

import pytest

from sidecar.window import EMPTY, SlidingWindow, percentile


@pytest.mark.parametrize(
    "values, q, expected",
    [
        ([], 0.5, None),
        ([7.0], 0.99, 7.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 0.75, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
        ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
        (list(map(float, range(1, 101))), 0.99, 99.0),
        (list(map(float, range(1, 101))), 0.5, 50.0),
        (list(map(float, range(1, 1001))), 0.99, 990.0),
    ],
)
def test_nearest_rank_percentile(values, q, expected):
    assert percentile(values, q) == expected


def test_percentile_rejects_bad_q():
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_empty_window_is_absent_not_zero():
    assert SlidingWindow().summary(100.0) == EMPTY
    assert EMPTY.latency_p99_s is None and EMPTY.queue_p99_s is None


def test_summary_over_the_window():
    w = SlidingWindow(max_age_s=10.0, max_samples=1000)
    for i in range(100):
        w.add(now=float(i) * 0.01, latency_s=(i + 1) / 1000.0, queue_s=0.0 if i < 98 else 0.5, error=i % 10 == 0)
    s = w.summary(now=1.0)
    assert s.count == 100
    assert s.latency_p50_s == pytest.approx(0.050)
    assert s.latency_p99_s == pytest.approx(0.099)
    assert s.queue_p99_s == 0.5
    assert s.error_rate == pytest.approx(0.1)


def test_service_time_is_latency_less_the_queue_wait():
    w = SlidingWindow(max_age_s=10.0, max_samples=1000)
    for i in range(100):  # every answer served in 0.2 s; the last half waited 1 s in the queue first
        w.add(
            now=float(i) * 0.01, latency_s=0.2 + (1.0 if i >= 50 else 0.0), queue_s=1.0 if i >= 50 else 0.0, error=False
        )
    s = w.summary(now=1.0)
    assert (s.latency_p50_s, s.latency_p99_s) == (pytest.approx(0.2), pytest.approx(1.2))
    assert (s.service_p50_s, s.service_p99_s) == (pytest.approx(0.2), pytest.approx(0.2))
    assert EMPTY.service_p50_s is None and EMPTY.service_p99_s is None


@pytest.mark.parametrize(
    "max_age_s, max_samples, now, count",
    [
        (10.0, 1000, 5.0, 50),  # everything recent
        (2.0, 1000, 5.0, 20),  # only samples finished at 3.0 s or later
        (10.0, 30, 5.0, 30),  # the count bound keeps the latest 30
        (1.0, 1000, 100.0, 0),  # everything aged out
    ],
)
def test_age_and_count_bounds(max_age_s, max_samples, now, count):
    w = SlidingWindow(max_age_s, max_samples)
    for i in range(50):
        w.add(now=i * 0.1, latency_s=float(i), queue_s=0.0, error=False)
    s = w.summary(now)
    assert s.count == count
    if count:
        assert s.latency_p99_s == 49.0  # the newest sample is always kept


def test_old_slow_requests_leave_the_window():
    w = SlidingWindow(max_age_s=5.0, max_samples=1000)
    w.add(0.0, 9.0, 0.0, True)
    w.add(6.0, 0.01, 0.0, False)
    s = w.summary(7.0)
    assert s.latency_p99_s == 0.01 and s.error_rate == 0.0


@pytest.mark.parametrize("args", [(0.0, 10), (1.0, 0)])
def test_bad_bounds(args):
    with pytest.raises(ValueError):
        SlidingWindow(*args)
