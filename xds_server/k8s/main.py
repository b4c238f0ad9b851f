"""`python -m xds_server.k8s`: the ModelService controller on its own, printing what it would hand the
control plane (one JSON line per change). xds_server embeds the same Controller with its own sink; this
entry point is for trying the controller against a cluster and for debugging.

    python -m xds_server.k8s                      # in a pod: the service account
    python -m xds_server.k8s --kubeconfig ~/.kube/config --namespace models
    python -m xds_server.k8s --api-url http://127.0.0.1:8001   # kubectl proxy, or the fake API server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config

from sie.spec import ModelService
from xds_server.k8s.controller import Controller, ControllerSettings
from xds_server.k8s.deployments import DeploymentSettings
from xds_server.k8s.pods import Endpoint

log = logging.getLogger("sie.k8s")


def api_client(api_url: str | None = None, kubeconfig: str | None = None) -> client.ApiClient:
    """An ApiClient for a plain URL (no auth: kubectl proxy, tests), a kubeconfig, or in-cluster config."""
    if api_url:
        configuration = client.Configuration()
        configuration.host = api_url.rstrip("/")
        return client.ApiClient(configuration)
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


class PrintingSink:
    async def models_changed(
        self, models: Mapping[str, ModelService], records: Mapping[str, dict[str, Any]] | None = None
    ) -> None:
        _emit({"models": sorted(models)})

    async def endpoints_changed(self, model_id: str, endpoints: tuple[Endpoint, ...]) -> None:
        _emit(
            {
                "model_id": model_id,
                "endpoints": [{"instance_id": e.instance_id, "address": e.address, "node": e.node} for e in endpoints],
            }
        )


def _emit(line: dict) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xds_server.k8s", description="SIE ModelService controller")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--api-url", help="API server URL without authentication (kubectl proxy, tests)")
    where.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    p.add_argument("--namespace", default=None, help="watch one namespace (default: all)")
    p.add_argument("--worker-port", type=int, default=3000)
    p.add_argument("--sidecar-port", type=int, default=8081)
    p.add_argument(
        "--p0-only-tiers",
        default="",
        help="TIER,... tiers only P0 models may use (DeploymentSettings.p0_only_tiers; default none)",
    )
    p.add_argument(
        "--worker-run-as-user",
        type=int,
        default=None,
        help="the uid model workers run as, with runAsNonRoot (default: the image's user)",
    )
    p.add_argument("--resync-s", type=float, default=300.0)
    p.add_argument("--watch-timeout-s", type=int, default=300)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p.parse_args(argv)


def controller_settings(args: argparse.Namespace) -> ControllerSettings:
    return ControllerSettings(
        namespace=args.namespace,
        resync_s=args.resync_s,
        watch_timeout_s=args.watch_timeout_s,
        deployment=DeploymentSettings(
            worker_port=args.worker_port,
            sidecar_port=args.sidecar_port,
            p0_only_tiers=frozenset(t.strip() for t in args.p0_only_tiers.split(",") if t.strip()),
            worker_run_as_user=args.worker_run_as_user,
        ),
    )


async def run(args: argparse.Namespace, stop: asyncio.Event) -> None:
    settings = controller_settings(args)
    with api_client(args.api_url, args.kubeconfig) as api:
        controller = Controller(api, PrintingSink(), settings)
        await controller.start()
        log.info("controller started (namespace: %s)", args.namespace or "all")
        try:
            await stop.wait()
        finally:
            await controller.stop()
            log.info("controller stopped")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )

    async def guarded() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await run(args, stop)

    asyncio.run(guarded())
    return 0
