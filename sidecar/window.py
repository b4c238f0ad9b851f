"""Latency, queue-time and error figures over a sliding window (pure, no clock of its own).

The data path appends one sample per request that reached the worker (O(1), a tuple in a bounded
deque); the telemetry loop asks for a summary twice a second, which prunes old samples and sorts
what is left (at most `max_samples`, so the cost is bounded whatever the request rate).

The window is "the last `max_age_s` seconds, and at most the last `max_samples` requests": at a low
rate the age bound applies, at a high one the count bound keeps the summary cheap and recent.

The recent part (the fast signal of sie.telemetry) is the newest end of the same samples, those that
finished in the last `recent_s` seconds, together with the requests still running, each counted at its
age so far: their count, mean latency and its standard deviation. A p99 over 30 s moves only once about
1% of the window is slow; the recent mean moves as soon as the requests finishing now are slow, and the
running ones make it move before they finish. A request that has run for 600 ms will take at least
600 ms, so its age is a lower bound on its latency: counting it never overstates a slowdown, and it
shows one from the first requests that overrun, not only once slow answers arrive. It is also what
makes a hung worker (no answers at all, every request running longer and longer) look slow rather than
idle. Its cost is the recent samples and the running requests alone (the samples sit at the right end
of the deque, in completion order).
`jumped` is the pure rule the telemetry loop uses to send a record at once when it rises sharply.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict


@dataclass(frozen=True)
class WindowSummary:
    count: int
    latency_p50_s: float | None  # None when the window is empty: absent, not zero
    latency_p99_s: float | None
    queue_p99_s: float | None
    error_rate: float  # errors / count; 0.0 when empty
    recent_count: int = 0  # requests that finished in the last recent_s seconds, plus those running
    recent_latency_mean_s: float | None = None  # their mean latency (age, if running); None when none
    recent_latency_std_s: float | None = None  # their standard deviation (population); None when none
    recent_s: float | None = None  # the length of the recent part
    recent_running: int = 0  # how many of recent_count are still running (counted at their age)
    oldest_running_s: float | None = None  # the age of the oldest running request; None when none runs
    # The longest answer in the window before its last recent_max_s (None when there is none): the
    # baseline for `overdue`, which a slowdown's first slow answers must not raise at once.
    latency_max_s: float | None = None
    # The same answers' service time: latency less the wait in this sidecar's queue. It says how fast the
    # instance serves, where latency also says how much of the load it was given (the weight policy's
    # comparison against the fleet reads it, xds_server/policy/signals.py).
    service_p50_s: float | None = None
    service_p99_s: float | None = None


EMPTY = WindowSummary(0, None, None, None, 0.0)


class _RecentFields(TypedDict):
    """The recent-part fields of a WindowSummary, built once and passed to either constructor."""

    recent_count: int
    recent_latency_mean_s: float | None
    recent_latency_std_s: float | None
    recent_s: float | None
    recent_running: int
    oldest_running_s: float | None


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list: the smallest value with at least q of the
    samples at or below it. Nearest-rank never invents a value that was not observed."""
    if not sorted_values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def overdue(w: WindowSummary, factor: float = 1.5) -> bool:
    """Whether a request has been running `factor` times longer than the longest answer in the window
    (before its last few seconds): among hundreds of answers that is rare while nothing changed, so it
    says the instance is slow now (a stall, or a slowdown whose slow answers are still few)."""
    return (
        w.oldest_running_s is not None and w.latency_max_s is not None and w.oldest_running_s > factor * w.latency_max_s
    )


def jumped(
    sent: WindowSummary | None,
    now: WindowSummary,
    factor: float = 1.3,
    min_count: int = 5,
    step: float = 1.1,
    overdue_factor: float = 1.5,
) -> bool:
    """Whether the control plane should hear of the latency now, not at the next tick: a request has
    just become overdue (above), or the recent mean latency is `factor` or more above the baseline (the
    whole window's median, which a rise of a second or two barely moves; the last record's recent mean
    while the window has none), on at least `min_count` requests, and it rose by `step` since the last
    record (so a slowdown is followed step by step as its evidence grows, and a level that was already
    sent is not sent again). Falls are not urgent (weights climb back slowly anyway), so only rises
    count."""
    if sent is None:
        return False
    if overdue(now, overdue_factor) and not overdue(sent, overdue_factor):
        return True
    if sent.recent_latency_mean_s is None or now.recent_latency_mean_s is None:
        return False
    baseline = now.latency_p50_s if now.latency_p50_s is not None else sent.recent_latency_mean_s
    mean = now.recent_latency_mean_s
    return now.recent_count >= min_count and mean >= factor * baseline and mean >= step * sent.recent_latency_mean_s


