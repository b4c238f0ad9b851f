"""The sidecar's composition root: read settings once, build every part, run, shut down in order.

Two listeners: the data listener (--listen) that Envoy dials serves the model's inference paths and
nothing else; the control listener (--control-listen) serves /-/ (health, readiness, state, metrics,
drain, sleep, wake), every route but health and readiness behind a token the control plane signed
(sidecar/admin.py). Startup prints one JSON line on stdout, {"event": "listening", "address":
"HOST:PORT", "control": "HOST:PORT", ...}, once both sockets are bound (with port 0 this is how the
launcher learns the ports).

Shutdown (SIGTERM or SIGINT): drain within --drain-timeout-s (state draining, reported at once; the
Kafka connector, if the model has `kafka_input`, hands its partitions over first), report `stopped`, stop
the background tasks, close the Kafka producer, the server and the client session, exit 0.

Kafka (issue 6): a model with `kafka_input` gets a connector that consumes exactly while the instance
serves (`follow_lifecycle`), takes its worker slots from the same admission Gate as HTTP requests, and
is drained by the DrainController before any drain or sleep waits for idleness.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time

import aiohttp
import prometheus_client
from aiohttp import web

from sidecar.admin import OPEN_PATHS, Admin
from sidecar.admission import Gate, Limits
from sidecar.drain import DrainController
from sidecar.gpu import GpuReader, open_nvml
from sidecar.kafka import connector_for, follow_lifecycle
from sidecar.metrics import Metrics, metric_labels
from sidecar.proxy import Proxy
from sidecar.reporter import Identity, Live, Reporter
from sidecar.settings import Settings, parse_settings
from sidecar.status import Status
from sidecar.validation import compile_schema
from sidecar.waking import Waker
from sidecar.window import SlidingWindow
from sidecar.worker import WorkerClient, WorkerWatch
from sidecar.worker_http import WorkerHTTP
from sie import auth
from sie.auth import CredentialError, TokenAuthenticator, TokenSource
from sie.auth.store import read_trust_bundle
from sie.engines import dialect_for
from sie.errors import SpecError
from sie.heap import freeze_startup_heap
from sie.http import json_errors
from sie.spec import BackendType
from sie.tasks import Policy, SupervisedTasks

log = logging.getLogger("sidecar")

# Connections for probes, load polls, release/resume and telemetry. The data path has its own
# (worker_http.py), so a full data path never starves the health probe (which would then misreport the
# worker as failed).
CONTROL_CONNECTIONS = 8
CONNECT_TIMEOUT_S = 2.0
SERVER_SHUTDOWN_S = 2.0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); pick a free port or use port 0") from exc
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def run(settings: Settings, gpu_reader: GpuReader | None = None) -> int:
    loop = asyncio.get_running_loop()
    spec = settings.spec.spec
    model = spec.model
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # Credentials first: a sidecar that cannot prove who it is, or check who calls it, must not serve.
    trust = read_trust_bundle(settings.trust_file)  # whose tokens to accept; how to verify an https control plane
    verifier = trust.verifier
    worker_key = auth.read_secret(settings.worker_key_file, "worker key") if settings.worker_key_file else None
    credential = TokenSource(path=settings.token_file) if settings.token_file is not None else None

    sock = _bind(settings.listen_host, settings.listen_port)
    bound_port = sock.getsockname()[1]
    address = settings.address or f"{settings.listen_host}:{bound_port}"
    control_sock = _bind(settings.control_host, settings.control_port)
    control_port = control_sock.getsockname()[1]

    # The client session of the sidecar's own calls: worker probes, telemetry and wake requests. Client
    # requests and Kafka work take their own connections to the worker (worker_http.py, below).
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=CONTROL_CONNECTIONS, limit_per_host=0, keepalive_timeout=30.0, ssl=trust.tls
        ),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
        cookie_jar=aiohttp.DummyCookieJar(),  # a control call keeps no cookies
    )
    status = Status(settings.instance_id)
    gate = Gate(Limits(settings.max_concurrent, settings.max_queue, settings.max_queue_time_s), loop)
    window = SlidingWindow(settings.tunables.window_s, settings.tunables.window_size, settings.tunables.recent_s)
    # How this engine is talked to (sie.engines): its health and load figures, how it sleeps, its paths.
    dialect = dialect_for(spec.backend.type)
    client = WorkerClient(
        session,
        settings.worker_url,
        settings.tunables.probe_timeout_s,
        worker_key,
        dialect=dialect,
        model_id=model.name,
        on_gpu=settings.worker_device == "gpu"
        if settings.worker_device is not None
        else settings.gpu_index is not None,
        metrics_url=settings.worker_metrics_url,
    )
    # The data path's own connections to the worker (sidecar/worker_http.py: less CPU a request than
    # aiohttp's client), carrying the worker's key on every call; every request in flight can go back
    # to the pool.
    worker_http = WorkerHTTP.from_url(
        settings.worker_url, dialect.key_headers(worker_key) or None, max_idle=settings.max_concurrent
    )
    # The proxy is built after the watch, so the watch reads its proof of life through a late-bound name.
    watch = WorkerWatch(
        client,
        status,
        settings.tunables.probe_interval_s,
        loop.time,
        answered_at=lambda: proxy.worker_answered_at,
        busy_grace_s=settings.tunables.probe_timeout_s + settings.tunables.probe_interval_s,
    )

    def kv() -> float | None:
        load = watch.load
        return load.kv_usage if load else None

    def hits() -> float | None:
        load = watch.load
        return load.cache_hit_rate if load else None

    # It holds no more requests than the gate can take once the instance serves (sidecar/waking.py).
    waker = (
        Waker(
            status,
            session,
            settings.wake_url,
            credential,
            spec.autoscale.wake_timeout_s,
            loop.time,
            max_held=settings.max_concurrent + settings.max_queue,
        )
        if settings.wake_url and credential is not None
        else None
    )

    labels = metric_labels(model.name, model.service_type.value, model.priority_level.value, model.version)
    metrics = Metrics(labels, live=lambda: (gate.core.in_flight, gate.core.queued, kv(), hits()))
    proxy = Proxy(
        worker=worker_http,
        instance_id=settings.instance_id,
        model_id=model.name,
        schema=compile_schema(spec.input_schema),
        paths=frozenset(p for p in spec.inference_paths if p in dialect.serves),
        targets={p: dialect.target(p, model.name) for p in spec.inference_paths if p in dialect.serves},
        codec=dialect.codec(settings.spec) if dialect.codec is not None else None,
        error_shape=dialect.error_shape,
        max_body_bytes=spec.limits.max_body_bytes,
        max_new_tokens=spec.max_new_tokens,
        retry_on_worker_loss=spec.routing.retry_on_worker_loss,
        gate=gate,
        status=status,
        metrics=metrics,
        window=window,
        clock=loop.time,
        on_worker_unreachable=watch.poke,
        worker_timeout_s=spec.sla.route_timeout_ms / 1000.0,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        waker=waker,
    )
    identity = Identity(
        instance_id=settings.instance_id,
        model_id=model.name,
        version=model.version,
        address=address,
        node=settings.node,
        priority=model.priority_level.value,
        service_type=model.service_type.value,
        gpu_index=settings.gpu_index,
        max_concurrent=settings.max_concurrent,
        simulated=spec.backend.type is BackendType.SIM,
    )

    def live() -> Live:
        return Live(
            status.state,
            gate.core.in_flight,
            gate.core.queued + (waker.held if waker is not None else 0),
            proxy.answered_total,
            window.summary(loop.time(), proxy.running_since()),
            watch.load,
            watch.gpu,
        )

    reporter = Reporter(
        identity,
        live,
        time.time,
        status.changed,
        settings.tunables.telemetry_interval_s,
        session,
        settings.control_url,
        credential,
    )
    kafka = connector_for(
        settings.spec,
        settings.instance_id,
        worker_url=settings.worker_url,
        worker_key=worker_key,
        gate=gate,
        registry=metrics.registry,
        on_invalid_schema=metrics.invalid_schema,
        drain_timeout_s=settings.tunables.drain_timeout_s,
    )
    controller = DrainController(
        status, gate, client, watch, metrics, loop.time, before_drain=kafka.drain if kafka is not None else None
    )
    admin = Admin(status, controller, reporter, metrics, settings.tunables.drain_timeout_s, settings.node)

    # The data listener: the model's inference paths and nothing else (Proxy.handle refuses the rest).
    app = web.Application(client_max_size=spec.limits.max_body_bytes + 1, middlewares=[json_errors()])
    app.router.add_route("*", "/{path:.*}", proxy.handle)
    control_app = web.Application(
        client_max_size=1 << 16, middlewares=[json_errors(), auth.middleware(TokenAuthenticator(verifier), OPEN_PATHS)]
    )
    control_app.add_routes(admin.routes())
    control_app.router.add_route("*", "/{path:.*}", admin.unknown)
    # handler_cancellation: a client that hangs up (Envoy at its route timeout) cancels its request here
    # and at the worker, so no slot waits for an answer nobody will read. The admin endpoints shield
    # their operations from it (sidecar.admin).
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, shutdown_timeout=SERVER_SHUTDOWN_S, handler_cancellation=True
    )
    control_runner = web.AppRunner(
        control_app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SERVER_SHUTDOWN_S,
        handler_cancellation=True,
    )
    tasks = SupervisedTasks()  # every loop here restarts: one bad reply must not end probing for good
    if gpu_reader is None and settings.gpu_index is not None:
        gpu_reader = await asyncio.to_thread(open_nvml, settings.gpu_index)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await control_runner.setup()
        await web.SockSite(control_runner, control_sock).start()
        tasks.start("health", Policy.RESTART, watch.run_health)
        tasks.start("load", Policy.RESTART, watch.run_load)
        if gpu_reader is not None:
            tasks.start("gpu", Policy.RESTART, lambda: watch.run_gpu(gpu_reader))
        if settings.control_url:
            tasks.start("telemetry", Policy.RESTART, reporter.run)
        if kafka is not None:
            tasks.start("kafka", Policy.RESTART, lambda: follow_lifecycle(kafka, status))
        print(
            json.dumps(
                {
                    "event": "listening",
                    "address": address,
                    "listen": f"{settings.listen_host}:{bound_port}",
                    "control": f"{settings.control_host}:{control_port}",
                    "instance_id": settings.instance_id,
                    "model_id": model.name,
                }
            ),
            flush=True,
        )
        log.info(
            "sidecar %s for %s listening on %s:%d (control %s:%d), worker %s",
            settings.instance_id,
            model.name,
            settings.listen_host,
            bound_port,
            settings.control_host,
            control_port,
            settings.worker_url,
        )
        freeze_startup_heap()  # full collections skip what start-up built (sie/heap.py)

        await stop.wait()
        log.info("stop signal: draining for at most %.1fs", settings.tunables.drain_timeout_s)
        report = await controller.shutdown(settings.tunables.drain_timeout_s)  # drains Kafka first (before_drain)
        log.info("drained before exit: %s", report)
    finally:
        await tasks.stop()
        if kafka is not None:
            try:
                await kafka.close()  # drains if still consuming (an error path), then closes the producer
            except Exception:  # noqa: BLE001 - the rest of the shutdown must still run
                log.exception("closing the Kafka connector failed")
        await reporter.send()  # the final record (`stopped`), once; best effort
        await runner.cleanup()
        await control_runner.cleanup()
        gate.close()
        await worker_http.close()
        await session.close()
        if gpu_reader is not None:
            gpu_reader.close()
        sock.close()
        control_sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_settings(sys.argv[1:] if argv is None else argv)
    except SpecError as exc:
        print(f"sidecar: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.tunables.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The unified schema has no *_created series; they double the scrape for nothing.
    prometheus_client.disable_created_metrics()
    try:
        return asyncio.run(run(settings))
    except CredentialError as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("%s", exc)
        return 1
