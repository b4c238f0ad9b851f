"""Latency, queue-time and error figures over a sliding window (pure, no clock of its own).

The data path appends one sample per request that reached the worker (O(1), a tuple in a bounded
deque); the telemetry loop asks for a summary twice a second, which prunes old samples and sorts
what is left (at most `max_samples`, so the cost is bounded whatever the request rate).

The window is "the last `max_age_s` seconds, and at most the last `max_samples` requests": at a low
rate the age bound applies, at a high one the count bound keeps the summary cheap and recent.

The recent part (the fast signal of sie.telemetry) is the newest end of the same samples: those that
finished in the last `recent_s` seconds, their count, mean latency and its standard deviation. A p99 over 30 s moves only once
about 1% of the window is slow; the recent mean moves as soon as the requests finishing now are slow.
Its cost is the recent samples alone (they sit at the right end of the deque, in completion order).
`jumped` is the pure rule the telemetry loop uses to send a record at once when it rises sharply.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowSummary:
    count: int
    latency_p50_s: float | None  # None when the window is empty: absent, not zero
    latency_p99_s: float | None
    queue_p99_s: float | None
    error_rate: float  # errors / count; 0.0 when empty
    recent_count: int = 0  # requests that finished in the last recent_s seconds
    recent_latency_mean_s: float | None = None  # their mean latency; None when there were none
    recent_latency_std_s: float | None = None  # their standard deviation (population); None when none
    recent_s: float | None = None  # the length of the recent part


EMPTY = WindowSummary(0, None, None, None, 0.0)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list: the smallest value with at least q of the
    samples at or below it. Nearest-rank never invents a value that was not observed."""
    if not sorted_values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must lie in [0, 1], got {q}")
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def jumped(sent: WindowSummary | None, now: WindowSummary, factor: float = 1.5, min_count: int = 5) -> bool:
    """Whether the recent mean latency rose by `factor` or more since the last record sent, on at
    least `min_count` requests: a slowdown the control plane should hear of now, not at the next tick.
    Falls are not urgent (weights climb back slowly anyway), so only rises count."""
    if sent is None or sent.recent_latency_mean_s is None or now.recent_latency_mean_s is None:
        return False
    return now.recent_count >= min_count and now.recent_latency_mean_s >= factor * sent.recent_latency_mean_s


class SlidingWindow:
    def __init__(self, max_age_s: float = 30.0, max_samples: int = 1000, recent_s: float = 2.0):
        if max_age_s <= 0 or max_samples < 1:
            raise ValueError(f"window needs max_age_s > 0 and max_samples >= 1, got {max_age_s}, {max_samples}")
        if not recent_s > 0:
            raise ValueError(f"the recent part needs recent_s > 0, got {recent_s}")
        self.max_age_s = max_age_s
        self.recent_s = min(recent_s, max_age_s)  # the recent part is the newest end of the window
        # (finished_at, latency_s, queue_s, error); maxlen enforces the count bound on append.
        self._samples: deque[tuple[float, float, float, bool]] = deque(maxlen=max_samples)

    def add(self, now: float, latency_s: float, queue_s: float, error: bool) -> None:
        self._samples.append((now, latency_s, queue_s, error))

    def summary(self, now: float) -> WindowSummary:
        samples = self._samples
        cutoff = now - self.max_age_s
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        if not samples:
            return EMPTY
        latencies = sorted(s[1] for s in samples)
        queues = sorted(s[2] for s in samples)
        errors = sum(1 for s in samples if s[3])
        recent_cutoff = now - self.recent_s
        recent_count, recent_total, recent_squares = 0, 0.0, 0.0
        for sample in reversed(samples):  # newest first; completion order, so stop at the first old one
            if sample[0] < recent_cutoff:
                break
            recent_count += 1
            recent_total += sample[1]
            recent_squares += sample[1] * sample[1]
        recent_mean = recent_total / recent_count if recent_count else None
        return WindowSummary(
            count=len(samples),
            latency_p50_s=percentile(latencies, 0.50),
            latency_p99_s=percentile(latencies, 0.99),
            queue_p99_s=percentile(queues, 0.99),
            error_rate=errors / len(samples),
            recent_count=recent_count,
            recent_latency_mean_s=recent_mean,
            recent_latency_std_s=(math.sqrt(max(0.0, recent_squares / recent_count - recent_mean * recent_mean))
                                  if recent_mean is not None else None),
            recent_s=self.recent_s,
        )
