"""Admission: at most `max_concurrent` requests at the worker, a bounded FIFO queue behind them.

`AdmissionQueue` is the core: no asyncio, every call takes `now`, so tests drive it with a fake clock.
`Gate` is the asyncio shell: it gives each queued request a future, and keeps ONE timer armed at the
head's deadline. Because every waiter waits at most the same `max_wait_s` and the queue is FIFO,
deadlines never decrease along the queue, so the head always expires first.

Invariants (checked by the unit tests):
  * in_flight <= max_concurrent and len(waiting) <= max_queue, always;
  * a request is queued only when no slot is free, and admitted in arrival order;
  * a waiter leaves the queue exactly once: admitted, expired, handed back or withdrawn;
  * a waiter whose deadline has passed is never admitted (it is expired first).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    ADMITTED = "admitted"  # holds a slot; the caller must call release() exactly once
    QUEUED = "queued"
    QUEUE_FULL = "queue_full"  # 429: the queue bound is reached
    QUEUE_TIMEOUT = "queue_timeout"  # 503: waited longer than max_wait_s (or may not wait at all)
    HANDED_BACK = "handed_back"  # 503: the instance is draining and gave the request back unserved


@dataclass(frozen=True)
class Limits:
    max_concurrent: int
    max_queue: int
    max_wait_s: float

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {self.max_concurrent}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must not be negative, got {self.max_queue}")


class Waiter:
    """One queued request. `token` belongs to the shell (the Gate keeps a future there)."""

    __slots__ = ("enqueued_at", "deadline", "token")

    def __init__(self, enqueued_at: float, deadline: float):
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.token: asyncio.Future[Verdict] | None = None


class AdmissionQueue:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.in_flight = 0
        self.waiting: deque[Waiter] = deque()
        self.completed = 0  # requests that held a slot and released it

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and not self.waiting

    def arrive(self, now: float) -> tuple[Verdict, Waiter | None]:
        if self.in_flight < self.limits.max_concurrent and not self.waiting:
            self.in_flight += 1
            return Verdict.ADMITTED, None
        if len(self.waiting) >= self.limits.max_queue:
            return Verdict.QUEUE_FULL, None
        if self.limits.max_wait_s <= 0:
            return Verdict.QUEUE_TIMEOUT, None
        waiter = Waiter(now, now + self.limits.max_wait_s)
        self.waiting.append(waiter)
        return Verdict.QUEUED, waiter

    def release(self, now: float) -> tuple[list[Waiter], list[Waiter]]:
        """A request left the worker. Returns (admitted, expired) waiters, both in queue order."""
        if self.in_flight <= 0:
            raise RuntimeError("release() without a matching admission: the in-flight count would go negative")
        self.in_flight -= 1
        self.completed += 1
        expired = self.expire(now)
        admitted = []
        while self.waiting and self.in_flight < self.limits.max_concurrent:
            admitted.append(self.waiting.popleft())
            self.in_flight += 1
        return admitted, expired

    def expire(self, now: float) -> list[Waiter]:
        expired = []
        while self.waiting and self.waiting[0].deadline <= now:
            expired.append(self.waiting.popleft())
        return expired

    def withdraw(self, waiter: Waiter) -> bool:
        """The caller gave up (its client went away). False when the waiter was no longer queued."""
        try:
            self.waiting.remove(waiter)
        except ValueError:
            return False
        return True

    def hand_back_all(self) -> list[Waiter]:
        """Empty the queue (drain deadline): these requests never reached the worker."""
        out = list(self.waiting)
        self.waiting.clear()
        return out

    @property
    def next_deadline(self) -> float | None:
        return self.waiting[0].deadline if self.waiting else None


class Gate:
    """The asyncio shell around AdmissionQueue. Use from the event loop thread only.

    Hot path: `arrive()` is a plain call; only a queued request awaits `wait()`.
    """

    def __init__(self, limits: Limits, loop: asyncio.AbstractEventLoop):
        self.core = AdmissionQueue(limits)
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._idle: asyncio.Future[None] | None = None  # exists only while someone waits for idle

    def arrive(self) -> tuple[Verdict, Waiter | None]:
        verdict, waiter = self.core.arrive(self._loop.time())
        if waiter is not None:
            waiter.token = self._loop.create_future()
            if self._timer is None:
                self._arm()
        return verdict, waiter

    async def wait(self, waiter: Waiter) -> Verdict:
        """Wait for a queued request's turn: ADMITTED, QUEUE_TIMEOUT or HANDED_BACK."""
        future = waiter.token
        assert future is not None, "wait() takes a waiter from Gate.arrive, which gives it a token"
        try:
            return await future
        except asyncio.CancelledError:
            # The handler was cancelled. If the slot was already granted, hand it on, or it leaks.
            if self.core.withdraw(waiter):
                self._check_idle()
            elif not future.cancelled() and future.done() and future.result() is Verdict.ADMITTED:
                self.release()
            # Otherwise the future was cancelled before release() popped the waiter, and release()
            # has already passed the slot on (see _resolve's return value).
            raise

    def release(self) -> None:
        admitted, expired = self.core.release(self._loop.time())
        for waiter in expired:
            _resolve(waiter, Verdict.QUEUE_TIMEOUT)
        for waiter in admitted:
            if not _resolve(waiter, Verdict.ADMITTED):
                # Its caller was cancelled while queued and can no longer use the slot: pass it on.
                self.release()
        if self._idle is not None:
            self._check_idle()

    def hand_back_all(self) -> int:
        waiters = self.core.hand_back_all()
        for waiter in waiters:
            _resolve(waiter, Verdict.HANDED_BACK)
        self._check_idle()
        return len(waiters)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight or queued; False if `timeout_s` passed first."""
        if self.core.idle:
            return True
        if self._idle is None or self._idle.done():
            self._idle = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: see sie.tasks.wait_event
                await asyncio.shield(self._idle)
        except TimeoutError:
            return self.core.idle
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        deadline = self.core.next_deadline
        self._timer = None if deadline is None else self._loop.call_at(deadline, self._on_deadline)

    def _on_deadline(self) -> None:
        for waiter in self.core.expire(self._loop.time()):
            _resolve(waiter, Verdict.QUEUE_TIMEOUT)
        self._arm()
        self._check_idle()

    def _check_idle(self) -> None:
        if self._idle is not None and not self._idle.done() and self.core.idle:
            self._idle.set_result(None)


def _resolve(waiter: Waiter, verdict: Verdict) -> bool:
    """Deliver a verdict; False when nobody is waiting for it any more."""
    future = waiter.token
    if future is None or future.done():
        return False
    future.set_result(verdict)
    return True
