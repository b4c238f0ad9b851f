"""The autoscaler's thin loop: every TICK_S, for each autoscaled model (ModelServiceSpec.autoscaled) not
in a rollout, pool its ready instances' telemetry into a Demand, decide (policy.decide), and hand the
count to the registry (Registry.set_scale), which re-places the model (policy.fleet_shape): the warm
pool's sleeping instances are woken first, new ones go where a node host's ledger admits them, and
removed ones drain and sleep (the warm pool) or drain and stop.

Activity (for the scale-to-zero idle rule) is any request in flight, queued or held at one of the
model's instances, or a rise of an instance's requests_total between two looks. The autoscaler's first
look at a model counts as activity, so a restarted control plane never takes a model to zero at once.

Demand is read only where the registry lets an instance serve (DESIGN §10: a sidecar speaks for its own
instance, and an instance counts only while the placement gives it to a live node): the ready records
of Registry.eds_records, and the sleeping records of the stable build's instances placed on a live node
that registered them (`_holders`). Each record counts for at most what its sidecar admits: in flight up
to the spec's max_concurrent_requests, queued up to its queue bound, held up to both together
(sidecar/waking.py's max_held), so no record can ask for more instances than its own load needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sie.spec import ModelServiceSpec
from sie.telemetry import InstanceState, TelemetryRecord
from xds_server.autoscale.policy import Demand, ScaleState, decide
from xds_server.registry import Registry
from xds_server.rollout.gates import track_stats

log = logging.getLogger(__name__)

STALE_S = 5.0  # a sleeping instance's record older than this says nothing about held requests
# The sidecar's queue bound per max_concurrent_requests when it is not given --max-queue, as node hosts
# start it (sidecar/settings.py QUEUE_PER_SLOT; the two packages may not import each other, and a test
# holds the two equal).
QUEUE_PER_SLOT = 4

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
            sleeping = self._holders(mid, entry.generation, now)
            slots, queue = _admits(spec)
            short = reg.waiting_for_memory(mid, entry.generation)
            first_look = mid not in self._active_at
            active_at = self._activity(mid, ready + sleeping, now)
            pooled = track_stats(ready)  # the same pooling the rollout gates judge on
            demand = Demand(
                ready=len(ready),
                in_flight=float(sum(min(r.in_flight, slots) for r in ready)),
                queued=float(sum(min(r.queued, queue) for r in ready)),
                queue_time_ms=pooled.queue_time_ms,
                p99_ms=pooled.p99_ms,
                held=sum(min(r.in_flight + r.queued, slots + queue) for r in sleeping),
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

    def _holders(self, model_id: str, generation: int, now: float) -> list[TelemetryRecord]:
        """The sleeping records that may speak for held requests: one per instance of the stable build,
        heard from within STALE_S, that the registry would give EDS as a wake holder (Registry.in_eds:
        its node live and still listing it), placed on that node or handed over from there
        (Placement.holds) and at the address that node registered for it (Registry.registered_address).
        A record of an instance scaled away, placed nowhere, or on a lost node says nothing."""
        reg, out = self.registry, []
        for tel in reg.instances_of(model_id):
            if reg.generation(model_id, tel.record.instance_id) != generation:
                continue
            for copy in reg.all_copies(tel.record.instance_id):  # of two copies, the one placed there
                r = copy.record
                if (
                    r.state is InstanceState.SLEEPING
                    and now - copy.received_at <= STALE_S
                    and reg.in_eds(copy, now, sleeping=True)
                    and reg.placement.holds(r.instance_id, r.node)
                    and reg.registered_address(r) is not None
                ):
                    out.append(r)
                    break
        return out

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


def _admits(spec: ModelServiceSpec) -> tuple[int, int]:
    """(in flight, queued): the most one of the model's sidecars admits by default (sidecar/settings.py)."""
    slots = spec.resources.max_concurrent_requests
    return slots, QUEUE_PER_SLOT * slots
