"""The sidecar's own endpoints, all under /-/ (never forwarded to the worker).

  GET  /-/healthz                  200 while the sidecar process serves (liveness)
  GET  /-/ready                    200 only while the state is ready (Kubernetes readiness)
  GET  /-/state                    the current TelemetryRecord as JSON
  GET  /-/metrics                  the unified Prometheus metrics
  POST /-/drain?timeout_s=30       stop taking work, wait for it to finish -> DrainReport JSON, or 409
                                   superseded when a wake came first (the report is attached)
  POST /-/sleep?timeout_s=30&reason=eviction
                                   drain, then release the worker's memory -> 200, or 409 not idle
  POST /-/wake?timeout_s=60        resume the worker's memory and wait for ready -> 200, or 504

Drain, sleep and wake run to their end even when the caller hangs up. The server cancels the handlers
of clients that go away (sidecar.main), which is right for a data request and wrong here: a sleep cut
between the drain and the release would leave the instance draining, with its memory still held.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

from sidecar.drain import DrainController, DrainSuperseded, NotIdleError
from sidecar.lifecycle import TransitionError
from sidecar.metrics import CONTENT_TYPE, Metrics
from sidecar.reporter import Reporter
from sidecar.status import Status
from sidecar.worker import WorkerCallError
from sie.auth import Role, identity
from sie.errors import Forbidden, error_body
from sie.telemetry import InstanceState

log = logging.getLogger(__name__)

WAKE_TIMEOUT_S = 60.0
REASONS = ("eviction", "rollout", "idle", "manual", "shutdown")

T = TypeVar("T")
_operations: set[asyncio.Task] = set()  # strong references: a shielded task outlives its handler


async def _to_completion(operation: Awaitable[T]) -> T:
    """Await `operation` in its own task, which a cancelled handler leaves running to its end."""
    task = asyncio.ensure_future(operation)
    _operations.add(task)
    task.add_done_callback(_operations.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_abandoned)  # no one will read the answer: the log says how it ended
        raise


def _log_abandoned(task: asyncio.Task) -> None:
    if task.cancelled():
        log.warning("an operation whose caller hung up was cancelled: %s", task.get_coro())
    elif task.exception() is not None:
        log.warning("an operation whose caller hung up failed: %s", task.exception())
    else:
        log.info("an operation whose caller hung up finished: %s", task.result())


def _json(status: int, doc: dict) -> web.Response:
    return web.Response(status=status, text=json.dumps(doc), content_type="application/json")


def _error(status: int, kind: str, message: str, **extra: object) -> web.Response:
    return _json(status, error_body(kind, message, **extra))


def _timeout(request: web.Request, default: float) -> float:
    raw = request.query.get("timeout_s")
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise web.HTTPBadRequest(
            text=json.dumps(
                error_body("bad_request", f"timeout_s must be a number of seconds in (0, 3600], got {raw[:32]!r}")
            ),
            content_type="application/json",
        )
    return value


OPEN_PATHS = ("/-/healthz", "/-/ready")


class Admin:
    def __init__(
        self,
        status: Status,
        controller: DrainController,
        reporter: Reporter,
        metrics: Metrics,
        drain_timeout_s: float,
        node: str,
    ):
        self._node = node
        self._status = status
        self._controller = controller
        self._reporter = reporter
        self._metrics = metrics
        self._drain_timeout = drain_timeout_s

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/-/healthz", self.healthz),
            web.get("/-/ready", self.ready),
            web.get("/-/state", self.state),
            web.get("/-/metrics", self.metrics),
            web.post("/-/drain", self.drain),
            web.post("/-/sleep", self.sleep),
            web.post("/-/wake", self.wake),
            web.route("*", "/-/{rest:.*}", self.unknown),
        ]

    async def healthz(self, request: web.Request) -> web.Response:
        return _json(200, {"alive": True, "state": self._status.state.value})

    async def ready(self, request: web.Request) -> web.Response:
        state = self._status.state
        return _json(
            200 if state is InstanceState.READY else 503, {"ready": state is InstanceState.READY, "state": state.value}
        )

    def _allow(self, request: web.Request, *, change: bool) -> None:
        """This node's node host and admins may change the instance; readers may also look."""
        who = identity(request)
        if who.role is Role.NODE and who.node == self._node:
            return
        if who.role is Role.ADMIN or (not change and who.role is Role.READER):
            return
        need = f"the node host of node {self._node!r} or an admin" + ("" if change else " or a reader")
        raise Forbidden(f"{who.subject} may not {request.method} {request.path}: it needs {need}")

    async def state(self, request: web.Request) -> web.Response:
        self._allow(request, change=False)
        return _json(200, self._reporter.current().to_json())

    async def metrics(self, request: web.Request) -> web.Response:
        self._allow(request, change=False)
        return web.Response(body=self._metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def drain(self, request: web.Request) -> web.Response:
        self._allow(request, change=True)
        timeout_s = _timeout(request, self._drain_timeout)
        try:
            report = await _to_completion(self._controller.drain(timeout_s))
        except DrainSuperseded as exc:
            return _error(409, "superseded", str(exc), state=self._status.state.value, drain=exc.report.to_json())
        except TransitionError as exc:
            return _error(409, "conflict", str(exc), state=self._status.state.value)
        return _json(200, {"state": self._status.state.value, **report.to_json()})

    async def sleep(self, request: web.Request) -> web.Response:
        self._allow(request, change=True)
        timeout_s = _timeout(request, self._drain_timeout)
        reason = request.query.get("reason", "manual")
        if reason not in REASONS:
            return _error(400, "bad_request", f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
        try:
            report, state = await _to_completion(self._controller.sleep(timeout_s, reason))
        except NotIdleError as exc:
            return _error(409, "not_idle", str(exc), state=self._status.state.value, drain=exc.report.to_json())
        except TransitionError as exc:
            return _error(409, "conflict", str(exc), state=self._status.state.value)
        except WorkerCallError as exc:
            return _error(
                502,
                "worker_error",
                f"{exc}; the instance stays {self._status.state.value}",
                state=self._status.state.value,
            )
        return _json(
            200,
            {
                "state": state.value,
                "reason": reason,
                "already": report is None,
                "drain": report.to_json() if report else None,
            },
        )

    async def wake(self, request: web.Request) -> web.Response:
        self._allow(request, change=True)
        timeout_s = _timeout(request, WAKE_TIMEOUT_S)
        try:
            ready = await _to_completion(self._controller.wake(timeout_s))
        except TransitionError as exc:
            return _error(409, "conflict", str(exc), state=self._status.state.value)
        except WorkerCallError as exc:
            return _error(
                502,
                "worker_error",
                f"{exc}; the instance stays {self._status.state.value}",
                state=self._status.state.value,
            )
        if not ready:
            return _error(
                504,
                "wake_timeout",
                f"the worker did not report healthy within {timeout_s:g}s",
                state=self._status.state.value,
            )
        return _json(200, {"state": self._status.state.value})

    async def unknown(self, request: web.Request) -> web.Response:
        known = "healthz, ready, state, metrics (GET); drain, sleep, wake (POST)"
        return _error(404, "not_found", f"no sidecar endpoint {request.method} {request.path[:128]}; known: {known}")
