"""Helpers for tests that run the whole standalone stack (`sie up`) as a user would."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from sie import processes
from sie.auth.store import read_trust_bundle
from sie.cluster import load_cluster
from sie.processes import die_with_parent
from sie.standalone import envoy_admin_json
from sie_testing import error_shape
from sie_testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]


# Envoy's own listeners that are not SIE's (their errors are Envoy's plain text), by URL prefix.
NOT_SIE: set[str] = set()


def request(
    method: str,
    url: str,
    body: object | None = None,
    headers: dict | None = None,
    timeout: float = 30.0,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict, object]:
    """One HTTP call; an error answer from any SIE component must be in the one error shape. `context`
    verifies an https URL (default the system's CAs)."""
    data = None
    hdrs = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs.setdefault("content-type", "application/json")
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            raw, status, rh = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, rh = exc.read(), exc.code, dict(exc.headers)
    try:
        parsed: object = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    if status >= 400 and not any(url.startswith(prefix) for prefix in NOT_SIE):
        error_shape.check(status, parsed)
    return status, rh, parsed


def wait_until(probe, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except Exception as exc:  # noqa: BLE001 - a probe may fail while things start
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting until {what}; last: {last!r}")


def descendants(pid: int) -> set[int]:
    """Every live process whose ancestry includes pid (from /proc)."""
    return set(processes.descendants(pid))


def listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports the process listens on (from /proc: its sockets' inodes in /proc/net/tcp{,6})."""
    listening: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A":  # LISTEN
                listening[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    ports = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in listening:
            ports.add(listening[target[8:-1]])
    return ports


NOBODY = 65534
# Run as root, it becomes nobody (after its interpreter has started, from wherever it is installed) and
# tries the socket; its exit code is the errno (0: it connected).
_CONNECT_AS_NOBODY = """
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(sys.argv[1])
except OSError as exc:
    sys.exit(exc.errno or 255)
"""


def connect_as_nobody(path: Path) -> int:
    """Try to connect to the Unix socket at `path` as the unprivileged user nobody (the caller must be root):
    0 if it could, else the errno (13: permission denied)."""
    done = subprocess.run([sys.executable, "-c", _CONNECT_AS_NOBODY, str(path)], capture_output=True, timeout=20)
    assert done.returncode >= 0 and not done.stderr, done.stderr
    return done.returncode


def alive(pid: int) -> bool:
    """Running: not gone and not a zombie (one that exited and waits to be reaped)."""
    return processes.proc_stat(pid) is not None and processes.pid_alive(pid)


@dataclass
class Stack:
    proc: subprocess.Popen
    workdir: Path
    run_dir: Path
    envoy: str
    envoy_stats: str  # Envoy's stats listener: GET /ready and /stats/prometheus of its admin, nothing else
    admin: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def envoy_admin(self, path: str) -> tuple[int, object]:
        """GET a page of Envoy's admin interface: (status, JSON or text). Through its Unix socket in the run
        directory, as `sie up` reads it: it has no TCP port."""
        return envoy_admin_json(self.run_dir, path, timeout=5)

    @property
    def token(self) -> str:
        """The admin token `sie up` made in its run directory."""
        return (self.run_dir / "credentials" / "admin.token").read_text().strip()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def tls(self) -> ssl.SSLContext:
        """How to verify the admin API when it serves HTTPS: against the CA in the run directory's trust.pem."""
        return read_trust_bundle(self.run_dir / "credentials" / "trust.pem").tls

    def request(
        self, method: str, url: str, body: object | None = None, timeout: float = 30.0
    ) -> tuple[int, dict, object]:
        """`request` with the admin credential (admin API, node host API, sidecar control listeners)."""
        context = self.tls if url.startswith("https:") else None
        return request(method, url, body, headers=self.headers, timeout=timeout, context=context)

    def status(self) -> dict:
        code, _, body = self.request("GET", self.admin + "/v1/status", timeout=5)
        assert code == 200, body
        return body

    def model(self, name: str) -> dict:
        """The model's row of GET /v1/status (its instances, autoscale block, ...)."""
        (found,) = [m for m in self.status()["models"] if m["model_id"] == name]
        return found

    def node_events(self, kind: str | None = None) -> list[dict]:
        """The (one) node host's memory events (GET /v1/events), of one kind if given."""
        (node,) = self.status()["nodes"]
        code, _, body = self.request("GET", node["address"] + "/v1/events", timeout=5)
        assert code == 200, body
        return [e for e in body["events"] if kind is None or e["kind"] == kind]

    def state(self) -> dict:
        return json.loads((self.run_dir / "sie.json").read_text())

    def sie(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sie", *args], cwd=self.workdir, capture_output=True, text=True, timeout=timeout
        )


def picker_port_flags(cluster_file: Path, extra: tuple[str, ...]) -> list[str]:
    """A free port for the endpoint picker, unless the cluster file or the caller chooses one. Its default,
    18001, was the one fixed port of every test stack: any other stack on the machine, or one left over
    from a killed run, failed every stack test after it with "port 18001 is already in use"."""
    if "--picker-port" in extra or "picker_port" in load_cluster(cluster_file).settings.model_fields_set:
        return []
    return ["--picker-port", str(free_port())]


def start_stack(workdir: Path, cluster_file: Path, timeout: float = 400, extra: tuple[str, ...] = ()) -> Stack:
    ports = {name: free_port() for name in ("envoy", "envoy_admin", "admin", "xds")}
    run_dir = workdir / "run"
    log_path = workdir / "sie-up.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sie",
            "up",
            "-f",
            str(cluster_file),
            "--envoy-port",
            str(ports["envoy"]),
            "--envoy-admin-port",
            str(ports["envoy_admin"]),
            "--admin-port",
            str(ports["admin"]),
            "--xds-port",
            str(ports["xds"]),
            "--run-dir",
            str(run_dir),
            "--timeout",
            str(timeout),
            *picker_port_flags(cluster_file, extra),
            *extra,
        ],
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # A test run that is killed (or crashes) takes its stacks with it: `sie up` gets SIGTERM when
        # the thread that started it ends, and stops what it started. Without this, a killed pytest left
        # `sie up` running, holding its ports and failing the next run.
        preexec_fn=die_with_parent(),
    )
    log.close()
    stack = Stack(
        proc,
        workdir,
        run_dir,
        f"http://127.0.0.1:{ports['envoy']}",
        f"http://127.0.0.1:{ports['envoy_admin']}",
        f"http://127.0.0.1:{ports['admin']}",
        log_path,
    )
    NOT_SIE.add(stack.envoy_stats)
    try:
        wait_until(lambda: proc.poll() is not None or "SIE is up" in stack.log(), timeout + 30, "sie up is up")
        if proc.poll() is not None:
            raise AssertionError(f"sie up exited {proc.returncode}:\n{stack.log()}")
        stack.admin = stack.state()["admin_url"]  # https when the cluster's admin_tls says so
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def stop_stack(stack: Stack) -> None:
    """Stop `sie up` like Ctrl-C would, and make sure nothing it started survives."""
    if stack.proc.poll() is None:
        tree = descendants(stack.proc.pid)
        stack.proc.send_signal(signal.SIGINT)
        try:
            stack.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(stack.proc.pid, signal.SIGKILL)
            stack.proc.wait(timeout=10)
        for pid in tree:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
