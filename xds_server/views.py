"""Read-only JSON views of the registry for the admin API and `sie status` (pure functions).

Addresses shown are the ones EDS uses: what the instance's node host (or Kubernetes) registered.
"""

from __future__ import annotations

import dataclasses

from sie.wire import InstanceReport
from xds_server.control import ControlLoop
from xds_server.policy.decisions import ModelDecision
from xds_server.registry import EDS_TELEMETRY_TTL_S, ModelEntry, Registry
from xds_server.rollout.machine import RolloutState


def node_reports(registry: Registry) -> dict[str, list[tuple[str, InstanceReport]]]:
    """model_id -> (node, report) of every instance the nodes report; built once per request.

    A node's report of an instance placed on another node is left out: a node speaks only for what it was
    given, so its claim changes neither EDS nor what an operator is shown."""
    out: dict[str, list[tuple[str, InstanceReport]]] = {}
    placed = registry.placement.by_instance
    for node in registry.nodes.values():
        name = node.heartbeat.node
        for inst in node.heartbeat.instances:
            if placed.get(inst.instance_id, name) == name:
                out.setdefault(inst.model_id, []).append((name, inst))
    return out


def instance_rows(
    registry: Registry,
    control: ControlLoop,
    model_id: str,
    now: float,
    wall: float,
    reports: dict[str, list[tuple[str, InstanceReport]]] | None = None,
) -> list[dict]:
    """Every instance of a model the control plane knows of: placed, reported by a node, or reporting."""
    if reports is None:
        reports = node_reports(registry)
    rows: dict[str, dict] = {}
    placement = registry.placement
    for iid in placement.of_model(model_id):
        rows[iid] = {"instance_id": iid, "node": placement.by_instance[iid], "state": "pending", "address": None}
    for iid, of in placement.unplaced.items():  # wanted, but no node may or can take it: say why
        if of == model_id:
            rows[iid] = {"instance_id": iid, "node": None, "state": "unplaced", "address": None}
    for iid, row in rows.items():
        if iid in placement.reasons:
            row["placement"] = placement.reasons[iid]
            if row["state"] == "unplaced":
                row["detail"] = placement.reasons[iid]
    for node, inst in reports.get(model_id, ()):
        row = rows.setdefault(inst.instance_id, {"instance_id": inst.instance_id})
        row.update(
            node=node,
            gpu=inst.gpu_index,
            cpus=inst.cpus,  # the cores its processes may use ("" not pinned: any of its node's)
            state=inst.state.value,
            address=inst.sidecar_address,
            restarts=inst.restarts,
            detail=inst.detail,
            version=inst.version,
        )
    decision = control.decisions.get(model_id, ModelDecision(model_id))
    for tel in registry.instances_of(model_id):
        iid = tel.record.instance_id
        row = rows.setdefault(iid, {"instance_id": iid})
        fresh = now - tel.received_at <= EDS_TELEMETRY_TTL_S
        row.update(
            node=tel.record.node,
            address=registry.registered_address(tel.record) or row.get("address"),
            telemetry_age_s=round(tel.record.age(wall), 3),
            in_flight=tel.record.in_flight,
            queued=tel.record.queued,
            cache_hit_rate=tel.record.cache_hit_rate,  # the engine's prefix cache (None: it has none)
            kv_usage=tel.record.kv_cache_usage,  # the engine's KV cache in use, 0..1, as it reports it
            engine_waiting=tel.record.engine_waiting,  # requests queued inside the engine, as it reports them
            version=tel.record.version,
        )
        if fresh or "state" not in row:
            row["state"] = tel.record.state.value
    entry = registry.models.get(model_id)
    for iid, row in rows.items():
        row["build"] = _build_role(entry, registry.generation(model_id, iid))
        ep = decision.endpoints.get(iid)
        row["in_eds"] = ep is not None
        row["weight"] = ep.weight if ep else None
        row["health"] = ep.health.value if ep else None
        row.setdefault("node", None)
        row.setdefault("address", None)
        row.setdefault("state", "unknown")
    return [rows[i] for i in sorted(rows)]


