"""One reconcile step as a pure function: a ModelService, its Deployment and its pods in; what to write out.

    plan = reconcile(obj, deployment, pods, settings, now, policy=network_policy)

`plan.deployment_action` is "create", "patch" or "none", with the body to send, and so is
`plan.policy_action` for the model's NetworkPolicy; `plan.status` is the status to write (None when it
is already what the object has, so a quiet cluster writes nothing); it holds no nulls, as a status
stored through a merge patch cannot, and `status_patch` turns it into the patch that removes what it
no longer has.

During a rollout a model has two builds (`builds`, from the control plane's rollout: xds_server/rollout),
each its own Deployment (deployments.deployment_name): `deployment` is the first build's (the serving
one), `plan.others` creates or patches the other's and deletes the Deployments no build wants any more
(the old build's after a promotion, the new one's after a rollback: Kubernetes then drains its pods).

Invariants:
- An invalid spec never touches an existing Deployment: a typo in an edit must not take a serving
  model down. The error goes to the status (condition Valid=False, reason SpecInvalid) instead.
- A Deployment of the same name that this ModelService does not own is never overwritten
  (reason DeploymentConflict).
- A condition's lastTransitionTime changes only when its status does.
- The status is written even when another write of the plan was refused: the controller's shell adds
  the condition Applied=False (reason WriteFailed, `with_write_failures`) naming what failed and why,
  and retries; a build is deleted only when every other write of the plan succeeded (new before old).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from sie.errors import SpecError
from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from xds_server.k8s.deployments import (
    MAX_SPEC_ANNOTATION_BYTES,
    Build,
    DeploymentSettings,
    deployment_name,
    desired_deployment,
    desired_network_policy,
    desired_replicas,
    needs_update,
    owned_by,
    selector,
    spec_annotation,
    tier_problems,
    update_patch,
)
from xds_server.k8s.pods import is_ready, is_terminating, waiting_problem
from xds_server.k8s.scheduling import scheduling_problems

Action = Literal["create", "patch", "none"]
OtherAction = Literal["create", "patch", "delete"]


@dataclass(frozen=True)
class Plan:
    deployment_action: Action = "none"
    deployment_body: dict[str, Any] | None = None
    status: dict[str, Any] | None = None
    service: ModelService | None = None  # the parsed spec, None when invalid
    problems: tuple[str, ...] = field(default=())
    policy_action: Action = "none"
    policy_body: dict[str, Any] | None = None
    # The other builds' Deployments: (action, name, body; for a delete, its DeleteOptions).
    others: tuple[tuple[OtherAction, str, dict[str, Any] | None], ...] = ()
    now: str = ""  # when the plan was made: the time of a condition the apply adds (with_write_failures)


def parse(
    obj: dict[str, Any], settings: DeploymentSettings = DeploymentSettings()
) -> tuple[ModelService | None, list[str]]:
    """The validated ModelService, or the problems (each naming the field) that make it invalid; what is
    valid on Kubernetes depends on the operator's `settings` (its P0-only tiers)."""
    meta = obj.get("metadata") or {}
    try:
        # Not sie.spec.MAX_SPEC_BYTES: a Kubernetes model never goes to a node host. What bounds it is
        # its pods' sie.io/spec annotation (below), which kubectl's own copy of the object does not swell.
        service = parse_model_service(obj, f"ModelService {meta.get('namespace')}/{meta.get('name')}")
    except SpecError as exc:
        return None, [str(p) for p in exc.problems]
    size = len(spec_annotation(service).encode())
    if size > MAX_SPEC_ANNOTATION_BYTES:
        return None, [
            f"spec: {size:,} bytes as the pods' sie.io/spec annotation; Kubernetes allows 262,144 bytes of "
            f"annotations on an object, and the pods' others need some: at most {MAX_SPEC_ANNOTATION_BYTES:,}"
        ]
    if not service.spec.model.image:
        return None, ["spec.model.image: required on Kubernetes (the container image that runs the worker)"]
    problems = tier_problems(service) + scheduling_problems(service, settings.p0_only_tiers)
    return (None, problems) if problems else (service, [])


