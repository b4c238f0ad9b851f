"""Background tasks that are named, supervised, logged when they die, and cancelled and awaited on
shutdown (DESIGN.md section 9).

A loop that raises is restarted after a pause: one bad reply from the worker must not end health
probing for the life of the process. The pause doubles up to a cap while it keeps failing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 0.5
RESTART_PAUSE_MAX_S = 10.0


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True once `event` is set, False after `timeout_s`.

    Not `asyncio.wait_for(event.wait(), t)`: on Python 3.11 that swallows a cancellation arriving
    as the event is set, and a loop built on it then never stops. `asyncio.timeout` does not.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


class Supervisor:
    def __init__(self) -> None:
        self._tasks: list[asyncio.Task] = []

    def start(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> asyncio.Task:
        task = asyncio.create_task(self._supervise(name, loop_fn), name=name)
        self._tasks.append(task)
        return task

    async def _supervise(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        pause = RESTART_PAUSE_S
        while True:
            started = loop.time()
            try:
                await loop_fn()
                log.warning("task %s returned; it is meant to run until cancelled, restarting", name)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task %s died; restarting in %.1fs", name, pause)
            if loop.time() - started > 60.0:
                pause = RESTART_PAUSE_S  # it ran well for a while: this is a new failure, not the same one
            await asyncio.sleep(pause)
            pause = min(pause * 2, RESTART_PAUSE_MAX_S)

    async def stop(self) -> None:
        """Cancel every task and wait for each to finish."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - already logged by _supervise; never block shutdown
                log.exception("task %s failed while stopping", task.get_name())
        self._tasks.clear()
