"""ModelService -> Deployment, as pure functions over plain JSON objects (what the API server sends).

The Deployment runs the model's worker container; the injection webhook adds the sidecar to each pod
(the pod template asks for it with `sie.io/inject: "true"`). The pod template carries the per-model SLA
annotations and the ModelService itself in `sie.io/spec`, which the webhook checks and the sidecar reads
through a downwardAPI volume; both the webhook and this builder follow `sie.crd`'s annotation names.

Tiers: a model with `scheduling.tier` gets the node's CPU isolation the Kubernetes way. Its pods select
nodes labelled `sie.io/tier=<tier>` (crd.TIER_LABEL), tolerate that key's NoSchedule taint (taint the
tier's nodes so nothing else lands there), and are in the Guaranteed QoS class: the worker's requests
equal its limits for cpu (whole CPUs: the spec's, rounded up, default 1) and memory (the spec's, which a
tier requires: `tier_problems`), and the webhook gives the sidecar the same (sidecar/injection.py). With
the kubelet's static CPU manager policy, a Guaranteed container with whole CPUs gets cores of its own.
What the spec's own nodeSelector and tolerations may say is checked first (scheduling.py).

Hardening (DESIGN §10: the worker runs the model's code): no service-account token is mounted into the
pod, the pod runs under the runtime's default seccomp profile, and the worker cannot gain privileges and
has no capabilities (see `DeploymentSettings.worker_run_as_user` for its uid). The webhook hardens the
sidecar it adds the same way, and runs it as a non-root user.

Invariants:
- The selector is `sie.io/model-id` plus `app.kubernetes.io/managed-by`: it never changes for a model
  (a Deployment's selector is immutable).
- `needs_update` compares only the fields this builder sets, so fields the API server defaults
  (imagePullPolicy, terminationMessagePath, ...) never cause an update loop.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from sie import crd
from sie.spec import API_VERSION, KIND, ModelService, Probe

MANAGED_BY = "sie-controller"
WORKER_CONTAINER = "worker"


@dataclass(frozen=True)
class DeploymentSettings:
    worker_port: int = 3000
    sidecar_port: int = 8081
    control_port: int = 8082
    termination_grace_s: int = 60  # room for the sidecar to drain in-flight requests
    # Who may reach a model's pods (its NetworkPolicy): the data port only from SIE's Envoy pods, the
    # sidecar's control port only from SIE's own namespace and from namespaces labelled for monitoring.
    system_namespace: str = "sie-system"
    envoy_labels: tuple[tuple[str, str], ...] = (("app.kubernetes.io/name", "sie-envoy"),)
    monitoring_namespace_label: tuple[str, str] = ("sie.io/monitoring", "true")
    tier_default_cpus: int = 1  # a tier's worker CPUs when its spec gives none (whole CPUs: exclusive cores)
    p0_only_tiers: frozenset[str] = frozenset()
    """Tiers only P0 models may use (default none): a P1 or P2 ModelService naming one is invalid
    (SpecInvalid), as a node host's --p0-only-tiers refuses it in standalone. The operator sets it, since
    a ModelService author may not: `python -m xds_server.k8s --p0-only-tiers gold`."""
    worker_run_as_user: int | None = None
    """The uid the worker container runs as, with runAsNonRoot (default None: the image's own user). Off
    by default because GPU worker images (SGLang's, NVIDIA's) run as root, and runAsNonRoot would stop
    them starting; set it when every model image runs as that uid. Root or not, the worker has no
    capabilities, cannot gain privileges, and runs under the runtime's default seccomp profile."""

    def __post_init__(self) -> None:
        if self.worker_run_as_user is not None and not 0 < self.worker_run_as_user < 2**31:
            raise ValueError(f"worker_run_as_user must be a non-root uid (1 to 2^31-1), got {self.worker_run_as_user}")


@dataclass(frozen=True)
class Build:
    """One build of a model, run as its own Deployment: a rollout runs two (xds_server/rollout)."""

    generation: int
    service: ModelService
    replicas: int


def deployment_name(model_id: str, generation: int = 0) -> str:
    """The first build's Deployment is named for the model; each later build's `<model>-g<generation>`."""
    return model_id if generation == 0 else f"{model_id}-g{generation}"


def desired_replicas(service: ModelService) -> int:
    """The spec's replicas (or sla.min_replicas), always within [min_replicas, max_replicas]."""
    sla = service.spec.sla
    return max(sla.min_replicas, min(sla.max_replicas, service.spec.desired_replicas))


# The sie.io/spec annotation at most: Kubernetes allows 256 KiB of annotations on an object, and a pod's
# others (injection, ports, SLA, scrape) take well under 4 KiB.
MAX_SPEC_ANNOTATION_BYTES = 256 * 1024 - 4096


def spec_annotation(service: ModelService) -> str:
    """The canonical ModelService JSON for `sie.io/spec`: only what defines the model, so that unrelated
    edits (labels, kubectl's last-applied annotation) never roll the pods."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": service.model_id},
        "spec": service.to_dict()["spec"],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def pod_annotations(service: ModelService, settings: DeploymentSettings) -> dict[str, str]:
    spec = service.spec
    return {
        crd.A_INJECT: "true",
        crd.A_MODEL_ID: service.model_id,
        crd.A_PRIORITY: spec.model.priority_level.value,
        crd.A_SERVICE_TYPE: spec.model.service_type.value,
        crd.A_P99_LATENCY_MS: _num(spec.sla.p99_latency_ms),
        crd.A_MAX_QUEUE_TIME_MS: _num(spec.sla.max_queue_time_ms),
        crd.A_MAX_CONCURRENT: str(spec.resources.max_concurrent_requests),
        crd.A_WORKER_PORT: str(settings.worker_port),
        crd.A_SIDECAR_PORT: str(settings.sidecar_port),
        crd.A_CONTROL_PORT: str(settings.control_port),
        crd.A_SPEC: spec_annotation(service),
        # The unified metrics are on the sidecar's control listener; the scrape config in manifests/ keys
        # on these (and presents the reader token).
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(settings.control_port),
        "prometheus.io/path": "/-/metrics",
    }


def selector(model_id: str, generation: int = 0) -> dict[str, str]:
    """A build's pods. The first build's selector is the model's alone (so Deployments made before
    rollouts keep theirs: a selector cannot change); every later build's adds its generation."""
    labels = {crd.A_MODEL_ID: model_id, "app.kubernetes.io/managed-by": MANAGED_BY}
    return labels if generation == 0 else {**labels, crd.A_GENERATION: str(generation)}


