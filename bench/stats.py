"""Summaries of a load run (pure): percentiles, SLA attainment, throughput, share of traffic."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    scheduled_s: float  # when the open-loop schedule wanted the request sent (relative to run start)
    latency_s: float  # from the scheduled send time to the end of the response
    status: int  # HTTP status; 0 for a transport error
    instance: str = ""  # which instance answered (the sidecar's x-sie-instance header)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (q / 100) * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    errors: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    mean_ms: float
    sla_attainment: float  # share of ALL requests answered 200 within the SLA
    throughput_rps: float  # successful responses per second of run
    share: dict[str, float]  # instance -> share of successful responses

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.__dict__.items()}


def summarize(samples: Iterable[Sample], sla_ms: float, duration_s: float) -> Summary:
    samples = list(samples)
    ok = [s for s in samples if s.status == 200]
    lat_ms = [s.latency_s * 1000 for s in ok]
    within = sum(1 for s in ok if s.latency_s * 1000 <= sla_ms)
    counts = Counter(s.instance for s in ok)
    total_ok = len(ok) or 1
    return Summary(
        requests=len(samples),
        ok=len(ok),
        errors=len(samples) - len(ok),
        p50_ms=percentile(lat_ms, 50),
        p99_ms=percentile(lat_ms, 99),
        p999_ms=percentile(lat_ms, 99.9),
        mean_ms=(sum(lat_ms) / len(lat_ms)) if lat_ms else math.nan,
        sla_attainment=(within / len(samples)) if samples else math.nan,
        throughput_rps=len(ok) / duration_s if duration_s > 0 else math.nan,
        share={k: v / total_ok for k, v in sorted(counts.items())},
    )


def cdf_points(latencies_ms: Sequence[float], points: int = 200) -> list[tuple[float, float]]:
    """(latency, fraction <= latency) pairs for plotting a CDF."""
    ordered = sorted(latencies_ms)
    if not ordered:
        return []
    step = max(1, len(ordered) // points)
    out = [(ordered[i], (i + 1) / len(ordered)) for i in range(0, len(ordered), step)]
    if out[-1][1] != 1.0:
        out.append((ordered[-1], 1.0))
    return out


def batch_means(metrics: str) -> dict[str, float]:
    """Engine calls, rows and rows per call, from a worker's sie_worker_batch_size histogram (Prometheus text)."""
    found = {}
    for line in metrics.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(f"sie_worker_batch_size{suffix}"):
                found[suffix] = float(line.rsplit(" ", 1)[1])
    calls, rows = found.get("_count", 0.0), found.get("_sum", 0.0)
    return {"calls": calls, "rows": rows, "mean_rows": round(rows / calls, 2) if calls else 0.0}