def reconcile(
    obj: dict[str, Any],
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    settings: DeploymentSettings,
    now: str,
    duplicate_of: str | None = None,
    policy: dict[str, Any] | None = None,
    builds: list[Build] | None = None,
    others: dict[str, dict[str, Any]] | None = None,
    record: dict[str, Any] | None = None,
) -> Plan:
    """`now` is an RFC 3339 timestamp; `duplicate_of` names the ModelService that already serves this
    model id in another namespace (model ids are cluster-wide: they name Envoy clusters); `policy` is the
    model's NetworkPolicy as stored (None: none yet). The policy is created before the Deployment's pods
    can exist, and a NetworkPolicy of that name this ModelService does not own is never overwritten.

    `builds` (default: the spec's one build) come from the control plane's rollout, the first being the
    serving one; `others` are this model's other Deployments as stored, by name; `record` is the
    control plane's record of the build and its rollout, written to `status.build` and summarised in
    `status.rollout` (None: none to write)."""
    service, problems = parse(obj, settings)
    if duplicate_of is not None:
        service, problems = (
            None,
            [
                f"spec.model.name: model id already served by ModelService {duplicate_of}; "
                "model ids are unique in the cluster"
            ],
        )
    action: Action = "none"
    body = None
    conflict = deployment is not None and not owned_by(deployment, obj)
    wanted_builds = builds or ([Build(0, service, desired_replicas(service))] if service is not None else [])
    other_changes: list[tuple[OtherAction, str, dict[str, Any] | None]] = []
    if service is not None and not conflict:
        first = wanted_builds[0]
        desired = desired_deployment(obj, first.service, settings, first.generation, first.replicas)
        if deployment is None:
            action, body = "create", desired
        elif needs_update(deployment, desired):
            action, body = "patch", update_patch(desired)
        names = {deployment_name(service.model_id, first.generation)}
        for build in wanted_builds[1:]:
            name = deployment_name(service.model_id, build.generation)
            names.add(name)
            wanted = desired_deployment(obj, build.service, settings, build.generation, build.replicas)
            current = (others or {}).get(name)
            if current is None:
                other_changes.append(("create", name, wanted))
            elif owned_by(current, obj) and needs_update(current, wanted):
                other_changes.append(("patch", name, update_patch(wanted)))
        for name, current in sorted((others or {}).items()):
            if name not in names and owned_by(current, obj):
                other_changes.append(("delete", name, delete_options(current)))
    policy_action: Action = "none"
    policy_body = None
    if service is not None and not conflict and (policy is None or owned_by(policy, obj)):
        wanted = desired_network_policy(obj, service, settings)
        if policy is None:
            policy_action, policy_body = "create", wanted
        elif needs_update(policy, wanted):
            policy_action, policy_body = "patch", update_patch(wanted)
    status: dict[str, Any] | None = compute_status(obj, service, problems, deployment, pods, action, conflict, now)
    if status is not None and record is not None:
        status = with_rollout(status, record, obj, now)
    elif status is not None and "build" in (obj.get("status") or {}):
        status = {**status, "build": obj["status"]["build"], "rollout": obj["status"].get("rollout")}
    # A merge patch stores no null (it deletes the key), so neither does the status compared with it.
    status = _without_nulls(status) if status is not None else None
    if status == obj.get("status"):
        status = None
    return Plan(action, body, status, service, tuple(problems), policy_action, policy_body, tuple(other_changes), now)


def delete_options(current: dict[str, Any]) -> dict[str, Any]:
    """The DeleteOptions that retire a build's Deployment: that object only (its uid, as seen: never a
    namesake made since), its ReplicaSets and pods after it in the background (they drain as usual)."""
    options: dict[str, Any] = {"propagationPolicy": "Background"}
    uid = (current.get("metadata") or {}).get("uid")
    if uid:
        options["preconditions"] = {"uid": uid}
    return options


def with_write_failures(
    status: dict[str, Any], failures: list[str], stored: dict[str, Any] | None, now: str
) -> dict[str, Any]:
    """`status` with a condition `Applied` (False, reason WriteFailed) naming each write the API server
    refused, so the ModelService reports what the controller could not do (and why) while it retries.
    No failures: `status` as it is; the condition is absent once every write succeeds again."""
    if not failures:
        return status
    obj = {"metadata": {"generation": status.get("observedGeneration", 0)}, "status": stored or {}}
    previous = (stored or {}).get("conditions") or []
    condition = _conditions([("Applied", False, "WriteFailed", "; ".join(failures))], previous, obj, now)
    kept = [c for c in status.get("conditions") or [] if c.get("type") != "Applied"]
    return {**status, "conditions": kept + condition}


