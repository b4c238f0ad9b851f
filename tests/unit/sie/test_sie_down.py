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

from sie import standalone
from sie.cluster import ClusterSettings
from sie.processes import Child, pid_alive, process_start
from sie.standalone import STATE_FILE, state_owner_alive, stop_running

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

    monkeypatch.setattr("sie.standalone.os.kill", kill)
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
