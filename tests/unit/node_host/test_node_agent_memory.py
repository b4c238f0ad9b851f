"""The node agent under a GPU memory ledger: admission one load at a time, pre-eviction before a P0
starts, refusals with the reason, memory given back on stop (fake children, fake sidecars)."""

from __future__ import annotations

import asyncio

import pytest

from node_host.agent import NodeAgent
from node_host.ledger import EntryState
from node_host.settings import EvictionMode, NodeTunables
from sie.telemetry import InstanceState
from sie.wire import GPUInfo
from tests.unit.node_host.node_fakes import GIB, AgentRig, assignment, loaded, settle, state_record

P2_0, P2_1 = assignment("chat-p2-0"), assignment("chat-p2-1")
P0 = assignment("chat-p0-0", "P0", 30720)


@pytest.fixture
async def make(tmp_path):
    """Builds agents on one virtual 80 GiB GPU; shuts each down (and its session) after the test."""
    rig = AgentRig(tmp_path)

    def build(eviction: EvictionMode = EvictionMode.DRAIN) -> NodeAgent:
        gpu = GPUInfo(0, "virtual GPU (80 GiB, simulated)", 80 * GIB, 0.0, virtual=True)
        return rig.build([gpu], NodeTunables(eviction=eviction, post_timeout_s=0.2))

    yield build
    await rig.close()


@pytest.fixture
async def agent(make):
    return make()


def report(agent: NodeAgent, instance_id: str):
    return next(r for r in agent.instance_reports() if r.instance_id == instance_id)


async def full(agent: NodeAgent) -> None:
    agent.apply([P2_0, P2_1])
    await loaded(agent, "chat-p2-0")
    await loaded(agent, "chat-p2-1")
    assert agent.manager.ledger.gpus[0].level_mb == 56 * GIB


async def test_one_load_at_a_time_and_the_gpu_index_reaches_the_sidecar(agent):
    agent.apply([P2_0, P2_1])
    assert list(agent.supervisor.instances) == ["chat-p2-0"]
    inst = agent.supervisor.instances["chat-p2-0"]
    assert inst.gpu_index == 0 and inst.sidecar_argv[-2:] == ["--gpu-index", "0"]
    waiting = report(agent, "chat-p2-1")
    assert waiting.state is InstanceState.LOADING and "one load at a time" in waiting.detail
    await agent.tick()
    assert "chat-p2-1" not in agent.supervisor.instances  # the first is still loading
    await loaded(agent, "chat-p2-0")
    assert agent.manager.state_of("chat-p2-0") is EntryState.LOADED and "chat-p2-1" in agent.supervisor.instances


async def test_a_p0_starts_only_after_its_victim_has_slept(agent):
    await full(agent)
    agent.control.sleep_gate = asyncio.Event()
    agent.apply([P2_0, P2_1, P0])
    await settle()
    assert "chat-p0-0" not in agent.supervisor.instances
    waiting = report(agent, "chat-p0-0")
    assert waiting.state is InstanceState.LOADING and "making room: evicting chat-p2-" in waiting.detail
    (victim,) = [
        iid
        for iid in ("chat-p2-0", "chat-p2-1")
        if ("sleep", agent.supervisor.instances[iid].control_address) in agent.control.calls
    ]
    assert report(agent, victim).state is InstanceState.DRAINING
    agent.control.sleep_gate.set()
    await settle(20)
    assert "chat-p0-0" in agent.supervisor.instances and agent.supervisor.instances["chat-p0-0"].gpu_index == 0
    slept = report(agent, victim)
    assert slept.state is InstanceState.SLEEPING and "evicted for chat-p0-0 (P0)" in slept.detail
    assert agent.manager.ledger.gpus[0].level_mb == 58 * GIB


async def test_with_pre_eviction_off_the_p0_waits_failed_with_the_reason(make):
    agent = make(EvictionMode.OFF)
    await full(agent)
    agent.apply([P2_0, P2_1, P0])
    waiting = report(agent, "chat-p0-0")
    assert waiting.state is InstanceState.FAILED and "pre-eviction is off" in waiting.detail
    assert agent.control.calls == [] and "chat-p0-0" not in agent.supervisor.instances


async def test_an_instance_larger_than_any_gpu_is_refused_once_with_the_reason(agent):
    big = assignment("huge-0", "P0", 75 * 1024)
    agent.apply([big])
    agent.apply([big])
    assert agent.supervisor.instances == {} and list(agent.refused) == ["huge-0"]
    refused = report(agent, "huge-0")
    assert (
        refused.state is InstanceState.FAILED and refused.detail.startswith("refused:") and "tp_size" in refused.detail
    )


async def test_demand_from_the_sidecar_reaches_the_ledger(agent):
    await full(agent)
    address = agent.supervisor.instances["chat-p2-0"].control_address
    agent.control.states[address] = state_record(agent, "chat-p2-0", in_flight=3, queued=1, requests_total=10)
    await agent.heartbeat_once()  # the control plane is unreachable; the probes still run
    assert agent.manager.ledger.gpus[0].entry("chat-p2-0").demand == 4


async def test_a_stopped_instance_gives_its_memory_back(agent):
    await full(agent)
    agent.apply([P2_0])
    await asyncio.gather(*agent._stops.values())
    assert not agent.manager.holds("chat-p2-1") and agent.manager.ledger.gpus[0].level_mb == 28 * GIB
    assert [e["kind"] for e in agent.events.to_json()][-1] == "released"
