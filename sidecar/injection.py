"""Sidecar injection as a pure function: a pod (the JSON an AdmissionReview carries) in, a decision out.

A pod asks for the sidecar with `sie.io/inject: "true"` (annotation or label; the webhook configuration
selects on the label, since a webhook's objectSelector sees labels only). The sidecar is configured from
the pod's `sie.io/*` annotations:

- `sie.io/spec` (required): the ModelService as JSON. The sidecar reads it as a file through a
  downwardAPI volume, so the pod carries everything it needs and a spec change rolls the pods.
- `sie.io/model-id` (required) and the SLA annotations `sie.io/priority`, `sie.io/service-type`,
  `sie.io/p99-latency-ms`, `sie.io/max-queue-time-ms`, `sie.io/max-concurrent-requests` (optional): each
  present one must agree with the spec. Two sources of truth that disagree would be a silent
  misconfiguration, so a disagreement is refused, naming the annotation.
- `sie.io/worker-port` (default 3000), `sie.io/sidecar-port` (default 8081, the data listener Envoy
  dials) and `sie.io/control-port` (default 8082, the control listener: probes, metrics, drain, sleep).

Credentials (DESIGN §10): the sidecar proves who it is with a projected service-account token (audience
`sie`, rotated by the kubelet, read from a file on every telemetry post), which the control plane checks
with TokenReview; it checks its own callers against the control plane's public key, and the https
control URL's certificate against the CA, both in the trust bundle (sie.auth.tls: PEM blocks, a PUBLIC
KEY and a CERTIFICATE) which the webhook puts on the pod as the annotation `sie.io/trust` (nothing
secret; under 2 KiB) and the downwardAPI volume shows as a file. The worker, the model's own container,
shares only the pod's network with the sidecar, and the controller's NetworkPolicy lets only Envoy reach
the data port and only SIE's own components the control port.

Tiers (what the node host's `--tier-cpus` does on one machine, Kubernetes does per pod): when the spec
names `scheduling.tier`, the controller gives the worker requests equal to its limits in whole CPUs, so
the pod can be in the Guaranteed QoS class and the kubelet's static CPU manager can give it cores of its
own; the sidecar then gets the same: requests == limits, `tier_sidecar_cpu` (a whole CPU by default, so
its cores are exclusive too) and `memory_limit`. A pod is Guaranteed only when every container is.

The sidecar runs as a non-root user (`sidecar_uid`), cannot gain privileges, has no capabilities, a
read-only root filesystem and the runtime's default seccomp profile. Its token is a volume of its own,
mounted into the sidecar only: it does not depend on automountServiceAccountToken, which the controller
turns off for model pods, so the worker (the model's own code) gets no API token at all.

The patch adds one container (with its ports and probes), two volumes (the downwardAPI files and the
projected token), the trust annotation, the pod's fsGroup when it has none (see `sidecar_uid`), and
changes nothing else. A pod that already has the sidecar
container is left alone, so re-running admission (a reinvocation, or a pod re-created from a copy of an
injected one) never adds a second one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sie import crd, strict_json
from sie.errors import InputError, SpecError
from sie.spec import MODEL_ID_PATTERN, ModelService, Priority, ServiceType, is_model_id
from sie.spec_loader import parse_model_service

CONTAINER_NAME = crd.SIDECAR_CONTAINER
VOLUME_NAME = "sie-spec"
TOKEN_VOLUME = "sie-token"
SPEC_DIR = "/etc/sie"
SPEC_FILE = "modelservice.json"
TRUST_FILE = "trust.pem"
TOKEN_DIR = "/var/run/secrets/sie"
TOKEN_FILE = "token"
TOKEN_AUDIENCE = "sie"
A_TRUST = "sie.io/trust"
DEFAULT_WORKER_PORT = 3000
DEFAULT_SIDECAR_PORT = 8081
DEFAULT_CONTROL_PORT = 8082


@dataclass(frozen=True)
class InjectorSettings:
    """What the webhook's operator decides once for every pod."""

    sidecar_image: str = "sie:0.1.0"
    control_url: str = "https://sie-xds.sie-system.svc:8000"  # the admin API serves TLS (sie-admin-tls)
    image_pull_policy: str = "IfNotPresent"
    cpu_request: str = "250m"
    memory_request: str = "128Mi"
    memory_limit: str = "512Mi"
    # The sidecar's CPUs in a pod of a tier (requests == limits: the Guaranteed QoS class). A whole number,
    # so the kubelet's static CPU manager gives it exclusive cores, as it gives the worker.
    tier_sidecar_cpu: str = "1"
    # The trust bundle, as many PEM blocks as it holds: the control plane's public key(s), which the sidecar
    # checks its callers against, and the CA certificate it verifies the https control URL with.
    trust_pem: str = ""
    token_ttl_s: int = 3600  # the projected token's lifetime (the kubelet rotates it before it ends)
    sidecar_uid: int = 10001
    """The uid and gid the sidecar runs as (runAsNonRoot; default 10001, as every SIE component in
    manifests/base). A pod that names no fsGroup gets this one, so the sidecar can read its projected
    token and spec files: the kubelet makes them 0640 and of the pod's fsGroup, which every container of
    the pod has as a supplementary group (only the sidecar mounts them, so only it can read them)."""


