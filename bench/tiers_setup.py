"""What bench.tiers runs (pure): each stack's cluster file and which models each scenario loads.

Two `sie up` stacks side by side on this machine, the same in everything but `tier_cpus`: each has one
node host with one virtual GPU in the P0-only tier `gold` (the tier exists on both, as it would on any
SIE node today; the scorer runs off the GPU), and stack `tiers`'s node also reserves CPU cores for gold.
Each runs a scorer (P0, tier gold) and an LLM (P1, no tier); a scenario loads one stack's pair (SCENARIO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCORER_SLA_MS = 50.0
STACKS = ("shared", "tiers")


@dataclass(frozen=True)
class Scenario:
    stack: str  # which `sie up` serves it
    scorer: str  # the model under open-loop load
    llm: str | None  # the model kept busy meanwhile, or none
    clients_off_tier: bool  # the load generators run on the cores no tier reserves, as other software should


SCENARIO = {
    "a": Scenario("shared", "scorer-shared", None, clients_off_tier=False),
    "b": Scenario("shared", "scorer-shared", "llm-shared", clients_off_tier=False),
    "c": Scenario("tiers", "scorer-tiers", "llm-tiers", clients_off_tier=True),
    "c0": Scenario("tiers", "scorer-tiers", "llm-tiers", clients_off_tier=False),
    "a1": Scenario("tiers", "scorer-tiers", None, clients_off_tier=True),
}


def _node(name: str, gold: str | None) -> dict[str, Any]:
    node: dict[str, Any] = {"name": name, "virtual_gpus": "1x24GB", "gpu_tiers": "0=gold", "p0_only_tiers": "gold"}
    if gold is not None:
        node["tier_cpus"] = f"gold={gold}"
    return node


def _scorer(node: str) -> dict[str, Any]:
    name = f"scorer-{node}"
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "name": name,
                "version": "1.0.0",
                "path": f".sie/data/{name}.skops",
                "service_type": "scoring",
                "priority_level": "P0",
            },
            "backend": {"type": "sklearn", "config": {"demo": True}},
            "resources": {"max_concurrent_requests": 64},
            "input_schema": {"type": "json", "fields": [{"name": "text", "type": "string", "max_length": 4096}]},
            "output_schema": {"type": "json", "fields": [{"name": "score", "type": "float32", "range": [0.0, 1.0]}]},
            "sla": {"p99_latency_ms": SCORER_SLA_MS, "max_queue_time_ms": 100},
            "scheduling": {"tier": "gold"},
        },
    }


def _llm(node: str, threads: int, concurrency: int) -> dict[str, Any]:
    name = f"llm-{node}"
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "name": name,
                "version": "0.1.0",
                "path": f".sie/data/{name}",
                "service_type": "llm",
                "priority_level": "P1",
            },
            "backend": {
                "type": "torch",
                "config": {"demo": True, "max_total_tokens": 4096, "max_seq_len": 512, "num_threads": threads},
            },
            # Every closed-loop client is admitted at once: the sidecar never queues nor refuses one.
            "resources": {"max_concurrent_requests": concurrency},
            "sla": {"p99_latency_ms": 30_000, "max_queue_time_ms": 30_000},
        },
    }


def cluster_docs(stack: str, *, gold: str, llm_threads: int, llm_concurrency: int) -> list[dict[str, Any]]:
    """A stack's cluster file: its node (`tiers`: gold on CPUs `gold`; `shared`: no tier cores), its
    scorer and its LLM."""
    cluster = {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "Cluster",
        "spec": {
            # One instance per model: nothing for the endpoint picker to choose; none runs (and no fixed port).
            "picker_port": 0,
            # bench.tiers freezes one stack while it measures the other: a frozen node host is not lost.
            "settings": {"control_plane": {"heartbeat_timeout_s": 3600}},
            "nodes": [_node(stack, gold if stack == "tiers" else None)],
        },
    }
    return [cluster, _scorer(stack), _llm(stack, llm_threads, llm_concurrency)]
