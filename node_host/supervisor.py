"""The processes of each model instance on this node: a worker and its sidecar.

    instance ──> worker  (python -m node_host.backends.<engine> | SGLang)  on 127.0.0.1:WPORT
             └─> sidecar (python -m sidecar ... --worker-url http://127.0.0.1:WPORT)  on 127.0.0.1:SPORT
                                                         (data, for Envoy) and 127.0.0.1:CPORT (control)

Secrets of an instance live in RUN_DIR/secrets (0700), each file 0600, and go when the instance goes:
`<id>.worker-key`, a random key only the worker, its sidecar and this node host know (the worker answers
nothing but /health without it), and `<id>.token`, the sidecar's credential as the control plane issued
it in the assignment. That credential expires (xds_server.credentials.SIDECAR_TOKEN_TTL_S) and heartbeat
replies bring its renewal long before: `update_token` replaces the file, and the sidecar re-reads its
token file when it changes (sie.auth.TokenSource).

A child that dies on its own is restarted with backoff (restarts.py) on the same port (held for the
instance by process.PortReservations, so nothing else takes it meanwhile), and its crash
is recorded. A crashed worker's sidecar keeps running: it sees the worker down and reports it, so the
endpoint leaves EDS until the worker is back. A stop is graceful and ordered: the sidecar first
(SIGTERM: it drains, so Envoy stops sending and in-flight requests finish), then the worker; each gets
a grace period, then SIGKILL, and its whole process group is swept.

A worker can be parked (`park_worker`): killed at once and not restarted until `unpark_worker`. The
`--eviction kill` baseline does that (an OOM kill, for bench/eviction), and so does an unload
(autoscale.sleep_mode unload); the normal eviction puts the worker to sleep through its sidecar and never
touches the processes. A worker that crashes while its instance is asleep (`tick(asleep=...)`: the
ledger holds no memory for it) is parked too, not restarted: a restart would load the model at full
size into memory that is promised to others. The wake starts it, after the ledger has reserved its
memory again, as it starts an unloaded worker (node_host.pressure).

A start that fails partway (a command that cannot be built, no disk for the spec file, no file
descriptor for a port) leaves nothing behind: its ports are given back and its files removed.

Which GPU an instance gets is the caller's decision (`gpu_for(instance_id, spec)`: node_host's
GPUManager, which has already reserved its memory); the supervisor passes it to the worker's
environment and to the sidecar (`--gpu-index`). `worker_options(instance_id, spec)` adds keyword
arguments to the worker command (an SGLang server's memory budget, the free memory it starts in, and
its NCCL port).

Which CPU cores an instance's processes may use is the caller's decision too (`cpu_share_for(service)`:
node_host.cpus' plan for the spec's tier and priority; None leaves them as they are). Worker and
sidecar are started pinned to those cores (and SCHED_IDLE where the share says background), with the
thread-pool sizes of node_host.cpus.thread_env in their environment, and the kernel's answer
(`read_share(pid)`) is checked right after the spawn and reported. A background child whose autogroup
the kernel did not let it lower (unprivileged, one such change every 100 ms machine-wide) is lowered
from here (`lower_group(pid)`), a try per tick for GROUP_RETRY_S, and its share read again after.

Time, sleeping, process spawning and port picking are passed in, so the restart logic is tested with a
fake clock and fake children. `tick()` is called periodically by the node host; it never blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_host import restarts
from node_host.backends import registry
from node_host.backends.protocol import OOM_EXIT_CODE
from node_host.cpus import CpuShare, share_of, thread_env
from node_host.process import (
    Child,
    PortReservations,
    Spawn,
    describe_exit,
    last_words,
    log_size,
    read_tail,
    spawn,
)
from sie import model_files
from sie.auth import write_private
from sie.cpu_lists import format_cpu_list
from sie.engine_settings.kv_budget import KV_BUDGET_SCALE
from sie.engines import MemoryRelease, dialect_for
from sie.model_files import ModelFilePolicy
from sie.processes import lower_autogroup
from sie.spec import BackendType, ModelService
from sie.spec_loader import parse_model_service
from sie.wire import Assignment

log = logging.getLogger(__name__)

# A worker OOM-killed this many times in a row restarts with its KV-cache budget times KV_SHRINK (never
# below MIN_KV_SCALE of the spec's): the KV cache is what an engine sizes from the memory it finds, and
# what leaves room for activations and fragmentation when cut. "In a row" as restarts.py counts crashes.
OOM_KILLS_BEFORE_SHRINK = 2
KV_SHRINK = 0.75
MIN_KV_SCALE = 0.25

# The sidecar drains for up to 25 s by default (sidecar --drain-timeout-s); its grace must be longer.
SIDECAR_GRACE_S = 30.0
WORKER_GRACE_S = 10.0
_POLL_S = 0.05
# How long tick() keeps trying to lower the autogroup of a background child whose own try the kernel put
# off (one change every 100 ms machine-wide, unprivileged): enough for dozens started together.
GROUP_RETRY_S = 5.0


@dataclass(frozen=True)
class SidecarArgs:
    instance_id: str
    spec_file: Path
    listen: str  # host:port
    control_listen: str  # host:port
    worker_url: str
    worker_key_file: Path
    control_url: str
    token_file: Path
    trust_file: Path
    node: str
    gpu_index: int | None
    wake_url: str | None = None  # the node host's POST /v1/instances/<id>/wake for this instance
    worker_on_gpu: bool | None = None  # None: as gpu_index says; False for an instance on a virtual GPU
    worker_metrics_url: str | None = None  # where the engine serves its metrics apart from its API (Triton)


def sidecar_command(args: SidecarArgs, python: str | None = None) -> list[str]:
    """The sidecar's command line (its contract: sidecar/settings.py)."""
    argv = [
        python or sys.executable,
        "-m",
        "sidecar",
        "--instance-id",
        args.instance_id,
        "--spec-file",
        str(args.spec_file),
        "--listen",
        args.listen,
        "--control-listen",
        args.control_listen,
        "--worker-url",
        args.worker_url,
        "--worker-key-file",
        str(args.worker_key_file),
        "--control-url",
        args.control_url,
        "--token-file",
        str(args.token_file),
        "--trust-file",
        str(args.trust_file),
        "--node",
        args.node,
    ]
    if args.gpu_index is not None:
        argv += ["--gpu-index", str(args.gpu_index)]
    if args.wake_url:
        argv += ["--wake-url", args.wake_url]
    if args.worker_on_gpu is not None:
        argv += ["--worker-device", "gpu" if args.worker_on_gpu else "cpu"]
    if args.worker_metrics_url:
        argv += ["--worker-metrics-url", args.worker_metrics_url]
    return argv


