"""The autoscaler's thin loop: every TICK_S, for each autoscaled model (ModelServiceSpec.autoscaled) not
in a rollout, pool its ready instances' telemetry into a Demand, decide (policy.decide), and hand the
count to the registry (Registry.set_scale), which re-places the model (policy.fleet_shape): the warm
pool's sleeping instances are woken first, new ones go where a node host's ledger admits them, and
removed ones drain and sleep (the warm pool) or drain and stop.

Activity (for the scale-to-zero idle rule) is any request in flight, queued or held at one of the
model's instances, or a rise of an instance's requests_total between two looks. The autoscaler's first
look at a model counts as activity, so a restarted control plane never takes a model to zero at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.autoscale.policy import Demand, ScaleState, decide
from xds_server.registry import Registry
from xds_server.rollout.gates import track_stats

log = logging.getLogger(__name__)

STALE_S = 5.0  # a sleeping instance's record older than this says nothing about held requests

__all__ = ["Autoscaler"]


TICK_S = 0.1  # a decision is cheap; the autoscaler hears of a burst within a tenth of a second


class Autoscaler:
    def __init__(
        self, registry: Registry, *, on_decision: Callable[[str, ScaleState], None] = lambda model, state: None
    ):
        self.registry = registry
        self.states: dict[str, ScaleState] = {}
        self._active_at: dict[str, float] = {}  # model -> when it last had a request (registry clock)
        self._answered: dict[str, int] = {}  # instance -> requests_total at the last look
        self._on_decision = on_decision  # metrics

    def tick(self) -> None:
        reg = self.registry
        if not reg.synced:
            return
        now = reg.clock()
        for mid, entry in list(reg.models.items()):
            spec = entry.service.spec
            if not spec.autoscaled or entry.rolling:
                self.states.pop(mid, None)
                self._active_at.pop(mid, None)
                continue
            ready = [
                r
                for r in reg.eds_records(mid, now)
                if r.state is InstanceState.READY and reg.generation(mid, r.instance_id) == entry.generation
            ]
            sleeping = [
                t.record
                for t in reg.instances_of(mid)
                if t.record.state is InstanceState.SLEEPING and now - t.received_at <= STALE_S
            ]
            short = reg.waiting_for_memory(mid, entry.generation)
            first_look = mid not in self._active_at
            active_at = self._activity(mid, ready + sleeping, now)
            pooled = track_stats(ready)  # the same pooling the rollout gates judge on
            demand = Demand(
                ready=len(ready),
                in_flight=float(sum(r.in_flight for r in ready)),
                queued=float(sum(r.queued for r in ready)),
                queue_time_ms=pooled.queue_time_ms,
                p99_ms=pooled.p99_ms,
                held=sum(r.queued for r in sleeping),
                # An instance already placed that a node host holds back for memory: asking for more
                # would only queue more of them. The count stays, and the reason says what is missing.
                room=0 if short else None,
                short=short,
                idle_for_s=now - active_at,
                requested=active_at == now and not first_look,
            )
            state = self.states.get(mid) or ScaleState(desired=entry.replicas)
            following = decide(spec, state, demand, now)
            self.states[mid] = following
            if following.desired != state.desired:
                log.info("model %s: %d -> %d instances (%s)", mid, state.desired, following.desired, following.last)
            assert following.last is not None
            reg.set_scale(mid, following.desired, following.last.to_json())
            self._on_decision(mid, following)

    def _activity(self, model_id: str, records: list[TelemetryRecord], now: float) -> float:
        """When the model last had a request (see the module docstring)."""
        busy = False
        for r in records:
            before = self._answered.get(r.instance_id)
            self._answered[r.instance_id] = r.requests_total
            if r.in_flight or r.queued or (before is not None and r.requests_total > before):
                busy = True
        if busy or model_id not in self._active_at:
            self._active_at[model_id] = now
        return self._active_at[model_id]
