"""A failed GPU on the node agent (fake children, fake sidecars): its instances' workers die at once, the
instances stop and, still assigned here, go to a healthy GPU with room; with no room they are reported
`unplaceable` so the control plane places them on another node. Nothing is placed on the failed GPU again."""

from __future__ import annotations

import signal

import pytest

from node_host.agent import NodeAgent
from sie.telemetry import InstanceState
from sie.wire import GPUInfo
from tests.unit.node_host.node_fakes import GIB, AgentRig, assignment, loaded, settle

A, B = assignment("chat-a-0", "P1", 30720), assignment("chat-b-0", "P0", 30720)  # B may not make way for A


@pytest.fixture
async def make(tmp_path):
    rig = AgentRig(tmp_path)

    def build(gpus: int) -> NodeAgent:
        return rig.build(
            [GPUInfo(i, "virtual GPU (40 GiB, simulated)", 40 * GIB, 0.0, virtual=True) for i in range(gpus)]
        )

    yield build
    await rig.close()


def report(agent: NodeAgent, instance_id: str):
    return next(r for r in agent.instance_reports() if r.instance_id == instance_id)


async def test_a_failed_gpus_instance_restarts_on_a_healthy_gpu_of_the_node(make):
    agent = make(gpus=2)
    agent.apply([A])
    await loaded(agent, "chat-a-0")
    gpu = agent.manager.gpu_of("chat-a-0")
    worker = agent.supervisor.instances["chat-a-0"].worker_child
    assert agent.fail_gpu(gpu, "Xid 79: fallen off the bus") == ["chat-a-0"]
    assert signal.SIGKILL in worker.signals and agent.supervisor.instances["chat-a-0"].worker_parked
    await settle(20)
    assert "chat-a-0" not in agent.supervisor.instances and not agent.manager.holds("chat-a-0")
    agent.apply([A])  # the control plane still assigns it here
    assert agent.manager.gpu_of("chat-a-0") == 1 - gpu
    infos = {g.index: g for g in agent.manager.gpu_infos()}
    assert infos[gpu].failed == "Xid 79: fallen off the bus" and not infos[1 - gpu].failed
    assert [e["kind"] for e in agent.events.to_json()].count("gpu_failed") == 1


async def test_with_no_healthy_gpu_with_room_the_instance_is_unplaceable_here(make):
    agent = make(gpus=2)
    agent.apply([A, B])
    await loaded(agent, "chat-a-0")
    await loaded(agent, "chat-b-0")
    gpu = agent.manager.gpu_of("chat-a-0")
    assert agent.manager.gpu_of("chat-b-0") == 1 - gpu
    agent.fail_gpu(gpu, "uncorrected ECC errors (3)")
    await settle(20)
    agent.apply([A, B])
    waiting = report(agent, "chat-a-0")
    assert waiting.state is InstanceState.FAILED and waiting.unplaceable, waiting
    assert report(agent, "chat-b-0").unplaceable == ""
    # Every GPU failed: refused here for good, and the reason names the failures.
    agent.fail_gpu(1 - gpu, "device lost")
    await settle(20)
    agent.apply([A, B])
    for iid in ("chat-a-0", "chat-b-0"):
        r = report(agent, iid)
        assert "every GPU" in r.unplaceable and "device lost" in r.unplaceable, r


async def test_failing_a_gpu_twice_changes_nothing(make):
    agent = make(gpus=1)
    assert agent.fail_gpu(0, "device lost") == []
    assert agent.fail_gpu(0, "another reason") == []
    assert agent.manager.failed_gpus() == {0: "device lost"}


async def test_a_failure_nvml_reports_in_the_gpu_list_fails_the_gpu_at_the_heartbeat(make):
    import dataclasses

    agent = make(gpus=2)
    agent.apply([A])
    await loaded(agent, "chat-a-0")
    gpu = agent.manager.gpu_of("chat-a-0")
    real = agent._gpus

    async def reported():  # what node_host.main's reader returns once gpus.health says the GPU failed
        return [
            dataclasses.replace(g, failed="Xid 79: fallen off the bus") if g.index == gpu else g for g in await real()
        ]

    agent._gpus = reported
    await agent.heartbeat_once()  # the control plane is unreachable here: the failure is local business
    assert agent.manager.failed_gpus() == {gpu: "Xid 79: fallen off the bus"}
    (event,) = [e for e in agent.events.to_json() if e["kind"] == "gpu_failed"]
    assert event["instances"] == ["chat-a-0"] and event["gpu"] == gpu
    await agent.heartbeat_once()
    assert [e["kind"] for e in agent.events.to_json()].count("gpu_failed") == 1, "failed once, not every heartbeat"
