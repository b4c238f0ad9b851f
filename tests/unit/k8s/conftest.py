"""Builders for the Kubernetes unit tests: plain JSON objects as the API server would send them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def qwen_object(namespace: str = "models", uid: str = "uid-qwen", generation: int = 1) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "qwen2-7b-scoring.yaml").read_text())
    doc["metadata"].update(
        {
            "namespace": namespace,
            "uid": uid,
            "generation": generation,
            "resourceVersion": "7",
            "creationTimestamp": "2026-11-29T15:00:00Z",
        }
    )
    return doc


def pod(
    name: str,
    model_id: str = "qwen2-7b-scoring",
    namespace: str = "models",
    ready: bool = True,
    ip: str | None = "10.0.0.1",
    phase: str = "Running",
    sidecar: bool = True,
    node: str = "gpu-1",
    waiting: str | None = None,
    deleting: bool = False,
    sidecar_port: str | None = "8081",
) -> dict:
    annotations = {"sie.io/model-id": model_id}
    if sidecar_port is not None:
        annotations["sie.io/sidecar-port"] = sidecar_port
    containers = [{"name": "worker", "image": "w"}] + ([{"name": "sie-sidecar", "image": "s"}] if sidecar else [])
    status: dict = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    if waiting:
        status["containerStatuses"] = [
            {"name": "worker", "ready": False, "state": {"waiting": {"reason": waiting, "message": "back-off 5m0s"}}}
        ]
    meta = {"name": name, "namespace": namespace, "labels": {"sie.io/model-id": model_id}, "annotations": annotations}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T15:05:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": containers, "nodeName": node},
        "status": status,
    }


@pytest.fixture
def qwen() -> dict:
    return copy.deepcopy(qwen_object())


@pytest.fixture
def make_pod():
    return pod


@pytest.fixture
def make_qwen():
    return qwen_object
