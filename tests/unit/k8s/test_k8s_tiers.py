"""A model on a tier on Kubernetes: its pods go to the tier's nodes (label sie.io/tier) and are in the
Guaranteed QoS class, every container (the injected sidecar included) with requests == limits for cpu and
memory in whole CPUs, which the kubelet's static CPU manager pins to cores of their own."""

from __future__ import annotations

import jsonpatch
import kubernetes_validate
import pytest

from sidecar.injection import InjectorSettings, decide
from sie import crd
from sie.spec_loader import parse_model_service
from xds_server.k8s.deployments import DeploymentSettings, desired_deployment, guaranteed_cpus, tier_problems

SETTINGS = DeploymentSettings()


def qos_class(pod: dict) -> str:
    """The QoS class Kubernetes gives a pod (its rules: every container's cpu and memory limits set, and
    requests, where given, equal; requests default to limits)."""
    containers = pod["spec"]["containers"]
    if not any(c.get("resources", {}).get(k, {}) for c in containers for k in ("requests", "limits")):
        return "BestEffort"
    for c in containers:
        limits = c.get("resources", {}).get("limits", {})
        requests = {**limits, **c.get("resources", {}).get("requests", {})}
        if any(r not in limits or requests[r] != limits[r] for r in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed"


def injected_pod(obj: dict) -> dict:
    template = desired_deployment(obj, parse_model_service(obj), SETTINGS)["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "m-", **template["metadata"]},
        "spec": template["spec"],
    }
    decision = decide(pod, InjectorSettings())
    assert decision.allowed and decision.patch, decision.message
    return jsonpatch.apply_patch(pod, list(decision.patch))


def test_a_tiered_pod_is_guaranteed_on_the_tiers_nodes(qwen):
    qwen["spec"]["scheduling"]["tier"] = "gold"
    pod = injected_pod(qwen)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert qos_class(pod) == "Guaranteed"
    worker, sidecar = pod["spec"]["containers"]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": "1", "memory": "32Gi", "cpu": "1"}
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    assert sidecar["resources"] == {
        "requests": {"cpu": "1", "memory": "512Mi"},
        "limits": {"cpu": "1", "memory": "512Mi"},
    }
    # The spec's own nodeSelector and tolerations stay; the tier's label and taint come with them.
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "A100-80gb", crd.TIER_LABEL: "gold"}
    assert {"key": crd.TIER_LABEL, "operator": "Equal", "value": "gold", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]
    assert pod["metadata"]["labels"][crd.TIER_LABEL] == "gold"


def test_a_pod_on_no_tier_is_as_before(qwen):
    pod = injected_pod(qwen)
    assert qos_class(pod) == "Burstable" and crd.TIER_LABEL not in pod["spec"]["nodeSelector"]
    assert crd.TIER_LABEL not in pod["metadata"]["labels"]


@pytest.mark.parametrize(
    ("resources", "cpus"),
    [
        ({}, 1),  # none given: DeploymentSettings.tier_default_cpus
        ({"limits": {"cpu": "1500m"}}, 2),  # whole CPUs, rounded up: the static CPU manager pins no less
        ({"requests": {"cpu": "500m"}}, 1),
        ({"limits": {"cpu": 3}}, 3),
        ({"limits": {"cpu": 2.5}, "requests": {"cpu": "1"}}, 3),
        ({"limits": {"cpu": "2"}, "requests": {"cpu": "4"}}, 4),  # the larger: requests == limits either way
        ({"limits": {"cpu": "100m"}}, 1),
    ],
)
def test_a_tiers_worker_gets_whole_cpus(qwen, resources, cpus):
    qwen["spec"]["scheduling"]["tier"] = "gold"
    qwen["spec"]["resources"] = {"limits": {"memory": "4Gi", **resources.get("limits", {})}}
    if "requests" in resources:
        qwen["spec"]["resources"]["requests"] = resources["requests"]
    service = parse_model_service(qwen)
    assert guaranteed_cpus(service, SETTINGS) == cpus
    (worker,) = desired_deployment(qwen, service, SETTINGS)["spec"]["template"]["spec"]["containers"]
    assert worker["resources"]["requests"]["cpu"] == worker["resources"]["limits"]["cpu"] == str(cpus)


def test_a_memory_request_alone_becomes_the_limit_too(qwen):
    qwen["spec"]["scheduling"]["tier"] = "gold"
    qwen["spec"]["resources"] = {"requests": {"memory": "8Gi"}}
    (worker,) = desired_deployment(qwen, parse_model_service(qwen), SETTINGS)["spec"]["template"]["spec"]["containers"]
    assert worker["resources"] == {"limits": {"cpu": "1", "memory": "8Gi"}, "requests": {"cpu": "1", "memory": "8Gi"}}


def test_a_tier_without_memory_is_a_problem_named_for_the_field(qwen):
    qwen["spec"]["scheduling"]["tier"] = "gold"
    qwen["spec"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    (problem,) = tier_problems(parse_model_service(qwen))
    assert problem.startswith("spec.resources.limits.memory: required on Kubernetes")
    qwen["spec"]["scheduling"].pop("tier")
    assert tier_problems(parse_model_service(qwen)) == []


def test_the_tier_example_manifest_makes_guaranteed_pods_with_exclusive_cores():
    from pathlib import Path

    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests/examples/lr-fraud-gold.yaml").read_text())
    doc["metadata"].update({"namespace": "models", "uid": "uid-gold"})
    pod = injected_pod(doc)
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert qos_class(pod) == "Guaranteed"
    # Whole CPUs on every container: what the static CPU manager pins to exclusive cores.
    assert [c["resources"]["limits"]["cpu"] for c in pod["spec"]["containers"]] == ["2", "1"]
