"""sie.tasks.SupervisedTasks: FATAL deaths reach the owner, RESTART tasks come back after their backoff
(counted), LOG tasks only log, and stop() leaves nothing pending. Sleeps are faked; every test is bounded."""

from __future__ import annotations

import asyncio

import pytest

from sie.tasks import Backoff, Policy, SupervisedTasks, wait_event

pytestmark = pytest.mark.timeout(10)


class FakeSleep:
    """Records each pause and returns at once (after yielding to the loop)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.pauses.append(seconds)
        await asyncio.sleep(0)


async def _settle(until, rounds: int = 200) -> None:
    for _ in range(rounds):
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def _pending() -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()}


@pytest.mark.parametrize("body_ends", ["raises", "returns"])
async def test_a_fatal_death_reaches_the_owner(body_ends: str) -> None:
    deaths: list[tuple[str, BaseException]] = []
    tasks = SupervisedTasks(on_fatal=lambda name, exc: deaths.append((name, exc)))

    async def loop() -> None:
        await asyncio.sleep(0)
        if body_ends == "raises":
            raise ValueError("boom")

    tasks.start("control-loop", Policy.FATAL, loop)
    await _settle(lambda: deaths)
    name, exc = deaths[0]
    assert name == "control-loop" and tasks.fatal == deaths[0]
    assert isinstance(exc, ValueError if body_ends == "raises" else RuntimeError)
    assert len(deaths) == 1 and len(tasks) == 0
    await tasks.stop()


async def test_a_fatal_one_shot_may_return_but_not_raise() -> None:
    deaths: list[str] = []
    tasks = SupervisedTasks(on_fatal=lambda name, exc: deaths.append(name))

    async def ok() -> None:
        await asyncio.sleep(0)

    async def bad() -> None:
        raise KeyError("x")

    tasks.start("sync-ok", Policy.FATAL, ok, forever=False)
    tasks.start("sync-bad", Policy.FATAL, bad, forever=False)
    await _settle(lambda: len(tasks) == 0)
    assert deaths == ["sync-bad"]
    await tasks.stop()


async def test_a_restart_task_comes_back_after_a_doubling_capped_backoff() -> None:
    sleep, runs, deaths = FakeSleep(), [], []
    tasks = SupervisedTasks(on_fatal=lambda name, exc: deaths.append(name), sleep=sleep, clock=lambda: 0.0)

    async def flaky() -> None:
        runs.append(1)
        if len(runs) % 2:
            raise ValueError("one bad reply")
        # even runs return, which is also restarted

    tasks.start("health", Policy.RESTART, flaky, backoff=Backoff(base_s=0.5, max_s=2.0))
    await _settle(lambda: len(runs) >= 5)
    await tasks.stop()
    assert sleep.pauses[:4] == [0.5, 1.0, 2.0, 2.0]
    assert tasks.restarts["health"] == len(runs) - 1  # each run after the first is one restart
    assert deaths == [] and tasks.fatal is None


async def test_a_long_healthy_run_resets_the_backoff() -> None:
    sleep, now = FakeSleep(), [0.0]
    tasks = SupervisedTasks(sleep=sleep, clock=lambda: now[0])

    async def body() -> None:
        if len(sleep.pauses) == 2:
            now[0] += 100.0  # this run lasted longer than reset_after_s
        raise ValueError("again")

    tasks.start("load", Policy.RESTART, body, backoff=Backoff(base_s=1.0, max_s=8.0, reset_after_s=60.0))
    await _settle(lambda: len(sleep.pauses) >= 4)
    await tasks.stop()
    assert sleep.pauses[:4] == [1.0, 2.0, 1.0, 2.0]


async def test_a_log_task_only_logs(caplog: pytest.LogCaptureFixture) -> None:
    deaths: list[str] = []
    tasks = SupervisedTasks(on_fatal=lambda name, exc: deaths.append(name))

    async def stop_instance() -> None:
        raise OSError("gone")

    tasks.start("stop:i1", Policy.LOG, stop_instance, forever=False)
    await _settle(lambda: len(tasks) == 0)
    assert deaths == [] and tasks.fatal is None
    assert any("stop:i1" in r.getMessage() for r in caplog.records)
    await tasks.stop()


async def test_stop_cancels_every_task_and_leaves_none_pending() -> None:
    deaths: list[str] = []
    tasks = SupervisedTasks(on_fatal=lambda name, exc: deaths.append(name))
    started = [tasks.start(f"fatal-{i}", Policy.FATAL, lambda: asyncio.sleep(3600)) for i in range(3)]
    started.append(tasks.start("restart", Policy.RESTART, lambda: asyncio.sleep(3600)))
    started.append(tasks.start("log", Policy.LOG, lambda: asyncio.sleep(3600), forever=False))
    await asyncio.sleep(0)
    assert {t.get_name() for t in started} == {"fatal-0", "fatal-1", "fatal-2", "restart", "log"}
    assert len(tasks) == 5
    await tasks.stop()
    assert all(t.cancelled() for t in started)
    assert len(tasks) == 0 and not _pending()
    assert deaths == []  # being stopped is not a death


async def test_stop_while_a_restart_task_is_in_its_backoff() -> None:
    tasks = SupervisedTasks()  # the real asyncio.sleep: stop must cut the pause short

    async def dies() -> None:
        raise ValueError("boom")

    task = tasks.start("telemetry", Policy.RESTART, dies, backoff=Backoff(base_s=3600.0, max_s=3600.0))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(tasks.stop(), 1.0)
    assert task.cancelled() and not _pending()


async def test_wait_event() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 1.0) is True
