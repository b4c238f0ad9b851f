"""Latency, queue-time and error figures over a sliding window (pure, no clock of its own).

The data path appends one sample per request that reached the worker (O(1), a tuple in a bounded
deque); the telemetry loop asks for a summary twice a second, which prunes old samples and sorts
what is left (at most `max_samples`, so the cost is bounded whatever the request rate).

The window is "the last `max_age_s` seconds, and at most the last `max_samples` requests": at a low
rate the age bound applies, at a high one the count bound keeps the summary cheap and recent.
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


class SlidingWindow:
    def __init__(self, max_age_s: float = 30.0, max_samples: int = 1000):
        if max_age_s <= 0 or max_samples < 1:
            raise ValueError(f"window needs max_age_s > 0 and max_samples >= 1, got {max_age_s}, {max_samples}")
        self.max_age_s = max_age_s
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
        return WindowSummary(
            count=len(samples),
            latency_p50_s=percentile(latencies, 0.50),
            latency_p99_s=percentile(latencies, 0.99),
            queue_p99_s=percentile(queues, 0.99),
            error_rate=errors / len(samples),
        )
