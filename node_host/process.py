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
import socket
import subprocess
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from sie.processes import describe_exit, popen_in_own_session, signal_group

__all__ = ["Child", "PopenChild", "Spawn", "describe_exit", "free_port", "spawn"]


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
        signal_group(self.pid, sig)


def spawn(argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> PopenChild:
    """Start `argv` with stdout and stderr appended to `log_path`. `env` adds to the node host's
    environment. Call from the main thread (see the module docstring)."""
    return PopenChild(popen_in_own_session(list(argv), log_path, {**os.environ, **env} if env else None))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind port 0, read it, close). Another process may take it
    before the child binds; the child then exits and the supervisor restarts it with backoff."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
