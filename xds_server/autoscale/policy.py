"""The autoscaler's decision for one model. Pure: the policy, the last state and what the fleet shows in;
the desired replica count and the reason out.

The rule (Kubernetes' HPA and Knative's autoscaler, with SIE's SLA signals):

1. Demand is the requests in flight and queued at the model's ready instances plus those held at its
   sleeping ones, summed. Decisions read its mean over the last STABLE_S (six seconds): a rate is known
   to 10% only after about a hundred requests. A burst is answered at once: when the mean of the last
   SMOOTH_S (half a second) is at least PANIC (1.5) x n x T, the count follows that (Knative's panic
   window). T is the spec's `autoscale.target_concurrency` (default 0.7 x
   max_concurrent_requests per instance), tol its `tolerance` (10%). At the default T, 1.5 x n x T is
   every instance's slots busy and requests queued on top: no steady load is that by chance, and at
   Knative's 2x a 4x step queued a further 0.3-0.5 s before the first step up, long enough to cost
   1-2% of bench/autoscale's requests their SLA.
2. Hysteresis by bands: with n instances the count holds while demand lies within
   [(n - 1) x T x (1 - h), n x T x (1 + tol)], h being `scale_down_headroom` (35%). The bands of n and
   n - 1 overlap by more than one whole instance's worth, so noise that does not span one instance's
   load never moves the count back and forth, and neither does the fall of each instance's concurrency
   when one more shares the load (an LLM's requests finish sooner in a smaller batch).
3. Up (above the band, or a burst): ceil(demand / T), at once, by at most `max_step_up` (a burst's
   step by at most a doubling: half a second of demand is a rough size). Then no further step up until
   the instances of the last one serve, the backlog that built up while they came has drained into them
   (at most one request queued per instance), and UP_SETTLE_S more passed: the backlog goes to them
   first, instead of asking for more instances than the load needs (an overshoot that a later
   scale-down would have to take back). A backlog that UP_SETTLE_S after they serve is no smaller than
   when they began (demand, half a second's mean, has not fallen) is not draining: the fleet at its new
   size cannot absorb it, and the next step goes ahead (otherwise a load that keeps every instance near
   its admission limit, where a request or two stays queued, would hold the count for STABLE_S).
4. SLA pressure: while demand is at the target (n x T or more), the model's p99 queue wait above half
   of `sla.max_queue_time_ms` with requests queued at every instance now, or its p99 latency above
   `sla.p99_latency_ms`: one more instance than now, within rule 3's pacing (the target is too high
   for the SLA). Below the target neither a window's memory of a past burst nor an idle model's slow
   outlier scales it.
5. Down (below the band, by the six seconds' mean): ceil(demand / (T x (1 - h))) for the demand now
   (the last half second's mean where that is lower), the count that keeps that headroom, but
   never below the largest count recommended over the last `scale_down_window_s` (60 s), the count in
   force counting as recommended from when it was raised (or when the autoscaler first looked, after a
   restart): a dip shorter than the window never removes capacity, a sustained fall does, step by step
   as the recommendations fall.
6. Bounds: within [sla.min_replicas, sla.max_replicas], and never above what the fleet can fit
   (`room`: the instances the node hosts could add, when they say; `short` names what is missing).
7. Zero (sla.min_replicas 0): the last instance goes (to sleep, `fleet_shape`) only after
   `autoscale.idle_s` without a request, however the rest of the rule reads; a model at zero comes back
   to at least one the moment a request is held for it or seen at one of its instances (its sidecar
   woke it for a held request, sidecar/waking.py: the wake has already happened).

Within one phase of rising or falling load the count therefore only moves with the load: up at once, down
after the window, never against it; at a steady load it settles inside a band and stays there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from sie.spec import ModelServiceSpec

SMOOTH_S = 0.5  # demand for going up: averaged over the decisions of the last half second (rule 1)
STABLE_S = 6.0  # demand, stable: averaged over the last six seconds (rule 1)
PANIC = 1.5  # a burst: the last half second's demand at least this many times what the count is for
UP_SETTLE_S = 1.0  # after a step up's instances serve, before the next step up (rule 3)

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
    changed_at: float | None = None  # the last step up, or the first look (rule 5's hold)
    loads: tuple[tuple[float, float], ...] = field(default=())  # (time, demand) of the last SMOOTH_S
    up_at: float | None = None  # when the count last went up (rule 3's pacing)
    served_at: float | None = None  # when all of the instances of the last step up first served
    drained_at: float | None = None  # when, after that, no more than one request per instance was queued
    served_load: float | None = None  # demand (half a second's mean) when they first served


def target_of(spec: ModelServiceSpec) -> float:
    if spec.autoscale.target_concurrency is not None:
        return spec.autoscale.target_concurrency
    return 0.7 * spec.resources.max_concurrent_requests


def decide(spec: ModelServiceSpec, state: ScaleState, demand: Demand, now: float) -> ScaleState:
    policy, sla = spec.autoscale, spec.sla
    low, high = sla.min_replicas, sla.max_replicas
    current = state.desired
    target, tol, room = target_of(spec), policy.tolerance, 1 - policy.scale_down_headroom
    sample = max(0.0, demand.in_flight + demand.queued + demand.held)
    loads = tuple((t, v) for t, v in state.loads if now - t < STABLE_S) + ((now, sample),)
    fast = [v for t, v in loads if now - t < SMOOTH_S]
    load = sum(fast) / len(fast)
    # When the instances of the last step up all served (rule 3's pacing counts from then).
    served_at, drained_at, served_load = state.served_at, state.drained_at, state.served_load
    if served_at is None and demand.ready >= current:
        served_at, served_load = now, load
    if served_at is not None and drained_at is None:
        if demand.queued <= max(1, current):
            drained_at = now  # ...and the backlog that built up while they came has drained into them
        elif now - served_at >= UP_SETTLE_S and load >= (served_load or 0.0):
            drained_at = now  # ...or it is not draining: this size cannot absorb it
    # The stable mean reads only what the fleet saw at its present size, once the backlog that built up
    # while the last step up came has drained into it (and at least UP_SETTLE_S after it served).
    settled: float | None = None
    if state.up_at is not None:
        ready_at = max(served_at + UP_SETTLE_S, drained_at) if served_at and drained_at else math.inf
        # ...or STABLE_S after the step, should some of its instances never serve (a failed load).
        settled = min(ready_at, state.up_at + STABLE_S)
    if settled is not None and now - settled < SMOOTH_S:
        stable = None  # the fleet at its new size has not been seen long enough to judge it
    else:
        steady = [v for t, v in loads if settled is None or t >= settled] or [sample]
        stable = sum(steady) / len(steady)
    upper, lower = current * target * (1 + tol), (current - 1) * target * room
    burst = current > 0 and load >= PANIC * current * target
    if burst:
        recommended = math.ceil(load / target)
        why = f"demand {load:.1f} in flight and queued >= {PANIC:g} x {current} x {target:g} (a burst)"
    elif current == 0 and load > 0:
        recommended, why = math.ceil(load / target), f"demand {load:.1f} at zero"
    elif stable is None:
        recommended = current
        if demand.ready < current:
            why = f"demand {load:.1f}; waiting for the last step up to serve ({demand.ready} of {current} ready)"
        else:
            why = f"demand {load:.1f}; the last step up takes the backlog for {UP_SETTLE_S:g} s first"
    elif stable > upper:
        recommended = math.ceil(stable / target)
        why = f"demand {stable:.1f} over {STABLE_S:g} s > {current} x {target:g} x {1 + tol:g}"
    elif current > 0 and (stable < lower or (stable == 0 and load == 0)):
        # The count for the demand now (the last half second's mean, if lower): the window is what
        # holds capacity through a dip, and the six seconds' mean would hold it a further six.
        now_demand = min(stable, load)
        recommended = math.ceil(now_demand / (target * room)) if now_demand > 0 else 0
        why = f"demand {stable:.1f} over {STABLE_S:g} s < {current - 1} x {target:g} x {room:g}"
        if now_demand < stable:
            why += f" ({now_demand:.1f} now)"
    else:
        recommended = current
        why = f"demand {stable:.1f} over {STABLE_S:g} s within the band of {current} x {target:g}"
    pressed = []
    # The sidecars' p99s span their windows (30 s), so they stay high for a while after a burst: they
    # count only once the fleet has settled and runs at its target (the target may be set too high for
    # the SLA), and the queue wait only while requests are queued at every instance now.
    if stable is not None and stable >= max(1, current) * target:
        queued_now = demand.queued >= max(1, current)
        if demand.queue_time_ms is not None and demand.queue_time_ms > sla.max_queue_time_ms / 2 and queued_now:
            pressed.append(f"queue wait p99 {demand.queue_time_ms:.0f} ms > half of {sla.max_queue_time_ms:g} ms")
        if demand.p99_ms is not None and demand.p99_ms > sla.p99_latency_ms:
            pressed.append(f"p99 {demand.p99_ms:.0f} ms > SLA {sla.p99_latency_ms:g} ms")
    if pressed and recommended <= current:
        recommended, why = current + 1, "; ".join(pressed)
    if recommended < low <= current:
        why += f"; the floor is sla.min_replicas {low}"
    recommended = min(high, max(low, recommended))

    # The count in force since it was raised counts as a recommendation too: no scale-down within the
    # window of a step up (or of the autoscaler's first look at the model, after a restart). A step down
    # does not restart it: a sustained fall goes down step by step as the recommendations fall.
    since = state.changed_at if state.changed_at is not None else now
    window = [(t, n) for t, n in state.recommendations if now - t < policy.scale_down_window_s]
    window.append((now, recommended))
    held = [n for _, n in window] + ([current] if now - since < policy.scale_down_window_s else [])
    if recommended > current:
        if stable is None and current > 0:
            desired, verb = current, "hold"
            if demand.ready < current:
                why += f"; waiting for the last step up to serve ({demand.ready} of {current} ready) before another"
            else:
                why += f"; the last step up takes the backlog for {UP_SETTLE_S:g} s before another"
        else:
            # A burst's step is at most a doubling: half a second of demand is a rough size.
            step = min(policy.max_step_up, current) if burst else policy.max_step_up
            desired, verb = min(recommended, current + step), "up"
    else:
        desired = min(current, max(held))  # the window only holds capacity; it never adds any
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
    changed = now if desired > current else since
    up_at = now if desired > current else state.up_at
    return replace(
        state,
        desired=desired,
        recommendations=tuple(window),
        last=decision,
        changed_at=changed,
        loads=loads,
        up_at=up_at,
        served_at=None if desired > current else served_at,
        drained_at=None if desired > current else drained_at,
        served_load=None if desired > current else served_load,
    )


def _zero_rule(
    spec: ModelServiceSpec, current: int, desired: int, verb: str, why: str, demand: Demand
) -> tuple[int, str, str]:
    """Rule 7: a model allowed to reach zero leaves it at once on demand and reaches it only when idle."""
    idle_s = spec.autoscale.idle_s
    if current == 0 and (demand.held > 0 or demand.requested):
        held = f"{demand.held} requests held for a wake" if demand.held else "a request arrived (its wake is done)"
        return max(1, desired), "up", f"{held}; {why}"
    if current == 0 and desired == 0:
        return 0, "hold", "at zero: asleep, the first request wakes it"
    if current >= 1 and desired == 0:
        idle = demand.idle_for_s
        if idle is None or idle < idle_s:
            since = "no request seen yet" if idle is None else f"last request {idle:.0f} s ago"
            return 1, ("down" if current > 1 else "hold"), f"{why}; keeping 1 until {idle_s:g} s idle ({since})"
        return 0, "down", f"no request for {idle:.0f} s (idle_s {idle_s:g}): to zero, asleep"
    return desired, verb, why


def fleet_shape(spec: ModelServiceSpec, desired: int) -> tuple[int, int]:
    """(placed, awake): instances of an autoscaled model to keep placed and how many of them serve.

    `awake` of them serve, those closest to serving (xds_server.placement rule 1: ready ones first); the
    rest are the warm pool, loaded and asleep, up to `autoscale.warm_pool` of them and never beyond
    max_replicas in all. A model at zero keeps one asleep whatever warm_pool says: its sidecar is what
    holds the first request while it wakes."""
    high = spec.sla.max_replicas
    awake = min(high, max(0, desired))
    warm = min(spec.autoscale.warm_pool, high - awake)
    if awake == 0:
        warm = max(1, warm)
    return awake + warm, awake
