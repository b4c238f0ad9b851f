"""The node host's Prometheus metrics (node_host/metrics.py) and GET /metrics: an agent on a virtual GPU
under memory pressure (fake children, fake sidecars), scraped and parsed back with prometheus_client's
own parser; the pure `families` over hand-made figures of real GPUs; and who may scrape."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from node_host.agent import NodeAgent
from node_host.api import build_api
from node_host.gpu_manager import GPUManager
from node_host.ledger import Entry, EntryState, GPULedger
from node_host.metrics import (
    CONTENT_TYPE,
    GPU_FAILED,
    GPU_INFO,
    GPU_INSTANCE_MEMORY,
    GPU_MEMORY,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    NODE_INSTANCES,
    NodeFigures,
    NodeMetrics,
    families,
    figures,
)
from node_host.settings import NodeTunables
from node_host.sidecar_control import Outcome
from sie.auth import Identity, Signer, TokenAuthenticator
from sie.spec import Priority
from sie.telemetry import InstanceState
from sie.wire import GPUInfo
from sie_testing import error_shape
from tests.unit.node_host.node_fakes import GIB, AgentRig, assignment, loaded, settle

MIB = 1024 * 1024
P2_0, P2_1 = assignment("chat-p2-0"), assignment("chat-p2-1")
P0 = assignment("chat-p0-0", "P0", 30720)
VIRTUAL_80 = GPUInfo(0, "virtual GPU (80 GiB, simulated)", 80 * GIB, 0.0, virtual=True)


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, from the exposition text as Prometheus reads it."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def series(samples: dict, name: str) -> dict[frozenset, float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def one(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def where_memory_goes(samples: dict) -> dict[tuple[str, str, str], float]:
    """The README's PromQL line, sum by (node, gpu, model_id) (sie_gpu_instance_memory_bytes), done here."""
    out: Counter = Counter()
    for labels, value in series(samples, GPU_INSTANCE_MEMORY).items():
        d = dict(labels)
        out[d["node"], d["gpu"], d["model_id"]] += value
    return dict(out)


@pytest.fixture
async def make(tmp_path):
    rig = AgentRig(tmp_path)

    def build(gpus: list[GPUInfo], nvml: list[GPUInfo] | None = None, health: dict | None = None) -> NodeAgent:
        def reader(manager: GPUManager):
            async def read_gpus():  # as node_host.main's: NVML's reading where there is one, with the
                # ledger's, and each GPU's health (node_host.gpus.health: temperature, failed) where read
                return [replace(g, **(health or {}).get(g.index, {})) for g in manager.gpu_infos(nvml)]

            return read_gpus

        # A failed wake is retried after a millisecond, not the default 5 s.
        return rig.build(gpus, NodeTunables(post_timeout_s=0.2, eviction_retry_s=0.001), reader)

    yield build
    await rig.close()