@dataclass
class Instance:
    """One instance's processes. Mutated only by the ProcessManager, on the event loop."""

    instance_id: str
    service: ModelService
    spec: dict[str, Any]  # as assigned; compared with later assignments to notice a changed spec
    spec_file: Path
    gpu_index: int | None
    host: str
    worker_port: int
    sidecar_port: int
    control_port: int
    worker_key: str
    token: str  # the sidecar's credential, as last assigned
    worker_argv: list[str]
    worker_env: dict[str, str]
    sidecar_argv: list[str]
    cpu_share: CpuShare | None = None  # the only cores worker and sidecar may use, and how; None: unpinned
    sidecar_env: dict[str, str] | None = None
    # What the kernel said each child may use, read right after its last start (pinned instances only).
    share_seen: dict[str, CpuShare | None] = field(default_factory=dict)
    # role -> until when tick() tries to lower its child's autogroup (the kernel put the child's own try off)
    group_pending: dict[str, float] = field(default_factory=dict)
    log_starts: dict[str, int] = field(default_factory=dict)  # role -> its log's size when it last started
    worker: restarts.Slot = field(default_factory=restarts.Slot)
    sidecar: restarts.Slot = field(default_factory=restarts.Slot)
    worker_child: Child | None = None
    sidecar_child: Child | None = None
    stopping: bool = False
    worker_parked: bool = False  # not restarted until a wake (killed on purpose, or crashed while asleep)
    kv_scale: float = 1.0  # the KV budget it runs with, as a fraction of the spec's (OOM_KILLS_BEFORE_SHRINK)
    oom_in_a_row: int = 0
    kv_note: str = ""  # why kv_scale is below 1, for the instance report
    on_gpu: bool = False  # its worker runs on a real GPU (a virtual GPU's instance runs on the CPU)
    engine_cpus: tuple[int, ...] = ()  # the cores its engine binds its threads to (vLLM's CPU build), if any

    @property
    def sleep_way(self) -> tuple[str, str]:
        """How it sleeps, ("offload" or "unload", why): unloaded (its worker stopped once drained and
        idle, started again by a wake) where its engine cannot release memory where it runs
        (sie.engines), or where the spec asks for it (autoscale.sleep_mode)."""
        way = dialect_for(self.service.spec.backend.type).sleep(self.on_gpu)
        if way.release is MemoryRelease.UNLOAD:
            return "unload", way.why
        if self.service.spec.autoscale.sleep_mode == "unload":
            return "unload", "autoscale.sleep_mode unload: the worker is stopped, a wake loads it again"
        return "offload", way.why

    @property
    def health_path(self) -> str:
        """Where its worker says it serves (its engine's dialect, sie.engines)."""
        return dialect_for(self.service.spec.backend.type).health_path.replace("{model}", self.service.model_id)

    @property
    def worker_address(self) -> str:
        return f"{self.host}:{self.worker_port}"

    @property
    def sidecar_address(self) -> str:
        return f"{self.host}:{self.sidecar_port}"

    @property
    def control_address(self) -> str:
        return f"{self.host}:{self.control_port}"

    def sidecar_running(self) -> bool:
        """Its sidecar process is alive now (started and not ended, reaped or not). Only then is the
        control port the sidecar's: while it is down, another process on this host may listen there."""
        return self.sidecar_child is not None and self.sidecar_child.poll() is None

    def detail(self) -> str:
        """The last crash of each child, newest first, for the instance report."""
        crashes = [
            (slot.last_exit_at, f"{name} {slot.last_exit}" + (f" ({slot.last_words})" if slot.last_words else ""))
            for name, slot in (("worker", self.worker), ("sidecar", self.sidecar))
            if slot.last_exit is not None and slot.last_exit_at is not None
        ]
        parts = [text for _, text in sorted(crashes, reverse=True)] + ([self.kv_note] if self.kv_note else [])
        return "; ".join(parts + self.affinity_problems())

    def affinity_problems(self) -> list[str]:
        """Children whose cores or policy are not what they were started with (should never happen: said
        loudly). One whose autogroup the supervisor is still lowering (group_pending) is not a problem yet."""
        if self.cpu_share is None:
            return []
        return [
            f"{role} may use CPUs {seen.describe() if seen is not None else '(unreadable)'}, "
            f"not the {self.cpu_share.describe()} it was started with"
            + (
                " (background: SCHED_IDLE and, where the kernel has autogroups, its autogroup at nice 19)"
                if seen is not None and seen.cpus == self.cpu_share.cpus
                else ""
            )
            for role, seen in sorted(self.share_seen.items())
            if seen != self.cpu_share and role not in self.group_pending
        ]

    @property
    def cpu_list(self) -> str:
        """The cores it may use as a CPU list (the kernel's answer for the worker once read); "" unpinned."""
        if self.cpu_share is None:
            return ""
        seen = self.share_seen.get("worker")
        return format_cpu_list((seen or self.cpu_share).cpus)


