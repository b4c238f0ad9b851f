"""The weight policy (DESIGN.md section 5): telemetry in, per-endpoint weights, health and drops out.

Pure: `decide(model, records, previous, now, settings) -> (decision, state)`; `WeightPolicy` is the thin
stateful wrapper the control loop calls through the DecisionPolicy protocol. Same inputs, same output.

Envoy balances each model with LEAST_REQUEST, which scores a host by `weight / (active + 1)`, so the
weights here say how much of the fleet's capacity an endpoint is worth and Envoy's live in-flight counts
refine that between pushes. Per endpoint, from its newest record (signals.py has the details):

    saturation s = max(queued / max_concurrent,       queued = sidecar queue + engine waiting; a whole
                                                      batch waiting is saturated (queue_full if unknown)
                       kv_cache_usage / kv_full,        only while >= kv_waiting_min requests wait in the
                                                      engine (or waiting is unknown): a full cache that
                                                      admits everything is doing its job
                       latency_p99 / sla.p99_latency_ms,      these two over the sidecar's window (30 s),
                       queue_time_p99 / sla.max_queue_time_ms, only while >= window_waiting_min wait now
                       error_rate / error_rate_full)     unknown terms are skipped; stale: s = inf
    slowness r   = from the fast signal when trusted (>= recent_min_requests recent requests, and a fleet
                   reference of >= 3 such endpoints): (recent mean - recent_z standard errors of its
                   difference from the reference, at the fleet's typical spread) / the fleet's lower
                   median of recent means;
                   else max(p50 / fleet p50, p99 / fleet p99) over the sidecar's sliding window, of
                   service time (latency less the sidecar's queue wait, which says what share of the
                   load the endpoint had, not how fast it serves) where every endpoint reports it, fleet =
                   lower median of the fresh, serving endpoints that answered at least min_requests;
                   then raised to (age of the oldest running request / the fleet's typical latency)
                   when that request has run overdue_factor (1.5) times longer than the endpoint's
                   longest answer in a window of >= min_requests answers whose longest is within
                   overdue_max_spread (1.6) of its median: evidence before any answer, where
                   durations are predictable;
                   else (no evidence now) the last known slowness, its excess over 1 halving every
                   unknown_slowness_half_life_s, so a sidelined endpoint gets another chance

    target = MAX_WEIGHT * f_sat(s) * f_slow(r) * f_gpu - tiebreak, clamped to [floor, MAX_WEIGHT], then
             scaled so the best endpoint has MAX_WEIGHT (Envoy reads weights relative to each other, so
             a load all endpoints share changes nothing and pushes nothing)
      f_sat  = 1 up to s = knee, then linear to 0 at s = 1 (a saturated endpoint sits at the floor)
      f_slow = 1 up to r = slow_start, then geometric down to floor/MAX_WEIGHT at r = slow_floor:
               a fleet of equal endpoints stays at equal weights, a clearly slower one loses its share
      f_gpu  = 1 - gpu_rule_shift when gpu_utilization > 0.85 and queued > 50 (the source article's
               rule: move 30% of that instance's traffic elsewhere)
      tiebreak = up to gpu_tiebreak_points, by GPU utilisation above the fleet's least used: it orders
               otherwise equal endpoints but is below the hysteresis, so it never causes a push alone

Then, per endpoint, the published weight follows the target through an EWMA (fast down, slow up; the
rates are per `step_s` and scaled by the time since the last call, so calling more often changes
nothing), capped per step, rounded; within `hysteresis` of a full-weight target it finishes the climb.
The new decision is published only when some weight moved by at least `hysteresis` points or by a
factor of `hysteresis_ratio` (near the floor, shares move by ratios), reached full weight or the floor,
or health, membership or drops changed; otherwise the previous decision object is returned unchanged
and the control plane pushes nothing.

Rules over the whole model:
- fail-open: when every healthy endpoint is saturated (stale counts as saturated), all get full weight
  at once: our relative view is no better than Envoy's in-flight counts then.
- draining (or any non-serving state): health DRAINING, weight at the floor; back in service it ramps up.
- shedding (shedding.py): when even the least saturated fresh endpoint is over the model's
  priority threshold for `shed_after_s`, Envoy drops a share of new requests with a 503 (EDS
  drop_overloads). P2 starts at a lower overload than P1; P0 never sheds.

Why MAX_WEIGHT is 1000 with a floor of 1: LEAST_REQUEST divides a weight by (active + 1), so a busy
full-share host scores ~MAX_WEIGHT/11 and an idle one at the floor scores 1: with 100 the floor still
took ~2-3% of the traffic, with 1000 ~0.3%.

Dynamics, in the closed-loop model of tests/unit/xds_server/test_weights_closed_loop.py (four sim
engines at half their capacity, Envoy's LEAST_REQUEST, sidecars reporting every 0.5 s and at once when
their recent mean jumps) and on the real stack (bench/routing, results in bench/results/routing.json;
bench/reaction for the time to the first cut): a 3x slowdown reaches the policy through the sidecar's
fast signal, the last 0.5 s of answers (at least the last 8) plus the requests still running at their
age so far, and through the overdue rule, so it shows as soon as requests overrun, not only once slow
answers arrive. The first cut
came 0.75-1.8 s after it in the model with LLM-like requests (0.3-1.2 s each), 1.2-1.5 s in
bench/routing (0.5 s requests; the overdue rule is off there, their durations vary 4x) and 0.2-0.45 s in
bench/reaction (80 ms requests, 1000 endpoints); from 2 s after the
slowdown the slowed instance got 0.2-0.7% of the requests instead of ~12% under plain least-request. An equal fleet got no push at all (noise in the
recent means is discounted by their standard errors), so Envoy's power-of-two-choices pick runs
untouched. A KV-short instance keeps its share: least-request's in-flight counts already account for
its smaller batches. Recovery takes the sidecar's window (30 s) or the fading of unknown slowness,
whichever comes first, then the climb (+200 points per step): 34-36 s with a 10 s window in
tests/integration/test_weights_envoy.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sie.spec import ModelService
from sie.telemetry import TelemetryRecord
from xds_server.policy.decisions import MAX_WEIGHT, EndpointDecision, Health, ModelDecision
from xds_server.policy.settings import WeightSettings
from xds_server.policy.shedding import next_drop
from xds_server.policy.signals import EndpointSignals, read_signals, target_weight

__all__ = ["PolicyState", "WeightPolicy", "WeightSettings", "decide"]


@dataclass(frozen=True)
class PolicyState:
    """What one model's policy carries from one call to the next."""

    at: float | None = None  # `now` of the last call
    weights: Mapping[str, float] = field(default_factory=dict)  # smoothed, unrounded, by instance id
    slowness: Mapping[str, float] = field(default_factory=dict)  # last known, for endpoints gone quiet
    published: ModelDecision | None = None  # the last decision returned
    overloaded_since: float | None = None
    drop_percent: float = 0.0  # unrounded


