"""The autoscaler's thin loop: every second, for each autoscaled model (ModelServiceSpec.autoscaled) not
in a rollout, pool its ready instances' telemetry into a Demand, decide (policy.decide), and hand the
count to the registry (Registry.set_scale), which re-places the model: new instances go where a node
host's ledger admits them (waking a sleeping one of the model first), removed ones drain and stop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sie.telemetry import InstanceState
from xds_server.autoscale.policy import Demand, ScaleState, decide
from xds_server.registry import Registry
from xds_server.rollout.gates import track_stats

log = logging.getLogger(__name__)

__all__ = ["Autoscaler"]


class Autoscaler:
    def __init__(
        self, registry: Registry, *, on_decision: Callable[[str, ScaleState], None] = lambda model, state: None
    ):
        self.registry = registry
        self.states: dict[str, ScaleState] = {}
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
                continue
            ready = [
                r
                for r in reg.eds_records(mid, now)
                if r.state is InstanceState.READY and reg.generation(mid, r.instance_id) == entry.generation
            ]
            pooled = track_stats(ready)  # the same pooling the rollout gates judge on
            demand = Demand(
                ready=len(ready),
                in_flight=float(sum(r.in_flight for r in ready)),
                queued=float(sum(r.queued for r in ready)),
                queue_time_ms=pooled.queue_time_ms,
                p99_ms=pooled.p99_ms,
            )
            state = self.states.get(mid) or ScaleState(desired=entry.replicas)
            following = decide(spec, state, demand, now)
            self.states[mid] = following
            if following.desired != state.desired:
                log.info("model %s: %d -> %d instances (%s)", mid, state.desired, following.desired, following.last)
            assert following.last is not None
            reg.set_scale(mid, following.desired, following.last.to_json())
            self._on_decision(mid, following)
