"""Child processes of the node host: how they are started, signalled and reaped.

Every child (worker, sidecar) starts in its own session, so it and anything it forks (SGLang forks a
scheduler and a detokenizer) form one process group that a stop signals as a whole. Each child also
asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so a node host killed with
SIGKILL leaves no orphan serving stale weights.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. Children must
therefore be spawned from the main thread (the event loop's), never from an executor thread that may
be retired while the child lives.

The low-level part (own session, PDEATHSIG with the parent check, group signals) is sie.processes,
shared with `sie up`. `Spawn` is the seam the supervisor's tests replace: it returns anything with `pid`, `poll()` and
`signal_group(sig)`.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from sie.processes import describe_exit, popen_in_own_session, signal_group

__all__ = [
    "Child",
    "PopenChild",
    "PortReservations",
    "Spawn",
    "describe_exit",
    "free_port",
    "last_words",
    "log_size",
    "read_tail",
    "spawn",
]

TAIL_BYTES = 4096  # of a child's log read when it exits with an error
# Terminal sequences: CSI (colours, cursor; colon and private parameters too) and OSC (titles, links).
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")


def log_size(path: Path) -> int:
    """Bytes in a log file now (0 when there is none): where a child started now begins to write."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_tail(path: Path, size: int = TAIL_BYTES, start: int = 0) -> bytes:
    """The last `size` bytes of a log file at or after byte `start` (what one run of a child wrote, the
    log being appended across restarts); empty when it cannot be read or is not a regular file. When the
    read begins inside the file, its first, partial line is left out."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in its place must not block the loop
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            begin = max(start, f.seek(0, os.SEEK_END) - size)
            f.seek(begin)
            data = f.read(size)
        except OSError:
            return b""
    if begin > start:
        data = data.partition(b"\n")[2]
    return data


def last_words(tail: bytes, lines: int = 3, limit: int = 300, secrets: Sequence[str] = ()) -> str | None:
    """What a child that exited with an error said last (as Kubernetes' FallbackToLogsOnError shows
    it): its last `lines` non-empty lines of log, joined with " | ", terminal sequences and control
    characters dropped (a tab read as a space), each of `secrets` replaced by "***", cut to `limit`
    characters from the end (the reason comes last). None when it said nothing."""
    text = _ANSI.sub("", tail.decode("utf-8", errors="replace")).replace("\t", " ")
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    kept = ["".join(c for c in line if c.isprintable()).strip() for line in text.splitlines()]
    said = " | ".join([line for line in kept if line][-lines:])
    if not said:
        return None
    return said if len(said) <= limit else "..." + said[-(limit - 3) :]


class Child(Protocol):
    pid: int

    def poll(self) -> int | None:
        """The exit status once the process has ended (reaping it), else None. Negative: killed by -N."""
        ...

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the child's whole process group; a group already gone is not an error."""
        ...


class Spawn(Protocol):
    def __call__(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cpus: frozenset[int] | None = None,
        background: bool = False,
    ) -> Child:
        """Start argv (`env` added to the node host's environment; `cpus`: the only cores it may use,
        None: unpinned; `background`: SCHED_IDLE; both set before exec)."""
        ...


class PopenChild:
    """A real child process (subprocess.Popen) in its own session."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def signal_group(self, sig: int) -> None:
        signal_group(self.pid, sig)


def spawn(
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cpus: frozenset[int] | None = None,
    background: bool = False,
) -> PopenChild:
    """Start `argv` with stdout and stderr appended to `log_path`. `env` adds to the node host's
    environment; `cpus` pins it (and all it starts) to those cores and `background` makes it SCHED_IDLE,
    before exec (node_host.cpus). Call from the main thread (see the module docstring)."""
    merged = {**os.environ, **env} if env else None
    return PopenChild(popen_in_own_session(list(argv), log_path, merged, cpus, background))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind port 0, read it, close). Another process may take it
    before the child binds, so children this node host restarts get ports from PortReservations."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class PortReservations:
    """Ports for children, each held until released so no other socket on this host can take it.

    A port picked with bind-0-and-close is free only for a moment: the kernel may hand it out as the
    source port of any outgoing connection, and a long-lived one (a keep-alive pool) holds it for
    minutes, so a worker that binds its port after a 7 s model load failed with EADDRINUSE on every
    restart. Here the node host keeps a socket bound to each port it hands out (SO_REUSEADDR, never
    listening): Linux never picks an explicitly bound port as an ephemeral source port, the child binds
    it beside the reservation (children bind with SO_REUSEADDR: aiohttp and uvicorn do), and while the
    child is down a connect is refused at once, as for a free port, so a sidecar still sees its worker gone."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._held: dict[int, socket.socket] = {}

    def take(self) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        port = sock.getsockname()[1]
        self._held[port] = sock
        return port

    def release(self, port: int) -> None:
        sock = self._held.pop(port, None)
        if sock is not None:
            sock.close()

    def held(self) -> set[int]:
        return set(self._held)

    def close(self) -> None:
        for port in list(self._held):
            self.release(port)
