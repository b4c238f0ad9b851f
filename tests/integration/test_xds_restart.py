"""Restart safety with a real Envoy and xds_server as a real process.

The control plane is killed (SIGKILL) while traffic flows: Envoy keeps serving its last config. A new
xds_server is started with the same cluster file while the old sidecars keep posting telemetry and the
node host keeps heartbeating. It must rebuild its registry (including a model that was added through the
admin API and exists only in the node's reports, or, with --state-dir, in the control plane's own record
of what the admin API did) and answer Envoy only after its sync window; Envoy's configuration never goes
empty or partial, and ends exactly as it was (same versions).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
import time

import aiohttp
import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState
from sie.wire import InstanceReport
from sie_testing.control_plane_harness import FakeNodeHost, FakeSidecar
from sie_testing.credentials import Credentials
from sie_testing.ports import free_port
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyProcess, admin_socket_in

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SYNC_S = 2.0  # the default
CLUSTER_FILE = textwrap.dedent("""
    kind: ModelService
    spec:
      model: {name: scorer, service_type: scoring}
      backend: {type: sklearn}
      sla: {min_replicas: 2, max_replicas: 2}
""")
EXTRA = {"kind": "ModelService", "spec": {"model": {"name": "extra"}, "backend": {"type": "sim"}}}


class ControlPlaneProcess:
    def __init__(self, argv: list[str], log_path):
        self.argv = argv
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0

    async def start(self) -> dict:
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, stdout=asyncio.subprocess.PIPE, stderr=log)
        line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
        assert line, f"xds_server exited before listening; log:\n{self.log_path.read_text()}"
        self.started_at = time.monotonic()  # the sync window starts just before the "listening" line
        return json.loads(line)

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(sig)
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def get_json(session, url, headers=None):
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2), headers=headers) as resp:
        return resp.status, json.loads(await resp.text())


async def eventually(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = await probe()
        except (TimeoutError, aiohttp.ClientError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def healthy_by_model(clusters: dict) -> dict[str, int]:
    out = {}
    for cluster in clusters.get("cluster_statuses", []):
        if cluster["name"].startswith("model."):
            out[cluster["name"]] = sum(
                1 for h in cluster.get("host_statuses", []) if h["health_status"].get("eds_health_status") == "HEALTHY"
            )
    return out


async def config_versions(envoy) -> dict[str, str]:
    dump = await envoy.admin_json("/config_dump")
    out = {}
    for config in dump["configs"]:
        kind = config["@type"].rsplit(".", 1)[-1]
        if kind == "ClustersConfigDump":
            out["clusters"] = config.get("version_info")
        elif kind == "ListenersConfigDump":
            out["listeners"] = config.get("version_info")
        elif kind == "RoutesConfigDump":
            out["routes"] = [r.get("version_info") for r in config.get("dynamic_route_configs", [])]
    return out


@pytest.mark.parametrize("state_dir", [False, True], ids=["from the nodes", "from the state dir"])
async def test_killed_control_plane_keeps_envoy_serving_and_a_restart_never_empties_it(tmp_path, state_dir):
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(CLUSTER_FILE)
    creds = Credentials.create(tmp_path)
    admin_headers = creds.headers()
    admin_port, xds_port = free_port(), free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    argv = [
        sys.executable,
        "-m",
        "xds_server",
        "--cluster-file",
        str(cluster_file),
        "--host",
        "127.0.0.1",
        "--admin-port",
        str(admin_port),
        "--xds-port",
        str(xds_port),
        "--listener-port",
        "0",
        "--startup-sync-s",
        str(SYNC_S),
        "--debounce-ms",
        "20",
        "--policy",
        "equal",
        "--credentials-dir",
        str(creds.path),
    ]
    if state_dir:
        argv += ["--state-dir", str(tmp_path / "state")]
    first = ControlPlaneProcess(argv, tmp_path / "xds-1.log")
    second = ControlPlaneProcess(argv, tmp_path / "xds-2.log")
    session = aiohttp.ClientSession()
    sidecars: list[FakeSidecar] = []
    node = envoy = None
    samples: list[dict[str, int]] = []
    failures: list[str] = []
    try:
        await first.start()
        await eventually(lambda: _status_is(session, admin + "/healthz", 200), 10, "the first control plane ready")
        async with session.post(admin + "/v1/models", json=EXTRA, headers=admin_headers) as resp:
            assert resp.status == 201
        for iid, model in (("scorer-0", "scorer"), ("scorer-1", "scorer"), ("extra-0", "extra")):
            # The real interval, so a control plane that answered before hearing from everyone would be caught.
            sidecars.append(
                await FakeSidecar(
                    iid, model, admin, session, node="node-a", interval_s=0.5, signer=creds.signer
                ).start()
            )
        specs = {
            "scorer": parse_model_service(yaml_doc(CLUSTER_FILE)).to_dict(),
            "extra": parse_model_service(EXTRA).to_dict(),
        }
        node = FakeNodeHost(
            "node-a",
            admin,
            session,
            [
                InstanceReport(
                    s.instance_id,
                    s.model_id,
                    "0.0.0",
                    InstanceState.READY,
                    specs[s.model_id],
                    sidecar_address=s.address,
                )
                for s in sidecars
            ],
            interval_s=0.5,
            signer=creds.signer,
        ).start()
        # A short reconnect back-off: Envoy is back on the new control plane as soon as it listens.
        bootstrap = envoy_bootstrap(
            "restart-envoy",
            "sie-test",
            "127.0.0.1",
            xds_port,
            admin_socket_in(tmp_path),
            token=creds.envoy_token,
            reconnect_base_s=0.05,
            reconnect_max_s=0.2,
        )
        envoy = EnvoyProcess(bootstrap, tmp_path)
        envoy.start()
        await envoy.wait_ready(20)
        listeners = await eventually(lambda: envoy.admin_json("/listeners?format=json"), 10, "listener")
        ingress = (
            f"http://127.0.0.1:{listeners['listener_statuses'][0]['local_address']['socket_address']['port_value']}"
        )
        want = {"model.scorer": 2, "model.extra": 1}

        async def all_in_envoy():
            return healthy_by_model(await envoy.admin_json("/clusters?format=json")) == want

        await eventually(all_in_envoy, 10, "every instance HEALTHY in Envoy")
        before = await config_versions(envoy)

        async def watch() -> None:
            # Envoy's view and the data path, sampled through the whole kill and restart.
            while True:
                samples.append(healthy_by_model(await envoy.admin_json("/clusters?format=json")))
                for model, path in (("scorer", "/infer"), ("extra", "/generate")):
                    async with session.post(ingress + path, json={"model": model}) as resp:
                        if resp.status != 200:
                            failures.append(f"{model}: {resp.status} {await resp.text()}")
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch(), name="test-envoy-watcher")
        try:
            await first.stop(signal.SIGKILL)
            await asyncio.sleep(1.0)  # no control plane at all: Envoy serves its last config
            served_while_down = len(samples)
            await second.start()
            # Inside the sync window: not ready, replies non-authoritative, nothing pushed to Envoy.
            assert await _status_is(session, admin + "/healthz", 503)
            replies_before = len(node.replies)
            while time.monotonic() - second.started_at < SYNC_S * 0.8:
                assert await _pushes(session, admin, admin_headers) == 0, (
                    "the new control plane answered Envoy during its sync"
                )
                await asyncio.sleep(0.1)
            assert [r.authoritative for r in node.replies[replies_before:]] and not any(
                r.authoritative for r in node.replies[replies_before:]
            )
            await eventually(lambda: _status_is(session, admin + "/healthz", 200), 10, "the new control plane ready")
            await eventually(
                lambda: _pushes(session, admin, admin_headers), 10, "the new control plane pushing to Envoy"
            )
            await eventually(lambda: _authoritative(node), 5, "an authoritative heartbeat reply")
            await asyncio.sleep(0.5)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

        assert served_while_down > 5
        assert samples and all(s == want for s in samples), [s for s in samples if s != want][:3]
        assert failures == []
        assert await config_versions(envoy) == before  # Envoy's config did not change at all
        reply = node.replies[-1]
        assert sorted(a.instance_id for a in reply.assignments) == ["extra-0", "scorer-0", "scorer-1"]
        _, models = await get_json(session, admin + "/v1/models", admin_headers)
        sources = {m["metadata"]["name"]: m["status"]["source"] for m in models["models"]}
        assert sources == {"scorer": "file", "extra": "api" if state_dir else "node"}
    finally:
        if node is not None:
            await node.stop()
        for sidecar in sidecars:
            await sidecar.stop()
        if envoy is not None:
            await envoy.stop_async()
        await first.stop(signal.SIGKILL)
        await second.stop()
        await session.close()


def yaml_doc(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


async def _status_is(session, url, code) -> bool:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
        return resp.status == code


async def _pushes(session, admin, headers) -> float:
    async with session.get(admin + "/metrics", timeout=aiohttp.ClientTimeout(total=2), headers=headers) as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sie_xds_pushes_total"))


async def _authoritative(node) -> bool:
    return bool(node.replies) and node.replies[-1].authoritative
