"""Pods -> EDS endpoints: table tests."""

from __future__ import annotations

import pytest

from xds_server.k8s.pods import Endpoint, endpoint_of, endpoints_by_model, waiting_problem


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({}, Endpoint("p", "10.0.0.1:8081", "gpu-1", "models", "10.0.0.1:8082")),
        ({"sidecar_port": "9000"}, Endpoint("p", "10.0.0.1:9000", "gpu-1", "models", "10.0.0.1:8082")),
        ({"sidecar_port": None}, Endpoint("p", "10.0.0.1:8081", "gpu-1", "models", "10.0.0.1:8082")),
        ({"sidecar_port": "junk"}, Endpoint("p", "10.0.0.1:8081", "gpu-1", "models", "10.0.0.1:8082")),
        ({"ip": "fd00::5"}, Endpoint("p", "[fd00::5]:8081", "gpu-1", "models", "[fd00::5]:8082")),
        ({"ready": False}, None),
        ({"ip": None}, None),
        ({"phase": "Pending"}, None),
        ({"phase": "Succeeded"}, None),
        ({"deleting": True}, None),
        ({"sidecar": False}, None),  # not injected: nothing listens on the sidecar port
    ],
)
def test_endpoint_of_a_pod(make_pod, kwargs, expected):
    assert endpoint_of(make_pod("p", **kwargs)) == expected


def test_endpoints_by_model_groups_sorts_and_keeps_empty_models(make_pod):
    pods = [
        make_pod("q-b", ip="10.0.0.2"),
        make_pod("q-a", ip="10.0.0.1"),
        make_pod("q-c", ip="10.0.0.3", ready=False),
        make_pod("lr-a", model_id="lr", ip="10.0.1.1"),
        make_pod("q-elsewhere", namespace="other", ip="10.0.9.9"),  # same label, not the ModelService's namespace
        make_pod("stray", model_id="unknown", ip="10.0.9.8"),
    ]
    got = endpoints_by_model(pods, {"qwen2-7b-scoring": "models", "lr": "models", "idle": "models"})
    assert [e.instance_id for e in got["qwen2-7b-scoring"]] == ["q-a", "q-b"]
    assert [e.address for e in got["lr"]] == ["10.0.1.1:8081"]
    assert got["idle"] == ()
    assert set(got) == {"qwen2-7b-scoring", "lr", "idle"}


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({}, None),
        ({"ready": False}, None),
        ({"ready": False, "waiting": "ContainerCreating"}, None),
        ({"ready": False, "waiting": "CrashLoopBackOff"}, "CrashLoopBackOff"),
        ({"ready": False, "waiting": "ErrImagePull"}, "ErrImagePull"),
        ({"phase": "Failed"}, "PodFailed"),
    ],
)
def test_waiting_problem(make_pod, kwargs, reason):
    got = waiting_problem(make_pod("p", **kwargs))
    assert (got.split(":")[0] if got else None) == reason
