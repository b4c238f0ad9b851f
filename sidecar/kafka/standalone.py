"""The Kafka connector as a process of its own, beside a worker: the composition root for
`python -m sidecar.kafka`. It builds exactly what the sidecar builds (`connector_for` with an
admission Gate and a metrics registry), so the connector tested here is the one the
sidecar runs.

    python -m sidecar.kafka --spec-file SPEC.json --worker-url http://127.0.0.1:WPORT
        --worker-key-file KEY --trust-file TRUST.pem
        [--instance-id ID] [--control-listen 127.0.0.1:0] [--log-level info]
        [--session-timeout-ms 10000] [--drain-timeout-s 30] [--commit-interval-s 0.1]
        [--max-record-bytes 1048588] ... (one flag per ConnectorSettings tunable; --help lists them)

Control endpoints (on --control-listen; the bound address is printed on stdout as one JSON line,
{"control": "127.0.0.1:PORT"}, once the server listens). Every one needs a token the control plane
signed (checked against --trust-file): admin or reader for the reads, admin for the rest.

    GET  /-/metrics         Prometheus text: the inference_kafka_* series
    GET  /-/kafka           the connector's state, partitions and in-flight count (JSON)
    POST /-/kafka/drain     finish, commit and leave the group (as at eviction); answers when done
    POST /-/kafka/pause     the same, for sleep
    POST /-/kafka/resume    rejoin the group

SIGTERM or SIGINT drains (finish, commit, leave the group) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import uuid

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.admission import Gate, Limits
from sidecar.kafka.adapters import connector_for
from sidecar.kafka.connector import KafkaConnector
from sidecar.kafka.settings import ConnectorSettings
from sidecar.settings import load_spec
from sie import auth, settings_flags
from sie.auth import Role, TokenAuthenticator, Verifier
from sie.errors import SIEError
from sie.http import json_errors

log = logging.getLogger("sie.sidecar.kafka")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sidecar.kafka", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec-file", required=True, help="the ModelService (JSON or YAML) with a kafka_input block")
    parser.add_argument("--worker-url", required=True, help="the local worker, e.g. http://127.0.0.1:9001")
    parser.add_argument("--worker-key-file", required=True, help="file (0600) with the worker's key")
    parser.add_argument("--trust-file", required=True, help="PEM with the control plane's public key (who may call)")
    parser.add_argument("--instance-id", default=None, help="names this instance in headers and logs (default: random)")
    parser.add_argument(
        "--control-listen", default="127.0.0.1:0", help="HOST:PORT for metrics and control (0: free port)"
    )
    settings_flags.add_flags(parser, ConnectorSettings, "", "connector settings")
    parser.add_argument("--log-level", default="info")
    return parser


def control_app(connector: KafkaConnector, registry: CollectorRegistry, verifier: Verifier) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        auth.require(request, Role.ADMIN, Role.READER)
        return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")

    async def status(request: web.Request) -> web.Response:
        auth.require(request, Role.ADMIN, Role.READER)
        return web.json_response(connector.status())

    def command(action: str):
        async def run(request: web.Request) -> web.Response:
            auth.require(request, Role.ADMIN)
            await getattr(connector, action)()
            return web.json_response(connector.status())

        return run

    app = web.Application(middlewares=[json_errors(), auth.middleware(TokenAuthenticator(verifier))])
    app.router.add_get("/-/metrics", metrics)
    app.router.add_get("/-/kafka", status)
    for action in ("drain", "pause", "resume"):
        app.router.add_post(f"/-/kafka/{action}", command(action))
    return app


async def serve(args: argparse.Namespace) -> int:
    # Every input is read and checked before anything starts: a bad one is one line on stderr and exit 2.
    try:
        spec = load_spec(args.spec_file)
        worker_key = auth.read_secret(args.worker_key_file, "worker key")
        verifier = Verifier.from_pem(auth.read_secret(args.trust_file, "trust bundle").encode())
    except (SIEError, ValueError) as exc:  # the spec, a credential file, or a trust bundle that is not PEM
        print(f"cannot start the connector: {exc}", file=sys.stderr)
        return 2
    if spec.spec.kafka_input is None:
        print(
            f"{args.spec_file}: model {spec.model_id!r} has no kafka_input block; nothing to consume", file=sys.stderr
        )
        return 2
    instance_id = args.instance_id or f"{spec.model_id}-{uuid.uuid4().hex[:6]}"
    resources, sla = spec.spec.resources, spec.spec.sla
    loop = asyncio.get_running_loop()
    gate = Gate(
        Limits(
            resources.max_concurrent_requests, 4 * resources.max_concurrent_requests, sla.max_queue_time_ms / 1000.0
        ),
        loop,
    )
    registry = CollectorRegistry()
    try:
        connector = connector_for(
            spec,
            instance_id,
            worker_url=args.worker_url,
            worker_key=worker_key,
            gate=gate,
            registry=registry,
            **settings_flags.given(ConnectorSettings, args, ""),
        )
    except ValueError as exc:  # a worker URL or a connector setting that cannot work
        print(f"cannot start the connector: {exc}", file=sys.stderr)
        gate.close()
        return 2
    assert connector is not None  # kafka_input was checked above
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    host, _, port = args.control_listen.rpartition(":")
    runner = web.AppRunner(control_app(connector, registry, verifier), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, int(port))
        await site.start()
        bound = runner.addresses[0]
        print(json.dumps({"control": f"{bound[0]}:{bound[1]}", "instance_id": instance_id}), flush=True)
        await connector.start()
        log.info(
            "instance %s consuming %s in group %s",
            instance_id,
            spec.spec.kafka_input.topic,
            spec.spec.kafka_input.group_id,
        )
        await stopping.wait()
        log.info("instance %s draining", instance_id)
    finally:
        await connector.close()
        await runner.cleanup()
        gate.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))
