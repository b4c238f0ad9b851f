"""Every background task of a process, supervised by one helper (DESIGN.md section 9).

A task is named and started with an explicit policy:

- `Policy.FATAL`: its death stops the process. An exception (or, for a task meant to run until shutdown,
  a return) is logged, recorded as `SupervisedTasks.fatal`, and reported to the owner's `on_fatal`, which
  stops the process: a control plane or node host with a dead loop must not look healthy.
- `Policy.RESTART`: a loop that raises (or returns) is logged and started again after a backoff that
  doubles from `Backoff.base_s` up to `Backoff.max_s`; one bad reply from a worker must not end health
  probing for the life of the process. Restarts are counted per task.
- `Policy.LOG`: one-shot work whose failure is logged and goes no further (stopping one instance, an
  eviction): its owner reports the outcome where it matters.

`stop()` cancels every task and awaits each; no task outlives its owner.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class Policy(enum.Enum):
    FATAL = "fatal"
    RESTART = "restart"
    LOG = "log"


@dataclass(frozen=True)
class Backoff:
    base_s: float = 0.5
    """Pause before the first restart, in seconds (default 0.5): short, so one stray error costs little."""
    max_s: float = 10.0
    """Cap on the pause, which doubles while the task keeps failing, in seconds (default 10.0)."""
    reset_after_s: float = 60.0
    """A run longer than this, in seconds (default 60.0), makes the next failure a new one: the pause starts
    again from `base_s`."""


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


TaskBody = Callable[[], Coroutine[Any, Any, Any]]


class SupervisedTasks:
    """The background tasks of one owner (a process's composition root, or a component it builds).

    `on_fatal(name, exc)` is called once per FATAL death; `sleep` and `clock` are passed in so tests can
    drive RESTART backoffs without real waits.
    """

    def __init__(
        self,
        on_fatal: Callable[[str, BaseException], None] = lambda name, exc: None,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._on_fatal = on_fatal
        self._sleep = sleep
        self._clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self.restarts: dict[str, int] = {}
        """Restarts per RESTART task name, since the group was made."""
        self.fatal: tuple[str, BaseException] | None = None
        """The first FATAL death: (task name, what ended it)."""

    def start(
        self, name: str, policy: Policy, body: TaskBody, *, forever: bool = True, backoff: Backoff = Backoff()
    ) -> asyncio.Task[Any]:
        """Run `body()` as task `name` under `policy`. `forever`: it is meant to run until `stop()`, so a
        return is a death too (FATAL) or a restart (RESTART); a one-shot task (`forever=False`) may return."""
        coro = self._restarting(name, body, backoff) if policy is Policy.RESTART else body()
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, policy, forever))
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def _restarting(self, name: str, body: TaskBody, backoff: Backoff) -> None:
        clock = self._clock or asyncio.get_running_loop().time
        pause = backoff.base_s
        while True:
            started = clock()
            try:
                await body()
                log.warning("task %s returned; it is meant to run until cancelled, restarting in %.1fs", name, pause)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task %s died; restarting in %.1fs", name, pause)
            if clock() - started > backoff.reset_after_s:
                pause = backoff.base_s  # it ran well for a while: this is a new failure, not the same one
            await self._sleep(pause)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            pause = min(pause * 2, backoff.max_s)

    def _done(self, task: asyncio.Task[Any], policy: Policy, forever: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        name = task.get_name()
        if exc is not None:
            log.error("background task %s died", name, exc_info=exc)
        elif forever and not self._stopping and policy is Policy.FATAL:
            log.error("background task %s returned; it should run until shutdown", name)
            exc = RuntimeError("task returned")
        if exc is not None and policy is Policy.FATAL:
            if self.fatal is None:
                self.fatal = (name, exc)
            self._on_fatal(name, exc)

    async def stop(self) -> None:
        """Cancel every task and wait for each to finish; never raises for a task's failure."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
