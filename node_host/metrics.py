"""The node host's Prometheus metrics, served at GET /metrics on its API (admin or reader token, or the
node's own): where each GPU's memory goes, the GPUs' state, the instances, evictions and wakes.

    sie_gpu_memory_bytes{node, gpu, kind}       kind: total | used | reserved | sleeping
        total     the GPU's memory
        used      NVML's reading on a real GPU (every process, other tenants' too); the ledger's level on a
                  virtual one, which has nothing else to measure (GPUInfo.used_mb is exactly that)
        reserved  the ledger's level: what it holds for instances, plus what was in use before it started
        sleeping  what sleeping instances still hold (their residue; part of reserved)
    sie_gpu_instance_memory_bytes{node, gpu, model_id, instance_id, state}
                  what the ledger holds for each instance on each GPU; state loading | loaded | sleeping
    sie_gpu_utilization_ratio{node, gpu}        0..1; absent where unknown (virtual GPUs, MIG slices)
    sie_gpu_temperature_celsius{node, gpu}      absent where unknown
    sie_gpu_failed{node, gpu}                   1 once the GPU failed (sticky), else 0
    sie_gpu_info{node, gpu, name, virtual, tier, failed_reason}   always 1
    sie_node_instances{node, state}             instances by state, every state listed (0 where none)
    sie_node_evictions_total{node}              evictions started, one per victim (EventLog eviction_started)
    sie_node_wakes_total{node}                  wakes finished, the instance serving again (EventLog woken)

"Where is GPU memory going" is one line:

    sort_desc(sum by (node, gpu, model_id) (sie_gpu_instance_memory_bytes))

Labels are bounded: a node's GPUs and instances are (sie.wire MAX_GPUS, MAX_INSTANCES), and the free texts
(GPU name, failed reason) are cut to _MAX_TEXT. Nothing runs in the background: the collector reads the
agent at each scrape. The counters count every event since the node host started (EventLog.counts),
never the bounded event log, whose old events fall off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from node_host.agent import NodeAgent
from node_host.ledger import GPULedger
from sie.telemetry import InstanceState
from sie.wire import GPUInfo

# What generate_latest writes (the classic text format), which every Prometheus reads.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
MIB = 1024 * 1024
_MAX_TEXT = 120

GPU_MEMORY = "sie_gpu_memory_bytes"
GPU_INSTANCE_MEMORY = "sie_gpu_instance_memory_bytes"
GPU_UTILIZATION = "sie_gpu_utilization_ratio"
GPU_TEMPERATURE = "sie_gpu_temperature_celsius"
GPU_FAILED = "sie_gpu_failed"
GPU_INFO = "sie_gpu_info"
NODE_INSTANCES = "sie_node_instances"
NODE_EVICTIONS = "sie_node_evictions"  # prometheus_client appends _total to a counter's samples
NODE_WAKES = "sie_node_wakes"
# The labels each metric carries (the Grafana dashboard groups by no others).
LABELS = frozenset(
    {"node", "gpu", "kind", "model_id", "instance_id", "state", "name", "virtual", "tier", "failed_reason"}
)

EVICTION_KIND = "eviction_started"  # one per victim, whatever its outcome: the node decided to evict it
WAKE_KIND = "woken"  # a wake that finished (ledger or not); a failed one is wake_failed, not counted


@dataclass(frozen=True)
class NodeFigures:
    """What one scrape shows, read from the agent at once (so the figures agree with each other)."""

    node: str
    gpus: tuple[GPUInfo, ...]  # as GPUManager.gpu_infos gives them, NVML's figures where there are any
    measured: frozenset[int]  # the GPUs whose `used` is a reading (virtual, or NVML has reported)
    ledger: tuple[GPULedger, ...]
    instances: Mapping[InstanceState, int]
    evictions: int
    wakes: int


def families(f: NodeFigures) -> list[Metric]:
    """The metric families of one scrape (pure: tests feed it figures)."""
    node = f.node
    memory = GaugeMetricFamily(
        GPU_MEMORY, "GPU memory by kind: total, used, reserved, sleeping.", labels=["node", "gpu", "kind"]
    )
    held = GaugeMetricFamily(
        GPU_INSTANCE_MEMORY,
        "GPU memory the node host's ledger holds for each instance (the estimate until loaded, then measured).",
        labels=["node", "gpu", "model_id", "instance_id", "state"],
    )
    utilization = GaugeMetricFamily(GPU_UTILIZATION, "GPU utilisation, 0..1 (NVML).", labels=["node", "gpu"])
    temperature = GaugeMetricFamily(GPU_TEMPERATURE, "GPU temperature (NVML).", labels=["node", "gpu"])
    failed = GaugeMetricFamily(GPU_FAILED, "1 once the GPU failed; nothing is placed on it.", labels=["node", "gpu"])
    info = GaugeMetricFamily(
        GPU_INFO,
        "Always 1: the GPU's name, whether it is simulated, its tier and why it failed.",
        labels=["node", "gpu", "name", "virtual", "tier", "failed_reason"],
    )
    for g in f.gpus:
        gpu = str(g.index)
        kinds: dict[str, float | None] = {
            "total": g.total_mb,
            "used": g.used_mb if g.index in f.measured else None,  # no reading yet: absent, not the ledger's
            "reserved": g.reserved_mb,
            "sleeping": g.sleeping_mb,
        }
        for kind, mb in kinds.items():
            if mb is not None:
                memory.add_metric([node, gpu, kind], mb * MIB)
        if g.utilization is not None:
            utilization.add_metric([node, gpu], g.utilization)
        if g.temperature_c is not None:
            temperature.add_metric([node, gpu], g.temperature_c)
        failed.add_metric([node, gpu], 1.0 if g.failed else 0.0)
        virtual = "true" if g.virtual else "false"
        info.add_metric([node, gpu, g.name[:_MAX_TEXT], virtual, g.tier, g.failed[:_MAX_TEXT]], 1.0)
    for ledger_gpu in f.ledger:
        for e in ledger_gpu.entries:
            held.add_metric([node, str(ledger_gpu.index), e.model_id, e.instance_id, e.state.value], e.held_mb * MIB)
    instances = GaugeMetricFamily(NODE_INSTANCES, "Instances on this node by state.", labels=["node", "state"])
    for state in InstanceState:
        instances.add_metric([node, state.value], float(f.instances.get(state, 0)))
    evictions = CounterMetricFamily(
        NODE_EVICTIONS,
        "Instances this node put to sleep (or killed) to make room, counted as each starts.",
        labels=["node"],
    )
    evictions.add_metric([node], float(f.evictions))
    wakes = CounterMetricFamily(NODE_WAKES, "Sleeping instances woken and serving again.", labels=["node"])
    wakes.add_metric([node], float(f.wakes))
    return [memory, held, utilization, temperature, failed, info, instances, evictions, wakes]


def figures(agent: NodeAgent) -> NodeFigures:
    """The agent's state now. Which figure wins where the ledger and the heartbeat's GPU list differ:
    the ledger's figures (reserved, sleeping, each instance's) are read live, so that one scrape's
    instances add up to its `reserved`; NVML's (total, used, utilisation, temperature, a failure) come
    from the last heartbeat's reading (at most one heartbeat old), so a scrape never blocks on NVML and
    shows what the control plane was told."""
    seen = {g.index: g for g in agent.gpus_seen}
    live = agent.manager.gpu_infos([g for g in agent.gpus_seen if not g.virtual])
    gpus = tuple(_with_health(g, seen[g.index]) if g.index in seen else g for g in live)
    measured = frozenset(g.index for g in gpus if g.virtual or g.index in seen)
    states = Counter(r.state for r in agent.instance_reports())
    counts = agent.events.counts
    return NodeFigures(
        node=agent.settings.node,
        gpus=gpus,
        measured=measured,
        ledger=agent.manager.ledger.gpus,
        instances=dict(states),
        evictions=counts[EVICTION_KIND],
        wakes=counts[WAKE_KIND],
    )


def _with_health(live: GPUInfo, seen: GPUInfo) -> GPUInfo:
    """The live view, with the temperature and failure the heartbeat read where the live one has none."""
    return replace(
        live,
        temperature_c=live.temperature_c if live.temperature_c is not None else seen.temperature_c,
        failed=live.failed or seen.failed,
    )


class _AgentCollector(Collector):
    def __init__(self, agent: NodeAgent):
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        yield from families(figures(self._agent))


class NodeMetrics:
    """One registry per node host, holding only the collector that reads its agent."""

    def __init__(self, agent: NodeAgent):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_AgentCollector(agent))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
