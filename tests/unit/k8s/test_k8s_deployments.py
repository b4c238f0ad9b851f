"""ModelService -> Deployment: table tests on the pure builder."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest

from sie.spec_loader import parse_model_service
from xds_server.k8s.deployments import (
    DeploymentSettings,
    desired_deployment,
    desired_replicas,
    needs_update,
    update_patch,
)

SETTINGS = DeploymentSettings()


def build(obj: dict) -> dict:
    return desired_deployment(obj, parse_model_service(obj), SETTINGS)


def test_qwen_deployment_is_a_valid_kubernetes_deployment(qwen):
    deployment = build(qwen)
    kubernetes_validate.validate(deployment, "1.32", strict=True)
    assert deployment["metadata"]["name"] == "qwen2-7b-scoring" and deployment["metadata"]["namespace"] == "models"
    owner = deployment["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "ModelService",
        "qwen2-7b-scoring",
        "uid-qwen",
        True,
    )


def test_pods_carry_the_sla_annotations_and_ask_for_injection(qwen):
    template = build(qwen)["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert {k: v for k, v in annotations.items() if k != "sie.io/spec"} == {
        "sie.io/inject": "true",
        "sie.io/model-id": "qwen2-7b-scoring",
        "sie.io/priority": "P1",
        "sie.io/service-type": "llm",
        "sie.io/p99-latency-ms": "350",
        "sie.io/max-queue-time-ms": "100",
        "sie.io/max-concurrent-requests": "64",
        "sie.io/worker-port": "3000",
        "sie.io/sidecar-port": "8081",
        "sie.io/control-port": "8082",
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8082",
        "prometheus.io/path": "/-/metrics",
    }
    assert template["metadata"]["labels"]["sie.io/inject"] == "true"
    spec = json.loads(annotations["sie.io/spec"])
    assert spec["metadata"] == {"name": "qwen2-7b-scoring"} and spec["spec"]["sla"]["p99_latency_ms"] == 350
    # the canonical spec parses back to the same model
    assert parse_model_service(spec).spec == parse_model_service(qwen).spec


def test_worker_container_follows_the_spec(qwen):
    pod_spec = build(qwen)["spec"]["template"]["spec"]
    (worker,) = pod_spec["containers"]
    assert worker["image"] == "registry.internal/qwen2-7b-scoring:v1.2.0"
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}}
    assert worker["livenessProbe"] == {
        "httpGet": {"path": "/health", "port": 3000},
        "initialDelaySeconds": 60,
        "periodSeconds": 30,
        "timeoutSeconds": 1,
        "failureThreshold": 3,
    }
    assert "readinessProbe" not in worker
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "A100-80gb"}
    assert pod_spec["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
    ]


@pytest.mark.parametrize(
    "sla,replicas,expected",
    [
        ({"min_replicas": 2, "max_replicas": 4}, None, 2),
        ({"min_replicas": 2, "max_replicas": 4}, 3, 3),
        ({"min_replicas": 0, "max_replicas": 1}, None, 0),
        ({"min_replicas": 3}, None, 3),  # max defaults to min
        ({}, None, 1),
    ],
)
def test_replicas_within_min_and_max(qwen, sla, replicas, expected):
    qwen["spec"]["sla"] = sla
    if replicas is not None:
        qwen["spec"]["replicas"] = replicas
    service = parse_model_service(qwen)
    assert desired_replicas(service) == expected
    assert build(qwen)["spec"]["replicas"] == expected


def test_selector_does_not_depend_on_the_spec(qwen):
    before = build(qwen)["spec"]["selector"]
    qwen["spec"]["model"]["priority_level"] = "P0"
    qwen["spec"]["model"]["version"] = "2.0.0"
    assert build(qwen)["spec"]["selector"] == before


def _server_defaulted(deployment: dict) -> dict:
    """What the API server stores: our object plus defaults and status."""
    stored = copy.deepcopy(deployment)
    stored["metadata"].update(
        {
            "uid": "d1",
            "resourceVersion": "9",
            "generation": 1,
            "annotations": {"deployment.kubernetes.io/revision": "1"},
        }
    )
    stored["spec"].update({"revisionHistoryLimit": 10, "progressDeadlineSeconds": 600})
    container = stored["spec"]["template"]["spec"]["containers"][0]
    container.update({"imagePullPolicy": "IfNotPresent", "terminationMessagePath": "/dev/termination-log"})
    container["livenessProbe"].update(
        {"successThreshold": 1, "httpGet": {**container["livenessProbe"]["httpGet"], "scheme": "HTTP"}}
    )
    stored["spec"]["template"]["spec"].update({"restartPolicy": "Always", "dnsPolicy": "ClusterFirst"})
    stored["status"] = {"replicas": 2}
    return stored


@pytest.mark.parametrize(
    "edit,changes",
    [
        (lambda s: None, False),
        (lambda s: s["sla"].update(p99_latency_ms=500), True),
        (lambda s: s.update(replicas=3), True),
        (lambda s: s["model"].update(image="registry.internal/qwen2-7b-scoring:v1.3.0"), True),
        (lambda s: s["scheduling"].update(nodeSelector={}), True),
    ],
)
def test_needs_update_ignores_server_defaults_and_sees_spec_changes(qwen, edit, changes):
    stored = _server_defaulted(build(qwen))
    edit(qwen["spec"])
    desired = build(qwen)
    assert needs_update(stored, desired) is changes
    # and the merge patch, applied, brings it up to date
    patched = _merge(stored, update_patch(desired))
    assert needs_update(patched, desired) is False


def _merge(target, patch):
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def test_the_webhook_accepts_the_pods_this_deployment_makes(qwen):
    """The controller and the webhook agree on the annotation contract: a pod made from the template
    is injected, and the injected pod is a valid Pod."""
    import jsonpatch

    from sidecar.injection import InjectorSettings, decide

    template = build(qwen)["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "qwen2-7b-scoring-", **template["metadata"]},
        "spec": template["spec"],
    }
    decision = decide(pod, InjectorSettings())
    assert decision.allowed and decision.patch, decision.message
    kubernetes_validate.validate(jsonpatch.apply_patch(pod, list(decision.patch)), "1.32", strict=True)
