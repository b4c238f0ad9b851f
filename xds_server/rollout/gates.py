"""One version's figures from its sidecars' windows, and the rollout gates judged on them. Pure.

Statistics, and why: every sidecar keeps a sliding window of its last answers (window_s seconds, at most
window_size answers) and reports p99 latency, error rate, p99 queue wait and the count. A version's
figures pool its instances: the p99 is the request-weighted mean of the instances' p99s (instances of one
build under one balancer see the same traffic, and the mean does not let one idle instance decide), the
error rate is the sum of errors over the sum of answers, the queue wait the worst instance's. Both
versions' windows end at the same instant, so new and old are compared on the same stretch of traffic.
A figure from fewer than `min_requests` answers is not judged: the step waits for samples instead of
advancing on noise; a breach, once there are enough, rolls back at once (it does not wait for the hold).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sie.spec import SLA, RolloutGates
from sie.telemetry import InstanceState, TelemetryRecord

__all__ = ["GateResult", "TrackStats", "judge", "track_stats"]


@dataclass(frozen=True)
class TrackStats:
    """One version's pooled window figures, and how many of its instances are ready, and draining."""

    requests: int = 0
    p99_ms: float | None = None
    error_rate: float | None = None
    queue_time_ms: float | None = None
    ready: int = 0
    # Instances still running down their requests before they stop: their memory is not free yet, so an
    # old instance stopped to make room has not made it until it is gone (machine: one at a time).
    draining: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "p99_ms": _round(self.p99_ms),
            "error_rate": _round(self.error_rate, 4),
            "queue_time_ms": _round(self.queue_time_ms),
            "ready": self.ready,
            "draining": self.draining,
        }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def track_stats(records: Iterable[TelemetryRecord]) -> TrackStats:
    requests = 0
    errors = 0.0
    p99_weighted = 0.0
    queue: float | None = None
    ready = draining = 0
    for rec in records:
        if rec.state is InstanceState.READY:
            ready += 1
        elif rec.state is InstanceState.DRAINING:
            draining += 1
        n = rec.window_requests or 0
        if n <= 0:
            continue
        requests += n
        errors += (rec.error_rate or 0.0) * n
        if rec.latency_p99_ms is not None:
            p99_weighted += rec.latency_p99_ms * n
        if rec.queue_time_ms is not None:
            queue = rec.queue_time_ms if queue is None else max(queue, rec.queue_time_ms)
    if requests == 0:
        return TrackStats(ready=ready, draining=draining)
    return TrackStats(
        requests=requests,
        p99_ms=p99_weighted / requests,
        error_rate=errors / requests,
        queue_time_ms=queue,
        ready=ready,
        draining=draining,
    )


@dataclass(frozen=True)
class GateResult:
    """One gate's verdict: holds True/False, or None when there are not enough samples to judge."""

    name: str
    holds: bool | None
    value: float | None
    limit: float | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "holds": self.holds,
            "value": _round(self.value, 4),
            "limit": _round(self.limit, 4),
            "detail": self.detail,
        }


def judge(new: TrackStats, old: TrackStats, gates: RolloutGates, sla: SLA) -> list[GateResult]:
    """Each enabled gate on the new version's figures against the SLA and the old version's."""
    enough_new = new.requests >= gates.min_requests
    enough_old = old.requests >= gates.min_requests
    wait_new = f"{new.requests}/{gates.min_requests} answers from the new version"
    wait_old = f"{old.requests}/{gates.min_requests} answers from the old version"
    out = []
    if gates.p99_within_sla:
        out.append(_gate("p99_vs_sla", enough_new, new.p99_ms, sla.p99_latency_ms, "p99 ms", wait_new))
    if gates.max_p99_ratio is not None:
        if not (enough_new and enough_old) or new.p99_ms is None or old.p99_ms is None:
            out.append(GateResult("p99_vs_old", None, new.p99_ms, None, wait_new if not enough_new else wait_old))
        else:
            limit = old.p99_ms * gates.max_p99_ratio + gates.p99_slack_ms
            out.append(_gate("p99_vs_old", True, new.p99_ms, limit, "p99 ms", ""))
    if gates.max_error_rate_increase is not None:
        if not (enough_new and enough_old) or new.error_rate is None or old.error_rate is None:
            why = wait_new if not enough_new else wait_old
            out.append(GateResult("error_rate_vs_old", None, new.error_rate, None, why))
        else:
            limit = old.error_rate + gates.max_error_rate_increase
            out.append(_gate("error_rate_vs_old", True, new.error_rate, limit, "error rate", ""))
    if gates.queue_time_within_sla:
        out.append(
            _gate(
                "queue_time_vs_sla", enough_new, new.queue_time_ms or 0.0, sla.max_queue_time_ms, "queue ms", wait_new
            )
        )
    return out


def _gate(name: str, enough: bool, value: float | None, limit: float, what: str, wait: str) -> GateResult:
    if not enough or value is None:
        return GateResult(name, None, value, limit, wait or "no figure yet")
    holds = value <= limit
    relation = "<=" if holds else ">"
    return GateResult(name, holds, value, limit, f"{what} {value:.4g} {relation} {limit:.4g}")
