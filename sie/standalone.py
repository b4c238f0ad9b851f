"""`sie up`: the whole SIE stack on one machine, with a real Envoy, supervised until Ctrl-C or `sie down`.

Start order: xds_server (it loads the cluster file and waits out its sync window), then Envoy
(bootstrapped to xds_server over ADS), then the node host (which starts a worker and a sidecar per
instance). A child that dies is restarted with backoff; a restarted xds_server rebuilds its registry
from the cluster file, the node host's reports and the sidecars' telemetry before it answers Envoy, and
Envoy keeps serving its last configuration meanwhile.

Tiers (a node's `tier_cpus`): the cores a node host here reserves for a tier run that tier's instances
only, so `sie up` starts the control plane, Envoy and the picker on the other cores
(`infrastructure_cpus`), and each node host moves itself there (node_host.cpus).

Stop order is the reverse: node host first (its sidecars drain, then its workers stop), then Envoy, then
xds_server. Every child is stopped by its pid and reaped; none outlives `sie up` (see processes.py).

The run directory: `sie up` takes it (Stack.claim) before its first child starts, records each child in
its state file as it starts (Stack.write_state) and lets it go once the last has stopped; the lock, the
state file and `sie down` are sie.run_dir's.

Credentials (DESIGN §10): before anything starts, `sie up` makes sure RUN_DIR/credentials (0700, each
file 0600) holds the control plane's signing key, its public trust bundle, and the tokens of the admin,
a reader, Envoy and the node host (sie.auth.store). xds_server gets the directory, the node host its
token and the trust bundle, Envoy its token inside its bootstrap (written 0600); `sie status` and the
other commands read admin.token from there. Envoy's admin interface, which would show that token to
anyone who asks and stop for anyone, is the Unix socket RUN_DIR/envoy/admin.sock (0600, in a 0700
directory); the envoy_admin_port is its `stats` listener on loopback: GET /ready and /stats/prometheus only
(xds_server/bootstrap.py).
"""

from __future__ import annotations

import errno
import http.client
import json
import os
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from sie.auth import ADMIN_TOKEN, TRUST, CredentialDir, node_token_name, write_private
from sie.auth.store import read_trust_bundle
from sie.cluster import ClusterSettings, NodeSpec, file_policy
from sie.cpu_lists import format_cpu_list, parse_tier_cpus
from sie.endpoints import Endpoints, Machine, admin_certificate_names, is_wildcard
from sie.errors import StartupError
from sie.processes import Child, describe_exit, find_envoy, next_backoff
from sie.run_dir import claim_run_dir, release_run_dir, write_state_file
from sie.settings_flags import to_argv

# How long a node host may take to stop: its sidecars drain for up to 25 s within their 30 s grace,
# then its workers get 10 s (node_host/supervisor.py SIDECAR_GRACE_S, WORKER_GRACE_S; its instances
# stop in parallel), plus a margin. Past it, its process group is killed.
NODE_HOST_STOP_S = 50.0
# Envoy, the picker and the control plane, each.
CHILD_STOP_S = 10.0
# `sie down` waits this long for `sie up` to stop everything before it kills what is left.
STACK_STOP_S = NODE_HOST_STOP_S + 3 * CHILD_STOP_S + 10.0


SETTLING = ("loading", "draining")  # instance states on the way to the fleet's shape


def envoy_admin_socket(run_dir: Path) -> Path:
    """Envoy's admin interface: a Unix socket in a directory of its own, 0700 (`sie up` makes it so)."""
    return run_dir / "envoy" / "admin.sock"


