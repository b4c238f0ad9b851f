"""The ledger takes the measured memory (NVML on a real GPU, a fake here): at load, and again after a wake,
while what a sleeping worker still shows (its CUDA context) never becomes its awake figure."""

from __future__ import annotations

import aiohttp
import pytest

from node_host.agent import NodeAgent
from node_host.gpu_manager import GPUManager
from node_host.ledger import EntryState
from node_host.settings import AgentSettings, NodeTunables
from sie.auth import TokenSource
from sie.wire import GPUInfo
from tests.unit.node_host.node_fakes import GIB, FakeControl, Spawner, assignment, state_record, supervisor

IID = "chat-p2-0"


class FakeNVML:
    """What NVML would say each worker holds: `mb` on GPU 0 for every pid asked about."""

    def __init__(self) -> None:
        self.mb: float | None = None

    async def __call__(self, pids: list[int]) -> dict[int, dict[int, float]]:
        return {} if self.mb is None else {pid: {0: self.mb} for pid in pids}


@pytest.fixture
async def rig(tmp_path):
    manager = GPUManager([GPUInfo(0, "GPU 0", 80 * GIB, 0.0)], facts={})
    sup = supervisor(tmp_path, Spawner(), gpu_for=lambda iid, service: manager.gpu_of(iid))
    nvml = FakeNVML()

    async def gpus():
        return manager.gpu_infos()

    async with aiohttp.ClientSession() as session:
        agent = NodeAgent(
            AgentSettings("n1", "http://127.0.0.1:9", NodeTunables(post_timeout_s=0.2)),
            sup,
            session,
            credential=TokenSource(token="node-token"),
            gpus=gpus,
            facts={},
            manager=manager,
            control=FakeControl(),
            measure=nvml,
        )
        yield agent, nvml
        await agent.shutdown()


async def test_after_a_wake_the_measured_figure_replaces_the_one_from_before_the_sleep(rig):
    agent, nvml = rig
    agent.apply([assignment(IID, mb=28672)])
    inst = agent.supervisor.instances[IID]
    agent.control.healthy.add(inst.worker_address)
    agent.control.states[inst.control_address] = state_record(agent, IID)
    manager = agent.manager
    steps = [
        # (what happens, NVML's figure for the worker, the ledger's state, MiB it holds, its awake figure)
        ("loads", 20000.0, EntryState.LOADED, 20000.0, 20000.0),
        ("sleeps", 500.0, EntryState.SLEEPING, 0.0, 20000.0),  # the CUDA context NVML still counts
        ("wakes", 500.0, EntryState.LOADED, 20000.0, 20000.0),  # loaded again: the figure from before
        ("serves", 23000.0, EntryState.LOADED, 23000.0, 23000.0),  # the next heartbeat measures it again
    ]
    for step, mb, state, held, awake in steps:
        nvml.mb = mb
        if step == "loads":
            await agent.tick()
        elif step == "sleeps":
            manager.sleep(IID)  # as Pressure does once the sidecar's sleep has answered
            await agent.heartbeat_once()
        elif step == "wakes":
            assert manager.begin_wake(IID) is None
            manager.loaded(IID)  # as Pressure does once the sidecar's wake has answered (nothing measured)
        else:
            await agent.heartbeat_once()  # the control plane is unreachable; the probes still run
        entry = manager.ledger.gpu(0).entry(IID)
        assert (step, entry.state, entry.held_mb, entry.awake_mb) == (step, state, held, awake)
