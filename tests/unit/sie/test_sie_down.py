"""`sie down` and `sie up`'s "already running" check read pids from the run directory's state file; a
pid there may since belong to another process (after a crash, a reboot), which they must neither signal
nor take for SIE."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sie import standalone
from sie.cluster import ClusterSettings
from sie.errors import StartupError
from sie.processes import Child, pid_alive, process_start
from sie.run_dir import (
    STATE_FILE,
    AlreadyRunning,
    read_state,
    state_owner_alive,
    state_problems,
    stop_running,
)
from sie_testing.ports import free_port

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def write_state(run_dir, pid: int, started: int | None, children: dict[str, tuple[int, int | None]]) -> None:
    state = {
        "pid": pid,
        "pid_started": started,
        "children": {name: child_pid for name, (child_pid, _) in children.items()},
        "children_started": {name: start for name, (_, start) in children.items()},
    }
    (run_dir / STATE_FILE).write_text(json.dumps(state))


def test_a_pid_is_alive_only_while_it_is_the_process_that_was_recorded():
    proc = subprocess.Popen(SLEEPER)
    try:
        started = process_start(proc.pid)
        assert isinstance(started, int)
        assert pid_alive(proc.pid) and pid_alive(proc.pid, started)
        assert not pid_alive(proc.pid, started + 1)  # another process with the same number
    finally:
        proc.kill()
        proc.wait()
    assert not pid_alive(proc.pid, started)


def test_sie_down_leaves_alone_a_process_that_took_over_a_recorded_pid(tmp_path):
    stranger = subprocess.Popen(SLEEPER)
    other_child = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        start = process_start(stranger.pid)
        child_start = process_start(other_child.pid)
        assert start is not None and child_start is not None
        write_state(tmp_path, stranger.pid, start - 1, {"envoy": (other_child.pid, child_start - 1)})
        assert not state_owner_alive(json.loads((tmp_path / STATE_FILE).read_text()))
        logs: list[str] = []
        assert stop_running(tmp_path, timeout_s=2, log=logs.append)
        time.sleep(0.2)
        assert stranger.poll() is None and other_child.poll() is None, "sie down signalled a stranger"
        assert logs == []
        assert not (tmp_path / STATE_FILE).exists()
    finally:
        for proc in (stranger, other_child):
            proc.kill()
            proc.wait()


def test_sie_down_stops_the_recorded_processes(tmp_path):
    sie_up = subprocess.Popen(SLEEPER)  # stands for `sie up`: SIGTERM ends it
    leftover = subprocess.Popen(SLEEPER, start_new_session=True)  # a child that outlived it
    try:
        start, leftover_start = process_start(sie_up.pid), process_start(leftover.pid)
        write_state(tmp_path, sie_up.pid, start, {"envoy": (leftover.pid, leftover_start)})
        logs: list[str] = []
        assert stop_running(tmp_path, timeout_s=10, log=logs.append)
        assert sie_up.wait(timeout=10) == -15
        assert leftover.wait(timeout=10) == -9
        assert logs == [f"stopping leftover envoy (pid {leftover.pid})"]
    finally:
        for proc in (sie_up, leftover):
            proc.kill()
            proc.wait()


def test_a_state_file_without_start_times_falls_back_to_the_pid(tmp_path):
    sie_up = subprocess.Popen(SLEEPER)
    try:
        write_state(tmp_path, sie_up.pid, None, {})
        assert state_owner_alive(json.loads((tmp_path / STATE_FILE).read_text()))
        assert stop_running(tmp_path, timeout_s=10, log=lambda _line: None)
        assert sie_up.wait(timeout=10) == -15
    finally:
        sie_up.kill()
        sie_up.wait()


def test_sie_down_of_another_users_sie_up_says_so_and_keeps_its_state(tmp_path, monkeypatch):
    sie_up = subprocess.Popen(SLEEPER)
    real_kill = os.kill

    def kill(pid: int, sig: int) -> None:  # as a user who may not signal that process
        if pid == sie_up.pid and sig != 0:
            raise PermissionError(1, "Operation not permitted")
        real_kill(pid, sig)

    monkeypatch.setattr("sie.run_dir.os.kill", kill)
    try:
        write_state(tmp_path, sie_up.pid, process_start(sie_up.pid), {})
        logs: list[str] = []
        assert not stop_running(tmp_path, timeout_s=2, log=logs.append)
        assert logs == [f"sie up (pid {sie_up.pid}) runs as another user; this one may not stop it"]
        assert (tmp_path / STATE_FILE).exists() and sie_up.poll() is None
    finally:
        real_kill(sie_up.pid, signal.SIGKILL)
        sie_up.wait()


# A child that, on SIGTERM, records that it was asked and waits until every sibling was asked too (as a
# node host draining its sidecars takes its time), then exits 0. Stopped one after another, the first
# waits in vain for the second and exits 3.
TAKES_ITS_TIME = """
import os, signal, sys, time
from pathlib import Path
here, siblings = Path(sys.argv[1]), int(sys.argv[2])
def asked(*_):
    (here / f"asked-{os.getpid()}").touch()
    deadline = time.monotonic() + 5
    while len(list(here.glob("asked-*"))) < siblings:
        if time.monotonic() > deadline:
            sys.exit(3)  # the others were never asked while this one was stopping
        time.sleep(0.02)
    (here / f"done-{os.getpid()}").touch()
    sys.exit(0)