def model_json(
    registry: Registry,
    control: ControlLoop,
    model_id: str,
    now: float,
    wall: float,
    reports: dict[str, list[tuple[str, InstanceReport]]] | None = None,
) -> dict:
    """The ModelService JSON with `status` filled in: source, desired and live instance counts."""
    entry = registry.models[model_id]
    rows = instance_rows(registry, control, model_id, now, wall, reports)
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    out = dict(entry.spec_dict)
    out["status"] = {
        "source": entry.source,
        "desired_instances": entry.replicas,
        "instances": states,
        "ready_instances": states.get("ready", 0),
        "in_eds": sum(1 for r in rows if r["in_eds"]),
        "generation": entry.generation,
        "rollout": rollout_json(entry.rollout, wall) if entry.rollout is not None else None,
        "autoscale": autoscale_json(entry),
    }
    return out


def _build_role(entry: ModelEntry | None, generation: int) -> str:
    """stable, new (a rollout's new build), or retiring (a build that drains: old after a promotion, new
    after a rollback)."""
    if entry is None or generation == entry.generation:
        return "stable"
    if entry.rolling and entry.rollout is not None and generation == entry.rollout.generation:
        return "new"
    return "retiring"


def autoscale_json(entry: ModelEntry) -> dict | None:
    """Who sets the model's replica count, to what, and why."""
    spec = entry.service.spec
    if spec.autoscaled:
        return {"by": "sie", "desired": entry.replicas, **(entry.scale_decision or {"reason": "no decision yet"})}
    if spec.replicas is not None and spec.sla.max_replicas > spec.sla.min_replicas:
        return {
            "by": "spec.replicas",
            "desired": spec.replicas,
            "reason": (
                "an external scaler owns the count: spec.replicas is set (by hand, kubectl scale, or an HPA "
                "or KEDA through the scale subresource); SIE's autoscaler stands aside until it is removed"
            ),
        }
    return None


def rollout_json(state: RolloutState, wall: float) -> dict:
    """A rollout as the admin API and `sie rollout status` show it, with how long its step has held: the
    hold stops counting while the new build is short of ready instances (`unready_since`), as the
    machine counts it."""
    out = state.to_json()
    until = state.unready_since if state.unready_since is not None else wall
    out["held_s"] = round(until - state.step_since, 1) if state.live and state.step_since is not None else None
    return out


def endpoints_json(registry: Registry, control: ControlLoop, now: float, wall: float) -> list[dict]:
    out = []
    for iid in sorted(registry.telemetry):
        tel = registry.telemetry[iid]
        decision = control.decisions.get(tel.record.model_id)
        ep = decision.endpoints.get(iid) if decision else None
        out.append(
            {
                "instance_id": iid,
                "model_id": tel.record.model_id,
                "record": tel.record.to_json(),
                "age_s": round(tel.record.age(wall), 3),
                "received_age_s": round(now - tel.received_at, 3),
                "in_eds": registry.in_eds(tel, now),
                "decision": dataclasses.asdict(ep) | {"health": ep.health.value} if ep else None,
            }
        )
    return out


def nodes_json(registry: Registry, now: float) -> list[dict]:
    out = []
    for name in sorted(registry.nodes):
        entry = registry.nodes[name]
        hb = entry.heartbeat.to_json()
        live = registry.node_live(entry, now)
        hb.update(
            live=live,
            # ready, or lost: no heartbeat for heartbeat_timeout_s (its endpoints left EDS, its instances
            # were placed elsewhere; they stay there or come back, as `rebalance` says, when it returns)
            health="ready" if live else "lost",
            lost_at=entry.lost_wall if not live else None,
            last_seen_age_s=round(now - entry.last_seen, 3),
            assigned=registry.placement.for_node(name) if registry.synced else None,
            handing_over=sorted(i for i, n in registry.placement.leaving.items() if n == name),
        )
        out.append(hb)
    return out
