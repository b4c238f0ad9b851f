"""Child processes of `sie up`: start them so none can outlive SIE, stop them by pid, always reap.

Every child starts in its own session (a Ctrl-C in the terminal reaches only `sie up`, which then stops
the children in order) and with PR_SET_PDEATHSIG=SIGTERM, so even a SIGKILLed `sie up` leaves no
orphan behind: the kernel signals each child when its parent dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    """One supervised child process with its restart bookkeeping."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start_at: float = 0.0
    backoff_s: float = 0.5
    last_exit: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                env=self.env,
            )
        finally:
            log.close()
        self.started_at = time.monotonic()

    def poll(self) -> int | None:
        """The exit code if the child has ended (and is reaped), else None."""
        if self.proc is None:
            return None
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, wait up to grace_s, then SIGKILL the child's whole process group. Always reaps."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        # The child's session may still hold grandchildren that ignored SIGTERM; they must not outlive it.
        _signal_group(self.proc.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def next_backoff(current_s: float, ran_for_s: float, *, initial_s: float = 0.5, cap_s: float = 10.0,
                 stable_after_s: float = 30.0) -> float:
    """Delay before the next restart: doubles per crash, back to the start after a stable run."""
    if ran_for_s >= stable_after_s:
        return initial_s
    return min(cap_s, max(initial_s, current_s * 2))