def decide(
    model: ModelService,
    records: Sequence[TelemetryRecord],
    previous: PolicyState,
    now: float,
    settings: WeightSettings = WeightSettings(),
) -> tuple[ModelDecision, PolicyState]:
    """One model's decision from the newest record of each of its instances."""
    newest = _newest(model.model_id, records)
    if not newest:
        decision = ModelDecision(model_id=model.model_id, reason="no endpoints")
        return decision, PolicyState(at=now, published=decision)

    dt = settings.step_s if previous.at is None else min(max(0.0, now - previous.at), settings.step_s * 4)
    elapsed = 0.0 if previous.at is None else max(0.0, now - previous.at)
    signals = read_signals(model, newest, _faded(previous.slowness, elapsed, settings), now, settings)
    serving = [s for s in signals if s.health is Health.HEALTHY]
    fail_open = bool(serving) and all(s.saturation >= 1.0 for s in serving)

    targets = _relative({sig.instance_id: target_weight(sig, signals, settings) for sig in serving}, settings)
    weights: dict[str, float] = {}
    endpoints: dict[str, EndpointDecision] = {}
    for sig in signals:
        if sig.health is not Health.HEALTHY:
            weights[sig.instance_id] = float(settings.floor)
            endpoints[sig.instance_id] = EndpointDecision(sig.address, settings.floor, Health.DRAINING, sig.reason)
            continue
        if fail_open:
            smoothed, reason = float(MAX_WEIGHT), f"fail-open (all saturated); {sig.reason}"
        else:
            target = targets[sig.instance_id]
            smoothed = _smooth(previous.weights.get(sig.instance_id), target, dt, settings)
            reason = f"target {target:.0f}; {sig.reason}"
        weights[sig.instance_id] = smoothed
        endpoints[sig.instance_id] = EndpointDecision(
            sig.address, _publishable(smoothed, settings), Health.HEALTHY, reason
        )

    shed = next_drop(model, serving, previous.drop_percent, previous.overloaded_since, now, dt, settings)
    reason = _model_reason(signals, fail_open, shed.reason)
    candidate = ModelDecision(model.model_id, endpoints, drop_overload_percent=shed.published, reason=reason)
    published = candidate if _worth_pushing(previous.published, candidate, settings) else previous.published
    assert published is not None
    state = PolicyState(
        at=now,
        weights=weights,
        slowness={s.instance_id: s.slowness for s in signals if s.slowness is not None},
        published=published,
        overloaded_since=shed.overloaded_since,
        drop_percent=shed.percent,
    )
    return published, state