async def test_a_scrape_shows_where_the_memory_goes_and_what_pressure_did(make):
    agent = make([VIRTUAL_80])
    metrics = NodeMetrics(agent)
    agent.apply([P2_0, P2_1])
    await loaded(agent, "chat-p2-0")
    await loaded(agent, "chat-p2-1")
    agent.apply([P2_0, P2_1, P0])  # the P0 needs a P2 to make way
    await settle(20)
    (victim,) = [i for i in ("chat-p2-0", "chat-p2-1") if agent.manager.state_of(i) is EntryState.SLEEPING]
    (awake,) = {"chat-p2-0", "chat-p2-1"} - {victim}
    await agent.heartbeat_once()  # the control plane is unreachable; the GPUs are read all the same

    s = parse(metrics.exposition().decode())
    memory = {dict(labels)["kind"]: value for labels, value in series(s, GPU_MEMORY).items()}
    # A virtual GPU's use is the ledger's level: 28 GiB awake + 30 GiB loading, the sleeper holds nothing.
    assert memory == {"total": 80 * GIB * MIB, "used": 58 * GIB * MIB, "reserved": 58 * GIB * MIB, "sleeping": 0.0}
    assert series(s, GPU_INSTANCE_MEMORY) == {
        frozenset(
            {"node": "n1", "gpu": "0", "model_id": "chat-p2", "instance_id": awake, "state": "loaded"}.items()
        ): 28 * GIB * MIB,
        frozenset(
            {"node": "n1", "gpu": "0", "model_id": "chat-p2", "instance_id": victim, "state": "sleeping"}.items()
        ): 0.0,
        frozenset(
            {"node": "n1", "gpu": "0", "model_id": "chat-p0", "instance_id": "chat-p0-0", "state": "loading"}.items()
        ): 30 * GIB * MIB,
    }
    assert where_memory_goes(s) == {("n1", "0", "chat-p2"): 28 * GIB * MIB, ("n1", "0", "chat-p0"): 30 * GIB * MIB}
    states = {dict(labels)["state"]: value for labels, value in series(s, NODE_INSTANCES).items()}
    assert states.keys() == {state.value for state in InstanceState}  # every state, 0 where none
    assert states == {
        state.value: float(n) for state, n in Counter(r.state for r in agent.instance_reports()).items()
    } | {state.value: 0.0 for state in InstanceState if state not in {r.state for r in agent.instance_reports()}}
    assert states["sleeping"] == 1.0 and sum(states.values()) == 3.0
    assert one(s, "sie_node_evictions_total", node="n1") == 1.0
    assert one(s, "sie_node_wakes_total", node="n1") == 0.0
    assert series(s, GPU_UTILIZATION) == {} and series(s, GPU_TEMPERATURE) == {}  # unknown: absent, not zero
    assert one(s, GPU_FAILED, node="n1", gpu="0") == 0.0
    info = dict(next(iter(series(s, GPU_INFO))))
    assert info == {
        "node": "n1",
        "gpu": "0",
        "name": "virtual GPU (80 GiB, simulated)",
        "virtual": "true",
        "tier": "",
        "failed_reason": "",
    }

    # The P0 goes and its memory is released; the sleeper's first wake fails (not a wake), the next works.
    agent.apply([P2_0, P2_1])
    await asyncio.gather(*agent._stops.values())
    agent.control.wake_result = Outcome(False, 503, {"error": {"type": "unavailable", "message": "not yet"}})
    await agent.tick()
    await settle(20)
    assert agent.events.counts["wake_failed"] == 1
    assert one(parse(metrics.exposition().decode()), "sie_node_wakes_total", node="n1") == 0.0
    agent.control.wake_result = Outcome(True, 200, {"state": "ready"})
    await asyncio.sleep(0.01)  # past the retry pause
    await agent.tick()
    await settle(20)
    assert agent.manager.state_of(victim) is EntryState.LOADED
    s = parse(metrics.exposition().decode())
    assert where_memory_goes(s) == {("n1", "0", "chat-p2"): 56 * GIB * MIB}
    assert one(s, "sie_node_wakes_total", node="n1") == 1.0
    assert one(s, "sie_node_evictions_total", node="n1") == 1.0


async def test_a_real_gpu_shows_nvmls_reading_only_once_the_heartbeat_has_one(make):
    real = GPUInfo(0, "NVIDIA H100 80GB HBM3", 81_559.0, 0.0)
    nvml = [GPUInfo(0, "NVIDIA H100 80GB HBM3", 81_559.0, 9_000.0, utilization=0.25)]
    agent = make([real], nvml, health={0: {"temperature_c": 61.0, "failed": "device lost"}})
    metrics = NodeMetrics(agent)
    agent.apply([P2_0])
    s = parse(metrics.exposition().decode())
    memory = {dict(labels)["kind"]: value for labels, value in series(s, GPU_MEMORY).items()}
    assert "used" not in memory  # no reading yet: absent, never the ledger's level in NVML's place
    assert memory["reserved"] == 28 * GIB * MIB and series(s, GPU_TEMPERATURE) == {}

    await agent.heartbeat_once()  # NVML says the GPU failed: the agent fails it and stops what ran there
    agent.apply([P2_0, P2_1])  # after the heartbeat: the ledger's figures are read live, not from it
    s = parse(metrics.exposition().decode())
    memory = {dict(labels)["kind"]: value for labels, value in series(s, GPU_MEMORY).items()}
    assert memory["total"] == 81_559.0 * MIB
    assert memory["used"] == 9_000.0 * MIB  # NVML's: every process on the GPU, not what the ledger reserved
    assert memory["sleeping"] == 0.0
    assert one(s, GPU_UTILIZATION, node="n1", gpu="0") == 0.25
    assert one(s, GPU_TEMPERATURE, node="n1", gpu="0") == 61.0
    assert one(s, GPU_FAILED, node="n1", gpu="0") == 1.0
    assert dict(next(iter(series(s, GPU_INFO))))["failed_reason"] == "device lost"


