"""bench/cpu_cap.py on real processes: a busy process capped to a third of the CPU is held stopped about
two thirds of the time (sampled from /proc: what the machine's other load does not change), and when the
cap is told to end, it runs again (never left stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sie.processes import proc_stat, terminate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _stopped_share(pid: int, seconds: float) -> float:
    states = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        states.append(_state(pid))
        time.sleep(0.0037)  # not a divisor of the cap's period
    return states.count("T") / len(states)


def _ticks(pid: int) -> int:
    stat = proc_stat(pid)
    assert stat is not None
    return stat.ticks


def test_a_capped_process_gets_its_fraction_and_runs_again_when_the_cap_ends():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    cap = None
    try:
        assert _stopped_share(busy.pid, 0.5) == 0.0
        cap = subprocess.Popen(
            [sys.executable, "-m", "bench.cpu_cap", "--fraction", "0.333", str(busy.pid)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert cap.stdout is not None and cap.stdout.readline().startswith("capping")
        stopped = _stopped_share(busy.pid, 2.0)
        assert 0.5 < stopped < 0.8, stopped  # 2/3 of every 30 ms
        cap.send_signal(signal.SIGTERM)
        assert cap.wait(10) == 0
        assert _stopped_share(busy.pid, 0.5) == 0.0
        ticks = _ticks(busy.pid)
        time.sleep(0.5)
        assert _ticks(busy.pid) > ticks  # it runs
    finally:
        terminate(cap, 5)
        if cap is not None and cap.stdout is not None:
            cap.stdout.close()
        os.kill(busy.pid, signal.SIGCONT)
        terminate(busy, 5)


def test_the_cap_ends_by_itself_when_its_processes_are_gone():
    short = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
    cap = subprocess.Popen(
        [sys.executable, "-m", "bench.cpu_cap", "--fraction", "0.5", str(short.pid)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while short.poll() is None and time.monotonic() < deadline:  # reaped here, so its pid goes away
            time.sleep(0.05)
        assert cap.wait(10) == 0
    finally:
        terminate(cap, 5)
        terminate(short, 5)
