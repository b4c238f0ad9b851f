"""The node agent when something goes wrong around an instance: a sidecar that answers /-/state with a
record it cannot use, or is down; a start the machine refuses; a sleeping worker that crashes (fake
children, fake sidecars)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from node_host.agent import START_RETRY_S, NodeAgent
from node_host.ledger import EntryState
from node_host.settings import NodeTunables
from sie.telemetry import InstanceState
from sie.wire import GPUInfo
from tests.unit.node_host.node_fakes import GIB, AgentRig, Clock, assignment, loaded, settle, state_record

P2_0, P2_1 = assignment("chat-p2-0"), assignment("chat-p2-1")
P0 = assignment("chat-p0-0", "P0", 30720)


@pytest.fixture
async def rig(tmp_path):
    rig = AgentRig(tmp_path)
    yield rig
    await rig.close()


def build(rig: AgentRig, clock: Clock | None = None) -> NodeAgent:
    gpu = GPUInfo(0, "virtual GPU (80 GiB, simulated)", 80 * GIB, 0.0, virtual=True)
    return rig.build([gpu], NodeTunables(post_timeout_s=0.2), clock=clock)


def report(agent: NodeAgent, instance_id: str):
    return next(r for r in agent.instance_reports() if r.instance_id == instance_id)


async def full(agent: NodeAgent) -> None:
    agent.apply([P2_0, P2_1])
    await loaded(agent, "chat-p2-0")
    await loaded(agent, "chat-p2-1")


def record(**fields: Any) -> Callable[[NodeAgent], Any]:
    return lambda agent: state_record(agent, "chat-p2-0", **fields)


# (case, the body chat-p2-0's sidecar answers, what the logged reason names)
MALFORMED = [
    ("a count that is not a number", lambda agent: {"state": "ready", "in_flight": "x"}, "in_flight"),
    ("a full record, a count not a number", record(in_flight="x"), "in_flight"),
    ("a negative count", record(queued=-1), "queued"),
    ("a count past its bound", record(requests_total=2**70), "requests_total"),
    ("a state that does not exist", record(state="exploded"), "state"),
    ("a field that does not exist", record(extra=1), "extra"),
    ("another instance's record", lambda agent: state_record(agent, "chat-p2-1"), "chat-p2-1"),
    ("not an object", lambda agent: ["ready"], "object"),
]


@pytest.mark.parametrize("body,named", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
async def test_a_state_reply_it_cannot_use_fails_that_probe_only_and_is_logged_once(rig, caplog, body, named):
    agent = build(rig)
    await full(agent)
    bad, good = (agent.supervisor.instances[iid].control_address for iid in ("chat-p2-0", "chat-p2-1"))
    agent.control.states[good] = state_record(agent, "chat-p2-1", in_flight=2, queued=1)
    agent.control.states[bad] = body(agent)
    caplog.set_level(logging.WARNING, logger="node_host.agent")
    for _ in range(3):
        assert await agent.heartbeat_once() is None
        assert agent.reachable is False  # it went on to post (the control plane is away)
    assert agent.sidecar_states["chat-p2-0"] is None
    assert agent.manager.ledger.gpus[0].entry("chat-p2-1").demand == 3  # the other instance is read
    said = [r.getMessage() for r in caplog.records if "/-/state" in r.getMessage()]
    assert len(said) == 1 and "chat-p2-0" in said[0] and named in said[0]


async def test_a_valid_state_after_a_bad_one_is_read_again(rig):
    agent = build(rig)
    await full(agent)
    address = agent.supervisor.instances["chat-p2-0"].control_address
    agent.control.states[address] = state_record(agent, "chat-p2-0", in_flight="x")
    await agent.heartbeat_once()
    agent.control.states[address] = state_record(agent, "chat-p2-0", in_flight=4, requests_total=9)
    await agent.heartbeat_once()
    assert agent.sidecar_states["chat-p2-0"]["in_flight"] == 4
    assert agent.manager.ledger.gpus[0].entry("chat-p2-0").demand == 4


async def test_a_sidecar_that_is_down_is_not_asked_for_its_state(rig):
    """The request carries the node's token: while the sidecar is down, another process may hold its port."""
    agent = build(rig)
    await full(agent)
    down, up = (agent.supervisor.instances[iid] for iid in ("chat-p2-0", "chat-p2-1"))
    down.sidecar_child.status = 1  # ended; not reaped yet
    await agent.heartbeat_once()
    await agent.tick()  # reaped; its restart waits out the backoff
    assert down.sidecar_child is None and down.sidecar.restart_at is not None
    await agent.heartbeat_once()
    assert down.control_address not in agent.control.asked
    assert agent.control.asked.count(up.control_address) == 2


async def test_a_start_the_machine_refuses_gives_its_memory_back_and_is_tried_again_later(rig, tmp_path):
    clock = Clock()
    agent = build(rig, clock)
    (tmp_path / "specs").write_text("")  # the spec folder cannot be made: an OSError, as on a full disk
    agent.apply([P2_0])  # does not raise
    assert "chat-p2-0" not in agent.supervisor.instances and not agent.manager.holds("chat-p2-0")
    waiting = report(agent, "chat-p2-0")
    assert waiting.state is InstanceState.FAILED and "could not start" in waiting.detail and waiting.unplaceable
    clock.now += START_RETRY_S - 0.1
    await agent.tick()
    assert [e["kind"] for e in agent.events.to_json()].count("start_failed") == 1  # not yet tried again
    assert not agent.manager.holds("chat-p2-0")
    (tmp_path / "specs").unlink()
    clock.now += 0.1
    await agent.tick()
    assert "chat-p2-0" in agent.supervisor.instances and agent.manager.state_of("chat-p2-0") is EntryState.LOADING
    assert "chat-p2-0" not in agent.pending


async def test_a_sleeping_worker_that_crashes_starts_again_only_from_its_wake(rig):
    clock = Clock()
    agent = build(rig, clock)
    await full(agent)
    agent.apply([P2_0, P2_1, P0])
    await settle(20)
    await loaded(agent, "chat-p0-0")
    (victim,) = [iid for iid in ("chat-p2-0", "chat-p2-1") if agent.manager.state_of(iid) is EntryState.SLEEPING]
    level = agent.manager.ledger.gpus[0].level_mb
    spawned: list[tuple[str, EntryState | None]] = []
    rig.spawner.before = lambda log: spawned.append((log.name, agent.manager.state_of(victim)))
    inst = agent.supervisor.instances[victim]
    inst.worker_child.status = 1  # crashes while asleep (a segfault, the host's OOM killer)
    for _ in range(3):
        await agent.tick()
        clock.now += 60.0  # well past any backoff
    assert spawned == [] and inst.worker_child is None and inst.worker_parked
    assert agent.manager.state_of(victim) is EntryState.SLEEPING and agent.manager.ledger.gpus[0].level_mb == level
    assert "worker exit code 1" in report(agent, victim).detail
    agent.apply([P2_0, P2_1])  # the P0 goes: its memory is free, the sleeper fits again
    await asyncio.gather(*agent._stops.values())
    await agent.tick()  # the wake reserves its memory, then starts the worker
    await settle(20)
    assert spawned == [(f"{victim}.worker.log", EntryState.LOADING)]
    assert agent.manager.state_of(victim) is EntryState.LOADED and not inst.worker_parked
