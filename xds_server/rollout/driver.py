"""The thin shell around the rollout machine: observe the registry, advance, apply, record.

`tick()` runs every half second beside the control loop (main.py): for each model in a rollout it pools
each build's telemetry (gates.track_stats), asks the machine for the next state, and hands it to the
registry, which changes the placement's counts, the routes' split, and at the end promotes or rolls back.
Every transition is logged, counted, and recorded through `on_change` (state.py), so a control-plane
restart resumes where it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from xds_server.registry import Registry
from xds_server.rollout.gates import track_stats
from xds_server.rollout.machine import Action, RolloutConflict, RolloutState, act, advance

log = logging.getLogger(__name__)

__all__ = ["RolloutDriver"]


class RolloutDriver:
    def __init__(
        self,
        registry: Registry,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_transition: Callable[[RolloutState], None] = lambda state: None,
    ):
        self.registry = registry
        self._on_change = on_change  # record the rollout (state.py)
        self._on_transition = on_transition  # metrics
        # The wall-clock time of this control plane's first observation. A wait recorded before it (a
        # step being prepared, a share short of instances, read back after a restart) counts from here:
        # the time the control plane was down is not the new build's wait (machine.advance).
        self._watching_since: float | None = None

    def tick(self) -> None:
        reg = self.registry
        if not reg.synced:
            return
        now, wall = reg.clock(), reg.wall_clock()
        if self._watching_since is None:
            self._watching_since = wall
        for mid, entry in list(reg.models.items()):
            state = entry.rollout
            if state is None or not entry.rolling or entry.target is None:
                continue
            records = reg.eds_records(mid, now)
            new = track_stats(r for r in records if reg.generation(mid, r.instance_id) == state.generation)
            old = track_stats(r for r in records if reg.generation(mid, r.instance_id) == entry.generation)
            following = advance(
                state,
                new,
                old,
                entry.target.spec.sla,
                wall,
                waiting_for_memory=reg.waiting_for_memory(mid, state.generation),
                watched_since=self._watching_since,
            )
            self._apply(mid, state, following)

    def act(self, model_id: str, action: Action) -> RolloutState:
        """A by-hand pause, resume or abort (RolloutConflict when the phase does not allow it)."""
        entry = self.registry.models[model_id]
        if entry.rollout is None:
            raise RolloutConflict(f"model {model_id!r} has no rollout")
        following = act(entry.rollout, action, self.registry.wall_clock())
        self._apply(model_id, entry.rollout, following)
        return following

    def _apply(self, model_id: str, before: RolloutState, after: RolloutState) -> None:
        self.registry.set_rollout(model_id, after)
        if len(after.events) != len(before.events) or after.events[-1:] != before.events[-1:]:
            event = after.events[-1]
            log.info("model %s rollout: %s at %d%% (%s)", model_id, event.what, event.share, event.detail)
            self._on_transition(after)
        if _recorded(before) != _recorded(after):
            self._on_change()


def _recorded(state: RolloutState) -> tuple:
    """What a restart must resume from (the figures and reasons are observed again)."""
    return (
        state.phase,
        state.step,
        state.live,
        state.step_since,
        state.share,
        state.withdrawn,
        state.unready_since,
        state.starved_since,
        state.preparing_since,
        state.yielded,
    )