def status_patch(stored: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `stored` into `new`: changed values, and None for each
    key `new` lacks, at every level of nested objects (lists are replaced whole)."""
    old = stored if isinstance(stored, dict) else {}
    out: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            nested = status_patch(before, value)
            if nested:
                out[key] = nested
        elif value != before or key not in old:
            out[key] = value
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def with_rollout(status: dict[str, Any], record: dict[str, Any], obj: dict[str, Any], now: str) -> dict[str, Any]:
    """`status` with the control plane's record (`build`), its rollout summarised for people and the
    printer column (`rollout.summary`), and a `Rollout` condition whose reason is the rollout's phase."""
    rollout = record.get("rollout")
    build = {k: v for k, v in record.items() if k != "autoscale"}
    out = {**status, "build": build} if build else dict(status)
    if record.get("autoscale") is not None:
        # Who sets the count (`by`: sie, or spec.replicas for an external scaler), to what (`desired`, also
        # `replicas`, the scale subresource's status), why, and the model's ready pods now (`current`).
        out["autoscale"] = {**record["autoscale"], "current": status["readyReplicas"]}
        out["replicas"] = record["autoscale"].get("desired", out["replicas"])
    if not rollout:
        return out
    share = (rollout.get("share") or {}).get("new", 0)
    phase = str(rollout.get("phase"))
    active = phase in ("progressing", "paused")
    step = f"{rollout.get('step')}/{len(rollout.get('steps') or [])}"
    out["rollout"] = {
        "phase": phase,
        "fromVersion": rollout.get("from_version"),
        "toVersion": rollout.get("to_version"),
        "step": rollout.get("step"),
        "steps": rollout.get("steps"),
        "share": rollout.get("share"),
        "reason": rollout.get("reason"),
        "gates": rollout.get("gates"),
        "failedGate": rollout.get("failed_gate"),
        "summary": f"{share}% step {step}" + ("" if active else f" {phase}"),
    }
    reasons = {
        "progressing": "Progressing",
        "paused": "Paused",
        "succeeded": "Succeeded",
        "rolled_back": "RolledBack",
        "aborted": "Aborted",
    }
    ok = phase in ("progressing", "succeeded")
    message = f"{rollout.get('from_version')} -> {rollout.get('to_version')}: {rollout.get('reason')}"
    previous = (obj.get("status") or {}).get("conditions") or []
    extra = _conditions([("Rollout", ok, reasons.get(phase, phase), message)], previous, obj, now)
    out["conditions"] = [c for c in status["conditions"] if c.get("type") != "Rollout"] + extra
    if active and out.get("phase") == "Ready":
        out["phase"] = "Progressing"
    return out


def compute_status(
    obj: dict[str, Any],
    service: ModelService | None,
    problems: list[str],
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    action: Action,
    conflict: bool,
    now: str,
) -> dict[str, Any]:
    live = [p for p in pods if not is_terminating(p)]
    ready = sum(1 for p in live if is_ready(p))
    if service is not None:
        wanted = desired_replicas(service)
    else:
        wanted = int(((deployment or {}).get("spec") or {}).get("replicas") or 0) if not conflict else 0
    failing = [msg for msg in (waiting_problem(p) for p in live) if msg]
    conditions: list[tuple[str, bool, str, str]] = []
    if service is None:
        conditions.append(("Valid", False, "SpecInvalid", "; ".join(problems)))
    else:
        conditions.append(("Valid", True, "SpecValid", "the spec is valid"))
    if conflict:
        name = deployment["metadata"]["name"] if deployment else "?"
        conditions.append(
            (
                "Deployed",
                False,
                "DeploymentConflict",
                f"Deployment {name} exists and is not owned by this ModelService; rename or delete it",
            )
        )
    elif action == "create":
        conditions.append(("Deployed", True, "DeploymentCreated", "created the Deployment"))
    elif deployment is None:
        conditions.append(("Deployed", False, "DeploymentMissing", "no Deployment yet (the spec is invalid)"))
    elif action == "patch":
        conditions.append(("Deployed", True, "DeploymentUpdated", "updated the Deployment to the spec"))
    else:
        conditions.append(("Deployed", True, "DeploymentUpToDate", "the Deployment matches the spec"))
    if failing:
        reason = failing[0].split(":", 1)[0]
        conditions.append(("Ready", False, reason, f"{ready} of {wanted} ready; " + "; ".join(failing[:3])))
    elif ready >= wanted:
        conditions.append(("Ready", True, "ReplicasReady", f"{ready} of {wanted} ready"))
    else:
        conditions.append(("Ready", False, "ReplicasNotReady", f"{ready} of {wanted} ready"))
    model_id = service.model_id if service is not None else ((obj.get("spec") or {}).get("model") or {}).get("name")
    return {
        "selector": ",".join(f"{k}={v}" for k, v in sorted(selector(str(model_id or "")).items())),
        "phase": _phase(service, conflict, ready, wanted, bool(failing), deployment),
        "observedGeneration": (obj.get("metadata") or {}).get("generation", 0),
        "replicas": wanted,
        "readyReplicas": ready,
        "conditions": _conditions(conditions, (obj.get("status") or {}).get("conditions") or [], obj, now),
    }


def _phase(
    service: ModelService | None,
    conflict: bool,
    ready: int,
    wanted: int,
    failing: bool,
    deployment: dict[str, Any] | None,
) -> str:
    if service is None:
        return "Invalid"
    if conflict or (failing and ready < wanted):
        return "Degraded"
    if ready >= wanted and _rolled_out(deployment, wanted):
        return "Ready"
    if ready == 0:
        return "Pending"
    return "Progressing"


def _rolled_out(deployment: dict[str, Any] | None, wanted: int) -> bool:
    if wanted == 0:
        return True
    if deployment is None:
        return False
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation", 0)
    return status.get("observedGeneration", 0) >= generation and status.get("updatedReplicas", 0) >= wanted


def _conditions(
    new: list[tuple[str, bool, str, str]], old: list[dict[str, Any]], obj: dict[str, Any], now: str
) -> list[dict[str, Any]]:
    previous = {c.get("type"): c for c in old}
    generation = (obj.get("metadata") or {}).get("generation", 0)
    out = []
    for kind, ok, reason, message in new:
        status = "True" if ok else "False"
        before = previous.get(kind)
        since = (
            before["lastTransitionTime"]
            if before and before.get("status") == status and before.get("lastTransitionTime")
            else now
        )
        out.append(
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since,
                "observedGeneration": generation,
            }
        )
    return out