class SlidingWindow:
    def __init__(
        self,
        max_age_s: float = 30.0,
        max_samples: int = 1000,
        recent_s: float = 0.5,
        recent_min_count: int = 8,
        recent_max_s: float = 2.0,
    ):
        if max_age_s <= 0 or max_samples < 1:
            raise ValueError(f"window needs max_age_s > 0 and max_samples >= 1, got {max_age_s}, {max_samples}")
        if not recent_s > 0:
            raise ValueError(f"the recent part needs recent_s > 0, got {recent_s}")
        if recent_min_count < 0:
            raise ValueError(f"the recent part needs recent_min_count >= 0, got {recent_min_count}")
        self.max_age_s = max_age_s
        self.recent_s = min(recent_s, max_age_s)  # the recent part is the newest end of the window
        # At a low request rate the last recent_s seconds hold too few answers to say anything, so the
        # recent part reaches further back for the newest recent_min_count ones, never past recent_max_s.
        self.recent_min_count = recent_min_count
        self.recent_max_s = min(max(recent_max_s, self.recent_s), max_age_s)
        # (finished_at, latency_s, queue_s, error); maxlen enforces the count bound on append.
        self._samples: deque[tuple[float, float, float, bool]] = deque(maxlen=max_samples)

    def add(self, now: float, latency_s: float, queue_s: float, error: bool) -> None:
        self._samples.append((now, latency_s, queue_s, error))

    def summary(self, now: float, running: Iterable[float] = ()) -> WindowSummary:
        """The window as of `now`; `running` holds the start times (same clock) of the requests still
        running, which join the recent part at their age so far."""
        samples = self._samples
        cutoff = now - self.max_age_s
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        ages = [max(0.0, now - started) for started in running]
        recent_running = recent_count = len(ages)
        recent_total, recent_squares = sum(ages), sum(age * age for age in ages)
        if not samples and not recent_running:
            return EMPTY
        recent_cutoff, furthest = now - self.recent_s, now - self.recent_max_s
        for sample in reversed(samples):  # newest first; completion order, so stop at the first old one
            if sample[0] < furthest or (sample[0] < recent_cutoff and recent_count >= self.recent_min_count):
                break
            recent_count += 1
            recent_total += sample[1]
            recent_squares += sample[1] * sample[1]
        recent_mean = recent_total / recent_count if recent_count else None
        recent = _RecentFields(
            recent_count=recent_count,
            recent_latency_mean_s=recent_mean,
            recent_latency_std_s=(
                math.sqrt(max(0.0, recent_squares / recent_count - recent_mean * recent_mean))
                if recent_mean is not None
                else None
            ),
            recent_s=self.recent_s,
            recent_running=recent_running,
            oldest_running_s=max(ages, default=None),
        )
        if not samples:  # only running requests: no finished figures yet
            return WindowSummary(0, None, None, None, 0.0, **recent)
        latencies = sorted(s[1] for s in samples)
        queues = sorted(s[2] for s in samples)
        services = sorted(max(0.0, s[1] - s[2]) for s in samples)
        errors = sum(1 for s in samples if s[3])
        return WindowSummary(
            count=len(samples),
            latency_p50_s=percentile(latencies, 0.50),
            latency_p99_s=percentile(latencies, 0.99),
            latency_max_s=max((x[1] for x in itertools.takewhile(lambda x: x[0] < furthest, samples)), default=None),
            queue_p99_s=percentile(queues, 0.99),
            error_rate=errors / len(samples),
            service_p50_s=percentile(services, 0.50),
            service_p99_s=percentile(services, 0.99),
            **recent,
        )
