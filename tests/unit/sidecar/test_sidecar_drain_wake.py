"""A wake during a drain: the drain ends at the wake, hands back nothing (the queue belongs to a serving
instance again) and says it was superseded; a drain no wake touched still hands back at its bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import make_mocked_request

from sidecar import lifecycle
from sidecar.admin import Admin
from sidecar.admission import Gate, Limits, Verdict, Waiter
from sidecar.drain import DrainController, DrainSuperseded
from sidecar.status import Status
from sie.auth import Identity, Role
from sie.auth.http import IDENTITY_KEY
from sie.telemetry import InstanceState

BOUND_S = 5.0  # every test here ends in well under this; one that waits it out has failed


class FakeWorker:
    async def load(self):
        return None

    async def release_memory(self) -> None:
        pass

    async def resume_memory(self) -> None:
        pass


class FakeWatch:
    """A poke gets a fresh OK probe at once, as the real watch does from a healthy worker."""

    def __init__(self, status: Status):
        self.status = status

    def poke(self) -> None:
        self.status.apply(lifecycle.on_probe, lifecycle.Probe.OK)


class World:
    """One request held at the worker (max_concurrent 1), so no drain reaches idleness by itself."""

    def __init__(self, before_drain=None):
        loop = asyncio.get_running_loop()
        self.status = Status("m-0")
        self.status.apply(lifecycle.on_probe, lifecycle.Probe.OK)
        self.gate = Gate(Limits(1, 8, 30.0), loop)
        assert self.gate.arrive()[0] is Verdict.ADMITTED
        self.controller = DrainController(
            self.status, self.gate, FakeWorker(), FakeWatch(self.status), None, loop.time, before_drain=before_drain
        )
        self.tasks: list[asyncio.Task] = []

    def start(self, operation) -> asyncio.Task:
        task = asyncio.create_task(operation)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        """Whatever a failed test left running is cancelled and awaited, so no task outlives it."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.gate.close()

    def queue(self, n: int) -> list[Waiter]:
        waiters = []
        for _ in range(n):
            verdict, waiter = self.gate.arrive()
            assert verdict is Verdict.QUEUED and waiter is not None
            waiters.append(waiter)
        return waiters


@pytest.fixture
async def worlds():
    made: list[World] = []

    def make(before_drain=None) -> World:
        made.append(World(before_drain))
        return made[-1]

    yield make
    for w in made:
        await w.close()


async def _until(condition) -> None:
    async with asyncio.timeout(BOUND_S):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("drain_timeout_s", [0.2, 60.0])
async def test_requests_queued_after_a_wake_are_not_handed_back_by_the_drain_it_superseded(worlds, drain_timeout_s):
    w = worlds()
    drain = w.start(w.controller.drain(drain_timeout_s))
    await _until(lambda: w.status.state is InstanceState.DRAINING)
    assert await w.controller.wake(1.0) is True and w.status.state is InstanceState.READY
    queued = w.queue(2)  # new traffic to a serving instance
    async with asyncio.timeout(BOUND_S):  # a drain still waiting out 60 s fails here
        with pytest.raises(DrainSuperseded) as caught:
            await drain
    await asyncio.sleep(0.3)  # past the short bound: nothing is handed back late either
    assert (caught.value.report.handed_back, caught.value.report.in_flight, caught.value.report.idle) == (0, 1, False)
    assert caught.value.report.waited_s < 1.0  # ended at the wake, not at its bound
    assert w.gate.core.queued == 2 and not any(q.token is not None and q.token.done() for q in queued)
    w.gate.release()
    assert await asyncio.wait_for(w.gate.wait(queued[0]), BOUND_S) is Verdict.ADMITTED


async def test_a_wake_while_the_before_drain_hook_runs_supersedes_the_drain(worlds):
    hook_may_finish = asyncio.Event()
    w = worlds(before_drain=hook_may_finish.wait)
    drain = w.start(w.controller.drain(0.2))
    await _until(lambda: w.status.state is InstanceState.DRAINING)
    await w.controller.wake(1.0)
    queued = w.queue(1)
    hook_may_finish.set()
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(DrainSuperseded) as caught:
            await drain
    await asyncio.sleep(0.3)
    assert caught.value.report.handed_back == 0 and w.gate.core.queued == 1 and not queued[0].token.done()