def generation_of_pod(pod: dict[str, Any]) -> int:
    text = ((pod.get("metadata") or {}).get("labels") or {}).get(crd.A_GENERATION, "0")
    return int(text) if isinstance(text, str) and text.isdigit() else 0


def desired_deployment(
    obj: dict[str, Any],
    service: ModelService,
    settings: DeploymentSettings,
    generation: int = 0,
    replicas: int | None = None,
) -> dict[str, Any]:
    """The Deployment of one build of a ModelService object (`obj` is the custom resource, for name,
    namespace, uid); `replicas` defaults to the spec's."""
    meta = obj["metadata"]
    model_id = service.model_id
    labels = {
        **selector(model_id, generation),
        "app.kubernetes.io/name": model_id,
        "app.kubernetes.io/part-of": "sie",
    }
    pod_labels = {**labels, crd.A_INJECT: "true", crd.A_PRIORITY: service.spec.model.priority_level.value}
    pod_spec: dict[str, Any] = {
        "containers": [worker_container(service, settings)],
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        # The worker runs the model's code (DESIGN §10: hostile until proven otherwise), so no container
        # gets the namespace's API token; the sidecar's identity is its own projected token (audience
        # sie), a volume the webhook adds, which mounts whatever this says.
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    scheduling = service.spec.scheduling
    node_selector = dict(scheduling.node_selector)
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations]
    if scheduling.tier is not None:
        pod_labels[crd.TIER_LABEL] = scheduling.tier
        node_selector[crd.TIER_LABEL] = scheduling.tier
        tolerations.append(
            {"key": crd.TIER_LABEL, "operator": "Equal", "value": scheduling.tier, "effect": "NoSchedule"}
        )
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(model_id, generation),
            "namespace": meta["namespace"],
            "labels": labels,
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "replicas": desired_replicas(service) if replicas is None else replicas,
            "selector": {"matchLabels": selector(model_id, generation)},
            # Never fewer ready instances than asked for while a new version rolls out.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": pod_annotations(service, settings)},
                "spec": pod_spec,
            },
        },
    }


def worker_container(service: ModelService, settings: DeploymentSettings) -> dict[str, Any]:
    spec = service.spec
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": spec.model.image,
        "ports": [{"name": "worker", "containerPort": settings.worker_port, "protocol": "TCP"}],
        "env": [
            {"name": "SIE_MODEL_ID", "value": service.model_id},
            {"name": "SIE_MODEL_VERSION", "value": spec.model.version},
            {"name": "SIE_BACKEND", "value": spec.backend.type.value},
            {"name": "SIE_WORKER_PORT", "value": str(settings.worker_port)},
            {
                "name": "SIE_SPEC_JSON",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{crd.A_SPEC}']"}},
            },
        ],
    }
    security: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if settings.worker_run_as_user is not None:
        security.update(runAsNonRoot=True, runAsUser=settings.worker_run_as_user)
    container["securityContext"] = security
    resources = _resources(service, settings)
    if resources:
        container["resources"] = resources
    if spec.health.liveness is not None:
        # Kubernetes requires successThreshold 1 on a liveness probe.
        container["livenessProbe"] = _probe(spec.health.liveness, liveness=True)
    if spec.health.readiness is not None:
        container["readinessProbe"] = _probe(spec.health.readiness, liveness=False)
    return container


def policy_name(model_id: str) -> str:
    return f"{model_id}-sie"