@dataclass(frozen=True)
class Decision:
    """allowed with an empty patch: nothing to do. Not allowed: `message` says which annotation and why."""

    allowed: bool
    patch: tuple[dict[str, Any], ...] = ()
    message: str = ""
    problems: tuple[str, ...] = field(default=())


def decide(pod: dict[str, Any], settings: InjectorSettings) -> Decision:
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    wanted = [v for v in (annotations.get(crd.A_INJECT), labels.get(crd.A_INJECT)) if v is not None]
    for value in wanted:
        if value not in ("true", "false"):
            return _refuse([f'{crd.A_INJECT}: must be "true" or "false", got {value!r}'])
    if "true" not in wanted:
        return Decision(allowed=True, message="injection not requested")
    containers = (pod.get("spec") or {}).get("containers") or []
    if any(c.get("name") == CONTAINER_NAME for c in containers):
        return Decision(allowed=True, message="already injected")
    problems, ports, service = _check_annotations(annotations, containers)
    for name in (VOLUME_NAME, TOKEN_VOLUME):
        if not problems and any(v.get("name") == name for v in (pod.get("spec") or {}).get("volumes") or []):
            problems.append(f"volume {name!r} already exists in the pod; the sidecar needs that name")
    if problems:
        return _refuse(problems)
    worker_port, sidecar_port, control_port = ports
    tiered = service is not None and service.spec.scheduling.tier is not None
    patch = _patch(pod, settings, worker_port, sidecar_port, control_port, tiered)
    return Decision(allowed=True, patch=tuple(patch), message="injected")


def sidecar_resources(settings: InjectorSettings, tiered: bool) -> dict[str, Any]:
    """A tier's sidecar: requests == limits (Guaranteed), whole CPUs; else a small request, memory capped."""
    if tiered:
        guaranteed = {"cpu": settings.tier_sidecar_cpu, "memory": settings.memory_limit}
        return {"requests": dict(guaranteed), "limits": dict(guaranteed)}
    return {
        "requests": {"cpu": settings.cpu_request, "memory": settings.memory_request},
        "limits": {"memory": settings.memory_limit},
    }