signal.signal(signal.SIGTERM, asked)
(here / f"ready-{os.getpid()}").touch()
while True:
    time.sleep(1)
"""


def test_the_node_hosts_are_asked_to_stop_together_not_one_after_another(tmp_path, monkeypatch):
    monkeypatch.setattr(standalone, "NODE_HOST_STOP_S", 15.0)
    stack = standalone.Stack(tmp_path / "cluster.yaml", ClusterSettings(), tmp_path / "run", log=lambda _l: None)
    for name in ("node-a", "node-b"):
        child = Child(name, [sys.executable, "-c", TAKES_ITS_TIME, str(tmp_path), "2"], tmp_path / f"{name}.log")
        stack.children[name] = child
        stack.node_children.append(name)
        child.start()
    try:
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        stack.stop()
        assert len(list(tmp_path.glob("done-*"))) == 2  # each exited on its own, none killed at its grace
        assert all(child.poll() == 0 for child in stack.children.values())
    finally:
        for child in stack.children.values():
            child.stop(grace_s=1)


# ---- one `sie up` per run directory, and a `sie down` that finds one still starting ---------------------


def quiet_stack(tmp_path, **settings) -> standalone.Stack:
    return standalone.Stack(
        tmp_path / "cluster.yaml", ClusterSettings(**settings), tmp_path / "run", log=lambda _line: None
    )


def test_a_second_sie_up_on_the_same_run_directory_is_refused_while_the_first_starts(tmp_path):
    first = quiet_stack(tmp_path)
    first.claim()  # what `sie up` does before its first child starts
    second = quiet_stack(tmp_path)
    try:
        with pytest.raises(AlreadyRunning, match=rf"already running or starting .* \(pid {os.getpid()}\)"):
            second.claim()
        second.stop()  # `sie up` stops what it started when it fails: the first's state file stays
        assert read_state(tmp_path / "run")["pid"] == os.getpid()
    finally:
        first.stop()
    assert read_state(tmp_path / "run") is None
    second.claim()  # the first has stopped: the directory is free
    second.stop()


def test_a_killed_sie_up_leaves_its_run_directory_free_and_the_next_stops_what_it_left(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", CLAIMS, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )  # claims the run directory, names a child in its state file, then waits
    leftover = subprocess.Popen(SLEEPER, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "claimed"
        with pytest.raises(AlreadyRunning):
            quiet_stack(tmp_path).claim()
        state = read_state(tmp_path / "run")
        state["children"] = {"envoy": leftover.pid}
        state["children_started"] = {"envoy": process_start(leftover.pid)}
        (tmp_path / "run" / STATE_FILE).write_text(json.dumps(state))
        holder.kill()
        holder.wait()
        stack = quiet_stack(tmp_path)
        stack.claim()  # the kernel let go of the dead one's lock
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert read_state(tmp_path / "run")["pid"] == os.getpid()
        stack.stop()
    finally:
        for proc in (holder, leftover):
            proc.kill()
            proc.communicate()


CLAIMS = """
import sys, time
from pathlib import Path
from sie.cluster import ClusterSettings
from sie.standalone import Stack
Stack(Path(sys.argv[1]) / "cluster.yaml", ClusterSettings(), Path(sys.argv[1]) / "run").claim()
print("claimed", flush=True)
time.sleep(60)
"""

# `sie up` as far as its wait for the control plane, with a sleeper for xds_server (nothing answers its
# /healthz, so it waits there, as a real one does while it syncs), stopped as `sie up` is: SIGTERM.
STARTING = """
import signal, sys, time
from pathlib import Path
from sie.cluster import ClusterSettings
from sie.processes import Child
from sie.errors import StartupError
from sie.standalone import Stack
here, ports = Path(sys.argv[1]), [int(p) for p in sys.argv[2:]]
settings = ClusterSettings(
    envoy_port=ports[0], envoy_admin_port=ports[1], admin_port=ports[2], xds_port=ports[3], picker_port=0
)
stack = Stack(here / "cluster.yaml", settings, here / "run")
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
stack._build_children = lambda: stack.children.update(xds_server=Child("xds_server", sleeper, here / "x.log"))
signal.signal(signal.SIGTERM, lambda *_: stack.request_stop())
try:
    stack.start(ready_timeout_s=60)
