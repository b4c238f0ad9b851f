"""The fast signal: the recent part of the latency window, the jump rule, and the early telemetry send."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest

from sidecar.reporter import Identity, Live, Reporter, build_record
from sidecar.window import EMPTY, SlidingWindow, WindowSummary, jumped, overdue
from sie.telemetry import InstanceState, TelemetryRecord
from sie_testing.sidecar_harness import FakeControlPlane


def _window(
    samples: list[tuple[float, float]], recent_s: float = 2.0, min_count: int = 0, max_s: float = 2.0
) -> SlidingWindow:
    w = SlidingWindow(
        max_age_s=30.0, max_samples=1000, recent_s=recent_s, recent_min_count=min_count, recent_max_s=max_s
    )
    for finished, latency in samples:
        w.add(finished, latency, 0.0, False)
    return w


@pytest.mark.parametrize(
    "case, samples, now, count, mean",
    [
        ("empty: absent, not zero", [], 10.0, 0, None),
        ("only old samples: none recent", [(1.0, 0.5), (2.0, 0.5)], 10.0, 0, None),
        ("old slow samples do not dilute the recent mean", [(1.0, 9.0)] * 50 + [(9.0, 0.2), (9.5, 0.4)], 10.0, 2, 0.3),
        ("the cut-off is inclusive", [(7.9, 1.0), (8.0, 0.5), (10.0, 0.7)], 10.0, 2, 0.6),
        # 90 requests at 0.5 s, then the last second's 10 at 3x: the recent mean doubles
        (
            "a slowdown shows at once in the recent mean",
            [(t * 0.1, 0.5 if t < 90 else 1.5) for t in range(100)],
            10.0,
            20,
            1.0,
        ),
    ],
)
def test_recent_part_of_the_window(case, samples, now, count, mean):
    s = _window(samples).summary(now)
    assert s.recent_count == count, case
    assert (s.recent_latency_mean_s == pytest.approx(mean)) if mean is not None else s.recent_latency_mean_s is None, (
        case
    )
    assert s.recent_s == (2.0 if samples else None)
    assert s.recent_running == 0


@pytest.mark.parametrize(
    "case, samples, now, count, mean",
    [
        # one answer every 0.1 s: the last 0.5 s holds 5 (9.6 .. 10.0), fewer than 8, so it reaches back
        ("a low rate reaches back for the newest 8", [(9.0 + t * 0.1, 0.1 * t) for t in range(11)], 10.0, 8, 0.65),
        ("a high rate stays within recent_s", [(9.0 + t * 0.01, 0.2) for t in range(101)], 10.0, 51, 0.2),
        # never past recent_max_s (2 s): an answer from 5 s ago says nothing about now
        ("never past recent_max_s", [(5.0, 9.0), (8.5, 0.2), (9.9, 0.4)], 10.0, 2, 0.3),
    ],
)
def test_the_recent_part_holds_enough_answers_when_it_can(case, samples, now, count, mean):
    s = _window(samples, recent_s=0.5, min_count=8).summary(now)
    assert (s.recent_count, s.recent_latency_mean_s) == (count, pytest.approx(mean)), case


def test_running_requests_count_at_their_age_so_far():
    # Four answers at 0.1 s, then the worker slows: two requests have been running 0.5 s and 0.3 s.
    w = _window([(9.8, 0.1)] * 4, recent_s=0.5)
    s = w.summary(10.0, running=[9.5, 9.7])
    assert (s.recent_count, s.recent_running) == (6, 2)
    assert s.recent_latency_mean_s == pytest.approx((4 * 0.1 + 0.5 + 0.3) / 6)
    assert s.count == 4 and s.latency_p99_s == 0.1  # the percentiles stay those of finished requests
    # A running request's age is a lower bound, so it only ever raises the mean as it runs on.
    later = w.summary(10.4, running=[9.5, 9.7])
    assert later.recent_latency_mean_s > s.recent_latency_mean_s


def test_the_oldest_running_request_and_the_longest_answer():
    w = _window([(5.0, 0.1), (6.0, 0.3), (7.0, 0.2), (9.5, 0.9)], recent_s=0.5)
    s = w.summary(10.0, running=[9.6, 9.9])
    # The longest answer leaves out the last 2 s (recent_max_s): 0.3 s, not the 0.9 s just answered.
    assert (s.oldest_running_s, s.latency_max_s) == (pytest.approx(0.4), 0.3)
    idle = w.summary(10.0)
    assert (idle.oldest_running_s, idle.latency_max_s) == (None, 0.3)  # none running: absent, not zero
    assert not overdue(s)  # 0.4 s is within 1.5x the longest answer (0.45 s)
    assert overdue(w.summary(10.0, running=[9.5]))  # 0.5 s is past it
    fresh = _window([(9.5, 0.9)]).summary(10.0, running=[8.0])
    assert fresh.latency_max_s is None and not overdue(fresh)  # nothing older than 2 s: no baseline


def test_a_hung_worker_looks_slow_not_idle():
    # No answer in the last 2 s, three requests stuck at the worker: without their ages the recent part
    # would be empty (unknown), which the policy cannot tell from an idle instance.
    w = _window([(1.0, 0.1)] * 20, recent_s=0.5)
    s = w.summary(10.0, running=[6.0, 7.0, 8.0])
    assert (s.recent_count, s.recent_running, s.recent_latency_mean_s) == (3, 3, pytest.approx(3.0))
    empty = SlidingWindow(recent_s=0.5).summary(10.0, running=[9.0])
    assert (empty.count, empty.latency_p50_s, empty.recent_count, empty.recent_latency_mean_s) == (0, None, 1, 1.0)


def test_the_recent_part_never_exceeds_the_window():
    assert SlidingWindow(max_age_s=1.0, recent_s=2.0).recent_s == 1.0
    assert SlidingWindow(max_age_s=1.0, recent_s=0.5, recent_max_s=2.0).recent_max_s == 1.0
    with pytest.raises(ValueError, match="recent_s > 0"):
        SlidingWindow(recent_s=0.0)
    with pytest.raises(ValueError, match="recent_min_count >= 0"):
        SlidingWindow(recent_min_count=-1)


def _recent(mean: float | None, count: int, p50: float | None = None) -> WindowSummary:
    return dataclasses.replace(EMPTY, recent_latency_mean_s=mean, recent_count=count, latency_p50_s=p50)


def _stuck(mean: float, oldest: float, longest: float) -> WindowSummary:
    return dataclasses.replace(_recent(mean, 20), oldest_running_s=oldest, latency_max_s=longest)


@pytest.mark.parametrize(
    "case, sent, now, expected",
    [
        ("doubled on enough requests", _recent(0.5, 20), _recent(1.0, 10), True),
        ("exactly the factor", _recent(0.5, 20), _recent(0.65, 10), True),
        ("noise below the factor", _recent(0.5, 20), _recent(0.6, 10), False),
        ("too few requests to trust", _recent(0.5, 20), _recent(5.0, 4), False),
        ("a fall is not urgent", _recent(1.0, 20), _recent(0.2, 20), False),
        ("nothing sent yet", None, _recent(1.0, 20), False),
        ("nothing known before", _recent(None, 0), _recent(1.0, 20), False),
        ("nothing recent now", _recent(0.5, 20), _recent(None, 0), False),
        # A slowdown sent part-way (1.4x the window's median) is followed as it grows: a further 1.1x
        # suffices, the baseline being the window's median, not the last (already raised) record.
        ("a rise followed step by step", _recent(0.7, 8, p50=0.5), _recent(0.78, 8, p50=0.5), True),
        ("the level already sent is not sent again", _recent(0.7, 8, p50=0.5), _recent(0.75, 8, p50=0.5), False),
        ("a rise back to the usual level is not news", _recent(0.3, 8, p50=0.5), _recent(0.5, 8, p50=0.5), False),
        # A request running 1.5x past the longest answer is news at once, whatever the mean says...
        ("a request newly overdue", _recent(0.5, 20), _stuck(0.5, oldest=0.8, longest=0.5), True),
        ("...once", _stuck(0.5, oldest=0.8, longest=0.5), _stuck(0.5, oldest=0.9, longest=0.5), False),
        ("not yet overdue", _recent(0.5, 20), _stuck(0.5, oldest=0.7, longest=0.5), False),
    ],
)
def test_jump_rule(case, sent, now, expected):
    assert jumped(sent, now, factor=1.3, min_count=5, step=1.1) is expected, case


IDENTITY = Identity("m-0", "m", "1", "127.0.0.1:9000", "n", "P1", "llm", None, 8, True)


def test_the_record_carries_the_fast_signal():
    window = WindowSummary(40, 0.1, 0.3, 0.0, 0.0, recent_count=12, recent_latency_mean_s=0.25, recent_s=2.0)
    record = build_record(IDENTITY, Live(InstanceState.READY, 1, 0, 40, window, None, None), 5.0, 1)
    assert (record.recent_requests, record.recent_latency_mean_ms, record.recent_window_s) == (12, 250.0, 2.0)
    assert record.recent_latency_std_ms is None  # not given here: absent, not zero
    assert TelemetryRecord.from_json(record.to_json()) == record
    old = {k: v for k, v in record.to_json().items() if not k.startswith("recent_")}
    parsed = TelemetryRecord.from_json(old)  # a record from a sidecar that predates the fast signal
    assert (parsed.recent_requests, parsed.recent_latency_mean_ms, parsed.recent_window_s) == (0, None, None)
    assert parsed.recent_latency_std_ms is None


async def test_a_latency_jump_is_sent_at_once_not_at_the_next_tick():
    plane = FakeControlPlane()
    await plane.start()
    figures = {"window": _recent(0.5, 20)}
    live = lambda: Live(InstanceState.READY, 0, 0, 100, figures["window"], None, None)  # noqa: E731
    async with aiohttp.ClientSession() as session:
        # A 60 s interval: any record after the first within the test's few seconds was sent early.
        reporter = Reporter(IDENTITY, live, lambda: 5.0, asyncio.Event(), 60.0, session, plane.url, check_s=0.05)
        task = asyncio.create_task(reporter.run())
        try:
            await reporter.send()
            sent = len(plane.records)
            figures["window"] = _recent(0.6, 20)  # 1.2x: noise, no early send
            await asyncio.sleep(0.3)
            assert len(plane.records) == sent and reporter.early_sends == 0
            figures["window"] = _recent(1.5, 20)  # 3x: sent at once
            record = await plane.wait_for(lambda r: r["recent_latency_mean_ms"] == 1500.0, timeout_s=5.0, after=sent)
            assert record["recent_requests"] == 20 and reporter.early_sends == 1
            await asyncio.sleep(0.3)  # the jump was reported: no repeat while the figure holds
            assert reporter.early_sends == 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await plane.stop()


def test_recent_spread():
    s = _window([(9.0, 0.5)] * 10 + [(9.5, 1.5)] * 10).summary(10.0)
    assert (s.recent_count, s.recent_latency_mean_s, s.recent_latency_std_s) == (
        20,
        pytest.approx(1.0),
        pytest.approx(0.5),
    )
    one = _window([(9.0, 0.7)]).summary(10.0)
    assert one.recent_latency_std_s == 0.0  # one sample: no spread seen (the policy pools the fleet's)
    assert _window([]).summary(10.0).recent_latency_std_s is None