def sidecar_container(
    settings: InjectorSettings,
    worker_port: int,
    sidecar_port: int,
    control_port: int = DEFAULT_CONTROL_PORT,
    tiered: bool = False,
) -> dict[str, Any]:
    """The container the webhook adds (`tiered`: the spec names a tier, see sidecar_resources).
    `$(POD_NAME)`, `$(NODE_NAME)`, `$(POD_IP)` are expanded by the kubelet."""
    probe: dict[str, Any] = {
        "httpGet": {"port": control_port},
        "periodSeconds": 2,
        "timeoutSeconds": 1,
        "failureThreshold": 3,
    }
    return {
        "name": CONTAINER_NAME,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-m", "sidecar"],
        "args": [
            "--instance-id",
            "$(POD_NAME)",
            "--spec-file",
            f"{SPEC_DIR}/{SPEC_FILE}",
            "--listen",
            f"0.0.0.0:{sidecar_port}",
            "--control-listen",
            f"0.0.0.0:{control_port}",
            "--worker-url",
            f"http://127.0.0.1:{worker_port}",
            "--control-url",
            settings.control_url,
            "--token-file",
            f"{TOKEN_DIR}/{TOKEN_FILE}",
            "--trust-file",
            f"{SPEC_DIR}/{TRUST_FILE}",
            "--node",
            "$(NODE_NAME)",
            # What Envoy dials and telemetry reports: the pod's own address, not the 0.0.0.0 it listens on.
            "--address",
            f"$(POD_IP):{sidecar_port}",
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
        "ports": [
            {"name": "sie-sidecar", "containerPort": sidecar_port, "protocol": "TCP"},
            {"name": "sie-control", "containerPort": control_port, "protocol": "TCP"},
        ],
        "readinessProbe": {**probe, "httpGet": {**probe["httpGet"], "path": "/-/ready"}},
        "livenessProbe": {**probe, "httpGet": {**probe["httpGet"], "path": "/-/healthz"}, "periodSeconds": 5},
        "resources": sidecar_resources(settings, tiered),
        "volumeMounts": [
            {"name": VOLUME_NAME, "mountPath": SPEC_DIR, "readOnly": True},
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.sidecar_uid,
            "runAsGroup": settings.sidecar_uid,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def spec_volume() -> dict[str, Any]:
    """The pod's own annotations as files: the ModelService, and the trust bundle."""
    return {
        "name": VOLUME_NAME,
        "downwardAPI": {
            "items": [
                {"path": SPEC_FILE, "fieldRef": {"fieldPath": f"metadata.annotations['{crd.A_SPEC}']"}},
                {"path": TRUST_FILE, "fieldRef": {"fieldPath": f"metadata.annotations['{A_TRUST}']"}},
            ],
            "defaultMode": 0o400,
        },
    }


def token_volume(settings: InjectorSettings) -> dict[str, Any]:
    """A service-account token for the audience `sie` only: useless against the Kubernetes API."""
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "sources": [
                {
                    "serviceAccountToken": {
                        "path": TOKEN_FILE,
                        "audience": TOKEN_AUDIENCE,
                        "expirationSeconds": settings.token_ttl_s,
                    }
                }
            ],
            "defaultMode": 0o400,
        },
    }


def _patch(
    pod: dict[str, Any],
    settings: InjectorSettings,
    worker_port: int,
    sidecar_port: int,
    control_port: int,
    tiered: bool,
) -> list[dict[str, Any]]:
    spec = pod.get("spec") or {}
    ops: list[dict[str, Any]] = [
        {
            "op": "add",
            "path": "/spec/containers/-",
            "value": sidecar_container(settings, worker_port, sidecar_port, control_port, tiered),
        }
    ]
    # JSON Patch cannot append to a list that is absent: create it instead.
    if spec.get("volumes"):
        ops += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in (spec_volume(), token_volume(settings))]
    else:
        ops.append({"op": "add", "path": "/spec/volumes", "value": [spec_volume(), token_volume(settings)]})
    # The sidecar, not root, must read the token and spec volumes: they belong to the pod's fsGroup.
    security = spec.get("securityContext")
    if not isinstance(security, dict):
        ops.append({"op": "add", "path": "/spec/securityContext", "value": {"fsGroup": settings.sidecar_uid}})
    elif security.get("fsGroup") is None:
        ops.append({"op": "add", "path": "/spec/securityContext/fsGroup", "value": settings.sidecar_uid})
    # The annotations exist (the spec is one of them); "/" in a key is "~1" in a JSON pointer.
    ops.append(
        {"op": "add", "path": "/metadata/annotations/" + A_TRUST.replace("/", "~1"), "value": settings.trust_pem}
    )
    return ops


