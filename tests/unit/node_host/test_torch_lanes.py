"""A lane runs its jobs in order on one daemon thread, and a stuck job never holds its closer or the
process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from node_host.backends.torch_engine.lanes import Lane

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def lane():
    lane = Lane("test")
    yield lane
    lane.close()


def test_jobs_run_in_order_on_one_thread(lane):
    seen: list[tuple[int, str]] = []
    futures = [lane.submit(lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    for f in futures:
        f.result(5)
    assert seen == [(i, "test") for i in range(5)]


def test_a_jobs_error_is_its_callers_and_the_lane_goes_on(lane):
    with pytest.raises(ZeroDivisionError):
        lane.submit(lambda: 1 / 0).result(5)
    assert lane.submit(lambda: 42).result(5) == 42


async def test_a_cancelled_caller_unqueues_its_job(lane):
    assert await lane.run(lambda: 7) == 7
    gate = threading.Event()
    lane.submit(gate.wait, 5)
    ran: list[int] = []
    task = asyncio.create_task(lane.run(lambda: ran.append(1)))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    gate.set()
    assert await lane.run(lambda: "after") == "after" and ran == []


async def test_closing_does_not_wait_for_a_stuck_job_beyond_its_grace():
    lane = Lane("stuck")
    never = threading.Event()
    lane.submit(never.wait)
    await asyncio.sleep(0.05)
    lane.close()
    t0 = time.monotonic()
    assert not await lane.wait_closed(0.2)
    assert time.monotonic() - t0 < 1.0 and lane.daemon
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(print)
    never.set()
    assert await lane.wait_closed(5)


def test_a_stuck_job_does_not_keep_the_process_alive():
    """A ThreadPoolExecutor's threads are joined at exit: SIGTERM then waited for SIGKILL."""
    code = (
        "import threading\n"
        "from node_host.backends.torch_engine.lanes import Lane\n"
        "Lane('stuck').submit(threading.Event().wait)\n"
        "print('exiting', flush=True)\n"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert done.returncode == 0 and done.stdout == "exiting\n", done.stderr
    assert time.monotonic() - t0 < 10
