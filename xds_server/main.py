"""The composition root of the control plane: builds the parts, runs them, stops them cleanly.

Startup (restart safety, see registry.py): models from the cluster file are loaded; the admin API
starts taking heartbeats and telemetry at once and the ADS server accepts Envoy's streams at once, but
no snapshot is published until the startup sync window has passed. During the window heartbeat replies
are non-authoritative, /healthz answers 503 and every DiscoveryRequest is held: Envoy keeps serving its
last configuration. Then the registry is marked synced and the first snapshot, built from everything
the nodes and sidecars reported, is published in one piece. Each autoscaled model starts the sync at
the count recorded before the restart (state.py) and ends it at no less than the instances the node
hosts report serving, so a restart shrinks no fleet.

Identity (DESIGN §10): the credentials directory holds the signing key and trust bundle. Every admin API
caller and every ADS stream is authenticated against them (and, on Kubernetes, service-account tokens
through TokenReview); sidecar credentials are signed with the key and handed out in heartbeat replies.

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from envoy.service.discovery.v3 import ads_pb2_grpc

from sie.auth import Authenticator, ChainAuthenticator, CredentialDir, CredentialError, Signer, TokenAuthenticator
from sie.auth.tls import server_context
from sie.cluster import ClusterSettings, file_policy, load_cluster
from sie.errors import Problem, SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie.tasks import Policy, SupervisedTasks
from xds_server import admin_listener
from xds_server.admin import AdminContext, admission_problems, make_app
from xds_server.ads import AdsServer
from xds_server.autoscale import driver as autoscale_driver
from xds_server.autoscale.driver import Autoscaler
from xds_server.autoscale.policy import ScaleState
from xds_server.control import ControlLoop, PendingChanges
from xds_server.credentials import TokenIssuer, stream_identity
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics, short_type
from xds_server.policy import DecisionPolicy, EqualWeights, WeightPolicy, WeightSettings
from xds_server.registry import Registry
from xds_server.rollout.driver import RolloutDriver
from xds_server.settings import Settings, cluster_file_arg, parse_args
from xds_server.snapshots import SnapshotCache
from xds_server.state import ModelState, SavedModel

if TYPE_CHECKING:  # kubernetes is imported only with --kubernetes
    from xds_server.k8s.controller import Controller

log = logging.getLogger("xds_server")

# Seconds the startup sync waits at most, after its window, for the specs it asked node hosts for
# (Registry.specs_awaited): one node's most, 512 instances of distinct 256 KiB specs at 4 MiB a beat,
# takes 32 beats, 16 s at the default interval.
SPEC_WAIT_LIMIT_S = 60.0


def make_policy(name: str | None, weights: WeightSettings = WeightSettings()) -> tuple[DecisionPolicy, str]:
    """The weight policy: `sie` (xds_server.policy.WeightPolicy with `weights`, the default) or `equal`."""
    if name == "equal":
        return EqualWeights(), "equal"
    return WeightPolicy(weights), "sie"


class XdsServer:
    """One control plane. `start()` returns once it listens; the sync window then runs in the background.

    `signer` is the identity key (it signs sidecar credentials); `authenticator` checks every caller
    (default: tokens that key signed)."""

    def __init__(
        self,
        settings: Settings,
        *,
        signer: Signer,
        authenticator: Authenticator | None = None,
        policy: DecisionPolicy | None = None,
        policy_name: str = "custom",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_fatal: Callable[[str], None] = lambda why: None,
    ):
        self.settings = settings
        if policy is None:
            policy, policy_name = make_policy(settings.loop.policy, settings.weights)
        self.signer = signer
        self.authenticator = authenticator or TokenAuthenticator(signer.verifier())
        self.metrics = ControlPlaneMetrics(wall_clock)
        self.cache = SnapshotCache()
        # What changed is built first: the registry reports into it, the control loop takes from it.
        changes = PendingChanges(clock)
        self.registry = Registry(
            clock=clock,
            heartbeat_timeout_s=settings.loop.heartbeat_timeout_s,
            rebalance=settings.loop.rebalance,
            retire_s=settings.loop.retire_s,
            changes=changes,
            tokens=TokenIssuer(signer),
            wall_clock=wall_clock,
            admission=self._admission,  # models recovered from the nodes' reports pass the API's checks
        )
        self.control = ControlLoop(
            self.registry,
            policy,
            self.cache,
            self.metrics,
            IngressConfig(settings.listener_address, settings.listener_port, settings.ingress, settings.picker_address),
            clock,
            wall_clock,
            settings.loop.debounce_s,
            lb_policy=settings.loop.lb_policy,
            prefix_affinity=settings.loop.prefix_affinity,
            picker=settings.picker_address,
            changes=changes,
            retire_s=settings.loop.retire_s,
        )
        self.ads = AdsServer(
            self.cache,
            self.metrics,
            clock,
            on_streams_changed=self.metrics.connected.set,
            authenticate=lambda md, ctx: stream_identity(self.authenticator, md, ctx),
        )
        self.rollouts = RolloutDriver(self.registry, on_change=self.save_models, on_transition=self.metrics.rollout)
        self.autoscaler = Autoscaler(self.registry, on_decision=self._scaled)
        self.cluster = ClusterSettings()
        self.files: ModelFilePolicy = ModelFilePolicy()
        self.file_models: dict[str, ModelService] = {}
        self.state = ModelState(settings.state_dir) if settings.state_dir is not None else None
        self._scales_saved: dict[str, int] = {}  # the counts the state file was last written with
        self.policy_name = policy_name
        self._clock = clock
        self._wall = wall_clock
        self._tasks = SupervisedTasks(on_fatal=lambda name, exc: on_fatal(f"task {name} died: {exc!r}"))
        self._runner: web.AppRunner | None = None
        self._admin_server: asyncio.Server | None = None
        self._refusal_logged_at = float("-inf")
        self._controller: Controller | None = None  # with --kubernetes
        self._k8s_api: Any = None  # the kubernetes ApiClient, with --kubernetes
        self._reviews: Any = None  # its TokenReviewAuthenticator, whose review threads stop with the server
        self._grpc: grpc.aio.Server | None = None
        self.admin_port = 0
        self.xds_port = 0
        self.synced = asyncio.Event()

    def _admission(self, service: ModelService, others: list[ModelService]) -> list[Problem]:
        """Why the admin API would refuse `service` beside `others` (the cluster's model-file policy,
        Envoy resources that build); [] if it would take it."""
        return admission_problems(service, others, self.files)

    def load_models(self) -> None:
        if self.settings.cluster_file is not None:
            cluster = load_cluster(self.settings.cluster_file)
            for warning in cluster.warnings:
                log.warning("%s", warning)
            self.cluster = cluster.settings
            self.files = file_policy(cluster.settings)
            self.file_models = {s.model_id: s for s in cluster.services}
            log.info("loaded %d models from %s", len(cluster.services), self.settings.cluster_file)
        api_models: dict[str, SavedModel] = {}
        deleted: set[str] = set()
        scales: dict[str, int] = {}
        if self.state is not None:
            scales = self.state.load().scales
            api_models, deleted = self.state.apply(self.file_models)
        for mid, service in self.file_models.items():
            if mid not in deleted and mid not in api_models:
                self.registry.add_model(service, "file")
        for saved in api_models.values():
            self.registry.restore_model(
                saved.service,
                "api",
                generation=saved.generation,
                rollout=saved.rollout,
                target=saved.target,
                previous=saved.previous,
            )
        # The autoscaler's counts: the startup sync raises each to what the node hosts report serving
        # (Registry.mark_synced), and the autoscaler's first look starts from it.
        for mid, scale in scales.items():
            self.registry.restore_scale(mid, scale)
        self._scales_saved = dict(scales)
        if api_models or deleted:
            log.info(
                "restored from %s: %d models made through the admin API, %d file models deleted through it",
                self.state.path if self.state else "-",
                len(api_models),
                len(deleted),
            )

    def save_models(self) -> None:
        """Record what the admin API made of the model set (state.py); a no-op without --state-dir."""
        if self.state is None:
            return
        api = {
            mid: SavedModel(e.service, e.generation, e.rollout, e.target, e.previous)
            for mid, e in self.registry.models.items()
            if e.source == "api"
        }
        gone = {mid: svc for mid, svc in self.file_models.items() if mid not in self.registry.models}
        # Models recovered from the nodes' reports are not in the file; their count comes back the same way.
        self._scales_saved = {
            mid: e.scale
            for mid, e in self.registry.models.items()
            if e.scale is not None and e.source in ("file", "api") and e.service.spec.autoscaled
        }
        try:
            self.state.save(api, gone, self.file_models, self._scales_saved)
        except OSError as exc:
            log.error(
                "cannot record the model change in %s: %s (it lasts until the next restart)", self.state.path, exc
            )

    def _scaled(self, model_id: str, state: ScaleState) -> None:
        """An autoscaler decision: into the metrics, and into the state file when the count changed."""
        self.metrics.scaled(model_id, state)
        entry = self.registry.models.get(model_id)
        if self.state is not None and entry is not None and entry.source in ("file", "api"):
            if entry.scale is not None and self._scales_saved.get(model_id) != entry.scale:
                self.save_models()

    async def start(self) -> None:
        s = self.settings
        self.load_models()
        if s.kubernetes.enabled:
            self._open_k8s()
        app = make_app(
            AdminContext(
                self.registry,
                self.control,
                self.metrics,
                self.ads,
                self._clock,
                self._wall,
                self.authenticator,
                self.policy_name,
                package_roots=self.files.roots,
                file_policy=self.files,
                on_models_changed=self.save_models,
                rollouts=self.rollouts,
            )
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        tls = None
        if s.admin_tls_dir is not None:
            try:
                tls = server_context(s.admin_tls_dir)
            except OSError as exc:  # ssl.SSLError is one: a key that does not match, a file that is not PEM
                raise CredentialError(f"--admin-tls-dir {s.admin_tls_dir}: cannot serve TLS from it: {exc}") from None
            admin_listener.bound_tls_buffers()
        # Connections bounded in number, TLS handshakes in time and memory (xds_server/admin_listener.py).
        sock = admin_listener.listener(s.host, s.admin_port, s.admin_max_connections, self._admin_refused)
        self.metrics.admin_connections.set_function(lambda: sock.open)
        assert self._runner.server is not None  # set up above
        self._admin_server = await admin_listener.serve(self._runner.server, sock, tls, s.admin_handshake_timeout_s)
        self.admin_port = sock.getsockname()[1]
        # so_reuseport off: a second control plane on the same port must fail loudly, not share it.
        # Messages are bounded: a DiscoveryRequest is small, and no client may make the server buffer more.
        self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 4 << 20)])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.ads, self._grpc)
        try:
            if s.xds_tls_dir is not None:
                self.xds_port = self._grpc.add_secure_port(f"{s.host}:{s.xds_port}", _tls_credentials(s.xds_tls_dir))
            else:
                self.xds_port = self._grpc.add_insecure_port(f"{s.host}:{s.xds_port}")
        except RuntimeError as exc:
            raise OSError(
                f"cannot listen for xDS on {s.host}:{s.xds_port} ({exc}); is another xds_server running? "
                "Stop it or pick another --xds-port"
            ) from None
        await self._grpc.start()
        if s.kubernetes.enabled:
            await self._start_controller()
        # A control plane with a dead loop must not look healthy: each of these stops the process.
        self._tasks.start("control-loop", Policy.FATAL, self.control.run)
        self._tasks.start("registry-sweep", Policy.FATAL, self.control.run_sweeps)
        # A rollout step that raised is logged and tried again; the models keep serving meanwhile.
        self._tasks.start("rollouts", Policy.RESTART, self._run_rollouts)
        self._tasks.start("autoscaler", Policy.RESTART, self._run_autoscaler)
        self._tasks.start("startup-sync", Policy.FATAL, self._sync_window, forever=False)
        log.info(
            "listening: admin http://%s:%d, xDS %s:%d; answering Envoy after a %.1f s startup sync",
            s.host,
            self.admin_port,
            s.host,
            self.xds_port,
            s.loop.startup_sync_s,
        )

    def _open_k8s(self) -> None:
        # Imported here: the kubernetes client is an optional extra (`sie[k8s]`) and slow to import.
        from xds_server.k8s import Controller, ControllerSettings
        from xds_server.k8s.deployments import DeploymentSettings
        from xds_server.k8s.main import api_client
        from xds_server.k8s.tokenreview import TokenReviewAuthenticator
        from xds_server.k8s_source import RegistrySink

        s = self.settings
        self._k8s_api = api = api_client(s.kubernetes.api_url, s.kubernetes.kubeconfig)
        sink = RegistrySink(self.registry)
        pods = DeploymentSettings(
            system_namespace=s.kubernetes.system_namespace,
            p0_only_tiers=s.kubernetes.p0_only,
            worker_run_as_user=s.kubernetes.worker_run_as_user,
        )
        self._controller = controller = Controller(
            api, sink, ControllerSettings(namespace=s.kubernetes.namespace, deployment=pods), fleet=sink
        )
        self.registry.on_builds_changed = controller.model_changed
        # Kubernetes workloads prove who they are with projected service-account tokens (TokenReview);
        # the controller knows which pods are instances of which model.
        self._reviews = reviews = TokenReviewAuthenticator(
            api, controller.pod_instance, system_namespace=s.kubernetes.system_namespace
        )
        self.authenticator = ChainAuthenticator(self.authenticator, reviews)

    async def _run_autoscaler(self, interval_s: float = autoscale_driver.TICK_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.autoscaler.tick()

    async def _run_rollouts(self, interval_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.rollouts.tick()

    async def _start_controller(self) -> None:
        assert self._controller is not None
        await self._controller.start()
        log.info("ModelService controller started (namespace: %s)", self.settings.kubernetes.namespace or "all")

    async def _sync_window(self) -> None:
        loop = self.settings.loop
        await asyncio.sleep(loop.startup_sync_s)
        deadline = time.monotonic() + loop.startup_nodes_timeout_s
        while len(self.registry.nodes) < loop.startup_nodes and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if len(self.registry.nodes) < loop.startup_nodes:
            log.warning(
                "%d of the %d node hosts expected reported within %.0f s (%s); placing on those",
                len(self.registry.nodes),
                loop.startup_nodes,
                loop.startup_nodes_timeout_s,
                ", ".join(sorted(self.registry.nodes)) or "none",
            )
        if self._controller is not None:
            # The first snapshot must hold the ModelServices that exist, not an empty registry.
            try:
                await asyncio.wait_for(self._controller.wait_synced(), self.settings.kubernetes.sync_timeout_s)
            except TimeoutError:
                log.error(
                    "the Kubernetes API did not list ModelServices within %.0f s; answering Envoy with "
                    "what is known and going on",
                    self.settings.kubernetes.sync_timeout_s,
                )
        await self._wait_for_specs()
        self.registry.mark_synced()  # no await since the last look at the specs: none can slip in between
        snapshot = self.control.rebuild()
        self.synced.set()
        versions = {short_type(t): v for t, v in snapshot.versions.items()} if snapshot else None
        log.info("startup sync over: answering Envoy with versions %s", versions)

    async def _wait_for_specs(self) -> None:
        """Reports that came with a spec digest only (their node sent the specs to the control plane
        before this restart) were answered with send_specs, and a model is recovered from the specs the
        node's next beats bring: wait while a node still sends them (Registry.specs_awaited), and for
        SPEC_WAIT_LIMIT_S at most."""
        give_up = time.monotonic() + SPEC_WAIT_LIMIT_S
        while self.registry.specs_awaited() and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        missing = self.registry.specs_missing()
        if missing:
            log.warning("%d reported instances sent no spec; a model only they run is not recovered", missing)

    def _admin_refused(self) -> None:
        """A connection to the admin API closed as it was accepted: admin_max_connections were open."""
        self.metrics.admin_refused.inc()
        now = self._clock()
        if now - self._refusal_logged_at >= 60.0:  # a flood is logged once a minute, not once a connection
            self._refusal_logged_at = now
            log.warning(
                "the admin API holds its %d connections (--admin-max-connections): new ones are closed as they "
                "are accepted (sie_admin_connections_refused_total counts them); a flood, or a fleet that "
                "needs a higher limit",
                self.settings.admin_max_connections,
            )

    async def stop(self) -> None:
        if self._controller is not None:
            await self._controller.stop()
            self._k8s_api.close()
        await self._tasks.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        if self._admin_server is not None:
            self._admin_server.close()  # no new connection; the runner's cleanup closes the open ones
        if self._runner is not None:
            await self._runner.cleanup()
        if self._reviews is not None:
            self._reviews.close()  # after the server: no request waits on a review now


def _tls_credentials(directory: Path) -> grpc.ServerCredentials:
    """TLS for ADS from DIR/tls.key, DIR/tls.crt, and DIR/ca.crt, which Envoy's client certificate must
    chain to (mutual TLS: the certificate is Envoy's credential)."""
    key, cert, ca = ((directory / name).read_bytes() for name in ("tls.key", "tls.crt", "ca.crt"))
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


async def _serve(settings: Settings) -> int:
    stop = asyncio.Event()
    fatal: list[str] = []

    def on_fatal(why: str) -> None:
        fatal.append(why)
        stop.set()

    assert settings.credentials_dir is not None  # checked by main
    signer = CredentialDir(settings.credentials_dir).signer()
    server = XdsServer(settings, signer=signer, on_fatal=on_fatal)
    try:
        await server.start()
    except (OSError, SpecError, CredentialError) as exc:
        log.error("%s", exc)
        await server.stop()
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        json.dumps(
            {
                "event": "listening",
                "admin_port": server.admin_port,
                "xds_port": server.xds_port,
                "listener_port": settings.listener_port,
            }
        ),
        flush=True,
    )
    await stop.wait()
    log.info("stopping%s", f" ({fatal[0]})" if fatal else "")
    await server.stop()
    return 1 if fatal else 0


def main(argv: list[str] | None = None) -> int:
    try:
        cluster_file = cluster_file_arg(argv)
        cluster = load_cluster(cluster_file).settings if cluster_file else None
        settings = parse_args(argv, cluster)  # SpecError: a bad key in the Cluster's settings.weights
    except SpecError as exc:
        print(f"xds_server: {exc}", file=sys.stderr)
        return 2
    if settings.credentials_dir is None:
        print(
            "xds_server: --credentials-dir is required: the control plane checks every caller against its "
            "keys (`sie up` creates them in <run-dir>/credentials)",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for warning in settings.warnings():
        log.warning("%s", warning)
    try:
        return asyncio.run(_serve(settings))
    except CredentialError as exc:
        log.error("%s", exc)
        return 2
