"""The weight policy's tunables (DESIGN.md section 5): one frozen dataclass, checked when built.

Every field says its unit, its default and why it has that value; weights.py, signals.py and
shedding.py read them. Weights are in points of MAX_WEIGHT (1000 = full share, see decisions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sie.telemetry import STALE_AFTER_S
from xds_server.policy.decisions import MAX_WEIGHT, MIN_WEIGHT

__all__ = ["WeightSettings"]


@dataclass(frozen=True)
class WeightSettings:
    """How the weight policy reads telemetry and moves weights. Invalid values raise ValueError."""

    # ---- saturation: each term is 1.0 at the level named here ----------------------------------------

    queue_full: float = 64.0
    """Requests (sidecar queue + engine waiting) that count as saturation 1 when the record has no
    max_concurrent. Default 64. A record that states max_concurrent uses it instead: one full batch
    waiting is saturated."""

    kv_full: float = 0.8
    """KV-cache use (fraction, 0-1) that counts as saturation 1. Default 0.8: an engine near its KV
    limit starts preempting or queueing."""

    kv_waiting_min: int = 2
    """Requests waiting in the engine before KV use counts at all (or the record does not say). Default
    2: a mostly full cache that admits every request is doing its job (SGLang keeps it full on purpose),
    and one arrival waiting for the next scheduler step is not KV pressure."""

    window_waiting_min: int = 1
    """Requests waiting now (sidecar queue + engine waiting) before the window's latency terms, p99
    over the SLA and queue time over the SLA's, count at all. Default 1. Those figures remember the
    sidecar's whole window (30 s): an endpoint with nothing waiting is not saturated now, whatever a past
    burst did to its p99. Counting them regardless held the instances that had taken a burst at the
    floor, idle, for the window's length while newly woken instances took all the load and saturated
    (bench/autoscale). An endpoint slow with nothing waiting is the slowness term's case (against the
    fleet); a whole fleet over its SLA changes no relative weight anyway."""

    error_rate_full: float = 0.5
    """Error rate (fraction of answers, 0-1) that counts as saturation 1. Default 0.5."""

    knee: float = 0.5
    """Saturation (dimensionless, in [0, 1)) below which an endpoint keeps its full share; above it the
    share falls linearly to the floor at 1. Default 0.5."""

    # ---- slowness against the fleet (latency over the fleet's lower median) -------------------------

    slow_start: float = 1.3
    """Slowness ratio (endpoint latency / fleet latency) up to which there is no penalty. Default 1.3:
    within 30% of the fleet is noise between equal endpoints."""

    slow_floor: float = 2.0
    """Slowness ratio at which the weight reaches the floor. Default 2.0: twice the fleet's latency or
    worse is clearly slower."""

    min_requests: int = 50
    """Answers (count) an endpoint's window needs before its sliding-window latency figures count.
    Default 50: fewer are noise."""

    recent_min_requests: int = 5
    """Recent requests (count) before the fast signal (the record's recent mean latency) is trusted, for
    the endpoint and for each of the at least three endpoints of the fleet reference. Default 5."""

    recent_z: float = 3.0
    """Standard errors (dimensionless) subtracted from the recent mean before comparing it with the
    fleet's. Default 3.0: few or widely spread samples (requests of different lengths) need a clearer
    slowdown before they cost an endpoint its share. The spread is the fleet's typical one (the upper
    median of the endpoints' standard deviations): the question is whether this endpoint's requests
    could come from the fleet's distribution, and a slowing endpoint's own spread is inflated by the
    very change being measured (old fast answers next to new slow ones)."""

    overdue_factor: float = 1.5
    """Multiple (> 1) of the endpoint's longest answer in its window (of at least min_requests answers)
    that a still-running request must exceed to count as overdue. Default 1.5. An overdue request is
    evidence on its own, before any slow answer: the endpoint is at least (its age / the fleet's
    typical latency) times slower now."""

    overdue_max_spread: float = 1.6
    """Largest ratio (>= 1) of the longest answer to the median answer for which the overdue rule
    applies. Default 1.6: only where durations are predictable (scorers, embeddings, fixed-length
    generation). Where they vary (LLM answers of any length), one long request under a heavier share of
    the load is no proof, and acting on it moved that load onto the others until they too looked slow
    (bench/routing scenario (b))."""

    unknown_slowness_half_life_s: float = 10.0
    """Seconds in which the excess over 1 of an endpoint's last known slowness halves while it has no
    latency evidence (no requests lately). Default 10 s: a slow endpoint sidelined at the floor gets
    almost no requests, so without this it could never show that it recovered."""

    # ---- the source article's rule, and GPU utilisation as a tie-breaker ---------------------------

    gpu_rule_utilization: float = 0.85
    """GPU utilisation (fraction, 0-1) above which, together with gpu_rule_queue, the source article's
    rule applies. Default 0.85, the article's."""

    gpu_rule_queue: int = 50
    """Queued requests (count) above which, together with gpu_rule_utilization, the rule applies.
    Default 50, the article's."""

    gpu_rule_shift: float = 0.30
    """Fraction (0-1) of the endpoint's traffic the rule moves elsewhere. Default 0.30, the article's."""

    gpu_tiebreak_points: float = 0.02 * MAX_WEIGHT
    """Weight points taken off per unit of GPU utilisation above the fleet's least used. Default 2% of
    MAX_WEIGHT (20 points): it orders otherwise equal endpoints but stays below the hysteresis, so it
    never causes a push alone."""

    # ---- dynamics: per step_s; calls closer together move proportionally less ------------------------

    step_s: float = 0.5
    """Seconds of one step, the unit of the rates below. Default 0.5 s, the telemetry interval."""

    alpha_down: float = 0.7
    """EWMA gain (in (0, 1]) toward a lower target per step. Default 0.7: back off a slow endpoint fast."""

    alpha_up: float = 0.3
    """EWMA gain (in (0, 1]) toward a higher target per step. Default 0.3: give load back slowly."""

    max_step_down: float = 0.6 * MAX_WEIGHT
    """Weight points a weight may fall per step. Default 60% of MAX_WEIGHT (600 points)."""

    max_step_up: float = 0.2 * MAX_WEIGHT
    """Weight points a weight may rise per step. Default 20% of MAX_WEIGHT (200 points)."""

    hysteresis: int = MAX_WEIGHT // 20
    """Weight points: smaller moves are not pushed (unless hysteresis_ratio says otherwise). Default
    5% of MAX_WEIGHT (50 points): no push for noise."""

    hysteresis_ratio: float = 2.0
    """Factor by which a weight that moved is pushed anyway. Default 2.0 (halved or doubled): near the
    floor, shares move by ratios, not by points."""

    floor: int = MIN_WEIGHT
    """The lowest weight (points, in [MIN_WEIGHT, MAX_WEIGHT)). Default MIN_WEIGHT (1): the exploration
    trickle, so a recovered endpoint is noticed."""

    stale_after_s: float = STALE_AFTER_S
    """Seconds after which an endpoint's telemetry is stale and it counts as saturated. Default
    sie.telemetry.STALE_AFTER_S, the one figure every component uses."""

    # ---- shedding (shedding.py): thresholds on the least saturated endpoint's saturation -------------

    shed_start_p2: float = 1.0
    """Overload (saturation) at which a P2 model starts shedding. Default 1.0: lower than P1's, so P2
    sheds first."""

    shed_start_p1: float = 1.5
    """Overload (saturation) at which a P1 model starts shedding. Default 1.5: only a deeper overload.
    P0 never sheds."""

    shed_after_s: float = 2.0
    """Seconds an overload must last before anything is shed. Default 2 s: a burst is not an overload."""

    shed_gain: float = 40.0
    """Drop percent points per step per unit of saturation over the threshold. Default 40."""

    max_drop_percent: float = 80.0
    """The largest drop (percent, in [0, 100)). Default 80: some traffic always passes, so recovery is
    measured."""

    drop_hysteresis: float = 2.0
    """Drop percent points: smaller changes of the drop are not pushed. Default 2."""

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
        for name in (
            "queue_full",
            "kv_full",
            "error_rate_full",
            "step_s",
            "max_step_down",
            "max_step_up",
            "unknown_slowness_half_life_s",
        ):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.max_drop_percent < 100:
            problems.append(f"max_drop_percent must lie in [0, 100), got {self.max_drop_percent}")
        if problems:
            raise ValueError("invalid WeightSettings: " + "; ".join(problems))