def _check_annotations(
    annotations: dict[str, str], containers: list[dict[str, Any]]
) -> tuple[list[str], tuple[int, int, int], ModelService | None]:
    problems: list[str] = []
    model_id = annotations.get(crd.A_MODEL_ID)
    if model_id is None:
        problems.append(f'{crd.A_MODEL_ID}: required when {crd.A_INJECT} is "true"')
    elif not is_model_id(model_id):
        problems.append(f"{crd.A_MODEL_ID}: {model_id!r} is not a model id (a DNS-1123 label, {MODEL_ID_PATTERN})")
    spec = _spec(annotations, problems)
    worker_port = _port(annotations, crd.A_WORKER_PORT, DEFAULT_WORKER_PORT, problems)
    sidecar_port = _port(annotations, crd.A_SIDECAR_PORT, DEFAULT_SIDECAR_PORT, problems)
    control_port = _port(annotations, crd.A_CONTROL_PORT, DEFAULT_CONTROL_PORT, problems)
    if worker_port == sidecar_port:
        problems.append(
            f"{crd.A_SIDECAR_PORT}: {sidecar_port} is also the worker port ({crd.A_WORKER_PORT}); pick another"
        )
    if control_port in (worker_port, sidecar_port):
        problems.append(f"{crd.A_CONTROL_PORT}: {control_port} is also the worker or the sidecar port; pick another")
    taken = {p.get("containerPort") for c in containers for p in c.get("ports") or []}
    for key, port in ((crd.A_SIDECAR_PORT, sidecar_port), (crd.A_CONTROL_PORT, control_port)):
        if port in taken and port != worker_port:
            problems.append(f"{key}: port {port} is already used by a container of this pod")
    if spec is not None:
        if model_id is not None and spec.model_id != model_id:
            problems.append(
                f"{crd.A_MODEL_ID}: {model_id!r} differs from the model in {crd.A_SPEC} ({spec.model_id!r})"
            )
        expected = {
            crd.A_PRIORITY: (spec.spec.model.priority_level.value, _enum(Priority)),
            crd.A_SERVICE_TYPE: (spec.spec.model.service_type.value, _enum(ServiceType)),
            crd.A_P99_LATENCY_MS: (spec.spec.sla.p99_latency_ms, _number(0, exclusive=True)),
            crd.A_MAX_QUEUE_TIME_MS: (spec.spec.sla.max_queue_time_ms, _number(0)),
            crd.A_MAX_CONCURRENT: (spec.spec.resources.max_concurrent_requests, _integer(1)),
        }
        for key, (want, parse) in expected.items():
            if key not in annotations:
                continue
            value, reason = parse(annotations[key])
            if reason:
                problems.append(f"{key}: {annotations[key]!r} {reason}")
            elif value != want:
                problems.append(
                    f"{key}: {annotations[key]!r} differs from {crd.A_SPEC} ({want}); "
                    "change the ModelService, not the annotation"
                )
    return problems, (worker_port, sidecar_port, control_port), spec


def _spec(annotations: dict[str, str], problems: list[str]) -> ModelService | None:
    raw = annotations.get(crd.A_SPEC)
    if raw is None:
        problems.append(
            f'{crd.A_SPEC}: required when {crd.A_INJECT} is "true" (the ModelService as JSON; '
            "the SIE controller sets it on the pods it creates)"
        )
        return None
    try:
        doc = strict_json.loads(raw, what="the annotation")
    except InputError as exc:
        problems.append(f"{crd.A_SPEC}: {exc}")
        return None
    try:
        return parse_model_service(doc, crd.A_SPEC)
    except SpecError as exc:
        problems.append(f"{crd.A_SPEC}: " + "; ".join(str(p) for p in exc.problems))
        return None


def _port(annotations: dict[str, str], key: str, default: int, problems: list[str]) -> int:
    if key not in annotations:
        return default
    value, reason = _integer(1, 65535)(annotations[key])
    if reason:
        problems.append(f"{key}: {annotations[key]!r} {reason}")
        return default
    return value


def _enum(kind):
    allowed = [m.value for m in kind]

    def parse(text: str):
        return (text, "") if text in allowed else (None, f"is not one of {', '.join(allowed)}")

    return parse


def _number(low: float, exclusive: bool = False):
    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            return None, "is not a number"
        if value < low or (exclusive and value == low) or value != value:
            return None, f"must be {'above' if exclusive else 'at least'} {low:g}"
        return value, ""

    return parse


def _integer(low: int, high: int | None = None):
    def parse(text: str):
        try:
            value = int(text)
        except ValueError:
            return None, "is not an integer"
        if value < low or (high is not None and value > high):
            return None, f"must be between {low} and {high}" if high is not None else f"must be at least {low}"
        return value, ""

    return parse


def _refuse(problems: list[str]) -> Decision:
    return Decision(allowed=False, message="; ".join(problems), problems=tuple(problems))
