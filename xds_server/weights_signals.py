"""What the weight policy reads from one endpoint's telemetry, and the target weight it implies (pure).

See weights.py for the formulas as a whole. Absent is not zero (sie.telemetry): a signal an instance
cannot measure (GPU figures without a GPU, KV use of a scorer, latency before the first request) is
left out of its saturation, never counted as idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from sie.spec import ModelService
from sie.telemetry import STALE_AFTER_S, TelemetryRecord
from xds_server.decisions import MAX_WEIGHT, MIN_WEIGHT, Health


@dataclass(frozen=True)
class WeightSettings:
    # Saturation: each term is 1.0 at the level named here.
    # Requests queued at the sidecar plus waiting in the engine: one full batch (the record's
    # max_concurrent) waiting is saturation 1; queue_full when the record has no max_concurrent.
    queue_full: float = 64.0
    kv_full: float = 0.8  # KV-cache use...
    # ...counted only while at least this many requests wait in the engine (or the record does not say):
    # a mostly full cache that admits every request is doing its job (SGLang keeps it full on purpose),
    # and one arrival waiting for the next scheduler step is not KV pressure.
    kv_waiting_min: int = 2
    error_rate_full: float = 0.5
    knee: float = 0.5  # below this saturation an endpoint keeps its full share
    # Slowness against the fleet (latency over the fleet's lower median).
    slow_start: float = 1.3  # within 30% of the fleet: no penalty (noise between equal endpoints)
    slow_floor: float = 2.0  # twice the fleet's latency or worse: the floor
    min_requests: int = 50  # latency figures of an endpoint that answered fewer requests are noise
    # The fast signal (the record's recent mean latency), trusted on at least this many recent requests
    # (the endpoint's, and those of at least three endpoints for the fleet reference), and read
    # conservatively: the mean minus recent_z standard errors of its difference from the reference, so
    # few or widely spread samples (requests of different lengths) need a clearer slowdown before they
    # cost an endpoint its share. The spread is the fleet's typical one (the upper median of the
    # endpoints' standard deviations): the question is whether this endpoint's requests could come from
    # the fleet's distribution, and a slowing endpoint's own spread is inflated by the very change
    # being measured (old fast answers next to new slow ones).
    recent_min_requests: int = 5
    recent_z: float = 3.0
    # Overdue: a request that has been running overdue_factor times longer than the endpoint's longest
    # answer in its window (of at least min_requests answers) is evidence on its own, before any slow
    # answer: the endpoint is at least (its age / the fleet's typical latency) times slower now. Only
    # where durations are predictable (the longest answer within overdue_max_spread of the median:
    # scorers, embeddings, fixed-length generation): where they vary (LLM answers of any length), one
    # long request under a heavier share of the load is no proof, and acting on it moved that load
    # onto the others until they too looked slow (bench/routing scenario (b)).
    overdue_factor: float = 1.5
    overdue_max_spread: float = 1.6
    # An endpoint with no latency evidence now (no requests lately) keeps its last known slowness, but
    # the excess over 1 halves every this many seconds: a slow endpoint sidelined at the floor gets
    # almost no requests, so without this it could never show that it recovered.
    unknown_slowness_half_life_s: float = 10.0
    # The source article's rule, and GPU utilisation as a tie-breaker.
    gpu_rule_utilization: float = 0.85
    gpu_rule_queue: int = 50
    gpu_rule_shift: float = 0.30
    gpu_tiebreak_points: float = 0.02 * MAX_WEIGHT
    # Dynamics: per step_s (the telemetry interval); calls closer together move proportionally less.
    step_s: float = 0.5
    alpha_down: float = 0.7  # EWMA gain toward a lower target per step
    alpha_up: float = 0.3
    max_step_down: float = 0.6 * MAX_WEIGHT  # weight points per step
    max_step_up: float = 0.2 * MAX_WEIGHT
    hysteresis: int = MAX_WEIGHT // 20  # weight points: smaller moves are not pushed...
    hysteresis_ratio: float = 2.0  # ...unless the weight halved or doubled (shares move by ratios near the floor)
    floor: int = MIN_WEIGHT  # the exploration trickle: a recovered endpoint is noticed
    stale_after_s: float = STALE_AFTER_S
    # Shedding (weights_shedding.py): thresholds on the least saturated endpoint's saturation.
    shed_start_p2: float = 1.0
    shed_start_p1: float = 1.5
    shed_after_s: float = 2.0  # overload must last this long before anything is shed
    shed_gain: float = 40.0  # drop percent points per step per unit of saturation over the threshold
    max_drop_percent: float = 80.0  # some traffic always passes, so recovery is measured
    drop_hysteresis: float = 2.0  # drop percent points

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.knee < 1:
            problems.append(f"knee must lie in [0, 1), got {self.knee}")
        if not 1 <= self.slow_start < self.slow_floor:
            problems.append(f"need 1 <= slow_start < slow_floor, got {self.slow_start}, {self.slow_floor}")
        if not MIN_WEIGHT <= self.floor < MAX_WEIGHT:
            problems.append(f"floor must lie in [{MIN_WEIGHT}, {MAX_WEIGHT}), got {self.floor}")
        for name in ("alpha_down", "alpha_up"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"{name} must lie in (0, 1], got {getattr(self, name)}")
        if not self.overdue_factor > 1:
            problems.append(f"overdue_factor must be > 1, got {self.overdue_factor}")
        if not self.overdue_max_spread >= 1:
            problems.append(f"overdue_max_spread must be >= 1, got {self.overdue_max_spread}")
        for name in ("queue_full", "kv_full", "error_rate_full", "step_s", "max_step_down", "max_step_up",
                     "unknown_slowness_half_life_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.max_drop_percent < 100:
            problems.append(f"max_drop_percent must lie in [0, 100), got {self.max_drop_percent}")
        if problems:
            raise ValueError("invalid WeightSettings: " + "; ".join(problems))


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
    """max of the known terms, with the name of the largest; stale telemetry is saturated."""
    age = rec.age(now)
    if age > s.stale_after_s:
        return math.inf, f"stale {age:.1f}s"
    sla = model.spec.sla
    queue_full = rec.max_concurrent if rec.max_concurrent > 0 else s.queue_full
    terms: list[tuple[float, str]] = [(_queued(rec) / queue_full, "queue"), (rec.error_rate / s.error_rate_full, "errors")]
    if rec.kv_cache_usage is not None and (rec.engine_waiting is None or rec.engine_waiting >= s.kv_waiting_min):
        terms.append((rec.kv_cache_usage / s.kv_full, "kv"))
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
    ref_p50 = _lower_median([r.latency_p50_ms for r in fresh])
    ref_p99 = _lower_median([r.latency_p99_ms for r in fresh])
    trusted = [r for r in serving if _trusted(r, s)]
    # Three at least: with two, the lower median is the smaller of two noisy means.
    ref_recent = _lower_median([r.recent_latency_mean_ms for r in trusted], at_least=3)
    ref_count = _lower_median([float(r.recent_requests) for r in trusted], at_least=3) or 0.0
    spread = _typical_spread(trusted)
    out = []
    for rec in records:
        sat, cause = saturation(rec, model, now, s)
        stale = math.isinf(sat)
        slowness = None if stale else _slowness(rec, (ref_recent, ref_count, spread), ref_p50, ref_p99, s)
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
        out.append(EndpointSignals(
            rec.instance_id, rec.address, health, stale, sat, cause, slowness, _queued(rec), rec.gpu_utilization,
            gpu_rule, reason,
        ))
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


def _slowness(rec: TelemetryRecord, recent_fleet: tuple[float | None, float, float], ref_p50: float | None,
              ref_p99: float | None, s: WeightSettings) -> float | None:
    """Latency over the fleet's: from the fast signal when it is trustworthy (it says how the endpoint
    serves now: its recent mean, conservatively, over the fleet's lower median of recent means), else
    from the sliding-window p50 and p99 (which remember up to the window's length); None when neither
    is known."""
    ref_recent, ref_count, spread = recent_fleet
    if _trusted(rec, s) and ref_recent and ref_count:
        assert rec.recent_latency_mean_ms is not None
        # The standard error of the difference between this mean and the reference's, were this
        # endpoint's requests drawn from the fleet's distribution.
        error = spread * math.sqrt(1 / rec.recent_requests + 1 / ref_count)
        return max(0.0, rec.recent_latency_mean_ms - s.recent_z * error) / ref_recent
    if rec.requests_total < s.min_requests:
        return None
    ratios = [value / ref for value, ref in ((rec.latency_p50_ms, ref_p50), (rec.latency_p99_ms, ref_p99))
              if value is not None and ref]
    return max(ratios) if ratios else None


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