class ProcessManager:
    def __init__(
        self,
        *,
        run_dir: Path,
        node: str,
        control_url: str,
        trust_file: Path,
        files: ModelFilePolicy = ModelFilePolicy(),
        host: str = "127.0.0.1",
        spawn: Spawn = spawn,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        ports: PortReservations | None = None,
        pick_port: Callable[[], int] | None = None,
        worker_command: Callable[..., list[str]] = registry.worker_command,
        sidecar_command: Callable[[SidecarArgs], list[str]] = sidecar_command,
        gpu_for: Callable[[str, ModelService], int | None] = lambda instance_id, service: None,
        cpu_share_for: Callable[[ModelService], CpuShare | None] = lambda service: None,
        read_share: Callable[[int], CpuShare | None] = share_of,
        lower_group: Callable[[int], bool] = lower_autogroup,
        environ: Mapping[str, str] = os.environ,
        worker_options: Callable[[str, ModelService], dict[str, Any]] = lambda instance_id, service: {},
        gpus_simulated: bool = False,
        policy: restarts.BackoffPolicy = restarts.BackoffPolicy(),
        sidecar_grace_s: float = SIDECAR_GRACE_S,
        worker_grace_s: float = WORKER_GRACE_S,
    ):
        self.run_dir = run_dir
        self.node = node
        self.control_url = control_url
        self.trust_file = trust_file
        self.files = files
        self.host = host
        # The node host's API (http://host:port), where sidecars ask for a wake. Known only once the API
        # listens, which needs the agent this manager is built for: main sets it before any instance starts.
        self.api_url = ""
        self._spawn = spawn
        self._clock = clock
        self._sleep = sleep
        # The instance's ports stay reserved until it is forgotten (see PortReservations); a test may
        # pass pick_port instead, for ports nothing binds.
        self._ports = ports if ports is not None else PortReservations(host)
        self._pick_port = pick_port or self._ports.take
        self._worker_command = worker_command
        self._sidecar_command = sidecar_command
        self._gpu_for = gpu_for
        self._cpu_share_for = cpu_share_for
        self._read_share = read_share
        self._lower_group = lower_group
        self._environ = environ  # what children inherit (a thread-pool size set there is kept)
        self._worker_options = worker_options
        self._gpus_simulated = gpus_simulated  # --virtual-gpus: an instance "on" one runs on the CPU
        self._policy = policy
        self._sidecar_grace = sidecar_grace_s
        self._worker_grace = worker_grace_s
        self.instances: dict[str, Instance] = {}

    # ---- starting ---------------------------------------------------------------------------------

    def start(self, assignment: Assignment) -> Instance:
        """Write the spec file, start the worker, then its sidecar. Raises SpecError (or ValueError) for a
        spec this node cannot run (the caller reports it; retrying the same spec will not help), OSError
        when the machine cannot (no disk, no file descriptors). Whatever it raises, it leaves nothing
        behind: the commands are built before any file is written, and the ports taken and the files
        written so far are given back first."""
        iid = assignment.instance_id
        if iid in self.instances:
            raise ValueError(f"instance {iid} already runs here")
        service = parse_model_service(assignment.spec, f"assignment {iid}")
        model_files.check_spec(service, self.files)
        if service.spec.model.path and service.spec.backend.type is not BackendType.SIM:
            # Under a model root, or refused here, before any process starts; a directory's symlinks too
            # (transformers and SGLang follow each one). The worker checks again where it loads.
            model_files.check_model_dir(model_files.resolve(service.spec.model.path, self.files), self.files)
        gpu = self._gpu_for(iid, service)
        share = self._cpu_share_for(service)
        threads = thread_env(share.cpus if share is not None else None, self._environ)
        spec_file = self._spec_path(iid)
        key_file, token_file = self.secret_path(iid, "worker-key"), self.secret_path(iid, "token")
        worker_key = secrets.token_urlsafe(32)
        ports: list[int] = []
        inst: Instance | None = None
        dialect = dialect_for(service.spec.backend.type)
        try:
            # worker, sidecar, control; and the engine's metrics where it serves them apart (Triton)
            while len(ports) < (4 if dialect.metrics_apart else 3):
                ports.append(self._pick_port())
            worker_port, sidecar_port, control_port = ports[:3]
            metrics_port = ports[3] if dialect.metrics_apart else None
            options = dict(self._worker_options(iid, service))
            if metrics_port is not None:
                options["metrics_port"] = metrics_port
            worker_argv = self._worker_command(
                service,
                spec_file,
                self.host,
                worker_port,
                key_file=key_file,
                key=worker_key,
                files=self.files,
                **options,
            )
            on_gpu = gpu is not None and not self._gpus_simulated
            engine_cpus = share.cpus if share is not None else options.get("cpus")
            sidecar_argv = self._sidecar_command(
                SidecarArgs(
                    instance_id=iid,
                    spec_file=spec_file,
                    listen=f"{self.host}:{sidecar_port}",
                    control_listen=f"{self.host}:{control_port}",
                    worker_url=f"http://{self.host}:{worker_port}",
                    worker_key_file=key_file,
                    control_url=self.control_url,
                    token_file=token_file,
                    trust_file=self.trust_file,
                    node=self.node,
                    gpu_index=gpu,
                    wake_url=f"{self.api_url}/v1/instances/{iid}/wake" if self.api_url else None,
                    worker_on_gpu=False if gpu is not None and self._gpus_simulated else None,
                    worker_metrics_url=f"http://{self.host}:{metrics_port}{dialect.metrics_path}"
                    if metrics_port is not None
                    else None,
                )
            )
            self._write_spec(iid, assignment.full_spec)
            self._write_secret(iid, "worker-key", worker_key)
            self._write_secret(iid, "token", assignment.token)
            inst = Instance(
                instance_id=iid,
                service=service,
                spec=dict(assignment.full_spec),
                spec_file=spec_file,
                gpu_index=gpu,
                host=self.host,
                worker_port=worker_port,
                sidecar_port=sidecar_port,
                control_port=control_port,
                worker_key=worker_key,
                token=assignment.token,
                worker_argv=worker_argv,
                worker_env={
                    **threads,
                    **registry.worker_env(
                        service,
                        gpu,
                        key=worker_key,
                        cpus=engine_cpus,
                        on_gpu=on_gpu,
                        options=options,
                        base_env=self._environ,
                    ),
                },
                sidecar_argv=sidecar_argv,
                cpu_share=share,
                sidecar_env=threads or None,
                on_gpu=on_gpu,
                engine_cpus=tuple(sorted(engine_cpus or ())),
            )
            self.instances[iid] = inst
            # A child that cannot be spawned is a crash, retried (_start_child); anything else raised here
            # is unexpected, and the instance goes as a whole.
            self._start_worker(inst)
            self._start_sidecar(inst)
        except BaseException:
            self._abandon(iid, ports, inst)
            raise
        log.info(
            "started %s (%s, %s): worker pid %s on %s, sidecar pid %s on %s, CPUs %s",
            inst.instance_id,
            service.model_id,
            service.spec.backend.type.value,
            inst.worker_child.pid if inst.worker_child else None,
            inst.worker_address,
            inst.sidecar_child.pid if inst.sidecar_child else None,
            inst.sidecar_address,
            inst.cpu_share.describe() if inst.cpu_share is not None else "any",
        )
        return inst

    def _abandon(self, instance_id: str, ports: list[int], inst: Instance | None) -> None:
        """Undo a start that failed partway: kill what it spawned, give its ports back, remove its files."""
        if inst is not None:
            for child in (inst.worker_child, inst.sidecar_child):
                if child is not None:
                    child.signal_group(signal.SIGKILL)
            self.instances.pop(instance_id, None)
        for port in ports:
            self._ports.release(port)
        self._remove_files(instance_id)

    def _spec_path(self, instance_id: str) -> Path:
        return self.run_dir / "specs" / f"{instance_id}.json"

    def _write_spec(self, instance_id: str, spec: Mapping[str, Any], kv_scale: float = 1.0) -> Path:
        """The spec file the worker and the sidecar read: the assigned spec, with the KV budget scale the
        OOM rule set (backend.config.kv_budget_scale) when it is below 1."""
        path = self._spec_path(instance_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_with_kv_scale(spec, kv_scale), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)  # a restarting child never reads half a file
        return path

    def secret_path(self, instance_id: str, name: str) -> Path:
        return self.run_dir / "secrets" / f"{instance_id}.{name}"

    def _write_secret(self, instance_id: str, name: str, value: str) -> Path:
        folder = self.run_dir / "secrets"
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        path = self.secret_path(instance_id, name)
        write_private(path, value.encode())
        return path

    def update_token(self, instance_id: str, token: str) -> None:
        """A new credential for a running sidecar (the control plane renewed it): the sidecar re-reads it.
        The file is replaced whole (write_private: a temporary file renamed over it), so the sidecar reads
        the old token or the new one, never a part; the old one is valid for half its life yet, so the
        switch has no gap."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.token == token or not token:
            return
        self._write_secret(instance_id, "token", token)
        inst.token = token

    def log_path(self, instance_id: str, role: str) -> Path:
        return self.run_dir / "logs" / f"{instance_id}.{role}.log"

    def _start_worker(self, inst: Instance) -> None:
        self._start_child(inst, "worker", inst.worker_argv, inst.worker_env)

    def _start_sidecar(self, inst: Instance) -> None:
        self._start_child(inst, "sidecar", inst.sidecar_argv, inst.sidecar_env)

    def _start_child(self, inst: Instance, role: str, argv: list[str], env: dict[str, str] | None) -> None:
        now = self._clock()
        slot = restarts.started(getattr(inst, role), now)
        inst.log_starts[role] = log_size(self.log_path(inst.instance_id, role))
        try:
            share = inst.cpu_share
            child = self._spawn(
                argv,
                self.log_path(inst.instance_id, role),
                env,
                cpus=share.cpus if share is not None else None,
                background=share is not None and share.background,
            )
        except (OSError, subprocess.SubprocessError) as exc:  # SubprocessError: the affinity could not be set
            # A child that cannot even be spawned (missing interpreter, no fds) is a crash like any
            # other: recorded, and retried with backoff.
            setattr(inst, role, restarts.exited(slot, now, f"could not start: {exc}", self._policy))
            log.error("cannot start the %s of %s: %s (argv %s)", role, inst.instance_id, exc, argv)
            return
        setattr(inst, f"{role}_child", child)
        setattr(inst, role, slot)
        if inst.cpu_share is not None:
            # Popen returns once the child has exec'd, so its affinity is set by now: check what the kernel says.
            inst.share_seen[role] = seen = self._read_share(child.pid)
            inst.group_pending.pop(role, None)
            if (
                seen is not None
                and inst.cpu_share.background
                and seen.cpus == inst.cpu_share.cpus
                and not seen.background
            ):
                # On its cores and SCHED_IDLE (else Popen would have failed), but its autogroup is not lowered:
                # unprivileged, the kernel takes one such change every 100 ms machine-wide and put the child's
                # try off (sie.processes). tick() tries from outside, without blocking, for a while.
                inst.group_pending[role] = now + GROUP_RETRY_S
            elif seen != inst.cpu_share:
                self._say_unpinned(inst, role, child.pid, seen, inst.cpu_share)

    @staticmethod
    def _say_unpinned(inst: Instance, role: str, pid: int, seen: CpuShare | None, wanted: CpuShare) -> None:
        log.error(
            "the %s of %s (pid %d) may use CPUs %s, not %s",
            role,
            inst.instance_id,
            pid,
            seen.describe() if seen is not None else "(unreadable)",
            wanted.describe(),
        )

    def _lower_groups(self, inst: Instance, now: float) -> None:
        """Retry lowering the autogroups the kernel put off (see _start_child); once they are lowered, or
        the time is up, the kernel's reading is what the instance reports."""
        for role, until in list(inst.group_pending.items()):
            child: Child | None = getattr(inst, f"{role}_child")
            if child is None:
                del inst.group_pending[role]
                continue
            lowered = self._lower_group(child.pid)
            if lowered or now >= until:
                del inst.group_pending[role]
                inst.share_seen[role] = seen = self._read_share(child.pid)
                if inst.cpu_share is not None and seen != inst.cpu_share:
                    self._say_unpinned(inst, role, child.pid, seen, inst.cpu_share)

    # ---- watching ---------------------------------------------------------------------------------

    def tick(self, asleep: Callable[[str], bool] = lambda instance_id: False) -> None:
        """Reap children that ended, schedule their restarts, start those that are due. A crashed worker
        of an instance that is `asleep` (instance id -> its memory is released) is parked instead: the
        wake that reserves its memory again starts it (unpark_worker)."""
        now = self._clock()
        for inst in list(self.instances.values()):
            if inst.stopping:
                continue
            if inst.group_pending:
                self._lower_groups(inst, now)
            for role in ("worker", "sidecar"):
                child: Child | None = getattr(inst, f"{role}_child")
                slot: restarts.Slot = getattr(inst, role)
                if role == "worker" and inst.worker_parked:
                    self._reap_parked(inst)
                    continue
                if child is not None:
                    status = child.poll()
                    if status is None:
                        continue
                    child.signal_group(signal.SIGKILL)  # whatever it forked must not outlive it
                    if not slot.running:
                        # Stopped on purpose (parked) and unparked before it was reaped: start it now.
                        setattr(inst, f"{role}_child", None)
                        if role == "worker":
                            self._start_worker(inst)
                        continue
                    # An error exit says why in its log (a refused spec, a failed load); a signal does not.
                    words = self._last_words(inst, role) if status > 0 else None
                    slot = restarts.exited(slot, now, describe_exit(status), self._policy, words)
                    setattr(inst, role, slot)
                    setattr(inst, f"{role}_child", None)
                    if role == "worker":
                        self._after_worker_crash(inst, status, slot)
                    log.warning(
                        "%s of %s (pid %d) ended: %s; restart %d in a row, in %.1f s (log: %s)",
                        role,
                        inst.instance_id,
                        child.pid,
                        slot.last_exit,
                        slot.crashes_in_a_row,
                        slot.restart_at - now if slot.restart_at is not None else 0.0,
                        self.log_path(inst.instance_id, role),
                    )
                if role == "worker" and slot.restart_at is not None and asleep(inst.instance_id):
                    self._park_asleep(inst)
                    continue
                if restarts.restart_due(slot, now):
                    (self._start_worker if role == "worker" else self._start_sidecar)(inst)
                    log.info(
                        "restarted the %s of %s (restart #%d)", role, inst.instance_id, getattr(inst, role).restarts
                    )

    def _last_words(self, inst: Instance, role: str) -> str | None:
        """What this run of the child wrote last, its credentials masked (the status is readable by
        every reader of the control plane)."""
        tail = read_tail(self.log_path(inst.instance_id, role), start=inst.log_starts.get(role, 0))
        return last_words(tail, secrets=(inst.worker_key, inst.token))

    def _after_worker_crash(self, inst: Instance, status: int, slot: restarts.Slot) -> None:
        """Count OOM kills in a row (SIGKILL, which the kernel's OOM killer sends, or the runtime's
        OOM_EXIT_CODE); the OOM_KILLS_BEFORE_SHRINK-th restarts the worker with a smaller KV budget."""
        if status not in (-signal.SIGKILL, OOM_EXIT_CODE):
            inst.oom_in_a_row = 0
            return
        inst.oom_in_a_row = 1 if slot.crashes_in_a_row == 1 else inst.oom_in_a_row + 1
        if inst.oom_in_a_row < OOM_KILLS_BEFORE_SHRINK or inst.kv_scale <= MIN_KV_SCALE:
            return
        kills, inst.oom_in_a_row = inst.oom_in_a_row, 0
        inst.kv_scale = max(MIN_KV_SCALE, round(inst.kv_scale * KV_SHRINK, 4))
        inst.kv_note = f"KV budget cut to {inst.kv_scale:.0%} of the spec's after {kills} OOM kills in a row"
        self._write_spec(inst.instance_id, inst.spec, inst.kv_scale)
        service = parse_model_service(_with_kv_scale(inst.spec, inst.kv_scale), f"instance {inst.instance_id}")
        inst.worker_argv = self._worker_command(
            service,
            inst.spec_file,
            self.host,
            inst.worker_port,
            key_file=self.secret_path(inst.instance_id, "worker-key"),
            key=inst.worker_key,
            files=self.files,
            **self._worker_options(inst.instance_id, service),
        )
        log.warning("%s: %s; its worker restarts with it", inst.instance_id, inst.kv_note)

    # ---- parking (the --eviction kill baseline, an unload, a crash while asleep) ------------------

    def park_worker(self, instance_id: str, why: str = "without a drain (--eviction kill)") -> None:
        """SIGKILL the instance's worker group now, as an OOM kill would, and do not restart it until
        `unpark_worker`. The sidecar keeps running and reports the worker down (or, when it had put the
        worker to sleep first, sleeping: an unload, autoscale.sleep_mode unload)."""
        inst = self.instances[instance_id]
        inst.worker_parked = True
        inst.worker = restarts.stopped(inst.worker)
        if inst.worker_child is not None:
            inst.worker_child.signal_group(signal.SIGKILL)
            log.warning("killed the worker of %s (pid %d) %s", instance_id, inst.worker_child.pid, why)
        self._reap_parked(inst)

    def unpark_worker(self, instance_id: str) -> None:
        """Start the parked worker again (a cold start: it loads from scratch)."""
        inst = self.instances[instance_id]
        if not inst.worker_parked:
            return
        inst.worker_parked = False
        if inst.worker_child is None and not inst.stopping:
            self._start_worker(inst)
        # else: the killed one is not reaped yet; tick() starts the new one as soon as it is

    def _park_asleep(self, inst: Instance) -> None:
        """The worker of a sleeping instance crashed: its crash stays on record, its restart waits for
        the wake, which reserves its memory before it starts it."""
        inst.worker_parked = True
        inst.worker = restarts.stopped(inst.worker)
        log.warning(
            "the worker of %s crashed while it was asleep; it starts again when the instance is woken",
            inst.instance_id,
        )

    def _reap_parked(self, inst: Instance) -> None:
        child = inst.worker_child
        if child is not None and child.poll() is not None:
            child.signal_group(signal.SIGKILL)
            inst.worker_child = None

    # ---- stopping ---------------------------------------------------------------------------------

    async def stop(self, instance_id: str) -> None:
        """Stop one instance gracefully (sidecar, then worker) and forget it."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        inst.stopping = True
        log.info("stopping %s: sidecar first (drain), then the worker", instance_id)
        try:
            await self._terminate(inst, "sidecar", self._sidecar_grace)
            await self._terminate(inst, "worker", self._worker_grace)
        finally:
            if inst.sidecar_child is None and inst.worker_child is None:
                self._forget(inst)
        log.info("stopped %s", instance_id)

    def _forget(self, inst: Instance) -> None:
        self.instances.pop(inst.instance_id, None)
        for port in (inst.worker_port, inst.sidecar_port, inst.control_port):
            self._ports.release(port)
        self._remove_files(inst.instance_id)

    def _remove_files(self, instance_id: str) -> None:
        """The instance's spec file and secrets; its logs stay: they explain what happened."""
        spec = self._spec_path(instance_id)
        secret_files = [self.secret_path(instance_id, name) for name in ("worker-key", "token")]
        for path in (spec, spec.with_suffix(".json.tmp"), *secret_files):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # said, not raised: a failed start's own error is the one to report
                log.error("cannot remove %s: %s", path, exc)
        # A model repository the node host wrote for it (Triton: node_host.backends.registry)
        shutil.rmtree(self.run_dir / "triton" / instance_id, ignore_errors=True)

    async def stop_all(self, instance_ids: Iterable[str] | None = None) -> None:
        """Stop instances together: every sidecar first, then every worker."""
        chosen = [self.instances[i] for i in (instance_ids or list(self.instances)) if i in self.instances]
        for inst in chosen:
            inst.stopping = True
        await asyncio.gather(*(self._terminate(i, "sidecar", self._sidecar_grace) for i in chosen))
        await asyncio.gather(*(self._terminate(i, "worker", self._worker_grace) for i in chosen))
        for inst in chosen:
            if inst.sidecar_child is None and inst.worker_child is None:
                self._forget(inst)

    async def _terminate(self, inst: Instance, role: str, grace_s: float) -> None:
        """SIGTERM the child's group, wait up to grace_s, then SIGKILL; always reap; sweep the group."""
        child: Child | None = getattr(inst, f"{role}_child")
        setattr(inst, role, restarts.stopped(getattr(inst, role)))
        if child is None:
            return
        status = child.poll()
        if status is None:
            child.signal_group(signal.SIGTERM)
            deadline = self._clock() + grace_s
            while (status := child.poll()) is None and self._clock() < deadline:
                await self._sleep(_POLL_S)
        if status is None:
            log.warning(
                "%s of %s (pid %d) ignored SIGTERM for %.0f s; killing it", role, inst.instance_id, child.pid, grace_s
            )
            child.signal_group(signal.SIGKILL)
            while (status := child.poll()) is None:
                await self._sleep(_POLL_S)  # SIGKILL cannot be ignored: this ends
        child.signal_group(signal.SIGKILL)  # anything the child forked and left behind
        setattr(inst, f"{role}_child", None)
        log.info("%s of %s (pid %d) stopped: %s", role, inst.instance_id, child.pid, describe_exit(status))

    # ---- reading ----------------------------------------------------------------------------------

    def respec(self, instance_id: str, spec: dict[str, Any], service: ModelService) -> None:
        """Record a new spec for a running instance whose processes do not depend on what changed
        (assignments.instance_view): its reports carry it, and its spec file on disk says it."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.stopping:
            return
        inst.spec, inst.service = dict(spec), service
        self._write_spec(instance_id, spec, inst.kv_scale)

    def running_specs(self) -> dict[str, dict[str, Any]]:
        return {iid: inst.spec for iid, inst in self.instances.items() if not inst.stopping}

    def all_specs(self) -> dict[str, dict[str, Any]]:
        """running_specs and those of the instances being stopped."""
        return {iid: inst.spec for iid, inst in self.instances.items()}

    def stopping_ids(self) -> set[str]:
        return {iid for iid, inst in self.instances.items() if inst.stopping}

    def pids(self) -> list[int]:
        return [
            c.pid for inst in self.instances.values() for c in (inst.worker_child, inst.sidecar_child) if c is not None
        ]

    def describe(self, inst: Instance) -> dict[str, Any]:
        """For the node host's GET /v1/instances."""

        def child(role: str) -> dict[str, Any]:
            slot: restarts.Slot = getattr(inst, role)
            proc: Child | None = getattr(inst, f"{role}_child")
            return {
                "pid": proc.pid if proc else None,
                "running": proc is not None,
                "restarts": slot.restarts,
                "crashes_in_a_row": slot.crashes_in_a_row,
                "last_exit": slot.last_exit,
                "last_words": slot.last_words,
                "restart_in_s": max(0.0, slot.restart_at - self._clock()) if slot.restart_at is not None else None,
                "log": str(self.log_path(inst.instance_id, role)),
                # The kernel's answer right after its last start (pinned instances); None: not pinned.
                "cpus": format_cpu_list(seen.cpus) if (seen := inst.share_seen.get(role)) is not None else None,
                "background": seen.background if seen is not None else None,
            }

        return {
            "instance_id": inst.instance_id,
            "model_id": inst.service.model_id,
            "backend": inst.service.spec.backend.type.value,
            "gpu_index": inst.gpu_index,
            "cpus": inst.cpu_list,  # "" when not pinned: any core of the node host's
            # SCHED_IDLE (a P1/P2 instance of the shared pool while tiers have cores): node_host.cpus
            "background": inst.cpu_share is not None and inst.cpu_share.background,
            "worker_address": inst.worker_address,
            "sidecar_address": inst.sidecar_address,
            "control_address": inst.control_address,
            "stopping": inst.stopping,
            "worker_parked": inst.worker_parked,
            "kv_budget_scale": inst.kv_scale,
            "sleep_mode": inst.sleep_way[0],
            "sleep_mode_why": inst.sleep_way[1],
            "spec_file": str(inst.spec_file),
            "worker": child("worker"),
            "sidecar": child("sidecar"),
        }


def _with_kv_scale(spec: Mapping[str, Any], kv_scale: float) -> dict[str, Any]:
    """`spec` (a ModelService dict) with backend.config.kv_budget_scale set, when the scale is below 1."""
    if kv_scale >= 1.0:
        return dict(spec)
    out = json.loads(json.dumps(spec))  # a deep copy of plain JSON
    inner = out.setdefault("spec", {})
    backend = inner.setdefault("backend", {})
    backend.setdefault("config", {})[KV_BUDGET_SCALE] = kv_scale
    return out
