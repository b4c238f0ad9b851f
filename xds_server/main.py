"""The composition root of the control plane: builds the parts, runs them, stops them cleanly.

Startup (restart safety, see registry.py): models from the cluster file are loaded; the admin API
starts taking heartbeats and telemetry at once and the ADS server accepts Envoy's streams at once, but
no snapshot is published until the startup sync window has passed. During the window heartbeat replies
are non-authoritative, /healthz answers 503 and every DiscoveryRequest is held: Envoy keeps serving its
last configuration. Then the registry is marked synced and the first snapshot, built from everything
the nodes and sidecars reported, is published in one piece.

On stdout the process prints one JSON line once it listens (ports resolved, useful with port 0):
    {"event": "listening", "admin_port": 8000, "xds_port": 18000, "listener_port": 8080}
Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from typing import Callable

import grpc
from aiohttp import web
from envoy.service.discovery.v3 import ads_pb2_grpc

from sie.cluster import load_cluster
from sie.errors import SpecError
from xds_server.admin import AdminContext, make_app
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop
from xds_server.decisions import DecisionPolicy, EqualWeights
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics, short_type
from xds_server.registry import Registry
from xds_server.settings import Settings, cluster_file_arg, parse_args
from xds_server.snapshots import SnapshotCache
from xds_server.tasks import Supervisor

log = logging.getLogger("xds_server")


def make_policy(name: str | None) -> tuple[DecisionPolicy, str]:
    """The weight policy: `sie` (xds_server.weights.WeightPolicy), `equal`, or None for sie-if-available."""
    if name == "equal":
        return EqualWeights(), "equal"
    try:
        from xds_server.weights import WeightPolicy  # imported here: another engineer's module, optional
    except ImportError as exc:
        if name == "sie":
            raise SystemExit(f"--policy sie needs xds_server.weights.WeightPolicy, which cannot be imported: {exc}")
        log.info("weight policy: equal (xds_server.weights is not available: %s)", exc)
        return EqualWeights(), "equal"
    return WeightPolicy(), "sie"


class XdsServer:
    """One control plane. `start()` returns once it listens; the sync window then runs in the background."""

    def __init__(self, settings: Settings, *, policy: DecisionPolicy | None = None, policy_name: str = "custom",
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 on_fatal: Callable[[str], None] = lambda why: None):
        self.settings = settings
        if policy is None:
            policy, policy_name = make_policy(settings.policy)
        self.metrics = ControlPlaneMetrics(wall_clock)
        self.cache = SnapshotCache()
        self.control: ControlLoop | None = None
        self.registry = Registry(clock=clock, node_ttl_s=settings.node_ttl_s, retire_s=settings.retire_s,
                                 on_change=lambda models: self.control.notify(models) if self.control else None)
        self.control = ControlLoop(
            self.registry, policy, self.cache, self.metrics,
            IngressConfig(settings.listener_host, settings.listener_port), clock, wall_clock, settings.debounce_s,
            lb_policy=settings.lb_policy,
        )
        self.ads = AdsServer(self.cache, self.metrics, clock, on_streams_changed=self.metrics.connected.set)
        self.policy_name = policy_name
        self._clock = clock
        self._wall = wall_clock
        self._supervisor = Supervisor(on_death=lambda name, exc: on_fatal(f"task {name} died: {exc!r}"))
        self._runner: web.AppRunner | None = None
        self._controller = None  # xds_server.k8s.Controller with --kubernetes
        self._k8s_api = None
        self._grpc: grpc.aio.Server | None = None
        self.admin_port = 0
        self.xds_port = 0
        self.synced = asyncio.Event()

    def load_models(self) -> None:
        if self.settings.cluster_file is None:
            return
        cluster = load_cluster(self.settings.cluster_file)
        for service in cluster.services:
            self.registry.add_model(service, "file")
        log.info("loaded %d models from %s", len(cluster.services), self.settings.cluster_file)

    async def start(self) -> None:
        s = self.settings
        self.load_models()
        app = make_app(AdminContext(self.registry, self.control, self.metrics, self.ads, self._clock, self._wall,
                                    self.policy_name))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, s.host, s.admin_port)
        await site.start()
        self.admin_port = self._runner.addresses[0][1]
        # so_reuseport off: a second control plane on the same port must fail loudly, not share it.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.ads, self._grpc)
        try:
            self.xds_port = self._grpc.add_insecure_port(f"{s.host}:{s.xds_port}")
        except RuntimeError as exc:
            raise OSError(f"cannot listen for xDS on {s.host}:{s.xds_port} ({exc}); is another xds_server running? "
                          "Stop it or pick another --xds-port") from None
        await self._grpc.start()
        if s.kubernetes:
            await self._start_controller()
        self._supervisor.spawn("control-loop", self.control.run())
        self._supervisor.spawn("registry-sweep", self.control.run_sweeps())
        self._supervisor.spawn("startup-sync", self._sync_window(), oneshot=True)
        log.info("listening: admin http://%s:%d, xDS %s:%d; answering Envoy after a %.1f s startup sync",
                 s.host, self.admin_port, s.host, self.xds_port, s.startup_sync_s)

    async def _start_controller(self) -> None:
        # Imported here: the kubernetes client is an optional extra (`sie[k8s]`) and slow to import.
        from xds_server.k8s import Controller, ControllerSettings
        from xds_server.k8s.main import api_client
        from xds_server.k8s_source import RegistrySink

        s = self.settings
        self._k8s_api = api_client(s.k8s_api_url, s.kubeconfig)
        self._controller = Controller(self._k8s_api, RegistrySink(self.registry),
                                      ControllerSettings(namespace=s.k8s_namespace))
        await self._controller.start()
        log.info("ModelService controller started (namespace: %s)", s.k8s_namespace or "all")

    async def _sync_window(self) -> None:
        await asyncio.sleep(self.settings.startup_sync_s)
        if self._controller is not None:
            # The first snapshot must hold the ModelServices that exist, not an empty registry.
            try:
                await asyncio.wait_for(self._controller.wait_synced(), self.settings.k8s_sync_timeout_s)
            except asyncio.TimeoutError:
                log.error("the Kubernetes API did not list ModelServices within %.0f s; answering Envoy with "
                          "what is known and going on", self.settings.k8s_sync_timeout_s)
        self.registry.mark_synced()
        snapshot = self.control.rebuild()
        self.synced.set()
        versions = {short_type(t): v for t, v in snapshot.versions.items()} if snapshot else None
        log.info("startup sync over: answering Envoy with versions %s", versions)

    async def stop(self) -> None:
        if self._controller is not None:
            await self._controller.stop()
            self._k8s_api.close()
        await self._supervisor.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._runner is not None:
            await self._runner.cleanup()


async def _serve(settings: Settings) -> int:
    stop = asyncio.Event()
    fatal: list[str] = []

    def on_fatal(why: str) -> None:
        fatal.append(why)
        stop.set()

    server = XdsServer(settings, on_fatal=on_fatal)
    try:
        await server.start()
    except (OSError, SpecError) as exc:
        log.error("%s", exc)
        await server.stop()
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "listening", "admin_port": server.admin_port, "xds_port": server.xds_port,
                      "listener_port": settings.listener_port}), flush=True)
    await stop.wait()
    log.info("stopping%s", f" ({fatal[0]})" if fatal else "")
    await server.stop()
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> int:
    try:
        cluster_file = cluster_file_arg(argv)
        cluster = load_cluster(cluster_file).settings if cluster_file else None
    except SpecError as exc:
        print(f"xds_server: {exc}", file=sys.stderr)
        return 2
    settings = parse_args(argv, cluster)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in settings.warnings():
        log.warning("%s", warning)
    return asyncio.run(_serve(settings))
