"""Pressure: evictions and wakes carried out through (fake) sidecars, against a real ledger."""

from __future__ import annotations

import asyncio
import signal

import pytest

from node_host.gpu_manager import GPUManager, Placed
from node_host.ledger import EntryState
from node_host.pressure import EventLog, EvictionMode, Pressure
from node_host.sidecar_control import Outcome
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState
from sie.wire import GPUInfo
from tests.unit.node_host.node_fakes import GIB, Clock, FakeControl, Spawner, assignment, settle, supervisor


class Rig:
    def __init__(self, tmp_path, mode=EvictionMode.DRAIN):
        self.clock, self.spawner, self.control = Clock(), Spawner(), FakeControl()
        self.manager = GPUManager(
            [GPUInfo(0, "virtual GPU (80 GiB, simulated)", 80 * GIB, 0.0, virtual=True)], facts={}
        )
        self.sup = supervisor(tmp_path, self.spawner, gpu_for=lambda iid, s: self.manager.gpu_of(iid))
        self.tasks: list[asyncio.Task] = []
        self.events = EventLog(wall=lambda: 1.7e9 + self.clock.now)
        self.pressure = Pressure(
            self.manager,
            self.sup,
            self.control,
            self.events,
            spawn=self.spawn,
            mode=mode,
            retry_after_s=5.0,
            clock=self.clock,
            wall=lambda: 1.7e9 + self.clock.now,
            sleep=lambda s: asyncio.sleep(0),
        )
        for iid in ("chat-p2-0", "chat-p2-1"):  # the GPU holds two loaded P2 instances: 56 GiB of 80
            a = assignment(iid)
            assert isinstance(self.manager.admit(iid, parse_model_service(a.spec, "t"), 0.0), Placed)
            self.sup.start(a)
            self.manager.loaded(iid)
        self.done: list[bool] = []

    def spawn(self, coro, name):
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task

    def evict_for_p0(self) -> tuple[str, ...]:
        decision = self.manager.admit(
            "chat-p0-0", parse_model_service(assignment("chat-p0-0", "P0", 30720).spec, "t"), 0.0
        )
        self.pressure.evict(decision.victims, for_instance="chat-p0-0", for_label="P0", on_done=self.done.append)
        return decision.victims

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events.to_json()]


async def test_memory_is_freed_only_after_the_victims_sidecar_has_put_it_to_sleep(tmp_path):
    rig = Rig(tmp_path)
    rig.control.sleep_gate = asyncio.Event()
    (victim,) = rig.evict_for_p0()
    await settle()
    address = rig.sup.instances[victim].control_address
    assert rig.control.calls == [("sleep", address)]
    # Draining: the ledger still holds the victim; nothing else may start a memory operation.
    assert rig.manager.state_of(victim) is EntryState.LOADED and rig.manager.ledger.gpus[0].level_mb == 56 * GIB
    assert rig.pressure.notes[victim].state is InstanceState.DRAINING and not rig.pressure.ready
    rig.control.sleep_gate.set()
    await asyncio.gather(*rig.tasks)
    assert rig.done == [True] and rig.pressure.ready
    assert rig.manager.state_of(victim) is EntryState.SLEEPING and rig.manager.ledger.gpus[0].level_mb == 28 * GIB
    note = rig.pressure.notes[victim]
    assert (
        note.state is InstanceState.SLEEPING
        and "evicted for chat-p0-0 (P0)" in note.detail
        and "drained 2" in note.detail
    )
    assert rig.kinds() == ["pressure", "eviction_started", "memory_released"]
    assert rig.sup.instances[victim].worker_child.signals == []  # drain mode never touches the processes


@pytest.mark.parametrize(
    "outcome",
    [
        Outcome(False, 409, error="not idle after 20.0s: 1 requests are still in flight"),
        Outcome(False, 0, error="no answer"),
    ],
)
async def test_a_failed_sleep_is_undone_and_frees_nothing(tmp_path, outcome):
    rig = Rig(tmp_path)
    rig.control.sleep_result = outcome
    (victim,) = rig.evict_for_p0()
    await asyncio.gather(*rig.tasks)
    address = rig.sup.instances[victim].control_address
    assert rig.control.calls == [("sleep", address), ("wake", address)]  # serve again
    assert rig.done == [False] and rig.manager.state_of(victim) is EntryState.LOADED
    assert rig.pressure.notes[victim].state is None and "failed" in rig.pressure.notes[victim].detail
    assert not rig.pressure.ready  # no new eviction for retry_after_s
    rig.clock.now += 5.0
    assert rig.pressure.ready


async def test_a_victim_whose_sidecar_is_down_is_not_called_and_frees_nothing(tmp_path):
    """The call carries the node's token, and while a sidecar is down another process of this host may
    listen on its port: nothing is sent there, and the eviction fails as an unanswered one does."""
    rig = Rig(tmp_path)
    for inst in rig.sup.instances.values():
        inst.sidecar_child.status = 1  # exited, not yet restarted
    (victim,) = rig.evict_for_p0()
    await asyncio.gather(*rig.tasks)
    assert rig.control.calls == []
    assert rig.done == [False] and rig.manager.state_of(victim) is EntryState.LOADED
    assert "its sidecar is not running" in rig.pressure.notes[victim].detail


