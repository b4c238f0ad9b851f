"""The autoscaler's decision for one model. Pure: the policy, the last state and what the fleet shows in;
the desired replica count and the reason out.

The rule (Kubernetes' HPA rule, with SIE's SLA signals):

1. Demand is the requests in flight and queued at the model's ready instances, summed. The recommended
   count is ceil(demand / target), the target being the spec's `autoscale.target_concurrency` (default
   0.7 x max_concurrent_requests per instance).
2. Hysteresis: while demand per current instance is within `tolerance` (10%) of the target, the count is
   the current one: noise around the target never moves it.
3. SLA pressure: if the model's p99 queue wait is above half of `sla.max_queue_time_ms`, or its p99
   latency above `sla.p99_latency_ms` while demand is at least half the target (so an idle model's slow
   outlier does not scale it), at least one more instance than now is recommended.
4. Up: a recommendation above the current count applies at once, by at most `max_step_up` instances.
5. Down: the count applied is the largest recommended over the last `scale_down_window_s` (60 s), the
   count in force counting as recommended when it was set (or when the autoscaler first looked, after a
   restart), so a dip shorter than the window never removes capacity, and a scale-down follows a
   sustained fall.
6. Bounds: within [sla.min_replicas, sla.max_replicas], and never above what the fleet can fit
   (`room`: the instances the node hosts could add, when they say).
7. Zero (sla.min_replicas 0): the last instance goes (to sleep, `fleet_shape`) only after
   `autoscale.idle_s` without a request, however the rest of the rule reads; a model at zero comes back
   to at least one the moment a request is held for it or seen at one of its instances (its sidecar
   woke it for a held request, sidecar/waking.py: the wake has already happened).

Within one phase of rising or falling load the count therefore only moves with the load: up at once, down
after the window, never against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from sie.spec import ModelServiceSpec

__all__ = ["Demand", "ScaleDecision", "ScaleState", "decide", "fleet_shape", "target_of"]


@dataclass(frozen=True)
class Demand:
    """What the model's ready instances report now (pooled from their sidecars' telemetry)."""

    ready: int
    in_flight: float
    queued: float = 0.0
    queue_time_ms: float | None = None  # the worst instance's p99 queue wait
    p99_ms: float | None = None  # request-weighted p99 over the instances' windows
    room: int | None = None  # instances the fleet could add now (None: unknown, not limited)
    short: str = ""  # what is missing, when the fleet cannot add one (a node host waits for memory)
    held: int = 0  # requests held at sleeping instances for a wake (a model at zero)
    idle_for_s: float | None = None  # seconds since the model last had a request (None: unknown)
    requested: bool = False  # a request was seen since the last look (in flight, queued, or answered)


@dataclass(frozen=True)
class ScaleDecision:
    desired: int
    recommended: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"desired": self.desired, "recommended": self.recommended, "reason": self.reason}


@dataclass(frozen=True)
class ScaleState:
    """The autoscaler's memory of one model: the count it applies and its recent recommendations."""

    desired: int
    recommendations: tuple[tuple[float, int], ...] = field(default=())  # (time, count), oldest first
    last: ScaleDecision | None = None
    changed_at: float | None = None


def target_of(spec: ModelServiceSpec) -> float:
    if spec.autoscale.target_concurrency is not None:
        return spec.autoscale.target_concurrency
    return 0.7 * spec.resources.max_concurrent_requests


def decide(spec: ModelServiceSpec, state: ScaleState, demand: Demand, now: float) -> ScaleState:
    policy, sla = spec.autoscale, spec.sla
    low, high = sla.min_replicas, sla.max_replicas
    current = state.desired
    target = target_of(spec)
    load = max(0.0, demand.in_flight + demand.queued + demand.held)
    base = max(current, 1)
    if load > 0 and abs(load / (base * target) - 1.0) <= policy.tolerance:
        recommended, why = current, f"demand {load:.1f} is within {policy.tolerance:.0%} of {base} x {target:g}"
    else:
        recommended = math.ceil(load / target) if load > 0 else 0
        why = f"demand {load:.1f} in flight and queued / {target:g} per instance"
    pressed = []
    if demand.queue_time_ms is not None and demand.queue_time_ms > sla.max_queue_time_ms / 2:
        pressed.append(f"queue wait p99 {demand.queue_time_ms:.0f} ms > half of {sla.max_queue_time_ms:g} ms")
    if demand.p99_ms is not None and demand.p99_ms > sla.p99_latency_ms and load >= target / 2:
        pressed.append(f"p99 {demand.p99_ms:.0f} ms > SLA {sla.p99_latency_ms:g} ms")
    if pressed and recommended <= current:
        recommended, why = current + 1, "; ".join(pressed)
    recommended = min(high, max(low, recommended))

    # The count in force since it was set counts as a recommendation too: no scale-down within the window
    # of a change (or of the autoscaler's first look at the model, after a restart).
    since = state.changed_at if state.changed_at is not None else now
    window = [(t, n) for t, n in state.recommendations if now - t < policy.scale_down_window_s]
    window.append((now, recommended))
    held = [n for _, n in window] + ([current] if now - since < policy.scale_down_window_s else [])
    if recommended > current:
        desired = min(recommended, current + policy.max_step_up)
        verb = "up"
    else:
        desired = max(held)
        verb = "down" if desired < current else "hold"
        if verb == "hold" and recommended < current:
            why += f"; holding {current} for the {policy.scale_down_window_s:g} s window"
    if low == 0:
        desired, verb, why = _zero_rule(spec, current, desired, verb, why, demand)
    if demand.room is not None and desired > current + demand.room:
        why += f"; only {demand.room} more fit on the nodes" + (f" ({demand.short})" if demand.short else "")
        desired = current + demand.room
    desired = min(high, max(low, desired))
    if desired == current:
        verb = "hold"
    decision = ScaleDecision(desired, recommended, f"{verb}: {why}")
    changed = since if desired == current else now
    return replace(state, desired=desired, recommendations=tuple(window), last=decision, changed_at=changed)


def _zero_rule(
    spec: ModelServiceSpec, current: int, desired: int, verb: str, why: str, demand: Demand
) -> tuple[int, str, str]:
    """Rule 7: a model allowed to reach zero leaves it at once on demand and reaches it only when idle."""
    idle_s = spec.autoscale.idle_s
    if current == 0 and (demand.held > 0 or demand.requested):
        held = f"{demand.held} requests held for a wake" if demand.held else "a request arrived (its wake is done)"
        return max(1, desired), "up", f"{held}; {why}"
    if current >= 1 and desired == 0:
        idle = demand.idle_for_s
        if idle is None or idle < idle_s:
            since = "no request seen yet" if idle is None else f"last request {idle:.0f} s ago"
            return 1, ("down" if current > 1 else "hold"), f"{why}; keeping 1 until {idle_s:g} s idle ({since})"
        return 0, "down", f"no request for {idle:.0f} s (idle_s {idle_s:g}): to zero, asleep"
    return desired, verb, why


def fleet_shape(spec: ModelServiceSpec, desired: int) -> tuple[int, int]:
    """(placed, awake): instances of an autoscaled model to keep placed and how many of them serve.

    The first `awake` instance ids serve; the rest are the warm pool, loaded and asleep, up to
    `autoscale.warm_pool` of them and never beyond max_replicas in all. A model at zero keeps one asleep
    whatever warm_pool says: its sidecar is what holds the first request while it wakes."""
    high = spec.sla.max_replicas
    awake = min(high, max(0, desired))
    warm = min(spec.autoscale.warm_pool, high - awake)
    if awake == 0:
        warm = max(1, warm)
    return awake + warm, awake
