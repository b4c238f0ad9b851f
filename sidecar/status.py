"""The instance's live lifecycle, and who hears when it changes.

One writer (the event loop). Every change goes through `apply`, which logs the transition, sets
`changed` (the telemetry loop sends a record at once) and wakes anyone in `wait_for`. The data path
reads only `serving`, a plain bool kept in step with the state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sidecar.lifecycle import Lifecycle
from sie.tasks import wait_event
from sie.telemetry import InstanceState

log = logging.getLogger(__name__)


class Status:
    def __init__(self, instance_id: str, lifecycle: Lifecycle | None = None):
        self._instance_id = instance_id
        self.lifecycle = lifecycle or Lifecycle()
        self.state = self.lifecycle.state
        self.serving = self.state.serves
        self.changed = asyncio.Event()  # cleared by its one reader, the telemetry loop
        self._moved = asyncio.Event()  # replaced after each change; see wait_for

    def apply(self, step: Callable[..., Lifecycle], *args: object) -> InstanceState:
        """lifecycle = step(lifecycle, *args); may raise lifecycle.TransitionError, changing nothing."""
        new = step(self.lifecycle, *args)
        if new == self.lifecycle:
            return self.state
        old_state = self.state
        self.lifecycle = new
        self.state = new.state
        self.serving = self.state.serves
        if self.state is not old_state:
            log.info("instance %s: %s -> %s (%s)", self._instance_id, old_state.value, self.state.value, step.__name__)
            self.changed.set()
            moved, self._moved = self._moved, asyncio.Event()
            moved.set()
        return self.state

    async def wait_for(self, wanted: Callable[[InstanceState], bool], timeout_s: float) -> bool:
        """True once `wanted(state)` holds; False if `timeout_s` passes first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not wanted(self.state):
            left = deadline - loop.time()
            if left <= 0:
                return False
            await wait_event(self._moved, left)
        return True
