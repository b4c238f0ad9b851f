"""What the node host tells the control plane about each instance (pure).

The node host only manages processes; the sidecar is the authority on serving state and reports it in
its telemetry. The state here is the process view, refined by one cheap look at the worker's /health:

    being stopped                        -> draining (the sidecar drains first)
    worker crashed, waiting to restart   -> failed
    worker /health 200                   -> ready
    worker /health 503 "sleeping"        -> sleeping
    worker /health 503 "failed"          -> failed
    anything else (loading, no answer)   -> loading
"""

from __future__ import annotations

from node_host.supervisor import Instance
from sie.telemetry import InstanceState
from sie.wire import Assignment, InstanceReport


def instance_state(*, stopping: bool, worker_running: bool, health: str | None) -> InstanceState:
    """`health`: the worker's /health status ("ok", "loading", "sleeping", ...) or None if no answer."""
    if stopping:
        return InstanceState.DRAINING
    if not worker_running:
        return InstanceState.FAILED
    if health == "ok":
        return InstanceState.READY
    if health == "sleeping":
        return InstanceState.SLEEPING
    if health == "failed":
        return InstanceState.FAILED
    return InstanceState.LOADING


def report(inst: Instance, health: str | None) -> InstanceReport:
    return InstanceReport(
        instance_id=inst.instance_id,
        model_id=inst.service.model_id,
        version=inst.service.spec.model.version,
        state=instance_state(stopping=inst.stopping, worker_running=inst.worker_child is not None, health=health),
        spec=inst.spec,
        sidecar_address=inst.sidecar_address,
        control_address=inst.control_address,
        worker_address=inst.worker_address,
        gpu_index=inst.gpu_index,
        cpus=inst.cpu_list,
        restarts=inst.worker.restarts + inst.sidecar.restarts,
        detail=inst.detail(),
    )


def refused_report(assignment: Assignment, reason: str) -> InstanceReport:
    """An assignment the node refused (invalid spec, unmet requirements): failed, with the reason."""
    model = (assignment.spec.get("spec") or {}).get("model") or {} if isinstance(assignment.spec, dict) else {}
    return InstanceReport(
        instance_id=assignment.instance_id,
        model_id=assignment.model_id,
        version=str(model.get("version", "")) if isinstance(model, dict) else "",
        state=InstanceState.FAILED,
        spec=assignment.spec,
        detail=f"refused: {reason}",
    )
