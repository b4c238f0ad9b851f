"""DrainController's `before_drain` hook (the Kafka connector's drain): awaited once the state reads draining and
before the DrainController waits for idleness, on every way out of service (drain, sleep, shutdown)."""

from __future__ import annotations

import asyncio

import pytest

from sidecar import lifecycle
from sidecar.admission import Gate, Limits, Verdict
from sidecar.drain import DrainController
from sidecar.status import Status
from sie.telemetry import InstanceState


class FakeWorker:
    def __init__(self, log: list[str]):
        self.log = log

    async def load(self):
        return None  # a worker that cannot say whether it is idle is taken at our word

    async def release_memory(self) -> None:
        self.log.append("release")

    async def resume_memory(self) -> None:
        self.log.append("resume")


class FakeWatch:
    def poke(self) -> None:
        pass


class FakeMetrics:
    def __init__(self):
        self.evictions = 0

    def evicted(self) -> None:
        self.evictions += 1


class KafkaLike:
    """Holds one worker slot, as a Kafka request in flight does, until its drain finishes that work."""

    def __init__(self, gate: Gate, status: Status, log: list[str], fail: bool = False):
        self.gate, self.status, self.log, self.fail = gate, status, log, fail
        verdict, _ = gate.arrive()
        assert verdict is Verdict.ADMITTED
        self.holding = True

    async def drain(self) -> None:
        self.log.append(f"kafka drain while {self.status.state.value}")
        await asyncio.sleep(0.01)
        if self.holding:
            self.holding = False
            self.gate.release()
        if self.fail:
            raise RuntimeError("broker went away")


def world(fail: bool = False):
    loop = asyncio.get_running_loop()
    status = Status("m-0")
    status.apply(lifecycle.on_probe, lifecycle.Probe.OK)
    gate = Gate(Limits(4, 8, 5.0), loop)
    log: list[str] = []
    kafka = KafkaLike(gate, status, log, fail)
    controller = DrainController(
        status, gate, FakeWorker(log), FakeWatch(), FakeMetrics(), loop.time, before_drain=kafka.drain
    )
    return controller, status, gate, kafka, log


async def test_drain_stops_kafka_after_the_state_turns_draining_and_then_reaches_idle():
    controller, status, gate, kafka, log = world()
    report = await controller.drain(timeout_s=2.0)
    assert log == ["kafka drain while draining"]
    # The slot the Kafka request held was given back by the hook, so the drain found the instance idle
    # instead of running into its bound.
    assert report.idle and report.in_flight == 0 and report.waited_s < 2.0
    assert status.state is InstanceState.DRAINING


async def test_sleep_releases_memory_only_after_kafka_has_stopped():
    controller, status, gate, kafka, log = world()
    report, state = await controller.sleep(timeout_s=2.0, reason="eviction")
    assert log == ["kafka drain while draining", "release"]
    assert state is InstanceState.SLEEPING and report is not None and report.idle


async def test_shutdown_drains_kafka_before_reporting_stopped():
    controller, status, gate, kafka, log = world()
    report = await controller.shutdown(timeout_s=2.0)
    assert log == ["kafka drain while draining"]
    assert report.idle and status.state is InstanceState.STOPPED


async def test_a_failing_hook_does_not_stop_the_http_drain(caplog):
    controller, status, gate, kafka, log = world(fail=True)
    report = await controller.drain(timeout_s=2.0)
    assert report.idle and status.state is InstanceState.DRAINING
    assert "before_drain hook failed" in caplog.text


async def test_without_a_hook_the_drain_waits_for_the_slot_until_its_bound():
    loop = asyncio.get_running_loop()
    status = Status("m-0")
    gate = Gate(Limits(4, 8, 5.0), loop)
    gate.arrive()  # a request that never finishes
    controller = DrainController(status, gate, FakeWorker([]), FakeWatch(), FakeMetrics(), loop.time)
    report = await controller.drain(timeout_s=0.1)
    assert not report.idle and report.in_flight == 1


@pytest.mark.parametrize("step", ["drain", "sleep"])
async def test_the_hook_runs_on_each_call(step):
    controller, status, gate, kafka, log = world()
    if step == "drain":
        await controller.drain(timeout_s=1.0)
        await controller.drain(timeout_s=1.0)
        assert log == ["kafka drain while draining"] * 2  # idempotent in the connector, called each time
    else:
        await controller.sleep(timeout_s=1.0, reason="idle")
        await controller.sleep(timeout_s=1.0, reason="idle")  # already asleep: nothing to do
        assert log == ["kafka drain while draining", "release"]
