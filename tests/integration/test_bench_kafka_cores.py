"""bench.kafka's per-second CPU reading of one process (the broker's), on real processes and /proc: a
busy process reads near one core in each second, an idle one near zero, and the awaited work's result
comes back."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from bench.kafka import cores_by_second
from bench.kafka_stack import Procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BUSY = "import time\nend = time.monotonic() + 4\nwhile time.monotonic() < end: pass"
IDLE = "import time\ntime.sleep(4)"


def test_cores_by_second_reads_a_busy_and_an_idle_process():
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    idle = subprocess.Popen([sys.executable, "-c", IDLE])
    try:

        async def work(value: str) -> str:
            await asyncio.sleep(2.5)
            return value

        async def both():
            return await asyncio.gather(cores_by_second(busy.pid, work("b")), cores_by_second(idle.pid, work("i")))

        (result_b, busy_cores), (result_i, idle_cores) = asyncio.run(both())
    finally:
        for proc in (busy, idle):
            proc.kill()
            proc.wait(timeout=5)
    assert (result_b, result_i) == ("b", "i")
    assert len(busy_cores) == 2 and len(idle_cores) == 2, "one reading per whole second of the work"
    assert max(busy_cores) > 0.4, busy_cores  # two cores shared with the test itself: not a full one
    assert max(idle_cores) < 0.1, idle_cores


def test_a_process_that_is_gone_gives_no_readings():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=10)

    async def work() -> int:
        await asyncio.sleep(1.2)
        return 7

    assert asyncio.run(cores_by_second(gone.pid, work())) == (7, [])


def test_procs_pid_names_the_latest_process_of_a_name(tmp_path):
    procs = Procs(tmp_path)
    try:
        first = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"])
        second = procs.start("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"])
        assert procs.pid("sleeper") == second.pid != first.pid
        with pytest.raises(KeyError, match="tansu"):
            procs.pid("tansu")
    finally:
        procs.stop_all()
