"""The run directory's bookkeeping: one `sie up` (or `sie join`) per run directory, and `sie down` finding it.

A run directory (`--run-dir`; .sie/run by default) holds what one running SIE needs on this machine: its
credentials, logs and saved state, and the two files of this module, which are how the commands of that
SIE find each other. The machine may run other users' software (DESIGN §10), and `sie down` kills the
pids the state file names, so the directory is used only when it is this user's alone: a real directory,
0700, owned by this user, in directories nobody else could swap it out of (sie.auth.store.private_dir).

The lock, RUN_DIR/sie.lock (LOCK_FILE): the one process using the directory holds it (flock, exclusive)
from before its first child starts until its last has stopped, and writes "PID START" of itself into it
(START: when that process started, in clock ticks since boot; with the pid it names one process, where a
pid alone may name a later one). The kernel lets go of a flock when its last holder ends, however it ends,
so a killed `sie up` never leaves the directory locked; `sie join` keeps the descriptor across the exec
into its node host, which so holds it. A second `sie up` or `sie join` on the directory is refused
(AlreadyRunning) for as long as the first holds it, even while that one is still starting, and is told the
holder's pid while that process (by its start time) runs.

The state file, RUN_DIR/sie.json (STATE_FILE): JSON the lock's holder (`sie up` only) writes 0600, under a
fresh name renamed into place (sie.auth.store.write_private), before its first child starts and again
each time one starts or restarts: its own pid and start time ("pid", "pid_started"), each child's
("children", "children_started": name to pid, name to start time), and where its services are
("admin_url", ..., for `sie status`). So `sie down` finds, and stops, a `sie up` that is still starting.

Taking the directory (claim_run_dir): make sure it is this user's alone, take the lock, then read the
state file a previous `sie up` left: if the process it names still runs (a `sie up` of a version that took
no lock) it is refused too; if not (it was killed), the children it names that still run are killed
first (stop_leftovers); then this process's state file is written. Letting go (release_run_dir): the state
file is removed, and the lock closed last: until then a new `sie up` would find the children still running.

Reading it (`sie down`, `sie status`: read_state): only a regular file (not a symbolic link) of this user
(or root), at most MAX_STATE_BYTES, holding JSON of the shape `sie up` writes (state_problems); anything
else is a StateFileError that says which and how to remove it. A file of an older version (no start
times) is read, and its pids are then checked without them. A pid is signalled, or taken for SIE, only
while it is still the process recorded there (sie.processes.pid_alive with its start time), never one that
took the number over after a crash or a reboot.

Stopping it (`sie down`: stop_running): SIGTERM to the `sie up` the state file names (its own stop order
and grace: sie.standalone.Stack.stop), waited for up to a timeout, then SIGKILL; then the process group of
every recorded child still running is killed (stop_leftovers); then the state file is removed, but only if
it still names that `sie up`: a new one may have taken the directory meanwhile, and its file is its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sie.auth import write_private
from sie.auth.store import private_dir, trusted_owner
from sie.errors import SIEError, StartupError
from sie.processes import pid_alive, process_start

STATE_FILE = "sie.json"
# Held (flock, exclusive) by the `sie up` or `sie join` using the run directory, from before its first
# child starts until its last has stopped; it holds "PID START" of its holder.
LOCK_FILE = "sie.lock"
MAX_STATE_BYTES = 1 << 20


class AlreadyRunning(StartupError):
    """Another `sie up` or `sie join` holds the run directory's lock: stop it, or use another --run-dir."""


class StateFileError(SIEError):
    """The run directory's state file is not one `sie up` wrote (or not this user's): the message says which."""


# ---- the lock -------------------------------------------------------------------------------------------


