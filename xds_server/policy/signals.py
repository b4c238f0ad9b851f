"""What the weight policy reads from one endpoint's telemetry, and the target weight it implies (pure).

See weights.py for the formulas as a whole. Absent is not zero (sie.telemetry): a signal an instance
cannot measure (GPU figures without a GPU, KV use of a scorer, latency before the first request) is
left out of its saturation, never counted as idle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sie.spec import ModelService
from sie.telemetry import TelemetryRecord
from xds_server.policy.decisions import MAX_WEIGHT, Health
from xds_server.policy.settings import WeightSettings


@dataclass(frozen=True)
class EndpointSignals:
    instance_id: str
    address: str
    health: Health
    stale: bool
    saturation: float  # inf when stale
    cause: str  # the term that set the saturation
    slowness: float | None  # latency over the fleet's; None when unknown
    queued: int
    gpu_utilization: float | None
    gpu_rule: bool  # the source article's rule applies: GPU busy and a long queue
    reason: str


def saturation(rec: TelemetryRecord, model: ModelService, now: float, s: WeightSettings) -> tuple[float, str]:
    """max of the known terms, with the name of the largest; stale telemetry is saturated. The window's
    latency terms count only while requests wait (WeightSettings.window_waiting_min), as KV use does."""
    age = rec.age(now)
    if age > s.stale_after_s:
        return math.inf, f"stale {age:.1f}s"
    sla = model.spec.sla
    queue_full = rec.max_concurrent if rec.max_concurrent > 0 else s.queue_full
    terms: list[tuple[float, str]] = [
        (_queued(rec) / queue_full, "queue"),
        (rec.error_rate / s.error_rate_full, "errors"),
    ]
    if rec.kv_cache_usage is not None and (rec.engine_waiting is None or rec.engine_waiting >= s.kv_waiting_min):
        terms.append((rec.kv_cache_usage / s.kv_full, "kv"))
    if _queued(rec) >= s.window_waiting_min:  # the window remembers 30 s; count it while requests wait now
        if rec.latency_p99_ms is not None:
            terms.append((rec.latency_p99_ms / sla.p99_latency_ms, "p99/sla"))
        if rec.queue_time_ms is not None and sla.max_queue_time_ms > 0:
            terms.append((rec.queue_time_ms / sla.max_queue_time_ms, "queue time"))
    value, cause = max(terms, key=lambda t: (t[0], t[1]))
    return value, cause


def read_signals(
    model: ModelService,
    records: Sequence[TelemetryRecord],
    last_slowness: Mapping[str, float],
    now: float,
    s: WeightSettings,
) -> list[EndpointSignals]:
    """Signals of every endpoint, in the order of `records` (one per instance, sorted by the caller)."""
    serving = [r for r in records if r.state.serves and r.age(now) <= s.stale_after_s]
    fresh = [r for r in serving if r.requests_total >= s.min_requests]
    by_service = bool(fresh) and all(r.service_p50_ms is not None for r in fresh)
    ref_p50 = _lower_median([_window_latency(r, by_service)[0] for r in fresh])
    ref_p99 = _lower_median([_window_latency(r, by_service)[1] for r in fresh])
    trusted = [r for r in serving if _trusted(r, s)]
    # Three at least: with two, the lower median is the smaller of two noisy means.
    ref_recent = _lower_median([r.recent_latency_mean_ms for r in trusted], at_least=3)
    ref_count = _lower_median([float(r.recent_requests) for r in trusted], at_least=3) or 0.0
    spread = _typical_spread(trusted)
    out = []
    for rec in records:
        sat, cause = saturation(rec, model, now, s)
        stale = math.isinf(sat)
        window = _window_latency(rec, by_service)
        slowness = None if stale else _slowness(rec, (ref_recent, ref_count, spread), window, (ref_p50, ref_p99), s)
        late = None if stale else _overdue(rec, ref_recent or ref_p50, s)
        if late is not None:
            slowness = late if slowness is None else max(slowness, late)
        if slowness is None:
            slowness = last_slowness.get(rec.instance_id)
        health = Health.HEALTHY if rec.state.serves else Health.DRAINING
        gpu_rule = (
            not stale
            and rec.gpu_utilization is not None
            and rec.gpu_utilization > s.gpu_rule_utilization
            and _queued(rec) > s.gpu_rule_queue
        )
        if health is Health.DRAINING:
            reason = f"{rec.state.value}"
        elif stale:
            reason = f"saturated: {cause}"
        else:
            reason = f"sat {sat:.2f} ({cause})"
            if slowness is not None:
                reason += f", {slowness:.1f}x fleet latency"
            if gpu_rule:
                reason += f", gpu rule -{s.gpu_rule_shift:.0%}"
        out.append(
            EndpointSignals(
                rec.instance_id,
                rec.address,
                health,
                stale,
                sat,
                cause,
                slowness,
                _queued(rec),
                rec.gpu_utilization,
                gpu_rule,
                reason,
            )
        )
    return out


def target_weight(sig: EndpointSignals, fleet: Sequence[EndpointSignals], s: WeightSettings) -> float:
    """The weight this endpoint deserves now, before smoothing (see weights.py for the formula)."""
    f_sat = 1.0 if sig.saturation <= s.knee else max(0.0, (1.0 - sig.saturation) / (1.0 - s.knee))
    f_slow = 1.0
    if sig.slowness is not None and sig.slowness > s.slow_start:
        depth = min(1.0, math.log(sig.slowness / s.slow_start) / math.log(s.slow_floor / s.slow_start))
        f_slow = (s.floor / MAX_WEIGHT) ** depth
    f_gpu = 1.0 - s.gpu_rule_shift if sig.gpu_rule else 1.0
    tiebreak = 0.0
    known = [f.gpu_utilization for f in fleet if f.gpu_utilization is not None and f.health is Health.HEALTHY]
    if sig.gpu_utilization is not None and known:
        tiebreak = s.gpu_tiebreak_points * max(0.0, sig.gpu_utilization - min(known))
    return min(float(MAX_WEIGHT), max(float(s.floor), MAX_WEIGHT * f_sat * f_slow * f_gpu - tiebreak))


def _slowness(
    rec: TelemetryRecord,
    recent_fleet: tuple[float | None, float, float],
    window: tuple[float | None, float | None],
    fleet_window: tuple[float | None, float | None],
    s: WeightSettings,
) -> float | None:
    """Latency over the fleet's: from the fast signal when it is trustworthy (it says how the endpoint
    serves now: its recent mean, conservatively, over the fleet's lower median of recent means), else
    from the sliding-window p50 and p99 of service time (_window_latency; they remember up to the
    window's length); None when neither is known."""
    ref_recent, ref_count, spread = recent_fleet
    if _trusted(rec, s) and ref_recent and ref_count:
        assert rec.recent_latency_mean_ms is not None
        # The standard error of the difference between this mean and the reference's, were this
        # endpoint's requests drawn from the fleet's distribution.
        error = spread * math.sqrt(1 / rec.recent_requests + 1 / ref_count)
        return max(0.0, rec.recent_latency_mean_ms - s.recent_z * error) / ref_recent
    if rec.requests_total < s.min_requests:
        return None
    ratios = [value / ref for value, ref in zip(window, fleet_window) if value is not None and ref]
    return max(ratios) if ratios else None


def _window_latency(rec: TelemetryRecord, by_service: bool) -> tuple[float | None, float | None]:
    """The window's (p50, p99) the fleet comparison reads: of service time (latency less the wait in
    the sidecar's queue) when every fresh endpoint reports it, else of latency. A queue wait says what
    share of the load an endpoint was given over the window, not how fast it serves: the instance that
    served alone until the others woke queued, they did not, and compared by latency it read 1.7x
    slower than them for the window's 30 s and lost its share (bench/autoscale)."""
    if by_service:
        return rec.service_p50_ms, rec.service_p99_ms
    return rec.latency_p50_ms, rec.latency_p99_ms


def _overdue(rec: TelemetryRecord, ref_latency: float | None, s: WeightSettings) -> float | None:
    """The slowness a request running far past everything usual proves: its age over the fleet's typical
    latency (a lower bound, since it is not done yet); None when no request is overdue. "Usual" is the
    endpoint's own longest answer in its window, and only once the window holds min_requests answers:
    the longest of 50 is past their 98th percentile, while the longest of a few (after an idle spell)
    says little. Its own, not the fleet's: a fleet reference moves when other endpoints were slow. Only
    where that longest answer is within overdue_max_spread of the median (see WeightSettings)."""
    oldest, longest, median = rec.oldest_running_ms, rec.latency_max_ms, rec.latency_p50_ms
    if oldest is None or longest is None or not median or not ref_latency or rec.window_requests < s.min_requests:
        return None
    if longest > s.overdue_max_spread * median:
        return None  # durations vary too much for one request to say anything
    if oldest <= s.overdue_factor * longest:
        return None
    return oldest / ref_latency


def _trusted(rec: TelemetryRecord, s: WeightSettings) -> bool:
    return rec.recent_latency_mean_ms is not None and rec.recent_requests >= s.recent_min_requests


def _typical_spread(records: Sequence[TelemetryRecord]) -> float:
    """The fleet's typical spread of request latency: the upper median of the endpoints' standard
    deviations, so one slowing endpoint (whose recent figures mix fast and slow requests) cannot widen
    it, and one endpoint's spread that is small by chance cannot narrow it."""
    stds = sorted(r.recent_latency_std_ms for r in records if r.recent_latency_std_ms is not None)
    return stds[len(stds) // 2] if stds else 0.0


def _queued(rec: TelemetryRecord) -> int:
    return rec.queued + (rec.engine_waiting or 0)


def _lower_median(values: Sequence[float | None], at_least: int = 2) -> float | None:
    """The lower median: with four endpoints, the second best, so one or two slow ones cannot move it."""
    known = sorted(v for v in values if v is not None and v > 0)
    return known[(len(known) - 1) // 2] if len(known) >= at_least else None
