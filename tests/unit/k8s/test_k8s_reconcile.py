"""One reconcile step (ModelService + Deployment + pods -> action and status): table tests."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from xds_server.k8s.deployments import MAX_SPEC_ANNOTATION_BYTES, DeploymentSettings, desired_deployment
from xds_server.k8s.reconcile import parse, reconcile, status_patch, with_write_failures

NOW = "2026-11-29T15:10:00Z"
SETTINGS = DeploymentSettings()


def stored(obj: dict, updated: int | None = None, generation: int = 1) -> dict:
    d = desired_deployment(obj, parse_model_service(obj), SETTINGS)
    d["metadata"]["generation"] = generation
    d["status"] = {
        "observedGeneration": generation,
        "updatedReplicas": d["spec"]["replicas"] if updated is None else updated,
    }
    return d


def conditions(status: dict) -> dict:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_new_model_creates_its_deployment(qwen):
    plan = reconcile(qwen, None, [], SETTINGS, NOW)
    assert plan.deployment_action == "create" and plan.deployment_body["kind"] == "Deployment"
    assert plan.status["phase"] == "Pending" and (plan.status["replicas"], plan.status["readyReplicas"]) == (2, 0)
    assert conditions(plan.status) == {
        "Valid": ("True", "SpecValid"),
        "Deployed": ("True", "DeploymentCreated"),
        "Ready": ("False", "ReplicasNotReady"),
    }
    assert all(c["lastTransitionTime"] == NOW and c["observedGeneration"] == 1 for c in plan.status["conditions"])


@pytest.mark.parametrize(
    "pods,updated,phase,ready,ready_condition",
    [
        ([], None, "Pending", 0, ("False", "ReplicasNotReady")),
        ([("a", True)], None, "Progressing", 1, ("False", "ReplicasNotReady")),
        ([("a", True), ("b", True)], None, "Ready", 2, ("True", "ReplicasReady")),
        ([("a", True), ("b", True)], 1, "Progressing", 2, ("True", "ReplicasReady")),  # rollout not finished
        ([("a", True), ("b", False)], None, "Progressing", 1, ("False", "ReplicasNotReady")),
        ([("a", True), ("b", "CrashLoopBackOff")], None, "Degraded", 1, ("False", "CrashLoopBackOff")),
        ([("a", "ImagePullBackOff"), ("b", "ImagePullBackOff")], None, "Degraded", 0, ("False", "ImagePullBackOff")),
        ([("a", True), ("b", True), ("c", "deleting")], None, "Ready", 2, ("True", "ReplicasReady")),
    ],
)
def test_pods_to_status(qwen, make_pod, pods, updated, phase, ready, ready_condition):
    objs = []
    for name, state in pods:
        if state == "deleting":
            objs.append(make_pod(name, deleting=True))
        elif isinstance(state, str):
            objs.append(make_pod(name, ready=False, waiting=state))
        else:
            objs.append(make_pod(name, ready=state))
    plan = reconcile(qwen, stored(qwen, updated), objs, SETTINGS, NOW)
    assert plan.deployment_action == "none"
    assert (plan.status["phase"], plan.status["readyReplicas"], plan.status["replicas"]) == (phase, ready, 2)
    assert conditions(plan.status)["Ready"] == ready_condition
    assert conditions(plan.status)["Deployed"] == ("True", "DeploymentUpToDate")


def test_failing_pod_is_named_in_the_message(qwen, make_pod):
    plan = reconcile(qwen, stored(qwen), [make_pod("qwen-x", ready=False, waiting="CrashLoopBackOff")], SETTINGS, NOW)
    ready = [c for c in plan.status["conditions"] if c["type"] == "Ready"][0]
    assert "pod qwen-x container worker" in ready["message"] and "0 of 2 ready" in ready["message"]


def test_spec_change_patches_the_deployment(qwen):
    current = stored(qwen)
    qwen["spec"]["sla"]["p99_latency_ms"] = 500
    plan = reconcile(qwen, current, [], SETTINGS, NOW)
    assert plan.deployment_action == "patch"
    assert plan.deployment_body["spec"]["template"]["metadata"]["annotations"]["sie.io/p99-latency-ms"] == "500"
    assert conditions(plan.status)["Deployed"] == ("True", "DeploymentUpdated")


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda s: s["sla"].update(min_replicas=5, max_replicas=2), "sla"),
        (lambda s: s["model"].pop("image"), "spec.model.image"),
        (lambda s: s["backend"].update(type="tensorflow"), "backend.type"),
        # an embedded engine's settings are part of the spec (sie.engine_settings)
        (lambda s: s["backend"].update(type="torch", config={"dtype": "float8"}), "spec.backend.config.dtype"),
        (lambda s: s.update(replicas=9), "replicas (9) must lie within"),
        (
            lambda s: (s.update(scheduling={"tier": "gold"}), s["resources"]["limits"].pop("memory")),
            "spec.resources.limits.memory: required on Kubernetes for a model on a tier",
        ),
    ],
)
def test_invalid_spec_leaves_the_deployment_alone_and_says_why(qwen, make_pod, edit, named):
    current = stored(qwen)
    edit(qwen["spec"])
    plan = reconcile(qwen, current, [make_pod("a"), make_pod("b")], SETTINGS, NOW)
    assert plan.deployment_action == "none" and plan.deployment_body is None
    assert plan.status["phase"] == "Invalid"
    valid = [c for c in plan.status["conditions"] if c["type"] == "Valid"][0]
    assert (valid["status"], valid["reason"]) == ("False", "SpecInvalid") and named in valid["message"]
    # the running pods are still reported
    assert plan.status["readyReplicas"] == 2 and plan.status["replicas"] == 2


def test_foreign_deployment_of_the_same_name_is_not_overwritten(qwen):
    foreign = stored(qwen)
    foreign["metadata"]["ownerReferences"] = []
    plan = reconcile(qwen, foreign, [], SETTINGS, NOW)
    assert plan.deployment_action == "none"
    assert plan.status["phase"] == "Degraded" and conditions(plan.status)["Deployed"] == ("False", "DeploymentConflict")


def test_duplicate_model_id_in_another_namespace_is_invalid(qwen):
    plan = reconcile(qwen, None, [], SETTINGS, NOW, duplicate_of="prod/qwen2-7b-scoring")
    assert plan.deployment_action == "none" and plan.status["phase"] == "Invalid"
    assert "already served by ModelService prod/qwen2-7b-scoring" in plan.status["conditions"][0]["message"]


def test_unchanged_status_is_not_written_again_and_keeps_transition_times(qwen, make_pod):
    pods = [make_pod("a"), make_pod("b")]
    first = reconcile(qwen, stored(qwen), pods, SETTINGS, NOW)
    qwen["status"] = first.status
    again = reconcile(qwen, stored(qwen), pods, SETTINGS, "2026-11-29T16:00:00Z")
    assert again.status is None  # nothing to write
    pods[1] = make_pod("b", ready=False)
    later = reconcile(qwen, stored(qwen), pods, SETTINGS, "2026-11-29T17:00:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in later.status["conditions"]}
    assert times == {"Valid": NOW, "Deployed": NOW, "Ready": "2026-11-29T17:00:00Z"}


def test_a_model_gets_a_network_policy_that_fences_its_pods(qwen):
    plan = reconcile(qwen, None, [], SETTINGS, NOW)
    assert plan.policy_action == "create"
    policy = plan.policy_body
    assert policy["metadata"]["name"] == "qwen2-7b-scoring-sie" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"] == plan.deployment_body["spec"]["selector"]
    data, control = policy["spec"]["ingress"]
    assert data["ports"] == [{"protocol": "TCP", "port": SETTINGS.sidecar_port}]
    assert data["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sie-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "sie-envoy"}},
        }
    ]
    assert control["ports"] == [{"protocol": "TCP", "port": SETTINGS.control_port}]
    # No rule names the worker port: only the sidecar, inside the pod, reaches the worker.
    assert all(p["port"] != SETTINGS.worker_port for rule in policy["spec"]["ingress"] for p in rule["ports"])
    # Once stored, nothing to do; a policy someone else owns is left alone.
    assert reconcile(qwen, None, [], SETTINGS, NOW, policy=policy).policy_action == "none"
    foreign = {**policy, "metadata": {**policy["metadata"], "ownerReferences": []}}
    assert reconcile(qwen, None, [], SETTINGS, NOW, policy=foreign).policy_action == "none"
    loose = {**policy, "spec": {**policy["spec"], "ingress": [{}]}}
    assert reconcile(qwen, None, [], SETTINGS, NOW, policy=loose).policy_action == "patch"


def test_an_invalid_spec_makes_no_policy(qwen):
    qwen["spec"]["sla"]["p99_latency_ms"] = -1
    assert reconcile(qwen, None, [], SETTINGS, NOW).policy_action == "none"


@pytest.mark.parametrize(
    "autoscale,replicas",
    [
        ({"by": "sie", "desired": 3, "recommended": 3, "reason": "up: demand 4.2 in flight and queued / 1.4"}, 3),
        ({"by": "spec.replicas", "desired": 4, "reason": "an external scaler owns the count: ..."}, 4),
    ],
)
def test_the_status_shows_who_scales_to_what_why_and_the_ready_pods_now(qwen, make_pod, autoscale, replicas):
    plan = reconcile(
        qwen, stored(qwen), [make_pod("a"), make_pod("b", ready=False)], SETTINGS, NOW, record={"autoscale": autoscale}
    )
    assert plan.status["autoscale"] == {**autoscale, "current": 1}
    # status.replicas is the scale subresource's status.replicas (the CRD's statusReplicasPath).
    assert plan.status["replicas"] == replicas and plan.status["readyReplicas"] == 1
    assert "build" not in plan.status  # a record of the count alone is no build record


def test_no_record_no_autoscale_status(qwen):
    assert "autoscale" not in reconcile(qwen, stored(qwen), [], SETTINGS, NOW).status


@pytest.mark.parametrize(
    "stored,new,patch",
    [
        (None, {"phase": "Ready"}, {"phase": "Ready"}),
        ({"phase": "Ready"}, {"phase": "Ready"}, {}),
        # A key the new status lacks is removed, at any depth: a plain merge patch would leave it.
        (
            {"autoscale": {"by": "sie", "desired": 2, "recommended": 2}, "replicas": 2},
            {"autoscale": {"by": "spec.replicas", "desired": 3}, "replicas": 3},
            {"autoscale": {"by": "spec.replicas", "desired": 3, "recommended": None}, "replicas": 3},
        ),
        ({"rollout": {"phase": "x"}, "phase": "Ready"}, {"phase": "Ready"}, {"rollout": None}),
        (
            {"conditions": [{"type": "A"}, {"type": "B"}]},
            {"conditions": [{"type": "A"}]},
            {"conditions": [{"type": "A"}]},
        ),
        ({"build": 1}, {"build": {"generation": 1}}, {"build": {"generation": 1}}),
    ],
)
def test_the_status_patch_turns_the_stored_status_into_the_new_one(stored, new, patch):
    assert status_patch(stored, new) == patch


def test_a_status_is_written_without_nulls_so_a_stored_one_compares_equal(qwen):
    record = {"autoscale": {"by": "sie", "desired": 2, "reason": "hold", "recommended": None}}
    status = reconcile(qwen, stored(qwen), [], SETTINGS, NOW, record=record).status
    assert "recommended" not in status["autoscale"]
    again = reconcile({**qwen, "status": status}, stored(qwen), [], SETTINGS, NOW, record=record)
    assert again.status is None


def test_a_spec_is_bounded_by_its_pods_annotation_not_by_kubectls_copy(qwen):
    # kubectl apply keeps a copy of the object in an annotation of its own: the ModelService doubles,
    # its pods' sie.io/spec does not (spec_annotation leaves metadata out).
    qwen["metadata"].setdefault("annotations", {})["kubectl.kubernetes.io/last-applied-configuration"] = "x" * 200_000
    service, problems = parse(qwen)
    assert service is not None and problems == []
    qwen["spec"]["backend"]["config"] = {f"arg{n}": "z" * 4000 for n in range(70)}  # 280 KB of engine args
    service, problems = parse(qwen)
    assert service is None and len(problems) == 1
    assert (
        "as the pods' sie.io/spec annotation" in problems[0] and f"at most {MAX_SPEC_ANNOTATION_BYTES:,}" in problems[0]
    )


def test_a_build_no_longer_wanted_is_deleted_as_seen_and_only_if_owned(qwen):
    service = parse_model_service(qwen)
    serving = stored(qwen)
    old = desired_deployment(qwen, service, SETTINGS, generation=1, replicas=1)
    old["metadata"]["uid"] = "uid-old"
    foreign = desired_deployment(
        {**qwen, "metadata": {**qwen["metadata"], "uid": "someone-else"}}, service, SETTINGS, 2
    )
    plan = reconcile(
        qwen, serving, [], SETTINGS, NOW, others={"qwen2-7b-scoring-g1": old, "qwen2-7b-scoring-g2": foreign}
    )
    # Only the one it owns, and only that object (its uid: never a namesake made since); its pods drain.
    assert plan.others == (
        ("delete", "qwen2-7b-scoring-g1", {"propagationPolicy": "Background", "preconditions": {"uid": "uid-old"}}),
    )


def test_a_refused_write_is_a_condition_that_holds_its_time_and_goes_when_writes_succeed(qwen):
    status = reconcile(qwen, stored(qwen), [], SETTINGS, NOW).status
    refused = ["delete Deployment qwen2-7b-scoring-g1: HTTP 403 Forbidden"]
    failed = with_write_failures(status, refused, None, NOW)
    applied = [c for c in failed["conditions"] if c["type"] == "Applied"]
    assert [(c["status"], c["reason"], c["message"]) for c in applied] == [("False", "WriteFailed", refused[0])]
    assert applied[0]["observedGeneration"] == 1 and failed["phase"] == status["phase"]
    # The same refusal again: the same status (lastTransitionTime kept), so nothing is written.
    later = "2026-11-29T15:20:00Z"
    again = with_write_failures(
        reconcile({**qwen, "status": failed}, stored(qwen), [], SETTINGS, later).status, refused, failed, later
    )
    assert again == failed
    # Every write succeeded: the plan's status has no such condition, and differs from the stored one.
    healed = reconcile({**qwen, "status": failed}, stored(qwen), [], SETTINGS, later).status
    assert healed is not None and "Applied" not in conditions(healed)
    assert with_write_failures(status, [], None, NOW) is status
