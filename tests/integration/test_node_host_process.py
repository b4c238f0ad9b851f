"""node_host as a real process under a fake control plane: it starts a real worker (the demo sklearn
scorer) and a real sidecar per assignment, restarts a killed worker with backoff, obeys only
authoritative replies, survives the control plane going away, and leaves no process behind, whether
it is stopped with SIGTERM or killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from sie.auth import Identity
from sie.spec import spec_digest
from sie_testing.credentials import Credentials
from tests.integration.standalone_helpers import alive

pytestmark = pytest.mark.integration


def scorer_assignment(instance_id: str, models: Path) -> dict[str, Any]:
    spec = {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": "scorer"},
        "spec": {
            "model": {"name": "scorer", "path": str(models / "scorer.skops"), "service_type": "scoring"},
            "backend": {"type": "sklearn", "config": {"demo": True}},
            "input_schema": {"fields": [{"name": "text", "type": "string"}]},
            "output_schema": {"fields": [{"name": "score", "type": "float32", "range": [0.0, 1.0]}]},
        },
    }
    return {"instance_id": instance_id, "model_id": "scorer", "spec": spec}


class FakeControlPlane:
    """Answers heartbeats with whatever `assignments`/`authoritative` say, each assignment with the
    sidecar credential a real control plane signs; records what it hears and with which credential."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self.credentials: list[str | None] = []
        self.assignments: list[dict[str, Any]] = []
        self.authoritative = True
        self.heartbeats: list[dict[str, Any]] = []
        self.telemetry: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/nodes/heartbeat", self._heartbeat)
        app.router.add_post("/v1/telemetry", self._telemetry)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _heartbeat(self, request: web.Request) -> web.Response:
        self.credentials.append(request.headers.get("Authorization"))
        self.heartbeats.append(await request.json())
        assignments = [
            {**a, "token": self.creds.token(Identity.for_sidecar(a["instance_id"], a["model_id"], "n1"))}
            for a in self.assignments
        ]
        return web.json_response({"authoritative": self.authoritative, "assignments": assignments})

    async def _telemetry(self, request: web.Request) -> web.Response:
        self.credentials.append(request.headers.get("Authorization"))
        self.telemetry.append(await request.json())
        return web.json_response({"ok": True})