except StartupError as exc:
    print("start failed:", exc, flush=True)
finally:
    stack.stop()
"""


def test_sie_down_stops_a_sie_up_that_is_still_starting(tmp_path):
    ports = [str(free_port()) for _ in range(4)]
    sie_up = subprocess.Popen(
        [sys.executable, "-c", STARTING, str(tmp_path), *ports], stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        state = None
        while time.monotonic() < deadline and not (state and state.get("children")):
            state = read_state(tmp_path / "run") if (tmp_path / "run").exists() else None
            time.sleep(0.05)
        assert state and state["pid"] == sie_up.pid, "the state file names a `sie up` before it is up"
        (child_pid,) = state["children"].values()
        assert stop_running(tmp_path / "run", timeout_s=20, log=lambda _line: None)
        out, _ = sie_up.communicate(timeout=20)
        assert "asked to stop (Ctrl-C or `sie down`) before everything was up" in out
        assert not pid_alive(child_pid, state["children_started"]["xds_server"])
        assert read_state(tmp_path / "run") is None
    finally:
        sie_up.kill()
        sie_up.communicate()


def test_a_stack_asked_to_stop_starts_no_more_children(tmp_path):
    stack = quiet_stack(tmp_path)
    stack.children["xds_server"] = Child("xds_server", SLEEPER, tmp_path / "x.log")
    stack.request_stop()
    try:
        with pytest.raises(StartupError, match="asked to stop"):
            stack._start_child("xds_server")
        assert stack.children["xds_server"].proc is None
    finally:
        stack.children["xds_server"].stop(grace_s=1)


# ---- a state file that is not one `sie up` wrote ---------------------------------------------------------


@pytest.mark.parametrize(
    "content, why",
    [
        ('{"pid": "x"}', "'pid' is 'x', not a process id"),
        ("{}", "names no 'pid'"),
        ("[1]", "JSON list, not an object"),
        ("not json", "not JSON"),
        ('{"pid": PID, "children": {"envoy": "x"}}', "'children' is not a table"),
        ('{"pid": PID, "children_started": []}', "'children_started' is not a table"),
        ('{"pid": PID, "pid_started": "soon"}', "'pid_started' is not a start time"),
        ('{"pid": PID, "admin_url": 7}', "'admin_url' is not a URL"),
    ],
)
def test_sie_down_and_sie_status_name_what_is_wrong_with_a_malformed_state_file(tmp_path, capsys, content, why):
    from sie.cli import main

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has: were the file believed, nothing would be signalled
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / STATE_FILE).write_text(content.replace("PID", str(gone.pid)))
    for command in ("down", "status"):
        assert main([command, "--run-dir", str(run)]) == 1
        err = capsys.readouterr().err
        assert why in err and f"rm {run / STATE_FILE}" in err, err


@pytest.mark.parametrize(
    "state, why",
    [
        ({"pid": True}, "not a process id"),  # int(True) is 1: init
        ({"pid": 0}, "not a process id"),  # os.kill(0, ...) signals this process's whole group
        ({"pid": -1}, "not a process id"),  # os.kill(-1, ...) signals every process it may
        ({"pid": 2**31}, "not a process id"),  # os.kill cannot take it
        ({"pid": 7, "children": {"envoy": 0}}, "'children' is not a table"),
        ({"pid": 7, "children_started": {"envoy": -3}}, "'children_started' is not a table"),
    ],
)
def test_a_pid_sie_down_would_misread_is_not_one(state, why):
    """Checked on the parsed file only: handed to `sie down`, these would signal init or a whole group."""
    assert any(why in problem for problem in state_problems(state))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
STATE_KEYS = st.sampled_from(["pid", "pid_started", "children", "children_started", "admin_url"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(STATE_KEYS, JSON, max_size=5) | JSON)
def test_any_state_file_is_either_refused_by_name_or_safe_for_sie_down_to_read(state):
    if state_problems(state):
        return
    state_owner_alive(state)  # neither raises nor may be given a pid os.kill cannot take
    for child_pid in state.get("children", {}).values():
        pid_alive(child_pid, state.get("children_started", {}).get("x"))


def test_sie_join_refuses_a_run_directory_a_sie_up_holds(tmp_path, monkeypatch, capsys):
    from sie.cli import main

    def no_exec(*_args):
        raise AssertionError("sie join went on to start a node host")

    monkeypatch.setattr("os.execv", no_exec)
    stack = quiet_stack(tmp_path)
    stack.claim()
    try:
        argv = ["join", "http://127.0.0.1:1", "--node", "n1", "--token-file", "t", "--trust-file", "p"]
        assert main([*argv, "--run-dir", str(tmp_path / "run")]) == 1
        assert "already running or starting" in capsys.readouterr().err
    finally:
        stack.stop()
