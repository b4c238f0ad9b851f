"""bench.kafka's stack: the processes it starts (stopped by pid), the scorer's spec, Envoy's static
bootstrap, and the waits for each part to be ready."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.fraud_scorer import FIELDS, ensure_fraud_scorer
from sie_testing.credentials import Credentials
from sie_testing.sidecar_harness import sidecar_argv

# Worker slots of the instance: the baseline consumer keeps 32 HTTP requests in flight, the connector
# takes at most half the slots for its batched calls (sidecar/kafka/adapters.py).
MAX_CONCURRENT = 32
SLA_MS = 50.0


class Procs:
    """Every process the bench starts, stopped by pid (SIGTERM, then SIGKILL) when the run ends."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.running: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], stdout: Any = None) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(
                argv,
                stdout=stdout or log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        self.running.append((name, proc))
        return proc

    def pid(self, name: str) -> int:
        """The pid of the process started under `name` (the latest, if several were)."""
        for each, proc in reversed(self.running):
            if each == name:
                return proc.pid
        raise KeyError(f"no process named {name!r} was started")

    def stop(self, name: str) -> None:
        """Stop one process by its name (SIGTERM, then SIGKILL); it stays listed, so stop_all skips it."""
        for each, proc in self.running:
            if each == name and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                _wait_or_kill(proc)

    def stop_all(self) -> None:
        for _name, proc in reversed(self.running):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.running):
            _wait_or_kill(proc)


def _wait_or_kill(proc: subprocess.Popen) -> None:
    """Wait for a process asked to stop; SIGKILL it after 15 s."""
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def start_worker(procs: Procs, name: str, spec_file: Path, port: int, key_file: Path, model_root: Path) -> None:
    """The sklearn scorer worker of `spec_file` on 127.0.0.1:`port`, with its API key."""
    procs.start(
        name,
        [
            sys.executable,
            "-m",
            "node_host.backends.sklearn_engine",
            "--spec-file",
            str(spec_file),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key-file",
            str(key_file),
            "--model-root",
            str(model_root),
        ],
    )


async def start_sidecar(
    procs: Procs, name: str, instance_id: str, spec_file: Path, worker_url: str, key_file: Path, creds: Credentials
) -> tuple[int, str]:
    """A sidecar in front of the worker at `worker_url` (with its Kafka connector when the spec has a
    kafka_input): (data port, control address), once it announced them."""
    argv = sidecar_argv(
        spec_file, worker_url, creds=creds, instance_id=instance_id, node="bench", worker_key_file=key_file
    )
    sidecar = procs.start(name, argv, stdout=subprocess.PIPE)
    announced = await read_json_line(sidecar, name)
    return int(announced["listen"].rsplit(":", 1)[1]), announced["control"]


def model_spec(workdir: Path, bootstrap: str, topic: str, output_topic: str, group: str) -> dict[str, Any]:
    """The fraud scorer (bench/fraud_scorer.py) as a ModelService, consuming `topic` into `output_topic`."""
    return {
        "spec": {
            "model": {
                "name": "scorer",
                "service_type": "scoring",
                "priority_level": "P1",
                "path": str(ensure_fraud_scorer(workdir / "fraud.skops")),
            },
            "backend": {"type": "sklearn"},
            "resources": {"max_concurrent_requests": MAX_CONCURRENT},
            "input_schema": {"fields": FIELDS},
            "output_schema": {"fields": [{"name": "score", "type": "float32", "range": [0.0, 1.0]}]},
            "sla": {"p99_latency_ms": SLA_MS, "max_queue_time_ms": 1000},
            "kafka_input": {
                "bootstrap_servers": bootstrap,
                "topic": topic,
                "group_id": group,
                "output_topic": output_topic,
                "dead_letter_topic": "dead",
            },
        }
    }


def envoy_config(listen_port: int, admin_port: int, sidecar_port: int) -> dict[str, Any]:
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "ingress",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {"cluster": "scorer", "timeout": "15s"},
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                                                },
                                            }
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "scorer",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "lb_policy": "LEAST_REQUEST",
                    "load_assignment": {
                        "cluster_name": "scorer",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {"address": "127.0.0.1", "port_value": sidecar_port}
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        },
    }


async def wait_http(session: aiohttp.ClientSession, url: str, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    return
        except (TimeoutError, aiohttp.ClientError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready at {url} after {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


async def wait_port(port: int, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not listening on 127.0.0.1:{port}") from None
            await asyncio.sleep(0.05)


async def read_json_line(proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> dict[str, Any]:
    if proc.stdout is None:
        raise RuntimeError(f"{what} was started without stdout=subprocess.PIPE, so its ready line cannot be read")
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout_s)
    if not line:
        raise RuntimeError(f"{what} exited before it was ready (exit {proc.poll()}); see its log")
    return json.loads(line)
