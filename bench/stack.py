"""One `sie up` stack for a benchmark: a cluster file from documents, free ports on 127.0.0.1, and the
URLs and admin token once it says it is up. Stopped with bench.eviction.stop_stack (its process group)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.eviction import stop_stack
from sie.standalone import envoy_admin_socket
from sie_testing.ports import free_port

__all__ = ["Urls", "free_port", "start_cluster"]


@dataclass(frozen=True)
class Urls:
    envoy: str
    envoy_admin: Path  # Envoy's admin interface: a Unix socket in the run directory (no TCP port)
    admin: str
    node: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def start_cluster(
    workdir: Path,
    docs: list[dict[str, Any]],
    timeout_s: float = 150.0,
    name: str = "cluster",
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen, Urls]:
    """`sie up -f <docs> [extra]` on free ports; returns once it serves (raises with its log's tail if not).
    With `--control-plane` in `extra` no node host runs here and `Urls.node` is ""."""
    cluster = workdir / f"{name}.yaml"
    cluster.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    ports = {name: free_port() for name in ("envoy", "envoy_admin", "admin", "xds")}
    log_path = workdir / "sie-up.log"
    argv = [sys.executable, "-m", "sie", "up", "-f", str(cluster), "--run-dir", str(workdir / "run")]
    for port_name, port in ports.items():
        argv += [f"--{port_name.replace('_', '-')}-port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--timeout", str(timeout_s), *extra],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop_stack can kill it whole
        )
    deadline = time.time() + timeout_s + 30
    while "SIE is up" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.time() > deadline:
            stop_stack(proc)
            raise RuntimeError(f"sie up did not come up:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    token = (workdir / "run" / "credentials" / "admin.token").read_text().strip()
    node_file = workdir / "run" / "node_host.json"
    node = json.loads(node_file.read_text())["address"] if node_file.exists() else ""
    return proc, Urls(
        f"http://127.0.0.1:{ports['envoy']}",
        envoy_admin_socket(workdir / "run"),
        f"http://127.0.0.1:{ports['admin']}",
        node,
        token,
    )