def test_families_of_hand_made_figures():
    entries = (
        Entry("big-0", "big", Priority.P0, 40 * GIB, measured_mb=41 * GIB, state=EntryState.LOADED),
        Entry("small-0", "small", Priority.P2, 8 * GIB, state=EntryState.SLEEPING, residue_mb=512.0),
        Entry("small-1", "small", Priority.P2, 8 * GIB, state=EntryState.LOADED),
    )
    ledger = (GPULedger(0, 80 * GIB, headroom_mb=1024.0, entries=entries), GPULedger(1, 80 * GIB))
    long_name = "X" * 500
    figures = NodeFigures(
        node="gpu-node-7",
        gpus=(
            GPUInfo(0, "H100", 80 * GIB, 52 * GIB, 0.9, reserved_mb=50.5 * GIB, sleeping_mb=512.0, tier="gold"),
            GPUInfo(1, long_name, 80 * GIB, 3.0, None, reserved_mb=0.0, failed="Xid 79: fallen off the bus " * 20),
            GPUInfo(2, "seen by NVML only", 24 * GIB, 100.0, 0.0, temperature_c=35.0),  # not in the ledger
        ),
        measured=frozenset({0, 1, 2}),
        ledger=ledger,
        instances={InstanceState.READY: 2, InstanceState.SLEEPING: 1},
        evictions=7,
        wakes=5,
    )
    text = b"".join(_text(f) for f in families(figures)).decode()
    s = parse(text)
    assert one(s, GPU_MEMORY, node="gpu-node-7", gpu="0", kind="sleeping") == 512.0 * MIB
    assert one(s, GPU_MEMORY, node="gpu-node-7", gpu="0", kind="used") == 52 * GIB * MIB
    assert {dict(k)["kind"] for k in series(s, GPU_MEMORY) if dict(k)["gpu"] == "2"} == {"total", "used"}
    assert where_memory_goes(s) == {
        ("gpu-node-7", "0", "big"): 41 * GIB * MIB,
        ("gpu-node-7", "0", "small"): 8.5 * GIB * MIB,
    }
    assert one(s, GPU_UTILIZATION, node="gpu-node-7", gpu="2") == 0.0  # known and idle: present
    assert {dict(k)["gpu"] for k in series(s, GPU_UTILIZATION)} == {"0", "2"}
    infos = {dict(k)["gpu"]: dict(k) for k in series(s, GPU_INFO)}
    assert len(infos["1"]["name"]) == 120 and len(infos["1"]["failed_reason"]) == 120  # bounded label values
    assert infos["0"]["tier"] == "gold" and infos["0"]["virtual"] == "false"
    assert {dict(k)["gpu"]: v for k, v in series(s, GPU_FAILED).items()} == {"0": 0.0, "1": 1.0, "2": 0.0}
    assert one(s, "sie_node_evictions_total", node="gpu-node-7") == 7.0
    assert one(s, NODE_INSTANCES, node="gpu-node-7", state="failed") == 0.0


def _text(family) -> bytes:
    class Once(Collector):
        def collect(self):
            yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Once())
    return generate_latest(registry)


@pytest.fixture
async def api(make):
    signer = Signer.generate()
    agent = make([VIRTUAL_80])
    client = TestClient(TestServer(build_api(agent, TokenAuthenticator(signer.verifier()))))
    await client.start_server()
    try:
        yield client, signer
    finally:
        await client.close()


@pytest.mark.parametrize(
    "who, status",
    [
        (None, 401),
        (Identity.for_sidecar("chat-p2-0", "chat-p2", "n1"), 403),  # a sidecar, even one of this node
        (Identity.for_node("n2"), 403),  # another node
        (Identity.envoy(), 403),
        (Identity.reader(), 200),
        (Identity.admin(), 200),
        (Identity.for_node("n1"), 200),  # the node itself
    ],
)
async def test_only_readers_and_the_node_itself_may_scrape(api, who, status):
    client, signer = api
    headers = {} if who is None else {"Authorization": f"Bearer {signer.issue(who)}"}
    resp = await client.get("/metrics", headers=headers)
    assert resp.status == status
    if status == 200:
        assert resp.headers["Content-Type"] == CONTENT_TYPE
        assert (GPU_MEMORY, frozenset({"node": "n1", "gpu": "0", "kind": "total"}.items())) in parse(await resp.text())
    else:
        error_shape.check(resp.status, await resp.json())


async def test_which_events_count_as_evictions_and_wakes(make):
    agent = make([VIRTUAL_80])
    for kind in (
        "pressure",  # one decision, two victims: two evictions
        "eviction_started",
        "eviction_started",
        "memory_released",  # the first victim slept
        "eviction_failed",  # the second would not: still an eviction the node started
        "wake_started",
        "wake_failed",  # not a wake
        "wake_started",
        "woken",  # a wake
        "woken_for_request",  # the same wake, seen by the request that asked for it: not a second one
        "slept",  # put to sleep for the fleet's shape, for no one: not an eviction
    ):
        agent.events.add(kind, "chat-p2-0")
    f = figures(agent)
    assert (f.evictions, f.wakes) == (2, 1)
