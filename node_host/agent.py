"""The node host's loops: heartbeat to the control plane, supervision ticks, and its small HTTP API.

Every HEARTBEAT_INTERVAL_S the node host posts a sie.wire.NodeHeartbeat (GPUs, facts, every instance
with its full spec) to CONTROL_URL/v1/nodes/heartbeat and applies the reply, but only when it is
`authoritative`: a control plane that is still rebuilding its registry never tears the data plane down.
When the control plane cannot be reached, everything keeps running and the next heartbeat retries.

API (on --host/--port):
    GET /healthz        {"status": "ok", "node", "control_plane_reachable", "instances"}
    GET /v1/instances   {"node", "address", "instances": [...], "refused": [...]}
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine

import aiohttp
from aiohttp import web

from node_host import assignments, reports
from node_host.requirements import unmet_requirements
from node_host.supervisor import Instance, Supervisor
from sie.errors import Problem, SpecError
from sie.spec_loader import parse_model_service
from sie.wire import HEARTBEAT_INTERVAL_S, Assignment, GPUInfo, HeartbeatReply, InstanceReport, NodeHeartbeat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentSettings:
    node: str
    control_url: str
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    tick_interval_s: float = 0.1
    probe_timeout_s: float = 0.3  # the worker /health look; a slow answer counts as "loading"
    post_timeout_s: float = 2.0


@dataclass(frozen=True)
class Refused:
    """An assignment this node cannot run; kept so it is reported and not retried every heartbeat."""

    assignment: Assignment
    reason: str


class NodeAgent:
    def __init__(
        self,
        settings: AgentSettings,
        supervisor: Supervisor,
        session: aiohttp.ClientSession,
        *,
        gpus: Callable[[], Awaitable[list[GPUInfo]]],
        facts: dict[str, str],
    ):
        self.settings = settings
        self.supervisor = supervisor
        self._session = session
        self._gpus = gpus
        self.facts = facts
        self.address = ""  # http://host:port of the API, set once it listens
        self.refused: dict[str, Refused] = {}
        self.reachable: bool | None = None  # None until the first heartbeat
        self._health: dict[str, str | None] = {}
        self._tasks: set[asyncio.Task] = set()
        self._stops: dict[str, asyncio.Task] = {}

    # ---- tasks ------------------------------------------------------------------------------------

    def spawn_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s died: %r", task.get_name(), task.exception(), exc_info=task.exception())

    def loops(self) -> list[asyncio.Task]:
        """Start the heartbeat and supervision loops; they run until cancelled."""
        return [
            self.spawn_task(self._every(self.settings.heartbeat_interval_s, self.heartbeat_once), "heartbeat"),
            self.spawn_task(self._every(self.settings.tick_interval_s, self._tick), "supervise"),
        ]

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[Any]]) -> None:
        """Run fn forever. A failing round is logged and the loop goes on: a bug in one heartbeat must
        not take the node's instances down with the node host."""
        while True:
            try:
                await fn()
            except Exception:
                log.exception("%s failed; retrying in %.1f s", asyncio.current_task().get_name(), interval_s)
            await asyncio.sleep(interval_s)

    async def _tick(self) -> None:
        self.supervisor.tick()

    async def shutdown(self) -> None:
        """Stop the loops, then every instance (sidecars first); leaves no child process."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.supervisor.stop_all()

    # ---- heartbeat --------------------------------------------------------------------------------

    async def heartbeat_once(self) -> HeartbeatReply | None:
        await self._probe_workers()
        beat = NodeHeartbeat(
            node=self.settings.node,
            address=self.address,
            gpus=await self._gpus(),
            instances=self.instance_reports(),
            facts=self.facts,
        )
        url = self.settings.control_url.rstrip("/") + "/v1/nodes/heartbeat"
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.post_timeout_s)
            async with self._session.post(url, json=beat.to_json(), timeout=timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                reply = HeartbeatReply.from_json(await resp.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
            if self.reachable is not False:  # log the change, not every retry
                log.warning("control plane %s unreachable (%s); keeping every instance running, retrying", url, exc)
            self.reachable = False
            return None
        if self.reachable is not True:
            log.info("control plane %s reachable", url)
        self.reachable = True
        if reply.authoritative:
            self.apply(reply.assignments)
        return reply

    def apply(self, assigned: list[Assignment]) -> None:
        current = {**self.supervisor.running_specs(), **{iid: r.assignment.spec for iid, r in self.refused.items()}}
        plan = assignments.plan(assigned, current, self.supervisor.stopping_ids())
        for iid in plan.stop:
            if self.refused.pop(iid, None) is not None:
                continue  # nothing runs for a refused assignment
            self._stops[iid] = self.spawn_task(self._stop(iid), f"stop:{iid}")
        for assignment in plan.start:
            self._start(assignment)

    def _start(self, assignment: Assignment) -> None:
        try:
            service = parse_model_service(assignment.spec, f"assignment {assignment.instance_id}")
            unmet = unmet_requirements(service.spec.backend.requires, self.facts)
            if unmet:
                raise SpecError(
                    f"ModelService {service.model_id!r} on node {self.settings.node!r}",
                    [Problem("spec.backend.requires", reason) for reason in unmet],
                )
            self.supervisor.start(assignment)
        except (SpecError, ValueError, ImportError) as exc:
            log.error("refusing %s (%s): %s", assignment.instance_id, assignment.model_id, exc)
            self.refused[assignment.instance_id] = Refused(assignment, str(exc))

    async def _stop(self, instance_id: str) -> None:
        try:
            await self.supervisor.stop(instance_id)
        finally:
            self._stops.pop(instance_id, None)
            self._health.pop(instance_id, None)

    async def _probe_workers(self) -> None:
        live = [i for i in self.supervisor.instances.values() if not i.stopping and i.worker_child is not None]
        results = await asyncio.gather(*(self._probe(i) for i in live))
        self._health = {i.instance_id: status for i, status in zip(live, results)}

    async def _probe(self, inst: Instance) -> str | None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.probe_timeout_s)
            async with self._session.get(f"http://{inst.worker_address}/health", timeout=timeout) as resp:
                body = await resp.json(content_type=None)
                return str(body.get("status")) if isinstance(body, dict) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    def instance_reports(self) -> list[InstanceReport]:
        out = [reports.report(inst, self._health.get(iid)) for iid, inst in sorted(self.supervisor.instances.items())]
        for iid, refused in sorted(self.refused.items()):
            out.append(reports.refused_report(refused.assignment, refused.reason))
        return out

    # ---- HTTP API ---------------------------------------------------------------------------------

    def build_api(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/v1/instances", self._instances)
        return app

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "node": self.settings.node,
                "control_plane_reachable": self.reachable,
                "instances": len(self.supervisor.instances),
            }
        )

    async def _instances(self, _: web.Request) -> web.Response:
        rows = []
        for report in self.instance_reports():
            inst = self.supervisor.instances.get(report.instance_id)
            row = self.supervisor.describe(inst) if inst is not None else {"instance_id": report.instance_id, "model_id": report.model_id}
            row.update(state=report.state.value, restarts=report.restarts, detail=report.detail)
            rows.append(row)
        return web.json_response({"node": self.settings.node, "address": self.address, "instances": rows})
