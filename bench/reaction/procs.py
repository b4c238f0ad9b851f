"""The processes of one bench.reaction setup: how each is started, read and stopped (always by its pid).

    Plane     bench.reaction.plane: a real xds_server with a timeline of the watched instances
    Fleet     bench.reaction.fleet: fake sidecars and node hosts that post like real ones
    SimPair   one real instance: a `sim` worker (node_host.backends.sim.worker) and a real sidecar
    envoy     xds_server.envoy_process.EnvoyProcess, bootstrapped to the plane

Also the cluster file they share, and a CPU meter over /proc for the report.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.proc_cpu import CLK_TCK
from sie.processes import proc_stat, terminate
from sie_testing.credentials import Credentials
from sie_testing.sidecar_harness import sidecar_argv

SIM_MODEL = "sim"  # the model whose instances are real (sim worker + sidecar)
PROBE_MODEL = "probe"  # fake sidecars in the bench's own process, for the control-plane-only drain
FLEET_PREFIX = "fleet-"


@dataclass(frozen=True)
class Scale:
    """Registered endpoints: `real` + `probes` + `fleet_models` x `fleet_per_model`."""

    real: int
    probes: int
    fleet_models: int
    fleet_per_model: int

    @property
    def endpoints(self) -> int:
        return self.real + self.probes + self.fleet_models * self.fleet_per_model


def _model(name: str, replicas: int, priority: str) -> dict:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "version": "1.0.0", "service_type": "llm", "priority_level": priority},
            "backend": {"type": "sim"},
            "resources": {"max_concurrent_requests": 32},
            "sla": {
                "p99_latency_ms": 1000,
                "max_queue_time_ms": 1000,
                "min_replicas": replicas,
                "max_replicas": replicas,
            },
        },
    }


def write_cluster(path: Path, scale: Scale) -> dict:
    """The cluster file; returns the sim model's ModelService document (the real sidecars' spec)."""
    sim = _model(SIM_MODEL, scale.real, "P0")
    docs = [sim, _model(PROBE_MODEL, scale.probes, "P1")]
    docs += [_model(f"{FLEET_PREFIX}{k:03d}", scale.fleet_per_model, "P1") for k in range(scale.fleet_models)]
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return sim


def _read_line(proc: subprocess.Popen, timeout_s: float, what: str, log: Path) -> str:
    stdout = proc.stdout
    if stdout is None:
        raise RuntimeError(f"{what} was started without stdout=subprocess.PIPE, so its ready line cannot be read")
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    line = stdout.readline().decode() if ready else ""
    if not line:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        raise RuntimeError(f"{what} printed nothing within {timeout_s} s (exit code {proc.poll()}); its log:\n{tail}")
    return line


def _popen(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as err:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def stop_process(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after grace_s; by pid, and reaped."""
    if proc is None:
        return
    terminate(proc, grace_s)
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class Plane:
    proc: subprocess.Popen
    admin_url: str
    xds_port: int
    timeline: Path
    policy: str

    @classmethod
    def start(
        cls,
        workdir: Path,
        cluster_file: Path,
        watch: list[str],
        debounce_ms: float,
        policy: str,
        listener_port: int,
        creds: Credentials,
    ) -> Plane:
        timeline, log = workdir / "timeline.jsonl", workdir / "plane.log"
        proc = _popen(
            [
                sys.executable,
                "-m",
                "bench.reaction.plane",
                "--timeline",
                str(timeline),
                "--watch",
                ",".join(watch),
                "--cluster-file",
                str(cluster_file),
                "--admin-port",
                "0",
                "--credentials-dir",
                str(creds.path),
                "--xds-port",
                "0",
                "--listener-port",
                str(listener_port),
                "--startup-sync-s",
                "1.0",
                "--debounce-ms",
                str(debounce_ms),
                "--policy",
                policy,
                "--log-level",
                "warning",
            ],
            log,
        )
        info = json.loads(_read_line(proc, 60, "the control plane", log))
        return cls(proc, f"http://127.0.0.1:{info['admin_port']}", info["xds_port"], timeline, info["policy"])

    def events(self) -> list[dict]:
        with open(self.timeline) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]