async def test_a_sleeper_wakes_when_the_gpu_falls_under_the_low_watermark(tmp_path):
    rig = Rig(tmp_path)
    (victim,) = rig.evict_for_p0()
    await asyncio.gather(*rig.tasks)
    rig.manager.admit("chat-p0-0", parse_model_service(assignment("chat-p0-0", "P0", 30720).spec, "t"), 0.0)
    rig.manager.loaded("chat-p0-0")
    rig.pressure.step()
    assert rig.pressure.ready and len(rig.tasks) == 1  # 58 GiB held: no room under 60 GiB for 28 more
    rig.manager.release("chat-p0-0")  # the P0 model was deleted
    rig.pressure.step()
    assert rig.pressure.waking == victim and rig.manager.state_of(victim) is EntryState.LOADING  # one load at a time
    rig.pressure.step()  # a second step starts nothing while the wake runs
    await asyncio.gather(*rig.tasks)
    assert rig.control.calls[-1] == ("wake", rig.sup.instances[victim].control_address)
    assert rig.manager.state_of(victim) is EntryState.LOADED and victim not in rig.pressure.notes
    assert rig.kinds()[-2:] == ["wake_started", "woken"]


async def test_a_failed_wake_leaves_it_asleep_and_waits_before_trying_again(tmp_path):
    rig = Rig(tmp_path)
    (victim,) = rig.evict_for_p0()
    await asyncio.gather(*rig.tasks)
    rig.control.wake_result = Outcome(False, 504, error="the worker did not report healthy within 60s")
    rig.pressure.step()
    await asyncio.gather(*rig.tasks)
    assert rig.manager.state_of(victim) is EntryState.SLEEPING and "wake failed" in rig.pressure.notes[victim].detail
    calls = len(rig.control.calls)
    rig.pressure.step()
    assert len(rig.control.calls) == calls  # quiet for retry_after_s


async def test_kill_mode_kills_the_worker_without_a_drain_and_restarts_it_to_wake(tmp_path):
    rig = Rig(tmp_path, mode=EvictionMode.KILL)
    workers = {iid: inst.worker_child for iid, inst in rig.sup.instances.items()}
    (victim,) = rig.evict_for_p0()
    await asyncio.gather(*rig.tasks)
    inst = rig.sup.instances[victim]
    assert set(workers[victim].signals) == {signal.SIGKILL} and inst.worker_parked and inst.worker_child is None
    assert rig.control.calls == [] and rig.manager.state_of(victim) is EntryState.SLEEPING
    assert rig.pressure.notes[victim].state is InstanceState.STOPPED
    rig.sup.tick()
    assert inst.worker_child is None  # parked: not restarted like a crash
    spawned = len(rig.spawner.children)
    rig.pressure.step()
    await settle()
    assert len(rig.spawner.children) == spawned + 1 and not inst.worker_parked  # a cold start
    rig.control.healthy.add(inst.worker_address)
    await asyncio.gather(*rig.tasks)
    assert rig.manager.state_of(victim) is EntryState.LOADED and rig.kinds()[-1] == "woken"


async def test_demand_wakes_a_sleeper_that_fits_under_the_high_watermark_only_when_its_model_is_starved(tmp_path):
    rig = Rig(tmp_path)
    small_p0 = parse_model_service(assignment("chat-p0-0", "P0", 14 * 1024).spec, "t")
    rig.manager.sleep("chat-p2-0")
    assert isinstance(rig.manager.admit("chat-p0-0", small_p0, 0.0), Placed)
    rig.manager.loaded("chat-p0-0")
    # 14 + 28 held; waking 28 more gives 70 GiB: over the low watermark (60), under the high one (72).
    rig.pressure.step(starved=lambda model_id: False)
    assert rig.pressure.waking is None
    rig.pressure.step(starved=lambda model_id: model_id == "chat-p2")
    assert rig.pressure.waking == "chat-p2-0"
    await asyncio.gather(*rig.tasks)
    assert rig.manager.state_of("chat-p2-0") is EntryState.LOADED
    assert "demand for chat-p2 returned" in rig.events.to_json()[-2]["why"]


async def test_demand_never_wakes_a_sleeper_that_would_need_a_victim(tmp_path):
    rig = Rig(tmp_path)
    rig.evict_for_p0()
    await asyncio.gather(*rig.tasks)
    rig.manager.admit("chat-p0-0", parse_model_service(assignment("chat-p0-0", "P0", 30720).spec, "t"), 0.0)
    rig.manager.loaded("chat-p0-0")
    rig.pressure.step(starved=lambda model_id: True)  # 58 + 28 > 72: it would take the P0's memory
    assert rig.pressure.waking is None


def test_the_event_counts_outlive_the_bounded_log():
    events = EventLog(wall=lambda: 1.7e9, maxlen=2)
    for kind in ("eviction_started", "memory_released", "eviction_started", "woken"):
        events.add(kind, "chat-p2-0")
    assert [e["kind"] for e in events.to_json()] == ["eviction_started", "woken"]  # the log forgot two
    assert events.counts == {"eviction_started": 2, "memory_released": 1, "woken": 1}  # the counts did not
