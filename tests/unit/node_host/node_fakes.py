"""Fakes for the node host's memory tests: children that never run, and sidecars that answer as told."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from node_host.agent import NodeAgent
from node_host.gpu_manager import GPUManager
from node_host.settings import AgentSettings, NodeTunables
from node_host.sidecar_control import Outcome
from node_host.supervisor import ProcessManager
from sie.auth import TokenSource
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import Assignment, GPUInfo

GIB = 1024.0


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Child:
    def __init__(self, pid: int, argv: list[str]):
        self.pid, self.argv, self.status, self.signals = pid, argv, None, []

    def poll(self) -> int | None:
        return self.status

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if self.status is None and sig in (signal.SIGTERM, signal.SIGKILL):
            self.status = -sig


class Spawner:
    def __init__(self) -> None:
        self.children: list[Child] = []
        self.before: Callable[[Path], None] | None = None  # called with the child's log path before each spawn

    def __call__(self, argv, log_path, env=None, cpus=None, background=False) -> Child:
        if self.before is not None:
            self.before(log_path)
        self.children.append(Child(7000 + len(self.children), list(argv)))
        return self.children[-1]


def supervisor(
    tmp_path: Path, spawner: Spawner, gpu_for=lambda iid, service: None, clock: Callable[[], float] | None = None
) -> ProcessManager:
    ports = iter(range(31000, 31200))
    return ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url="http://127.0.0.1:1",
        trust_file=tmp_path / "trust.pem",
        spawn=spawner,
        pick_port=lambda: next(ports),
        gpu_for=gpu_for,
        **({"clock": clock} if clock is not None else {}),
    )


def sim_spec(name: str, priority: str, mb: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "priority_level": priority},
            "backend": {"type": "sim"},
            "resources": {"min_gpu_memory_mb": mb},
        },
    }


def assignment(instance_id: str, priority: str = "P2", mb: int = 28672) -> Assignment:
    model = instance_id.rsplit("-", 1)[0]
    return Assignment(instance_id, model, sim_spec(model, priority, mb))


class FakeControl:
    """SidecarControl that records calls; `sleep_gate`, when set, holds every sleep until it is set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.healthy: set[str] = set()  # worker addresses whose /health says ok
        self.states: dict[str, dict[str, Any]] = {}  # sidecar address -> /-/state body
        self.sleep_result = Outcome(True, 200, {"state": "sleeping", "drain": {"finished": 2, "waited_s": 0.4}})
        self.wake_result = Outcome(True, 200, {"state": "ready"})
        self.sleep_gate: asyncio.Event | None = None
        self.wake_gate: asyncio.Event | None = None  # when set, holds every wake until it is set
        self.reasons: list[str] = []
        self.asked: list[str] = []  # sidecar addresses whose /-/state was asked for

    async def sleep(self, sidecar: str, *, reason: str, timeout_s: float) -> Outcome:
        self.calls.append(("sleep", sidecar))
        assert reason in ("eviction", "idle")
        self.reasons.append(reason)
        if self.sleep_gate is not None:
            await self.sleep_gate.wait()
        return self.sleep_result

    async def wake(self, sidecar: str, *, timeout_s: float) -> Outcome:
        self.calls.append(("wake", sidecar))
        if self.wake_gate is not None:
            await self.wake_gate.wait()
        return self.wake_result

    async def state(self, sidecar: str) -> dict[str, Any] | None:
        self.asked.append(sidecar)
        return self.states.get(sidecar)

    async def health(self, worker: str, path: str = "/health") -> str | None:
        return "ok" if worker in self.healthy else "loading"


def state_record(agent: NodeAgent, instance_id: str, **fields: Any) -> dict[str, Any]:
    """What the sidecar of `instance_id` answers at /-/state: a valid TelemetryRecord as JSON, `fields` set."""
    inst = agent.supervisor.instances[instance_id]
    record = TelemetryRecord(
        instance_id=instance_id,
        model_id=inst.service.model_id,
        version=inst.service.spec.model.version,
        address=inst.sidecar_address,
        node="n1",
        state=InstanceState.READY,
    )
    return {**record.to_json(), **fields}


async def settle(rounds: int = 5) -> None:
    """Let spawned tasks run to their next real wait."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class AgentRig:
    """Builds node agents over fake children and fake sidecars (`build`), and shuts each down (with its
    HTTP session) at `close`: the memory, GPU-failure and metrics tests share it."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.built: list[tuple[NodeAgent, aiohttp.ClientSession]] = []
        self.spawner = Spawner()  # the children of the agent built last

    def build(
        self,
        gpus: list[GPUInfo],
        tunables: NodeTunables | None = None,
        read_gpus: Callable[[GPUManager], Callable[[], Awaitable[list[GPUInfo]]]] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> NodeAgent:
        """An agent named n1 whose control plane is unreachable; `read_gpus(manager)` replaces the GPU
        reading (default: the ledger's view, as for virtual GPUs); `clock` the agent's and its supervisor's
        (default: monotonic)."""
        manager = GPUManager(gpus, facts={})
        self.spawner = Spawner()
        sup = supervisor(self.tmp_path, self.spawner, gpu_for=lambda iid, service: manager.gpu_of(iid), clock=clock)
        session = aiohttp.ClientSession()

        async def ledger_view() -> list[GPUInfo]:
            return manager.gpu_infos()

        agent = NodeAgent(
            AgentSettings("n1", "http://127.0.0.1:9", tunables or NodeTunables(post_timeout_s=0.2)),
            sup,
            session,
            credential=TokenSource(token="node-token"),
            gpus=read_gpus(manager) if read_gpus is not None else ledger_view,
            facts={},
            manager=manager,
            control=FakeControl(),
            **({"clock": clock} if clock is not None else {}),
        )
        self.built.append((agent, session))
        return agent

    async def close(self) -> None:
        for agent, session in self.built:
            await agent.shutdown()
            await session.close()


async def loaded(agent: NodeAgent, *instance_ids: str) -> None:
    """The workers of `instance_ids` answer healthy; one tick notices."""
    for iid in instance_ids:
        agent.control.healthy.add(agent.supervisor.instances[iid].worker_address)
    await agent.tick()
