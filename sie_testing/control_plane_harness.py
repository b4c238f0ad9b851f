"""Test doubles for the control plane's neighbours: a sidecar stand-in and a node-host stand-in.

    FakeSidecar   an aiohttp upstream (what Envoy dials) that records the requests it gets, answers JSON
                  naming itself, and posts its TelemetryRecord to xds_server every `interval_s` and at
                  once when its state changes. `refuse = True` makes it answer like a sidecar that will
                  not take the request (503 + x-sie-retryable: true) while EDS still lists it.
    FakeNodeHost  posts NodeHeartbeats reporting given instances and keeps the last reply; with
                  `for_sidecars` it registers fake sidecars' addresses, which EDS takes only from a node.

Both carry real credentials: `signer` (the control plane's sie.auth.Signer) issues the sidecar's and the
node's tokens, exactly as the control plane and `sie up` would. Both take the process's one aiohttp
ClientSession, and run their loops as named tasks stopped by stop(). Used by tests/integration/test_xds_*.py;
usable by other components' tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import aiohttp
from aiohttp import web

from sie.auth import Identity, Signer
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import HeartbeatReply, InstanceReport, NodeHeartbeat

log = logging.getLogger(__name__)


class FakeSidecar:
    def __init__(
        self,
        instance_id: str,
        model_id: str,
        control_url: str,
        session: aiohttp.ClientSession,
        *,
        signer: Signer,
        node: str = "test-node",
        interval_s: float = 0.25,
        state: InstanceState = InstanceState.READY,
    ):
        self.token = signer.issue(Identity.for_sidecar(instance_id, model_id, node))
        self.instance_id = instance_id
        self.model_id = model_id
        self.control_url = control_url
        self.node = node
        self.interval_s = interval_s
        self.requests: list[tuple[str, str]] = []  # (method, path) as the upstream saw them
        self.refuse = False
        self.posts_ok = 0
        self._state = state
        self._session = session
        self._seq = 0
        self._changed = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def state(self) -> InstanceState:
        return self._state

    @state.setter
    def state(self, value: InstanceState) -> None:
        self._state = value
        self._changed.set()

    def record(self) -> TelemetryRecord:
        self._seq += 1
        return TelemetryRecord(
            self.instance_id,
            self.model_id,
            "1",
            self.address,
            self.node,
            self._state,
            timestamp=time.time(),
            seq=self._seq,
            max_concurrent=8,
            reporter=f"fake-{id(self)}",
        )

    def report(self, spec: dict) -> InstanceReport:
        """What this instance's node host would register for it (its address is what EDS takes)."""
        return InstanceReport(
            self.instance_id,
            self.model_id,
            "1",
            self._state,
            spec,
            sidecar_address=self.address,
            control_address=self.address,
        )

    async def _handle(self, request: web.Request) -> web.Response:
        await request.read()
        if self.refuse:
            return web.json_response(
                {"error": {"type": "draining", "message": "refusing as asked"}},
                status=503,
                headers={"x-sie-retryable": "true"},
            )
        self.requests.append((request.method, request.path))
        return web.json_response({"instance": self.instance_id, "path": request.path})

    async def start(self) -> FakeSidecar:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._task = asyncio.create_task(self._report(), name=f"fake-sidecar-{self.instance_id}-telemetry")
        return self

    async def post_once(self) -> bool:
        try:
            async with self._session.post(
                self.control_url + "/v1/telemetry",
                json=self.record().to_json(),
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=aiohttp.ClientTimeout(total=2),
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    self.posts_ok += 1
                    return True
                log.warning("telemetry of %s refused: %s", self.instance_id, resp.status)
        except (TimeoutError, aiohttp.ClientError):
            pass  # the control plane is away (a restart test): keep trying, as a real sidecar does
        return False

    async def _report(self) -> None:
        while True:
            await self.post_once()
            try:
                await asyncio.wait_for(self._changed.wait(), self.interval_s)
            except TimeoutError:
                pass
            self._changed.clear()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()


class FakeNodeHost:
    def __init__(
        self,
        node: str,
        control_url: str,
        session: aiohttp.ClientSession,
        instances: list[InstanceReport] | Callable[[], list[InstanceReport]],
        *,
        signer: Signer,
        interval_s: float = 0.25,
    ):
        self.node = node
        self.control_url = control_url
        self._instances = instances
        self.interval_s = interval_s
        self.token = signer.issue(Identity.for_node(node))
        self.replies: list[HeartbeatReply] = []
        self._session = session
        self._task: asyncio.Task | None = None

    @classmethod
    def for_sidecars(
        cls,
        node: str,
        control_url: str,
        session: aiohttp.ClientSession,
        sidecars: Mapping[str, FakeSidecar] | Callable[[], Iterable[FakeSidecar]],
        specs: Mapping[str, dict],
        *,
        signer: Signer,
        interval_s: float = 0.25,
    ) -> FakeNodeHost:
        """A node host registering these sidecars (those on `node`) with their current state; `specs` maps
        model id -> ModelService dict. `sidecars` may be a mapping read at each beat, so added ones count."""

        def reports() -> list[InstanceReport]:
            found = sidecars.values() if isinstance(sidecars, Mapping) else sidecars()
            return [sc.report(specs[sc.model_id]) for sc in found if sc.node == node and sc.port]

        return cls(node, control_url, session, reports, signer=signer, interval_s=interval_s)

    @property
    def instances(self) -> list[InstanceReport]:
        return list(self._instances() if callable(self._instances) else self._instances)

    @instances.setter
    def instances(self, value: list[InstanceReport]) -> None:
        self._instances = value

    async def beat(self) -> HeartbeatReply | None:
        hb = NodeHeartbeat(node=self.node, address="http://127.0.0.1:1", instances=self.instances)
        try:
            async with self._session.post(
                self.control_url + "/v1/nodes/heartbeat",
                json=hb.to_json(),
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=aiohttp.ClientTimeout(total=2),
            ) as resp:
                if resp.status != 200:
                    log.warning("heartbeat of %s refused: %s %s", self.node, resp.status, (await resp.text())[:500])
                    return None
                reply = HeartbeatReply.from_json(await resp.json())
        except (TimeoutError, aiohttp.ClientError):
            return None  # the control plane is away (a restart test): keep trying, as a real node host does
        self.replies.append(reply)
        return reply

    async def _run(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.interval_s)

    def start(self) -> FakeNodeHost:
        self._task = asyncio.create_task(self._run(), name=f"fake-node-host-{self.node}")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
