"""Pressure's fleet operations: sleeping an instance the control plane keeps asleep (the warm pool, a
model at zero), and waking one at once for a request its sidecar holds, against a real ledger."""

from __future__ import annotations

import asyncio

from node_host.gpu_manager import Placed
from node_host.ledger import EntryState
from node_host.sidecar_control import Outcome
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState
from tests.unit.node_host.node_fakes import GIB, assignment
from tests.unit.node_host.test_pressure import Rig


async def test_a_fleet_sleep_drains_then_frees_the_memory_for_no_one(tmp_path):
    rig = Rig(tmp_path)
    assert rig.pressure.sleep_for_fleet("chat-p2-0", "the warm pool")
    assert not rig.pressure.ready, "one memory operation at a time"
    assert not rig.pressure.sleep_for_fleet("chat-p2-1", "the warm pool"), "a second waits its turn"
    await asyncio.gather(*rig.tasks)
    assert rig.control.reasons == ["idle"]
    assert rig.manager.state_of("chat-p2-0") is EntryState.SLEEPING
    assert rig.manager.ledger.gpus[0].level_mb == 28 * GIB
    note = rig.pressure.notes["chat-p2-0"]
    assert note.state is InstanceState.SLEEPING and "the warm pool" in note.detail
    assert "slept" in rig.kinds() and rig.pressure.ready


async def test_a_failed_fleet_sleep_serves_again_and_frees_nothing(tmp_path):
    rig = Rig(tmp_path)
    rig.control.sleep_result = Outcome(False, 409, {"error": {"type": "not_idle"}}, "409 not_idle")
    assert rig.pressure.sleep_for_fleet("chat-p2-0", "the warm pool")
    await asyncio.gather(*rig.tasks)
    assert rig.manager.state_of("chat-p2-0") is EntryState.LOADED
    assert [c[0] for c in rig.control.calls] == ["sleep", "wake"], "undone: the instance serves again"
    assert "sleep_failed" in rig.kinds()


async def asleep(rig: Rig, iid: str = "chat-p2-0") -> None:
    assert rig.pressure.sleep_for_fleet(iid, "zero")
    await asyncio.gather(*rig.tasks)
    rig.tasks.clear()
    rig.control.calls.clear()


async def test_a_wake_for_a_held_request_returns_once_it_serves(tmp_path):
    rig = Rig(tmp_path)
    await asleep(rig)
    assert await rig.pressure.wake_now("chat-p2-0", "a request is waiting", 5.0) is None
    assert rig.manager.state_of("chat-p2-0") is EntryState.LOADED
    assert rig.control.calls == [("wake", rig.sup.instances["chat-p2-0"].control_address)]
    assert await rig.pressure.wake_now("chat-p2-0", "again", 5.0) is None, "awake already: nothing to do"
    assert len(rig.control.calls) == 1


async def test_a_wake_under_way_for_the_same_instance_is_joined_not_repeated(tmp_path):
    rig = Rig(tmp_path)
    await asleep(rig)
    rig.control.wake_gate = asyncio.Event()
    first = asyncio.create_task(rig.pressure.wake_now("chat-p2-0", "held", 5.0))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(rig.pressure.wake_now("chat-p2-0", "held", 5.0))
    await asyncio.sleep(0.01)
    rig.control.wake_gate.set()
    assert await first is None and await second is None
    assert [c[0] for c in rig.control.calls] == ["wake"], "one wake"


async def test_a_wake_that_fails_says_why_and_leaves_it_asleep(tmp_path):
    rig = Rig(tmp_path)
    await asleep(rig)
    rig.control.wake_result = Outcome(False, 502, {"error": {"type": "worker_error"}}, "502 worker_error: boom")
    why = await rig.pressure.wake_now("chat-p2-0", "held", 5.0)
    assert why is not None and "boom" in why
    assert rig.manager.state_of("chat-p2-0") is EntryState.SLEEPING


async def test_no_room_to_wake_is_said_at_once_without_waiting(tmp_path):
    rig = Rig(tmp_path)
    await asleep(rig)
    # Another instance took the memory while it slept: 28 + 40 GiB of 80 leaves no room for 28 more.
    other = assignment("p0-0", "P0", 40 * 1024)
    assert isinstance(rig.manager.admit("p0-0", parse_model_service(other.spec, "t"), 0.0), Placed)
    rig.manager.loaded("p0-0")
    why = await rig.pressure.wake_now("chat-p2-0", "held", 5.0)
    assert why is not None and "no room" in why
    assert rig.control.calls == []


def test_a_worker_unparked_before_its_killed_process_is_reaped_starts_once_it_is(tmp_path):
    """autoscale.sleep_mode unload: a wake can follow the unload within milliseconds, before the killed
    worker has been reaped; the new worker must start as soon as the old one is gone, exactly once."""
    rig = Rig(tmp_path)
    inst = rig.sup.instances["chat-p2-0"]
    old = inst.worker_child
    assert old is not None
    old.signal_group = lambda sig: old.signals.append(sig)  # SIGKILLed, but not dead yet
    rig.sup.park_worker("chat-p2-0", "to unload it")
    assert inst.worker_child is old and inst.worker_parked
    spawned = len(rig.spawner.children)
    rig.sup.unpark_worker("chat-p2-0")
    assert len(rig.spawner.children) == spawned, "not while the old one may still hold its port"
    rig.sup.tick()
    assert len(rig.spawner.children) == spawned
    old.status = -9  # now it is gone
    rig.sup.tick()
    rig.sup.tick()
    assert len(rig.spawner.children) == spawned + 1 and inst.worker_child is rig.spawner.children[-1]
