"""Child processes of the node host: how they are started, signalled and reaped.

Every child (worker, sidecar) starts in its own session, so it and anything it forks (SGLang forks a
scheduler and a detokenizer) form one process group that a stop signals as a whole. Each child also
asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG), so a node host killed with
SIGKILL leaves no orphan serving stale weights.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. Children must
therefore be spawned from the main thread (the event loop's), never from an executor thread that may
be retired while the child lives.

`Spawn` is the seam the supervisor's tests replace: it returns anything with `pid`, `poll()` and
`signal_group(sig)`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Mapping, Protocol, Sequence

_PR_SET_PDEATHSIG = 1


class Child(Protocol):
    pid: int

    def poll(self) -> int | None:
        """The exit status once the process has ended (reaping it), else None. Negative: killed by -N."""
        ...

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the child's whole process group; a group already gone is not an error."""
        ...


class Spawn(Protocol):
    def __call__(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> Child: ...


class PopenChild:
    """A real child process (subprocess.Popen) in its own session."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # the child leads its own session, so its pgid is its pid
        except ProcessLookupError:
            pass
        except PermissionError:
            # The group is gone and its id reused by someone else's process: nothing of ours to signal.
            pass


_prctl = None  # libc's prctl, looked up in the parent: the child (between fork and exec) must not dlopen


def _die_with_parent(prctl, parent_pid: int) -> None:
    """Runs in the child between fork and exec; keep it to two system calls."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody would stop us
        os._exit(1)


def spawn(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> PopenChild:
    """Start `argv` with stdout and stderr appended to `log_path`. `env` adds to the node host's
    environment. Call from the main thread (see the module docstring)."""
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl = _prctl
    log_path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    with open(log_path, "ab", buffering=0) as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"\n=== {stamp} starting: {' '.join(argv)}\n".encode())
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
            start_new_session=True,
            preexec_fn=lambda: _die_with_parent(prctl, parent),
            close_fds=True,
        )
    return PopenChild(popen)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind port 0, read it, close). Another process may take it
    before the child binds; the child then exits and the supervisor restarts it with backoff."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def describe_exit(status: int) -> str:
    """'exit code 1' or 'killed by SIGKILL', for logs and the instance report."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit code {status}"