@dataclass
class Fleet:
    proc: subprocess.Popen
    instances: int
    mode: str

    @classmethod
    def start(
        cls,
        workdir: Path,
        cluster_file: Path,
        control_url: str,
        interval_s: float,
        mode: str,
        creds: Credentials,
        heartbeats: bool = True,
    ) -> Fleet:
        log = workdir / "fleet.log"
        proc = _popen(
            [
                sys.executable,
                "-m",
                "bench.reaction.fleet",
                "--cluster-file",
                str(cluster_file),
                "--credentials-dir",
                str(creds.path),
                "--control-url",
                control_url,
                "--prefix",
                FLEET_PREFIX,
                "--interval-s",
                str(interval_s),
                "--mode",
                mode,
                *([] if heartbeats else ["--no-heartbeats"]),
            ],
            log,
        )
        info = json.loads(_read_line(proc, 180, "the fleet", log))
        return cls(proc, info["instances"], mode)

    def stop(self) -> dict:
        """Stop it; its post counts and post latencies (what it printed on the way out)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=5)
        for line in reversed(out.decode(errors="replace").splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        return {}


@dataclass
class SimPair:
    """A sim worker and its sidecar, reporting to the plane as instance `instance_id` on `node`."""

    instance_id: str
    worker: subprocess.Popen
    worker_url: str
    worker_key: str
    sidecar: subprocess.Popen | None = None
    address: str = ""  # the sidecar's host:port (what Envoy dials)
    control_address: str = ""  # its control listener (drain, wake, state)

    @classmethod
    def start(
        cls,
        workdir: Path,
        spec_file: Path,
        instance_id: str,
        control_url: str,
        node: str,
        model_id: str,
        creds: Credentials,
    ) -> SimPair:
        log = workdir / f"{instance_id}.log"
        secrets = workdir / "secrets" / instance_id
        key, key_file = creds.worker_key(secrets)
        worker = _popen(
            [
                sys.executable,
                "-m",
                "node_host.backends.sim",
                "--spec-file",
                str(spec_file),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--api-key-file",
                str(key_file),
            ],
            log,
        )
        line = _read_line(worker, 60, f"sim worker {instance_id}", log)
        if not line.startswith("listening on "):
            stop_process(worker)
            raise RuntimeError(f"sim worker {instance_id} said {line!r}, expected 'listening on PORT'")
        pair = cls(instance_id, worker, f"http://127.0.0.1:{int(line.split()[-1])}", key)
        argv = sidecar_argv(
            spec_file,
            pair.worker_url,
            creds=creds,
            instance_id=instance_id,
            node=node,
            worker_key_file=key_file,
            control_url=control_url,
            token_file=creds.sidecar_token_file(secrets, instance_id, model_id, node),
            extra=("--log-level", "WARNING"),
        )
        pair.sidecar = _popen(argv, log)
        try:
            announced = json.loads(_read_line(pair.sidecar, 60, f"sidecar {instance_id}", log))
            pair.address, pair.control_address = announced["address"], announced["control"]
        except BaseException:
            pair.stop()
            raise
        return pair

    @property
    def sidecar_pid(self) -> int:
        assert self.sidecar is not None, "SimPair.start returns a pair with its sidecar running"
        return self.sidecar.pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.worker, self.sidecar) if p is not None]

    def stop(self) -> None:
        stop_process(self.sidecar, grace_s=30.0)  # it drains first
        stop_process(self.worker)


def _cpu_seconds(pid: int) -> float:
    stat = proc_stat(pid)
    return 0.0 if stat is None else stat.ticks / CLK_TCK


def _machine_busy() -> tuple[float, float]:
    """(busy jiffies, all jiffies) of the whole machine, every tenant included."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@dataclass
class CpuMeter:
    """Cores used by each group of processes (and by the whole machine) between start() and read()."""

    groups: dict[str, list[int]]
    _t0: float = 0.0
    _cpu0: dict[str, float] = field(default_factory=dict)
    _machine0: tuple[float, float] = (0.0, 0.0)

    def start(self) -> CpuMeter:
        self._t0 = time.monotonic()
        self._cpu0 = {name: sum(_cpu_seconds(p) for p in pids) for name, pids in self.groups.items()}
        self._machine0 = _machine_busy()
        return self

    def read(self) -> dict[str, float]:
        elapsed = max(1e-6, time.monotonic() - self._t0)
        out = {
            name: round((sum(_cpu_seconds(p) for p in pids) - self._cpu0[name]) / elapsed, 3)
            for name, pids in self.groups.items()
        }
        busy, total = _machine_busy()
        out["machine_busy_fraction"] = round((busy - self._machine0[0]) / max(1, total - self._machine0[1]), 3)
        return out
