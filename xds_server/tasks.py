"""Supervised background tasks: named, logged when they die, cancelled and awaited on shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Coroutine

log = logging.getLogger(__name__)


class Supervisor:
    """Owns the process's background tasks. A task that dies unexpectedly is logged with its traceback and
    reported to `on_death` (main stops the process: a control plane with a dead loop must not look healthy)."""

    def __init__(self, on_death: Callable[[str, BaseException], None] = lambda name, exc: None):
        self._tasks: set[asyncio.Task] = set()
        self._on_death = on_death
        self._closing = False
        self._oneshot: set[str] = set()

    def spawn(self, name: str, coro: Coroutine, *, oneshot: bool = False) -> asyncio.Task:
        """Run `coro` as task `name`; unless `oneshot`, it is meant to run until shutdown."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        if oneshot:
            self._oneshot.add(name)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task %s died", task.get_name(), exc_info=exc)
            self._on_death(task.get_name(), exc)
        elif not self._closing and task.get_name() not in self._oneshot:
            log.error("background task %s returned; it should run until shutdown", task.get_name())
            self._on_death(task.get_name(), RuntimeError("task returned"))

    async def close(self) -> None:
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