async def until(check: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = await check()
        except (aiohttp.ClientError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.1)


class NodeHostRig:
    def __init__(self, tmp: Path, cp: FakeControlPlane, http: aiohttp.ClientSession):
        self.tmp, self.cp, self.http = tmp, cp, http
        self.creds = cp.creds
        self.admin = self.creds.headers(Identity.reader())
        self.proc: subprocess.Popen | None = None
        self.api = ""
        self.children: set[int] = set()  # every child pid seen, for the no-orphan checks and cleanup

    def start(self, *extra: str) -> None:
        self.log = open(self.tmp / "node_host.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node_host",
                "--control-url",
                self.cp.url,
                "--node",
                "n1",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--run-dir",
                str(self.tmp / "run"),
                "--heartbeat-interval-s",
                "0.2",
                "--token-file",
                str(self.creds.node_token_file("n1")),
                "--trust-file",
                str(self.creds.trust_file),
                "--model-root",
                str(self.tmp / "models"),
                "--virtual-gpus",
                "1x24GB",  # the scorer runs off the GPU; the GPU is there for the node's metrics
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    async def instances(self) -> list[dict[str, Any]]:
        if not self.api:
            info = self.tmp / "run" / "node_host.json"
            if not info.exists():
                return []
            import json

            self.api = json.loads(info.read_text())["address"]
        async with self.http.get(self.api + "/v1/instances", headers=self.admin) as resp:
            rows = (await resp.json())["instances"]
        for row in rows:
            for role in ("worker", "sidecar"):
                if row.get(role, {}).get("pid"):
                    self.children.add(row[role]["pid"])
        return rows

    async def ready(self, instance_id: str) -> dict[str, Any]:
        """Ready in the node host's view (worker /health) and in the sidecar's (its own probe)."""

        async def check():
            rows = [r for r in await self.instances() if r["instance_id"] == instance_id]
            if not rows or rows[0]["state"] != "ready" or not rows[0]["sidecar"]["running"]:
                return None
            async with self.http.get(f"http://{rows[0]['control_address']}/-/ready") as resp:
                return rows[0] if resp.status == 200 else None

        return await until(check, 60, f"{instance_id} ready")

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.children:  # only if a test failed half-way: never leave a process behind
            if alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.log.close()

    def log_tail(self) -> str:
        return "\n".join((self.tmp / "node_host.log").read_text(errors="replace").splitlines()[-40:])


@pytest.fixture
async def rig(tmp_path):
    cp = FakeControlPlane(Credentials.create(tmp_path, nodes=("n1",)))
    await cp.start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        node = NodeHostRig(tmp_path, cp, http)
        try:
            yield node
        finally:
            node.cleanup()
            await cp.stop()


async def test_runs_restarts_and_stops_what_the_control_plane_assigns(rig, tmp_path):
    rig.cp.assignments = [scorer_assignment("scorer-a", tmp_path / "models")]
    rig.start()
    first = await rig.ready("scorer-a")

    # The data path works through the sidecar the node host started.
    async with rig.http.post(f"http://{first['sidecar_address']}/infer", json={"text": "great service"}) as resp:
        assert resp.status == 200, await resp.text()
        assert 0.0 <= (await resp.json())["score"] <= 1.0
    beat = rig.cp.heartbeats[-1]
    assert beat["node"] == "n1" and beat["address"] == rig.api
    # The node host heartbeats with its own credential, its sidecar reports with the one it was assigned.
    node_token = f"Bearer {rig.creds.node_token_file('n1').read_text().strip()}"
    assert node_token in rig.cp.credentials
    sidecar_tokens = {c for c in rig.cp.credentials if c and c != node_token}
    assert sidecar_tokens and all(
        rig.creds.signer.verifier().verify(t.split()[1]).name == "scorer-a" for t in sidecar_tokens
    )
    (report,) = beat["instances"]
    assert report["sidecar_address"] == first["sidecar_address"]
    # Its spec went with the first beat that reported it (this control plane's assignment named no digest,
    # and no reply asked for it again); every beat names it by digest (sie.wire).
    assert report["spec_digest"] == spec_digest(rig.cp.assignments[0]["spec"])
    reported = [b["instances"][0] for b in rig.cp.heartbeats if b["instances"]]
    assert reported[0]["spec"]["spec"]["model"]["name"] == "scorer" and report["spec"] is None

    # Its Prometheus metrics, for a reader: the virtual GPU's memory, and the scorer counted as ready.
    async with rig.http.get(rig.api + "/metrics") as resp:
        assert resp.status == 401
    async with rig.http.get(rig.api + "/metrics", headers=rig.admin) as resp:
        assert resp.status == 200 and resp.content_type == "text/plain", await resp.text()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(await resp.text())
            for s in family.samples
        }
    assert samples[("sie_gpu_memory_bytes", (("gpu", "0"), ("kind", "total"), ("node", "n1")))] == 24 * 2**30
    assert samples[("sie_node_instances", (("node", "n1"), ("state", "ready")))] == 1.0
    assert Path(first["worker"]["log"]).name == "scorer-a.worker.log"

    # A killed worker comes back on the same address; its sidecar is untouched.
    os.kill(first["worker"]["pid"], signal.SIGKILL)

    async def restarted():
        rows = await rig.instances()
        return rows and rows[0]["worker"]["restarts"] == 1 and rows[0]["worker"]["running"]

    await until(restarted, 20, "the worker restarted")
    second = await rig.ready("scorer-a")
    assert second["worker"]["pid"] != first["worker"]["pid"]
    assert second["worker"]["restarts"] == 1 and second["worker"]["last_exit"] == "killed by SIGKILL"
    assert second["worker_address"] == first["worker_address"]
    assert second["sidecar"]["pid"] == first["sidecar"]["pid"] and second["sidecar"]["restarts"] == 0
    assert "worker killed by SIGKILL" in second["detail"]
    assert not alive(first["worker"]["pid"])

    # A reply that is not authoritative changes nothing, even if it lists no assignment.
    rig.cp.authoritative, rig.cp.assignments = False, []
    seen = len(rig.cp.heartbeats)
    await until(lambda: asyncio.sleep(0, len(rig.cp.heartbeats) >= seen + 3), 10, "three more heartbeats")
    assert [r["instance_id"] for r in await rig.instances()] == ["scorer-a"]

    # An authoritative reply without it stops it: both processes end.
    rig.cp.authoritative = True
    await until(
        lambda: asyncio.sleep(0, not alive(second["worker"]["pid"]) and not alive(second["sidecar"]["pid"])),
        40,
        "scorer-a stopped",
    )
    assert await until(lambda: _empty(rig), 10, "no instances listed")

    # Start another, lose the control plane: it keeps running.
    rig.cp.assignments = [scorer_assignment("scorer-b", tmp_path / "models")]
    third = await rig.ready("scorer-b")
    await rig.cp.stop()

    async def unreachable():
        async with rig.http.get(rig.api + "/healthz") as resp:
            return (await resp.json())["control_plane_reachable"] is False

    await until(unreachable, 10, "the node host to notice the control plane is gone")
    await asyncio.sleep(0.6)  # a few more heartbeats that fail
    assert alive(third["worker"]["pid"]) and alive(third["sidecar"]["pid"])

    # SIGTERM: every instance stops (sidecars first) and the node host exits 0 leaving no process.
    rig.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(rig.proc.wait, 45) == 0, rig.log_tail()
    leftovers = [pid for pid in rig.children if alive(pid)]
    assert leftovers == [], rig.log_tail()
    assert not (tmp_path / "run" / "node_host.json").exists()


async def test_a_node_host_whose_every_heartbeat_would_be_refused_exits_saying_why(rig):
    # 65 labels: the control plane bounds a heartbeat's labels at 64, and would refuse every beat.
    rig.start("--labels", ",".join(f"k{i}=v" for i in range(65)))
    assert rig.proc is not None
    code = await asyncio.to_thread(rig.proc.wait, 30)
    assert code == 2, rig.log_tail()
    assert "would refuse every heartbeat" in rig.log_tail() and "labels" in rig.log_tail()
    assert rig.cp.heartbeats == []  # it never posted one


async def _empty(rig: NodeHostRig) -> bool:
    return await rig.instances() == []


async def test_a_node_host_killed_with_sigkill_takes_its_children_with_it(rig, tmp_path):
    rig.cp.assignments = [scorer_assignment("scorer-k", tmp_path / "models")]
    rig.start()
    inst = await rig.ready("scorer-k")
    pids = [inst["worker"]["pid"], inst["sidecar"]["pid"]]
    rig.proc.kill()
    rig.proc.wait()
    # PR_SET_PDEATHSIG delivers SIGTERM to each child; they exit on their own (the sidecar drains first).
    await until(lambda: asyncio.sleep(0, not any(alive(p) for p in pids)), 40, f"children {pids} to exit")
