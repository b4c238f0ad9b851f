"""Drain, sleep, wake and shutdown: the steps that take an instance out of service and back.

Drain: report `draining` at once (the control plane marks the endpoint DRAINING and Envoy stops
sending), refuse new requests with a retryable 503, let in-flight and queued work finish, and at the
bound hand every still-queued request back (retryable 503: the worker never saw them).

Sleep: drain, then release the worker's GPU memory, but only once the worker is idle: a real SGLang
asserts on release with requests in flight and crashes. If work is still in flight at the bound, the
sleep is refused (409) and the instance stays draining, so the caller can retry or wake it.

Wake: resume the memory, then wait for a fresh OK health probe before reporting `ready`.

Sleep and wake are serialised by one lock. A drain runs beside them (it is idempotent) and does not
take it, so that a wake ends a drain at once instead of waiting out its bound. A wake supersedes every
drain begun before it: the drain stops waiting, hands nothing back (the queue now belongs to a serving
instance) and raises DrainSuperseded with its report. Only a wake returns the intent to serve, so a drain
no wake has superseded still finds the instance draining or sleeping when its bound passes.

Other intake: an optional `before_drain` hook (the Kafka connector's drain) is awaited right after the
state turns draining (drain, sleep, shutdown) and before waiting for idleness. A topic is a standing
backlog: without the hook, Kafka work would keep taking worker slots and the instance would never
become idle, and a sleep could release memory while a Kafka call arrives. A hook that fails is logged
and the drain goes on; the HTTP path must still drain.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from sidecar import lifecycle
from sidecar.admission import Gate
from sidecar.metrics import Metrics
from sidecar.status import Status
from sidecar.worker import WorkerClient, WorkerWatch
from sie.errors import RetryableError, SIEError
from sie.telemetry import InstanceState

log = logging.getLogger(__name__)

# How often to ask the worker whether it is idle before a release.
WORKER_IDLE_POLL_S = 0.05


@dataclass(frozen=True)
class DrainReport:
    finished: int  # requests that completed at the worker during the drain
    handed_back: int  # queued requests refused with a retryable 503 at the bound
    in_flight: int  # still at the worker when the drain returned (0 unless the bound passed)
    idle: bool
    waited_s: float

    def to_json(self) -> dict:
        return asdict(self)


class NotIdleError(RetryableError):
    """Sleep refused: work is still in flight at the worker, so releasing memory would crash it."""

    def __init__(self, report: DrainReport, engine_busy: bool):
        self.report = report
        where = "the worker still runs requests" if engine_busy else f"{report.in_flight} requests are still in flight"
        super().__init__(
            f"not idle after {report.waited_s:.1f}s: {where}; memory was not released and the instance stays "
            "draining. Retry /-/sleep with a larger timeout_s, or /-/wake to serve again"
        )


class DrainSuperseded(SIEError):
    """A wake came before the drain ended: the instance was asked to serve again, so the drain stopped
    waiting and handed nothing back."""

    def __init__(self, report: DrainReport):
        self.report = report
        super().__init__(
            f"a wake came after the drain had waited {report.waited_s:.1f}s: the instance was asked to serve again, "
            "so the drain stopped and handed nothing back. POST /-/drain again if it should still drain"
        )


class DrainController:
    def __init__(
        self,
        status: Status,
        gate: Gate,
        worker: WorkerClient,
        watch: WorkerWatch,
        metrics: Metrics,
        clock: Callable[[], float],
        before_drain: Callable[[], Awaitable[None]] | None = None,
    ):
        self._status = status
        self._gate = gate
        self._worker = worker
        self._watch = watch
        self._metrics = metrics
        self._clock = clock
        self._before_drain = before_drain
        self._lock = asyncio.Lock()
        # Set by the next wake, then replaced: each drain keeps the one current when it began.
        self._woken = asyncio.Event()

    async def drain(self, timeout_s: float) -> DrainReport:
        """Raises DrainSuperseded when a wake comes before the bound or idleness."""
        woken = self._woken
        self._status.apply(lifecycle.drain)  # raises TransitionError when stopping
        await self._stop_other_intake()
        report = await self._wait_drained(timeout_s, woken)
        if woken.is_set():
            raise DrainSuperseded(report)
        return report

    async def sleep(self, timeout_s: float, reason: str) -> tuple[DrainReport | None, InstanceState]:
        """Returns (drain report, state); the report is None when the instance was already asleep."""
        async with self._lock:
            if self._status.lifecycle.released:
                return None, self._status.state
            started = self._clock()
            self._status.apply(lifecycle.sleep)
            await self._stop_other_intake()
            report = await self._wait_drained(timeout_s, None)  # a wake waits for the lock: none comes meanwhile
            if report.in_flight:
                raise NotIdleError(report, engine_busy=False)
            left = max(0.5, timeout_s - (self._clock() - started))
            if not await self._worker_idle(left):
                raise NotIdleError(report, engine_busy=True)
            await self._worker.release_memory()  # WorkerCallError: stays draining, caller sees why
            self._status.apply(lifecycle.released)
            if reason == "eviction":
                self._metrics.evicted()
            log.info("slept (reason %s): %s", reason, report)
            return report, self._status.state

    async def wake(self, timeout_s: float) -> bool:
        """True once the instance is ready again; False when `timeout_s` passed first."""
        async with self._lock:
            lifecycle.wake(self._status.lifecycle)  # TransitionError (stopping) before any memory moves
            if self._status.lifecycle.released:
                await self._worker.resume_memory()  # WorkerCallError: stays sleeping
            self._status.apply(lifecycle.wake)
            woken, self._woken = self._woken, asyncio.Event()
            woken.set()
            self._watch.poke()
            return await self._status.wait_for(lambda s: s is InstanceState.READY, timeout_s)

    async def shutdown(self, timeout_s: float) -> DrainReport:
        """SIGTERM: drain within the bound, then report stopped; a wake or sleep asked meanwhile is
        refused (409), since the process exits after it. Never raises."""
        self._status.apply(lifecycle.shut_down)
        await self._stop_other_intake()
        # No wake supersedes this drain: the process exits after it whatever was asked meanwhile.
        report = await self._wait_drained(timeout_s, None)
        self._status.apply(lifecycle.stop)
        return report

    async def _stop_other_intake(self) -> None:
        if self._before_drain is None:
            return
        try:
            await self._before_drain()
        except Exception:  # noqa: BLE001 - the HTTP drain must go on whatever the hook did
            log.exception("before_drain hook failed; draining the HTTP path anyway")

    async def _wait_drained(self, timeout_s: float, woken: asyncio.Event | None) -> DrainReport:
        """Wait for idleness within `timeout_s`, then hand back what is still queued; a wake (`woken`
        set) ends the wait and hands nothing back."""
        gate = self._gate
        started = self._clock()
        completed_before = gate.core.completed
        await self._idle_or_woken(timeout_s, woken)
        superseded = woken is not None and woken.is_set()
        # No await between this check and the hand-back: a wake cannot slip in between.
        handed_back = 0 if gate.core.idle or superseded else gate.hand_back_all()
        report = DrainReport(
            finished=gate.core.completed - completed_before,
            handed_back=handed_back,
            in_flight=gate.core.in_flight,
            idle=gate.core.idle,
            waited_s=round(self._clock() - started, 3),
        )
        log.info("drain%s: %s", " superseded by a wake" if superseded else "", report)
        return report

    async def _idle_or_woken(self, timeout_s: float, woken: asyncio.Event | None) -> None:
        """Return once nothing is in flight or queued, `woken` is set, or `timeout_s` has passed."""
        if woken is None:
            await self._gate.wait_idle(timeout_s)
            return
        waits = (asyncio.ensure_future(self._gate.wait_idle(timeout_s)), asyncio.ensure_future(woken.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _worker_idle(self, timeout_s: float) -> bool:
        """Our own count is zero, but a request whose client went away may still run in the engine
        until it notices the abort. Ask the worker; a worker that cannot say is taken at our word."""
        deadline = self._clock() + timeout_s
        while True:
            load = await self._worker.load()
            if load is None or ((load.running or 0) + (load.waiting or 0)) == 0:
                return True
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(WORKER_IDLE_POLL_S)
