"""What a ModelService may ask of the scheduler (xds_server/k8s/scheduling.py): its author chooses the
image, and the controller creates the pods, so the spec may not tolerate every taint, select or tolerate
SIE's or the control plane's node keys, or put a P1/P2 model on a tier the operator reserved for P0.
Such a spec is invalid (SpecInvalid, naming the field) and no Deployment is made of it."""

from __future__ import annotations

import pytest

from sie import crd
from sie.spec_loader import parse_model_service
from xds_server.k8s.deployments import DeploymentSettings
from xds_server.k8s.main import controller_settings, parse_args
from xds_server.k8s.reconcile import reconcile
from xds_server.k8s.scheduling import reserved, scheduling_problems

NOW = "2026-11-29T15:10:00Z"
GOLD_P0_ONLY = DeploymentSettings(p0_only_tiers=frozenset({"gold"}))


def scorer(priority: str = "P2", **scheduling) -> dict:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": "cheap", "namespace": "team-b", "uid": "u1", "generation": 1},
        "spec": {
            "model": {
                "name": "cheap",
                "image": "registry.example.com/x:1",
                "service_type": "scoring",
                "priority_level": priority,
            },
            "backend": {"type": "sklearn"},
            "resources": {"limits": {"memory": "1Gi"}},
            "scheduling": scheduling,
        },
    }


@pytest.mark.parametrize(
    ("scheduling", "field"),
    [
        # No key with Exists tolerates every taint: control-plane nodes and every reserved tier's.
        ({"tolerations": [{"operator": "Exists"}]}, "spec.scheduling.tolerations[0].key: required"),
        ({"tolerations": [{"key": "", "operator": "Exists", "effect": "NoSchedule"}]}, "tolerations[0].key"),
        (
            {"tolerations": [{"key": "dedicated", "operator": "Exists"}, {"key": "sie.io/tier", "operator": "Exists"}]},
            "spec.scheduling.tolerations[1].key: 'sie.io/tier' is reserved",
        ),
        (
            {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]},
            "tolerations[0].key: 'node-role.kubernetes.io/control-plane' is reserved",
        ),
        ({"nodeSelector": {"sie.io/tier": "gold"}}, "spec.scheduling.nodeSelector['sie.io/tier']: reserved"),
        (
            {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
            "nodeSelector['node-role.kubernetes.io/control-plane']: reserved",
        ),
        ({"nodeSelector": {"pool.sie.io/x": "y"}}, "nodeSelector['pool.sie.io/x']: reserved"),  # a subdomain too
        ({"tier": "gold"}, "spec.scheduling.tier: tier 'gold' is reserved for P0 models and this model is P2"),
    ],
)
def test_a_spec_that_reaches_for_reserved_nodes_is_invalid_naming_the_field(scheduling, field):
    obj = scorer(**scheduling)
    plan = reconcile(obj, None, [], GOLD_P0_ONLY, NOW)
    assert plan.service is None and plan.deployment_action == "none" and plan.deployment_body is None
    assert any(field in p for p in plan.problems), plan.problems
    valid = next(c for c in plan.status["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "SpecInvalid") and field in valid["message"]
    assert plan.status["phase"] == "Invalid"


def test_the_reviewers_spec_is_refused_for_every_reason_at_once():
    obj = scorer(
        nodeSelector={"sie.io/tier": "gold", "node-role.kubernetes.io/control-plane": ""},
        tolerations=[{"operator": "Exists"}],
        tier="gold",
    )
    problems = scheduling_problems(parse_model_service(obj), GOLD_P0_ONLY.p0_only_tiers)
    assert [p.split(":", 1)[0] for p in problems] == [
        "spec.scheduling.tolerations[0].key",
        "spec.scheduling.nodeSelector['sie.io/tier']",
        "spec.scheduling.nodeSelector['node-role.kubernetes.io/control-plane']",
        "spec.scheduling.tier",
    ]


@pytest.mark.parametrize(
    ("priority", "tier", "settings", "valid"),
    [
        ("P0", "gold", GOLD_P0_ONLY, True),
        ("P1", "gold", GOLD_P0_ONLY, False),
        ("P2", "silver", GOLD_P0_ONLY, True),  # not reserved for P0
        ("P2", "gold", DeploymentSettings(), True),  # no P0-only tier configured
    ],
)
def test_a_p0_only_tier_takes_p0_models_only(priority, tier, settings, valid):
    plan = reconcile(scorer(priority, tier=tier), None, [], settings, NOW)
    assert (plan.deployment_action == "create") is valid, plan.problems
    if valid:
        pod = plan.deployment_body["spec"]["template"]["spec"]
        # SIE's own tier keys, which the spec may not set, come from scheduling.tier.
        assert pod["nodeSelector"] == {crd.TIER_LABEL: tier}
        assert pod["tolerations"] == [
            {"key": crd.TIER_LABEL, "operator": "Equal", "value": tier, "effect": "NoSchedule"}
        ]


@pytest.mark.parametrize(
    "scheduling",
    [
        {},
        {"nodeSelector": {"nvidia.com/gpu.product": "A100-80gb", "kubernetes.io/arch": "amd64"}},
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        {"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]},
        {"tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "tolerationSeconds": 30}]},
    ],
)
def test_ordinary_scheduling_is_copied_to_the_pod(scheduling):
    plan = reconcile(scorer(**scheduling), None, [], GOLD_P0_ONLY, NOW)
    assert plan.problems == () and plan.deployment_action == "create"
    pod = plan.deployment_body["spec"]["template"]["spec"]
    assert pod.get("nodeSelector", {}) == scheduling.get("nodeSelector", {})
    assert pod.get("tolerations", []) == scheduling.get("tolerations", [])


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("sie.io/tier", True),
        ("sie.io/anything", True),
        ("x.sie.io/y", True),
        ("node-role.kubernetes.io/master", True),
        ("node-role.kubernetes.io/control-plane", True),
        ("notsie.io/x", False),
        ("sie.io", False),  # no prefix at all: a plain key
        ("dedicated", False),
        ("node.kubernetes.io/not-ready", False),
        ("kubernetes.io/hostname", False),
    ],
)
def test_reserved_keys(key, expected):
    assert reserved(key) is expected


def test_the_operator_sets_the_p0_only_tiers_and_the_workers_uid_on_the_controllers_command_line():
    args = parse_args(["--p0-only-tiers", "gold, platinum,", "--worker-run-as-user", "1000"])
    deployment = controller_settings(args).deployment
    assert deployment.p0_only_tiers == {"gold", "platinum"} and deployment.worker_run_as_user == 1000
    assert controller_settings(parse_args([])).deployment == DeploymentSettings()
    with pytest.raises(ValueError, match="non-root uid"):
        DeploymentSettings(worker_run_as_user=0)