class WeightPolicy:
    """The DecisionPolicy the control loop uses: `decide` per model, keeping each model's PolicyState."""

    def __init__(self, settings: WeightSettings = WeightSettings()):
        self.settings = settings
        self._states: dict[str, PolicyState] = {}

    def decide(self, model: ModelService, records: Sequence[TelemetryRecord], now: float) -> ModelDecision:
        decision, self._states[model.model_id] = decide(
            model, records, self._states.get(model.model_id, PolicyState()), now, self.settings
        )
        return decision

    def forget(self, model_id: str) -> None:
        """Drop a deleted model's state (a model re-created later starts fresh)."""
        self._states.pop(model_id, None)

    def state(self, model_id: str) -> PolicyState | None:
        return self._states.get(model_id)


def _newest(model_id: str, records: Sequence[TelemetryRecord]) -> list[TelemetryRecord]:
    """One record per instance (the newest), sorted by instance id; other models' records are ignored."""
    best: dict[str, TelemetryRecord] = {}
    for rec in records:
        if rec.model_id != model_id:
            continue
        have = best.get(rec.instance_id)
        if have is None or (rec.timestamp, rec.seq) > (have.timestamp, have.seq):
            best[rec.instance_id] = rec
    return [best[iid] for iid in sorted(best)]


def _relative(targets: dict[str, float], s: WeightSettings) -> dict[str, float]:
    """Targets scaled so the best endpoint has full weight. Envoy reads weights only relative to each
    other, so this changes no endpoint's share; it keeps a load every endpoint shares (all near the
    SLA, all with the GPU rule) from moving weights, hence from pushes and from leaving Envoy's
    equal-weight pick."""
    top = max(targets.values(), default=0.0)
    if top <= 0:
        return targets
    return {iid: min(float(MAX_WEIGHT), max(float(s.floor), t * MAX_WEIGHT / top)) for iid, t in targets.items()}


def _faded(slowness: Mapping[str, float], elapsed: float, s: WeightSettings) -> dict[str, float]:
    """Last known slowness, its excess over 1 halved every unknown_slowness_half_life_s (see there)."""
    keep = 0.5 ** (elapsed / s.unknown_slowness_half_life_s)
    return {iid: 1.0 + (value - 1.0) * keep if value > 1.0 else value for iid, value in slowness.items()}


def _smooth(old: float | None, target: float, dt: float, s: WeightSettings) -> float:
    """EWMA toward the target, faster down than up, at most max_step_* points per step_s."""
    if old is None:
        return target  # a new endpoint starts at its target; Envoy's in-flight counts protect it meanwhile
    down = target < old
    alpha = s.alpha_down if down else s.alpha_up
    fraction = min(1.0, dt / s.step_s)
    gain: float = 1.0 - (1.0 - alpha) ** fraction  # float ** float is typed Any (it may be complex)
    cap = (s.max_step_down if down else s.max_step_up) * fraction
    moved = max(-cap, min(cap, (target - old) * gain))
    new = min(float(MAX_WEIGHT), max(float(s.floor), old + moved))
    if target >= MAX_WEIGHT and MAX_WEIGHT - new < s.hysteresis:
        # The EWMA only approaches full weight; finishing the climb restores equal weights, under which
        # Envoy's LEAST_REQUEST goes back to its power-of-two-choices pick.
        return float(MAX_WEIGHT)
    return new


def _publishable(smoothed: float, s: WeightSettings) -> int:
    return int(min(MAX_WEIGHT, max(s.floor, math.floor(smoothed + 0.5))))


def _worth_pushing(old: ModelDecision | None, new: ModelDecision, s: WeightSettings) -> bool:
    if old is None or set(old.endpoints) != set(new.endpoints):
        return True
    if abs(old.drop_overload_percent - new.drop_overload_percent) >= s.drop_hysteresis:
        return True
    if (old.drop_overload_percent == 0) != (new.drop_overload_percent == 0):
        return True
    for iid, ep in new.endpoints.items():
        was = old.endpoints[iid]
        if (was.address, was.health) != (ep.address, ep.health):
            return True
        if abs(was.weight - ep.weight) >= s.hysteresis:
            return True
        if max(was.weight, ep.weight) >= s.hysteresis_ratio * min(was.weight, ep.weight):
            return True
        if ep.weight in (MAX_WEIGHT, s.floor) and ep.weight != was.weight:
            return True  # reaching a bound is always pushed, so smoothing never stalls just short of it
    return False


def _model_reason(signals: Sequence[EndpointSignals], fail_open: bool, shed_reason: str) -> str:
    serving = [s for s in signals if s.health is Health.HEALTHY]
    saturated = sum(1 for s in serving if s.saturation >= 1.0)
    parts = [f"{len(serving)} serving, {saturated} saturated"]
    if len(serving) < len(signals):
        parts.append(f"{len(signals) - len(serving)} draining")
    if fail_open:
        parts.append("fail-open: equal weights")
    if shed_reason:
        parts.append(shed_reason)
    return "; ".join(parts)