def envoy_admin_json(run_dir: Path, path: str, timeout: float = 2.0) -> tuple[int, object]:
    """GET an admin page of the Envoy of `sie up --run-dir run_dir`, through its socket; as http_json:
    (status, parsed JSON or text), status 0 when nothing answered."""
    from xds_server.bootstrap import admin_request

    try:
        status, body = admin_request(envoy_admin_socket(run_dir), path, timeout=timeout)
    except (OSError, http.client.HTTPException):
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """StartupError unless every port (0: none) can be listened on at `host`, saying what stands in the way:
    a host that does not resolve or is not this machine's, or a port another process holds."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise StartupError(
            f"the host {host[:256]!r} does not resolve ({exc}): set the Cluster's `host` (or --host) to a name or "
            "address of this machine, e.g. 127.0.0.1"
        ) from None
    busy = []
    for label, port in ports.items():
        if port == 0:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((address[0], port, *address[2:]))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise StartupError(
                        f"cannot listen on {host}:{port} ({label}): {exc.strerror}; set the Cluster's `host` (or "
                        "--host) to an address of this machine, or choose another port"
                    ) from None
                busy.append(f"{port} ({label})")
    if busy:
        raise StartupError(
            f"port {', '.join(busy)} is already in use on {host}: stop what holds it (is another `sie up` "
            "running? try `sie down`) or choose other ports with --envoy-port/--envoy-admin-port/"
            "--admin-port/--xds-port/--picker-port"
        )


def xds_server_argv(
    python: str,
    cluster_file: Path,
    s: ClusterSettings,
    credentials_dir: Path,
    run_dir: Path,
    admin_tls_dir: Path | None = None,
) -> list[str]:
    """The control plane's command line. The Cluster's `settings.control_plane` goes on as its flags
    (--heartbeat-timeout-s, ...) and `settings.weights` as --weights-* flags; xds_server checks their names and
    types against its dataclasses (sie/ does not import them)."""
    return (
        [
            python,
            "-m",
            "xds_server",
            "--cluster-file",
            str(cluster_file),
            "--host",
            s.host,
            "--admin-port",
            str(s.admin_port),
            "--xds-port",
            str(s.xds_port),
            "--listener-port",
            str(s.envoy_port),
            "--credentials-dir",
            str(credentials_dir),
            "--state-dir",
            str(run_dir / "state"),
        ]
        + (["--picker-address", f"127.0.0.1:{s.picker_port}"] if s.picker_port else [])
        + (["--admin-tls-dir", str(admin_tls_dir)] if admin_tls_dir is not None else [])
        + to_argv(s.settings.control_plane, "")
        + to_argv(s.settings.weights, "weights")
    )


def node_host_argv(
    python: str,
    s: ClusterSettings,
    control_url: str,
    run_dir: Path,
    token_file: Path,
    trust_file: Path,
    node: NodeSpec | None = None,
) -> list[str]:
    """One node host's command line (`node`: one of s.node_specs; default the first). The Cluster's
    `settings.node_host` goes on as its flags (--drain-timeout-s, ...); the node host checks them
    against node_host.settings.NodeTunables."""
    node = node or s.node_specs[0]
    argv = [
        python,
        "-m",
        "node_host",
        "--control-url",
        control_url,
        "--node",
        node.name,
        "--host",
        s.host,
        "--port",
        str(s.node_port if len(s.node_specs) == 1 else 0),
        "--run-dir",
        str(run_dir),
        "--token-file",
        str(token_file),
        "--trust-file",
        str(trust_file),
    ]
    argv += file_policy(s).resolved().argv()
    argv += node_flags(
        virtual_gpus=node.virtual_gpus,
        gpu_tiers=node.gpu_tiers,
        p0_only_tiers=node.p0_only_tiers,
        tier_cpus=node.tier_cpus,
        labels=",".join(f"{k}={v}" for k, v in sorted(node.labels.items())),
        taints=",".join(node.taints),
    )
    if s.eviction != "drain":
        argv += ["--eviction", s.eviction]
    return argv + to_argv(s.settings.node_host, "")


def node_flags(**values: str | None) -> list[str]:
    """One node's own node host flags (virtual_gpus, gpu_tiers, p0_only_tiers, tier_cpus, labels, taints, as the
    node host spells them), leaving out the empty ones: what `sie up` and `sie join` both pass."""
    out: list[str] = []
    for name, value in values.items():
        if value:
            out += ["--" + name.replace("_", "-"), value]
    return out


def infrastructure_cpus(nodes: list[NodeSpec], allowed: frozenset[int]) -> frozenset[int] | None:
    """The cores `sie up` runs the control plane, Envoy and the endpoint picker on: this process's cores
    (`allowed`) less every core a node host it starts here reserves for a tier (tier_cpus), so a tier's
    cores run that tier's instances and nothing else of SIE's (each node host moves itself off them too).
    None, unpinned, when no node reserves a core, or when together they reserve every one."""
    reserved: set[int] = set()
    for node in nodes:
        for cpus in parse_tier_cpus(node.tier_cpus).values():
            reserved |= cpus
    rest = allowed - reserved
    return rest if reserved and rest else None


def credentials(run_dir: Path) -> CredentialDir:
    return CredentialDir(run_dir / "credentials")


class _Refuse3xx(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a new address to call: urllib would follow it and send the same
    Authorization header to wherever it points. SIE's APIs never redirect."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


_NO_REDIRECTS = urllib.request.build_opener(_Refuse3xx)


def http_json(
    url: str,
    timeout: float = 2.0,
    token: str | None = None,
    method: str = "GET",
    payload: object = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, object]:
    """Call a URL (GET, or `method` with `payload` as JSON), with a bearer token when given; (status, parsed
    JSON or text). Status 0 when nothing answered, with the reason as text. `tls`: how an https URL's server is verified (the trust
    bundle's, sie.auth.tls.client_context); default the system's CAs."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if payload is not None:
        data = json.dumps(payload).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        opener = (
            _NO_REDIRECTS
            if tls is None
            else urllib.request.build_opener(_Refuse3xx, urllib.request.HTTPSHandler(context=tls))
        )
        with opener.open(request, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        # Nothing answered, or nothing this client trusts (ssl.SSLCertVerificationError): why, as text.
        return 0, str(getattr(exc, "reason", exc))
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


class Stack:
    """The children of one `sie up` and the loop that keeps them alive."""

    def __init__(
        self,
        cluster_file: Path,
        settings: ClusterSettings,
        run_dir: Path,
        log: Callable[[str], None] = print,
        control_plane_only: bool = False,
    ) -> None:
        self.cluster_file = cluster_file
        # `sie up --control-plane`: no node host here; they join from other machines (`sie join`).
        self.control_plane_only = control_plane_only
        self.settings = settings
        self.run_dir = run_dir
        self.log = log
        self.ep = Endpoints(
            settings.host,
            settings.envoy_port,
            settings.envoy_admin_port,
            settings.admin_port,
            settings.xds_port,
            admin_tls=settings.serves_tls,
        )
        self.children: dict[str, Child] = {}
        self.node_children: list[str] = []  # the node hosts' names in `children`, in start order
        self._stopping = False
        self.credentials = credentials(run_dir)
        self._admin_token = ""
        self._tls: ssl.SSLContext | None = None  # how this process verifies the admin API (trust.pem's CA)
        self._lock: int | None = None  # RUN_DIR/sie.lock's descriptor while this stack holds it (claim)

    # ---- composition -------------------------------------------------------------------------
    def _build_children(self) -> None:
        py = sys.executable
        logs = self.run_dir / "logs"
        s = self.settings
        nodes = [] if self.control_plane_only else s.node_specs
        creds = self.credentials.ensure(nodes=tuple(n.name for n in nodes))
        self._admin_token = creds.token(ADMIN_TOKEN)
        self._tls = read_trust_bundle(creds.file(TRUST)).tls
        # A fresh certificate each start, for the names this start serves under (host, admin_tls_names), and
        # for the one join_url prints (looked up once, so the two agree).
        if self.ep.machine is None and (s.serves_tls or is_wildcard(s.host)):
            self.ep = replace(self.ep, machine=Machine.here())
        tls_dir = None
        if s.serves_tls:
            tls_dir = creds.admin_certificate(*admin_certificate_names(s.host, s.admin_tls_names, self.ep.machine))
        infra = infrastructure_cpus(nodes, frozenset(os.sched_getaffinity(0)))
        self.children["xds_server"] = Child(
            "xds_server",
            xds_server_argv(py, self.cluster_file, s, creds.path, self.run_dir, tls_dir),
            logs / "xds_server.log",
            cpus=infra,
        )
        bootstrap_path = self.run_dir / "envoy.yaml"
        from xds_server.bootstrap import AdminSocketError, envoy_bootstrap

        admin_socket = envoy_admin_socket(self.run_dir)
        # Ours alone: Envoy binds the socket before it sets its mode, so nobody may enter the directory.
        admin_socket.parent.mkdir(mode=0o700, exist_ok=True)
        admin_socket.parent.chmod(0o700)
        try:
            bootstrap = envoy_bootstrap(
                node_id=f"sie-ingress-{s.node_name}",
                cluster_name="sie-ingress",
                xds_host=s.host,
                xds_port=s.xds_port,
                admin_socket=admin_socket,
                stats_port=s.envoy_admin_port,
                token=creds.token("envoy.token"),
                max_downstream_connections=s.ingress.max_connections,
            )
        except AdminSocketError as exc:
            raise StartupError(str(exc)) from exc
        write_private(bootstrap_path, yaml.safe_dump(bootstrap, sort_keys=False).encode())
        if s.picker_port:
            # Beside Envoy, on loopback: Envoy calls it for models with prefix affinity (xds_server/picker).
            self.children["picker"] = Child(
                "picker",
                [
                    py,
                    "-m",
                    "xds_server.picker",
                    "--listen",
                    f"127.0.0.1:{s.picker_port}",
                    "--control-url",
                    self.ep.admin_url,
                    "--token-file",
                    str(creds.file("reader.token")),
                    "--trust-file",
                    str(creds.file(TRUST)),
                    # Envoy sends it a whole body up to the ingress's limit in one message, with its attributes.
                    "--max-message-bytes",
                    str(s.ingress.max_body_bytes + 65_536),
                ],
                logs / "picker.log",
                cpus=infra,
            )
        self.children["envoy"] = Child(
            "envoy",
            [
                find_envoy(),
                "-c",
                str(bootstrap_path),
                "--base-id",
                str(40000 + s.envoy_admin_port % 20000),
                "--concurrency",
                "2",
                "--log-level",
                "warn",
                "--drain-time-s",
                "2",
            ],
            logs / "envoy.log",
            cpus=infra,
        )
        for node in nodes:
            # One node: the run directory itself (run/node_host.json, as before); several: one each.
            name, run = (
                ("node_host", self.run_dir)
                if len(nodes) == 1
                else (f"node_host-{node.name}", self.run_dir / "nodes" / node.name)
            )
            argv = node_host_argv(
                py, s, self.ep.admin_url, run, creds.file(node_token_name(node.name)), creds.file(TRUST), node
            )
            self.children[name] = Child(name, argv, logs / f"{name}.log")
            self.node_children.append(name)

    # ---- start ---------------------------------------------------------------------------------
    def claim(self) -> None:
        """Take the run directory: make sure it is this user's alone (private_dir), hold its lock for as
        long as this stack runs, and record this process in its state file before any child starts. So a
        second `sie up` on it is refused (AlreadyRunning), and `sie down` finds, and stops, one still
        starting. What a `sie up` that was killed left running is stopped first (sie.run_dir.claim_run_dir).
        Idempotent."""
        if self._lock is None:
            self._lock = claim_run_dir(self.run_dir, self.write_state, self.log)

    def start(self, ready_timeout_s: float = 300.0) -> None:
        self.claim()
        check_ports_free(
            self.settings.host,
            {
                "envoy ingress": self.settings.envoy_port,
                "envoy stats": self.settings.envoy_admin_port,
                "SIE admin API": self.settings.admin_port,
                "xDS gRPC": self.settings.xds_port,
                "endpoint picker": self.settings.picker_port,
            },
        )
        self._build_children()
        deadline = time.monotonic() + ready_timeout_s
        self._start_child("xds_server")
        # The node hosts of a `nodes:` list start with the control plane: its startup sync (and so its
        # /healthz) waits until all of them have reported (settings.loop.startup_nodes, their number, one
        # included), so the first placement spreads over every node instead of landing on whichever
        # reported first. The default single node starts once Envoy is ready.
        early = bool(self.settings.nodes)
        for name in self.node_children if early else ():
            self._start_child(name)
        self._wait(
            "xds_server answers /healthz",
            lambda: http_json(self.ep.admin_url + "/healthz", tls=self._tls)[0] == 200,
            deadline,
        )
        if "picker" in self.children:
            self._start_child("picker")
        self._start_child("envoy")
        self._wait("Envoy is ready", lambda: envoy_admin_json(self.run_dir, "/ready")[0] == 200, deadline)
        for name in () if early else self.node_children:
            self._start_child(name)
        if not self.control_plane_only:  # else the models serve once node hosts join
            self._wait("every model serves", self.all_models_serving, deadline, progress=True)
        self._check_stop()

    def _check_stop(self) -> None:
        if self._stopping:
            raise StartupError("asked to stop (Ctrl-C or `sie down`) before everything was up")

    def _start_child(self, name: str) -> None:
        self._check_stop()  # a stop asked for meanwhile starts nothing more
        child = self.children[name]
        child.start()
        # Every child is in the state file as soon as it runs: a `sie down` of this `sie up` while it is
        # still starting, or after it was killed, finds each one by pid.
        self.write_state()
        cores = f", CPUs {format_cpu_list(child.cpus)}: off the tiers' cores" if child.cpus is not None else ""
        self.log(f"  started {name} (pid {child.pid}{cores}, log {child.log_path})")

    def _wait(self, what: str, probe: Callable[[], bool], deadline: float, progress: bool = False) -> None:
        last_note = 0.0
        while time.monotonic() < deadline:
            self._check_stop()
            for name, c in self.children.items():
                code = c.poll()
                if code is not None:
                    raise StartupError(f"{name} {describe_exit(code)} while waiting until {what}; see {c.log_path}")
            if probe():
                return
            if progress and time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                self.log(f"  waiting until {what}: {self.progress_line()}")
            time.sleep(0.2)
        raise StartupError(f"timed out waiting until {what}; logs are in {self.run_dir / 'logs'}")

    def status(self) -> dict[str, Any] | None:
        code, body = http_json(self.ep.admin_url + "/v1/status", token=self._admin_token, tls=self._tls)
        return body if code == 200 and isinstance(body, dict) else None

    def all_models_serving(self) -> bool:
        """Every model has its desired instances ready, and an autoscaled one exactly those, its warm pool
        (and a model at zero, its one instance) asleep: the fleet has the shape the control plane wants."""
        status = self.status()
        if not status:
            return False
        models = status.get("models", [])
        if not models:
            # A cluster file of settings only (models come later with `sie apply`): nothing to wait for.
            # The status answers only once the control plane has loaded the file and its saved models.
            return True
        for m in models:
            rows = m.get("instances", [])
            ready = sum(1 for i in rows if i.get("state") == "ready")
            if ready < m.get("desired_replicas", 1):
                return False
            if (m.get("autoscale") or {}).get("by") == "sie" and (
                ready != m.get("desired_replicas", 1) or any(i.get("state") in SETTLING for i in rows)
            ):
                return False  # the warm pool is still loading, or not yet asleep
        return self.envoy_has_endpoints({m["model_id"] for m in models})

    def envoy_has_endpoints(self, model_ids: set[str]) -> bool:
        code, body = envoy_admin_json(self.run_dir, "/clusters?format=json")
        if code != 200 or not isinstance(body, dict):
            return False
        healthy: set[str] = set()
        for cluster in body.get("cluster_statuses", []):
            name = cluster.get("name", "")
            if not name.startswith("model."):
                continue
            for host in cluster.get("host_statuses", []):
                if host.get("health_status", {}).get("eds_health_status") == "HEALTHY":
                    healthy.add(name.removeprefix("model."))
        return model_ids <= healthy

    def progress_line(self) -> str:
        status = self.status()
        if not status:
            return "xds_server not answering yet"
        parts = []
        for m in status.get("models", []):
            states = [i.get("state", "?") for i in m.get("instances", [])]
            parts.append(f"{m['model_id']}: {','.join(states) or 'placing'}")
        return "; ".join(parts)

    # ---- supervise -----------------------------------------------------------------------------
    def supervise(self) -> None:
        """Keep every child alive until stop() is called (from a signal handler)."""
        while not self._stopping:
            now = time.monotonic()
            for name, child in self.children.items():
                code = child.poll()
                if code is None or self._stopping:
                    continue
                if child.next_start_at == 0.0:
                    ran = now - child.started_at
                    child.backoff_s = next_backoff(child.backoff_s, ran) if child.restarts else 0.5
                    child.next_start_at = now + child.backoff_s
                    child.last_exit = describe_exit(code)
                    self.log(f"! {name} {child.last_exit}; restarting in {child.backoff_s:.1f}s (log {child.log_path})")
                elif now >= child.next_start_at:
                    child.next_start_at = 0.0
                    child.restarts += 1
                    child.start()
                    self.log(f"  restarted {name} (pid {child.pid}, restart #{child.restarts})")
                    self.write_state()
            time.sleep(0.2)

    def request_stop(self) -> None:
        self._stopping = True

    def stop(self) -> None:
        self._stopping = True
        # The node hosts first and all at once: each drains its sidecars, then stops its workers, and
        # gets the whole of NODE_HOST_STOP_S for it, however many nodes there are.
        nodes = [child for name in self.node_children if (child := self.children.get(name)) and child.proc]
        for child in nodes:
            child.ask_to_stop()
        deadline = time.monotonic() + NODE_HOST_STOP_S
        for child in nodes:
            child.stop(grace_s=max(0.0, deadline - time.monotonic()))
            self.log(f"  stopped {child.name}")
        for name in ("envoy", "picker", "xds_server"):
            child = self.children.get(name)
            if child and child.proc is not None:
                child.stop(grace_s=CHILD_STOP_S)
                self.log(f"  stopped {name}")
        if self._lock is not None:
            release_run_dir(self.run_dir, self._lock)
            self._lock = None

    def write_state(self) -> None:
        """Record this `sie up` and its running children in the run directory's state file (sie.run_dir)."""
        write_state_file(
            self.run_dir,
            {name: c.pid for name, c in self.children.items() if c.pid},
            cluster_file=str(self.cluster_file),
            admin_url=self.ep.admin_url,
            envoy_url=self.ep.envoy_url,
            envoy_stats_url=self.ep.envoy_stats_url,
            envoy_admin_socket=str(envoy_admin_socket(self.run_dir)),
            credentials=str(self.credentials.path),
        )