def desired_network_policy(obj: dict[str, Any], service: ModelService, settings: DeploymentSettings) -> dict[str, Any]:
    """The NetworkPolicy of one model's pods (DESIGN §10): the sidecar's data port from SIE's Envoy only,
    its control port from SIE's namespace (node hosts, the control plane) and monitoring only, and nothing
    else at all; the worker port is reached only from inside the pod (its sidecar, on localhost)."""
    meta = obj["metadata"]
    model_id = service.model_id
    system = {"matchLabels": {"kubernetes.io/metadata.name": settings.system_namespace}}
    key, value = settings.monitoring_namespace_label
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(model_id),
            "namespace": meta["namespace"],
            "labels": {**selector(model_id), "app.kubernetes.io/part-of": "sie"},
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "podSelector": {"matchLabels": selector(model_id)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"namespaceSelector": system, "podSelector": {"matchLabels": dict(settings.envoy_labels)}}
                    ],
                    "ports": [{"protocol": "TCP", "port": settings.sidecar_port}],
                },
                {
                    "from": [{"namespaceSelector": system}, {"namespaceSelector": {"matchLabels": {key: value}}}],
                    "ports": [{"protocol": "TCP", "port": settings.control_port}],
                },
            ],
        },
    }


def needs_update(current: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether `current` (as stored, with server defaults) lacks anything `desired` sets."""
    return not _covers(current.get("metadata", {}).get("labels") or {}, desired["metadata"]["labels"]) or not _covers(
        current.get("spec") or {}, desired["spec"]
    )


def update_patch(desired: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that brings a Deployment to `desired`; lists are replaced whole."""
    return {"metadata": {"labels": desired["metadata"]["labels"]}, "spec": desired["spec"]}


def owned_by(deployment: dict[str, Any], obj: dict[str, Any]) -> bool:
    uid = obj["metadata"].get("uid")
    return any(
        ref.get("uid") == uid and ref.get("controller")
        for ref in deployment.get("metadata", {}).get("ownerReferences") or []
    )


def _covers(current: Any, desired: Any) -> bool:
    if isinstance(desired, dict):
        return isinstance(current, dict) and all(k in current and _covers(current[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(current, list)
            and len(current) == len(desired)
            and all(_covers(c, d) for c, d in zip(current, desired))
        )
    return current == desired or (isinstance(desired, (int, float, str)) and str(current) == str(desired))


def tier_problems(service: ModelService) -> list[str]:
    """What a model on a tier lacks on Kubernetes (its pod must be Guaranteed: a memory limit to match)."""
    res = service.spec.resources
    if service.spec.scheduling.tier is None or "memory" in res.limits or "memory" in res.requests:
        return []
    return [
        "spec.resources.limits.memory: required on Kubernetes for a model on a tier (scheduling.tier): its pod "
        "is in the Guaranteed QoS class, requests equal to limits for cpu and memory"
    ]


def guaranteed_cpus(service: ModelService, settings: DeploymentSettings) -> int:
    """A tier's worker CPUs: the larger of the spec's cpu limit and request, rounded up to whole CPUs (the
    static CPU manager pins only whole CPUs), at least one; `tier_default_cpus` when it gives none."""
    res = service.spec.resources
    given = [_cpu_amount(v) for v in (res.limits.get("cpu"), res.requests.get("cpu")) if v is not None]
    return max(1, math.ceil(max(given))) if given else settings.tier_default_cpus


def _resources(service: ModelService, settings: DeploymentSettings) -> dict[str, Any]:
    res = service.spec.resources
    limits = {k: _quantity(v) for k, v in res.limits.items()}
    requests = {k: _quantity(v) for k, v in res.requests.items()}
    if res.gpus is not None and "nvidia.com/gpu" not in limits and res.gpus > 0:
        limits["nvidia.com/gpu"] = str(res.gpus)
    if service.spec.scheduling.tier is not None:
        # Guaranteed: requests == limits for cpu and memory (and GPUs, which Kubernetes wants equal anyway).
        memory = res.limits.get("memory", res.requests.get("memory"))
        limits["cpu"] = str(guaranteed_cpus(service, settings))
        if memory is not None:
            limits["memory"] = _quantity(memory)
        requests = {**requests, **limits}
    out = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _probe(probe: Probe, liveness: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "httpGet": {"path": probe.http_get.path, "port": probe.http_get.port},
        "initialDelaySeconds": probe.initial_delay_seconds,
        "periodSeconds": probe.period_seconds,
        "timeoutSeconds": probe.timeout_seconds,
        "failureThreshold": probe.failure_threshold,
    }
    if not liveness:
        out["successThreshold"] = probe.success_threshold
    return out


_SUFFIX = {"m": Decimal("0.001"), "": Decimal(1), "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9)}
_AMOUNT = re.compile(r"^([0-9.eE+-]+?)(m|k|M|G|)$")


def _cpu_amount(value: int | float | str) -> float:
    """A CPU quantity ("500m", "2", 1.5) in CPUs; one the spec's quantity check let through but that
    names no CPU amount (a binary suffix) counts as one CPU."""
    if not isinstance(value, str):
        return float(value)
    match = _AMOUNT.match(value.strip())
    try:
        return float(Decimal(match.group(1)) * _SUFFIX[match.group(2)]) if match else 1.0
    except InvalidOperation:
        return 1.0


def _quantity(value: int | float | str) -> str:
    return value if isinstance(value, str) else _num(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