def lock_run_dir(run_dir: Path) -> int:
    """Hold RUN_DIR/sie.lock (flock, exclusive) and write "PID START" of this process into it: the open
    descriptor, to keep for as long as the run directory is in use. The kernel lets go of the lock when
    its last holder ends, however it ends, so a killed `sie up` never leaves the directory locked; a
    descriptor kept across exec (`sie join`'s node host) keeps it. AlreadyRunning, naming the holder,
    when another process holds it."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StartupError(f"cannot open {path}: {exc.strerror}; remove it and run again") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not trusted_owner(os.fstat(fd).st_uid, os.getuid()):
            raise StartupError(f"{path} is not a file of yours: remove it and run again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # The holder writes its line just after it takes the lock: a line read meanwhile may be an
            # earlier holder's, so the pid is named only while that process (by its start time) runs.
            pid, _, started = os.pread(fd, 64, 0).decode(errors="replace").strip().partition(" ")
            alive = pid.isdigit() and started.isdigit() and pid_alive(int(pid), int(started) or None)
            holder = f" (pid {pid})" if alive else ""
            raise AlreadyRunning(
                f"SIE is already running or starting with the run directory {run_dir}{holder}: "
                f"`sie down --run-dir {run_dir}` stops a `sie up` (Ctrl-C a `sie join`), or choose another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {process_start(os.getpid()) or 0}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- `sie up`: taking the run directory and letting it go ----------------------------------------------


def claim_run_dir(run_dir: Path, record: Callable[[], None], log: Callable[[str], None]) -> int:
    """Take the run directory for a `sie up`: make sure it is this user's alone (private_dir), hold its lock
    (lock_run_dir), stop what a `sie up` that was killed left running, and call `record` (which writes
    this process's state file, write_state_file) before any child starts. The lock's descriptor, to keep
    until release_run_dir. AlreadyRunning when another `sie up` or `sie join` has the directory."""
    private_dir(run_dir, "run directory")
    lock = lock_run_dir(run_dir)
    try:
        previous = read_state(run_dir)
        if previous is not None and state_owner_alive(previous):  # a `sie up` that took no lock (older)
            raise AlreadyRunning(
                f"SIE is already running with the run directory {run_dir} (pid {previous['pid']}): "
                f"`sie down --run-dir {run_dir}` stops it"
            )
        if previous is not None:
            stop_leftovers(previous, log)
        record()
    except BaseException:
        os.close(lock)
        raise
    return lock


def write_state_file(run_dir: Path, children: dict[str, int], **where: str) -> None:
    """Write the state file of the `sie up` that is this process, holding the run directory's lock: its pid,
    `where` (its services' URLs and paths, as `sie status` reads them), and `children` (name to pid), each
    pid with when that process started."""
    state = {
        "pid": os.getpid(),
        "pid_started": process_start(os.getpid()),
        **where,
        "children": children,
        # With each pid, when that process started: `sie down` signals a pid only while it is still
        # the process recorded here, not one that took the number over after a crash.
        "children_started": {name: process_start(pid) for name, pid in children.items()},
    }
    write_private(run_dir / STATE_FILE, json.dumps(state, indent=2).encode())


def release_run_dir(run_dir: Path, lock: int) -> None:
    """Let go of the run directory once every child has stopped: its state file, then its lock (the
    descriptor claim_run_dir returned)."""
    # Only the holder of the lock wrote the state file; a `sie up` refused by it leaves the running one's
    # alone. The lock goes last: until then a new `sie up` would find our children.
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    os.close(lock)


# ---- reading the state file -----------------------------------------------------------------------------


def _is_pid(value: Any) -> bool:
    # Below 2**31: os.kill takes a C int, and Linux pids stay below 2**22.
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31


def _is_start(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


def state_problems(state: Any) -> list[str]:
    """What makes `state` (a parsed state file) other than one `sie up` wrote, each named: what `sie down`
    and `sie status` read of it. A file of an older version (no start times) is fine."""
    if not isinstance(state, dict):
        return [f"it holds a JSON {type(state).__name__}, not an object"]
    problems = []
    if "pid" not in state:
        problems.append("it names no 'pid'")
    elif not _is_pid(state["pid"]):
        problems.append(f"its 'pid' is {str(state['pid'])[:32]!r}, not a process id")
    if not _is_start(state.get("pid_started")):
        problems.append("its 'pid_started' is not a start time")
    if not isinstance(state.get("admin_url", ""), str):
        problems.append("its 'admin_url' is not a URL")
    for key, valid, what in (("children", _is_pid, "ids"), ("children_started", _is_start, "start times")):
        table = state.get(key, {})
        if not isinstance(table, dict) or not all(isinstance(k, str) and valid(v) for k, v in table.items()):
            problems.append(f"its '{key}' is not a table of process names to {what}")
    return problems


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The state file of the `sie up` of `run_dir`, or None when there is none. StateFileError when it is
    not one `sie up` wrote (state_problems), or not this user's: `sie down` signals the pids it names, so
    they must be ones this user's `sie up` recorded. The run directory must be this user's alone."""
    path = private_dir(run_dir, "run directory", create=False) / STATE_FILE
    remove = f"if no `sie up` runs with --run-dir {run_dir}, remove it (`rm {path}`)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateFileError(f"cannot read the state file {path}: {exc.strerror}; {remove}") from None
    with open(fd, "rb") as f:
        info = os.fstat(f.fileno())
        data = f.read(MAX_STATE_BYTES + 1)
    if not stat.S_ISREG(info.st_mode) or not trusted_owner(info.st_uid, os.getuid()):
        raise StateFileError(f"the state file {path} is not a file of yours (owner uid {info.st_uid}); {remove}")
    try:
        if len(data) > MAX_STATE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
        state = json.loads(data)
    except ValueError as exc:
        raise StateFileError(f"the state file {path} is not JSON ({exc}); {remove}") from None
    problems = state_problems(state)
    if problems:
        raise StateFileError(f"the state file {path} is not one `sie up` wrote: {'; '.join(problems)}; {remove}")
    return dict(state)


def _recorded_start(value: Any) -> int | None:
    """A start time from the state file; None (check the pid alone) for a file written before they were
    recorded or by a system without /proc."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def state_owner_alive(state: dict[str, Any]) -> bool:
    """Whether the `sie up` that wrote `state` still runs (not a later process that took its pid)."""
    return pid_alive(int(state["pid"]), _recorded_start(state.get("pid_started")))


# ---- `sie down` -----------------------------------------------------------------------------------------


def stop_running(run_dir: Path, timeout_s: float, log: Callable[[str], None] = print) -> bool:
    """`sie down`: ask the running `sie up` to stop and wait until it and every child is gone (`timeout_s`:
    how long it may take to stop its stack, sie.standalone.STACK_STOP_S, before it is killed)."""
    state = read_state(run_dir)
    if state is None:
        log(f"no running SIE found (no {run_dir / STATE_FILE})")
        return False
    pid = int(state["pid"])
    if state_owner_alive(state):
        try:
            os.kill(pid, signal.SIGTERM)
        except PermissionError:
            log(f"sie up (pid {pid}) runs as another user; this one may not stop it")
            return False
        deadline = time.monotonic() + timeout_s
        while state_owner_alive(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        if state_owner_alive(state):
            log(f"sie up (pid {pid}) did not stop within {timeout_s:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
    stop_leftovers(state, log)
    try:
        current = read_state(run_dir)
    except SIEError:
        current = None
    # A new `sie up` may have taken the directory meanwhile: its state file is its own.
    if current is not None and (current["pid"], current.get("pid_started")) == (pid, state.get("pid_started")):
        (run_dir / STATE_FILE).unlink(missing_ok=True)
    return True


def stop_leftovers(state: dict[str, Any], log: Callable[[str], None]) -> None:
    """Kill what the children `state` names left running, by pid and while each is still the process recorded
    there. A `sie up` that died without stopping them had its children sent SIGTERM by the kernel
    (PDEATHSIG); this makes sure of it, and takes their process groups too."""
    children_started = state.get("children_started") or {}
    for name, child_pid in state.get("children", {}).items():
        if child_pid and pid_alive(int(child_pid), _recorded_start(children_started.get(name))):
            log(f"stopping leftover {name} (pid {child_pid})")
            try:
                os.killpg(int(child_pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
