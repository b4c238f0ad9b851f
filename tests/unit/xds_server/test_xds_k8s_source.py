"""Kubernetes-managed models in the registry: not placed on node hosts, and only ready pods enter EDS."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import NodeHeartbeat
from xds_server.k8s import Endpoint
from xds_server.k8s_source import RegistrySink
from xds_server.registry import Registry


def svc(name: str, replicas: int = 2):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": name},
                "backend": {"type": "sglang"},
                "sla": {"min_replicas": replicas, "max_replicas": replicas},
            }
        }
    )


def record(instance: str, model: str, state=InstanceState.READY, node="gpu-1", seq=1):
    return TelemetryRecord(
        instance_id=instance,
        model_id=model,
        version="0.0.0",
        address="10.0.0.7:8081",
        node=node,
        state=state,
        timestamp=1.0,
        seq=seq,
    )


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def registry():
    reg = Registry(clock=Clock())
    reg.mark_synced()
    return reg


async def test_models_come_and_go_with_the_controller(registry):
    sink = RegistrySink(registry)
    await sink.models_changed({"qwen": svc("qwen"), "lr": svc("lr", 1)})
    assert {m: e.source for m, e in registry.models.items()} == {"qwen": "kubernetes", "lr": "kubernetes"}
    await sink.models_changed({"qwen": svc("qwen")})
    assert set(registry.models) == {"qwen"}


async def test_a_model_from_another_source_is_never_taken_over_or_deleted(registry):
    registry.add_model(svc("qwen"), "file")
    sink = RegistrySink(registry)
    await sink.models_changed({"qwen": svc("qwen", 1)})
    assert registry.models["qwen"].source == "file"
    await sink.models_changed({})
    assert "qwen" in registry.models


async def test_node_hosts_are_not_asked_to_run_kubernetes_models(registry):
    registry.add_model(svc("local", 1), "file")
    await RegistrySink(registry).models_changed({"qwen": svc("qwen")})
    reply = registry.heartbeat(NodeHeartbeat(node="gpu-1", address="http://10.0.0.1:7070"))
    assert [a.model_id for a in reply.assignments] == ["local"]


@pytest.mark.parametrize(
    "ready_pods, state, expected",
    [
        ({"qwen-abc"}, InstanceState.READY, ["qwen-abc"]),
        ({"qwen-abc"}, InstanceState.DRAINING, ["qwen-abc"]),
        (set(), InstanceState.READY, []),  # the pod is not Ready in Kubernetes (yet, or any more)
        ({"qwen-abc"}, InstanceState.LOADING, []),  # ready pod, but the sidecar says the worker is loading
        ({"other-pod"}, InstanceState.READY, []),
    ],
)
async def test_only_ready_pods_with_serving_sidecars_enter_eds(registry, ready_pods, state, expected):
    sink = RegistrySink(registry)
    await sink.models_changed({"qwen": svc("qwen")})
    # The node host of that node heartbeats without the pod: it must not disown a Kubernetes pod.
    registry.heartbeat(NodeHeartbeat(node="gpu-1", address="http://10.0.0.1:7070"))
    registry.record_telemetry(record("qwen-abc", "qwen", state))
    registry.clock.now += 1
    registry.heartbeat(NodeHeartbeat(node="gpu-1", address="http://10.0.0.1:7070"))
    await sink.endpoints_changed(
        "qwen",
        tuple(Endpoint(instance_id=p, address="10.0.0.7:8081", node="gpu-1", namespace="models") for p in ready_pods),
    )
    assert [r.instance_id for r in registry.eds_records("qwen", registry.clock.now)] == expected