async def test_a_drain_after_the_wake_owns_the_queue_and_hands_it_back_at_its_own_bound(worlds):
    w = worlds()
    first = w.start(w.controller.drain(60.0))
    await _until(lambda: w.status.state is InstanceState.DRAINING)
    await w.controller.wake(1.0)
    queued = w.queue(2)
    second = await asyncio.wait_for(w.controller.drain(0.2), BOUND_S)
    assert second.handed_back == 2 and w.status.state is InstanceState.DRAINING
    assert [await asyncio.wait_for(w.gate.wait(q), BOUND_S) for q in queued] == [Verdict.HANDED_BACK] * 2
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(DrainSuperseded) as caught:
            await first
    assert caught.value.report.handed_back == 0


@pytest.mark.parametrize("step", ["drain", "shutdown"])
async def test_without_a_wake_the_queue_is_handed_back_at_the_bound(worlds, step):
    w = worlds()
    queued = w.queue(2)
    report = await asyncio.wait_for(getattr(w.controller, step)(0.2), BOUND_S)
    assert report.handed_back == 2 and report.in_flight == 1 and report.waited_s >= 0.15
    assert [await asyncio.wait_for(w.gate.wait(q), BOUND_S) for q in queued] == [Verdict.HANDED_BACK] * 2


async def test_a_wake_during_a_shutdown_is_refused_and_does_not_cut_it_short(worlds):
    # The process exits after a shutdown whatever is asked meanwhile: a wake is refused (409 from the
    # admin route) instead of reporting ready until the process stops, and the shutdown still waits out
    # its bound and hands back what is left, rather than leave the queue to be cut when the server closes.
    w = worlds()
    queued = w.queue(1)
    shutdown = w.start(w.controller.shutdown(0.3))
    await _until(lambda: w.status.state is InstanceState.DRAINING)
    with pytest.raises(lifecycle.TransitionError, match="stopping"):
        await w.controller.wake(1.0)
    with pytest.raises(lifecycle.TransitionError, match="stopping"):
        await w.controller.sleep(1.0, "eviction")
    assert w.status.state is InstanceState.DRAINING
    report = await asyncio.wait_for(shutdown, BOUND_S)
    assert report.handed_back == 1 and report.waited_s >= 0.25 and w.status.state is InstanceState.STOPPED
    assert await asyncio.wait_for(w.gate.wait(queued[0]), BOUND_S) is Verdict.HANDED_BACK


async def test_a_sleeping_instance_shut_down_is_not_woken_and_its_memory_not_resumed(worlds):
    w = worlds()
    w.status.apply(lifecycle.sleep)
    w.status.apply(lifecycle.released)
    resumed = []
    w.controller._worker.resume_memory = lambda: resumed.append(1)  # type: ignore[method-assign]
    w.status.apply(lifecycle.shut_down)
    assert w.status.state is InstanceState.SLEEPING
    with pytest.raises(lifecycle.TransitionError, match="stopping"):
        await w.controller.wake(1.0)
    assert resumed == [] and w.status.state is InstanceState.SLEEPING


async def test_the_drain_route_answers_409_superseded_with_the_report(worlds):
    w = worlds()
    admin = Admin(w.status, w.controller, reporter=None, metrics=None, drain_timeout_s=60.0, node="n-1")
    request = make_mocked_request("POST", "/-/drain?timeout_s=2")  # a drain left running ends soon
    request[IDENTITY_KEY] = Identity(Role.ADMIN, "ops")
    answer = w.start(admin.drain(request))
    await _until(lambda: w.status.state is InstanceState.DRAINING)
    await w.controller.wake(1.0)
    response = await asyncio.wait_for(answer, BOUND_S)
    error = json.loads(response.text)["error"]
    assert response.status == 409 and error["type"] == "superseded" and error["state"] == "ready"
    assert error["drain"]["handed_back"] == 0 and error["drain"]["in_flight"] == 1
    assert "POST /-/drain again" in error["message"]
