"""What a model's pods say, as pure functions: whether each is ready or failing, and the endpoints they
offer to Envoy.

An endpoint is the pod's sidecar (`podIP:sie.io/sidecar-port`), and its instance id is the pod's name,
which is also the `--instance-id` the injected sidecar reports telemetry under, so the control plane can
join the two. A pod is an endpoint only when it is Ready (every container, the sidecar included, passes
its readiness probe), has an IP, is not being deleted, and has the sidecar container.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sie import crd

DEFAULT_SIDECAR_PORT = 8081
DEFAULT_CONTROL_PORT = 8082
# Waiting reasons that will not fix themselves without a change: worth a status condition.
_STUCK = (
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "InvalidImageName",
    "RunContainerError",
)


@dataclass(frozen=True, order=True)
class Endpoint:
    """One ready instance of a model, as the control plane's EDS needs it."""

    instance_id: str  # the pod name
    address: str  # host:port of the sidecar's data listener (what Envoy dials)
    node: str = ""  # the Kubernetes node the pod runs on
    namespace: str = ""
    control_address: str = ""  # host:port of its control listener (metrics, drain, sleep, wake)
    generation: int = 0  # the model's build the pod runs (label sie.io/generation; 0 without one)


def model_id_of(pod: Mapping[str, Any]) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(crd.A_MODEL_ID)


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def has_sidecar(pod: Mapping[str, Any]) -> bool:
    return any(c.get("name") == crd.SIDECAR_CONTAINER for c in (pod.get("spec") or {}).get("containers") or [])


def endpoint_of(pod: Mapping[str, Any]) -> Endpoint | None:
    """The pod's endpoint, or None when it must not receive traffic."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or is_terminating(pod) or not is_ready(pod) or not has_sidecar(pod):
        return None
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    port = _port(annotations.get(crd.A_SIDECAR_PORT))
    control = _port(annotations.get(crd.A_CONTROL_PORT), DEFAULT_CONTROL_PORT)
    host = f"[{ip}]" if ":" in ip else ip
    label = (meta.get("labels") or {}).get(crd.A_GENERATION, "0")
    return Endpoint(
        generation=int(label) if isinstance(label, str) and label.isdigit() else 0,
        instance_id=meta.get("name", ""),
        address=f"{host}:{port}",
        control_address=f"{host}:{control}",
        node=(pod.get("spec") or {}).get("nodeName") or "",
        namespace=meta.get("namespace") or "",
    )


def endpoints_by_model(
    pods: Iterable[Mapping[str, Any]], namespaces: Mapping[str, str]
) -> dict[str, tuple[Endpoint, ...]]:
    """Ready endpoints per model id, sorted; `namespaces` maps each served model id to the namespace of
    its ModelService, so pods that merely carry the label elsewhere are not routed to. Every served model
    has an entry, empty when nothing is ready."""
    out: dict[str, list[Endpoint]] = {model_id: [] for model_id in namespaces}
    for pod in pods:
        model_id = model_id_of(pod)
        if (
            model_id is None
            or model_id not in namespaces
            or (pod.get("metadata") or {}).get("namespace") != namespaces[model_id]
        ):
            continue
        endpoint = endpoint_of(pod)
        if endpoint is not None:
            out[model_id].append(endpoint)
    return {model_id: tuple(sorted(eps)) for model_id, eps in out.items()}


def waiting_problem(pod: Mapping[str, Any]) -> str | None:
    """'Reason: pod/container: message' for a pod stuck in a way that needs a person, else None."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "?")
    if status.get("phase") == "Failed":
        return f"PodFailed: pod {name}: {status.get('message') or status.get('reason') or 'failed'}"
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _STUCK:
            detail = waiting.get("message") or ""
            return f"{waiting['reason']}: pod {name} container {container.get('name')}" + (
                f": {detail}" if detail else ""
            )
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return f"Unschedulable: pod {name}: {cond.get('message', '')}".rstrip(": ")
    return None


def _port(raw: str | None, default: int = DEFAULT_SIDECAR_PORT) -> int:
    try:
        port = int(raw) if raw is not None else default
    except ValueError:
        return default
    return port if 0 < port < 65536 else default
