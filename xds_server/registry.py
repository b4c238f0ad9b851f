"""The model registry: models, nodes and instance telemetry, as the control plane currently knows them.

Three sources feed it: the cluster file and the admin API (models), node-host heartbeats (nodes, the
instances they run, and the full spec of each), and sidecar telemetry (instance state and load).

Restart safety: a fresh xds_server starts `synced=False`. Until `mark_synced()` (the end of the startup
sync window) heartbeat replies are non-authoritative, so node hosts change nothing, and the registry
absorbs what the data plane reports. Models the nodes run but nobody declared (added through the admin
API before the restart) come back from the nodes' reports at any time, unless deleted since this
process started (a tombstone), so a node that heartbeats late does not lose its models either.
If the cluster file and a running instance disagree on a model's spec during the sync window, the
running spec wins, so a control-plane restart restarts nothing; `PUT /v1/models/<id>` applies a new one.

Not thread-safe: it lives on the event loop. Time comes from the injected monotonic `clock`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from sie.errors import SpecError
from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import Assignment, HeartbeatReply, NodeHeartbeat
from xds_server.placement import NodeView, Placement, place

log = logging.getLogger(__name__)

# An instance with no telemetry for this long leaves EDS (its sidecar is gone or cut off).
EDS_TELEMETRY_TTL_S = 10.0
# Telemetry of an instance not heard from for this long is forgotten (it disappears from /v1/endpoints).
FORGET_AFTER_S = 60.0
IN_EDS_STATES = frozenset({InstanceState.READY, InstanceState.DRAINING})


class ModelExists(Exception):
    pass


@dataclass
class ModelEntry:
    service: ModelService
    source: str  # "file", "api", "node" (recovered from a node's report) or "kubernetes" (the controller)
    spec_dict: dict  # service.to_dict(), computed once: every heartbeat reply carries it


@dataclass
class NodeEntry:
    heartbeat: NodeHeartbeat
    last_seen: float
    reported_ids: frozenset[str] = frozenset()


@dataclass
class InstanceTelemetry:
    record: TelemetryRecord
    received_at: float
    first_received_at: float


@dataclass
class Registry:
    clock: Callable[[], float]
    node_ttl_s: float = 3.0
    retire_s: float = 2.0
    on_change: Callable[[set[str] | None], None] = lambda models: None  # None: the model set changed
    synced: bool = False
    models: dict[str, ModelEntry] = field(default_factory=dict)
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    telemetry: dict[str, InstanceTelemetry] = field(default_factory=dict)
    # Models deleted recently: their cluster stays in xDS (without routes) until `retire_s` has passed, so
    # Envoy drops the routes before the cluster (removal order of FACTS.md).
    retiring: dict[str, tuple[ModelService, float]] = field(default_factory=dict)
    _tombstones: set[str] = field(default_factory=set)
    # Kubernetes-managed models: the pods the controller reports ready, per model. Kubernetes runs these
    # models (one Deployment each), so node hosts never get them, and only ready pods may enter EDS.
    k8s_ready: dict[str, frozenset[str]] = field(default_factory=dict)
    _by_model: dict[str, set[str]] = field(default_factory=dict)  # model_id -> instance ids with telemetry
    _placement: Placement = field(default_factory=lambda: Placement({}, {}))
    # Placement is a pure function of (models, node views, previous placement); node hosts heartbeat every
    # 0.5 s and almost always change nothing, so it is recomputed only when its inputs moved, and each
    # node's reply body is kept until then (building it deep-copies every assigned spec).
    _models_gen: int = 0
    _placement_key: tuple | None = None
    _reply_cache: dict[str, dict] = field(default_factory=dict)

    # ---- models -------------------------------------------------------------------------------

    def add_model(self, service: ModelService, source: str) -> None:
        if service.model_id in self.models:
            raise ModelExists(service.model_id)
        self._store(service, source)

    def put_model(self, service: ModelService, source: str) -> bool:
        """Create or replace; True when created."""
        created = service.model_id not in self.models
        self._store(service, source)
        return created

    def delete_model(self, model_id: str) -> bool:
        entry = self.models.pop(model_id, None)
        if entry is None:
            return False
        self.k8s_ready.pop(model_id, None)
        self._models_gen += 1
        self._tombstones.add(model_id)
        self.retiring[model_id] = (entry.service, self.clock())
        log.info("model %s deleted; its cluster leaves xDS in %.1f s", model_id, self.retire_s)
        self.on_change(None)
        return True

    def _store(self, service: ModelService, source: str) -> None:
        self._tombstones.discard(service.model_id)
        self.retiring.pop(service.model_id, None)
        self.models[service.model_id] = ModelEntry(service, source, service.to_dict())
        self._models_gen += 1
        self.on_change(None)

    # ---- nodes --------------------------------------------------------------------------------

    def heartbeat(self, hb: NodeHeartbeat) -> HeartbeatReply:
        now = self.clock()
        reported = frozenset(inst.instance_id for inst in hb.instances)
        previous = self.nodes.get(hb.node)
        self.nodes[hb.node] = NodeEntry(hb, now, reported)
        if previous is None or previous.reported_ids != reported:
            # What the node runs decides EDS membership of its instances (see in_eds).
            self.on_change({inst.model_id for inst in hb.instances}
                           | {t.record.model_id for t in self.telemetry.values() if t.record.node == hb.node})
        self._recover_models(hb)
        if not self.synced:
            # Change nothing: echo what runs, so even a node host that ignored `authoritative` keeps it.
            return HeartbeatReply(
                authoritative=False,
                assignments=[Assignment(i.instance_id, i.model_id, i.spec) for i in hb.instances],
            )
        self._replace_if_inputs_moved(now)
        return HeartbeatReply(authoritative=True, assignments=self.assignments_for(hb.node))

    def heartbeat_json(self, hb: NodeHeartbeat) -> dict:
        """heartbeat(hb).to_json(), with the authoritative reply body cached until placement changes."""
        reply = self.heartbeat(hb)
        if not reply.authoritative:
            return reply.to_json()
        cached = self._reply_cache.get(hb.node)
        if cached is None:
            cached = self._reply_cache[hb.node] = reply.to_json()
        return cached

    def _replace_if_inputs_moved(self, now: float) -> None:
        views = self.node_views(now)
        key = (self._models_gen, tuple(sorted((v.name, v.live, v.reported) for v in views.values())))
        if key != self._placement_key:
            self._placement = place(self.node_models(), views, self._placement.by_instance)
            self._placement_key = key
            self._reply_cache.clear()

    def node_models(self) -> dict[str, ModelService]:
        """The models node hosts run: all but the Kubernetes-managed ones (their Deployments run them)."""
        return {mid: e.service for mid, e in self.models.items() if e.source != "kubernetes"}

    def set_k8s_ready(self, model_id: str, instance_ids: frozenset[str]) -> None:
        """The controller's view of a Kubernetes model's ready pods (instance id = pod name)."""
        if self.k8s_ready.get(model_id) != instance_ids:
            self.k8s_ready[model_id] = instance_ids
            self.on_change({model_id})

    def assignments_for(self, node: str) -> list[Assignment]:
        out = []
        for iid in self._placement.for_node(node):
            entry = self.models.get(self._placement.model_of[iid])
            if entry is not None:
                out.append(Assignment(iid, entry.service.model_id, entry.spec_dict))
        return out

    def node_views(self, now: float) -> dict[str, NodeView]:
        return {
            name: NodeView(
                name=name,
                live=self.node_live(entry, now),
                reported=frozenset((i.instance_id, i.model_id) for i in entry.heartbeat.instances),
            )
            for name, entry in self.nodes.items()
        }

    def node_live(self, entry: NodeEntry, now: float) -> bool:
        return now - entry.last_seen <= self.node_ttl_s

    @property
    def placement(self) -> Placement:
        return self._placement

    def _recover_models(self, hb: NodeHeartbeat) -> None:
        for inst in hb.instances:
            mid = inst.model_id
            known = self.models.get(mid)
            if mid in self._tombstones or (known is not None and (self.synced or known.source != "file")):
                continue
            try:
                service = parse_model_service(inst.spec, f"node {hb.node} instance {inst.instance_id}")
            except SpecError as exc:
                log.warning("cannot recover model %s from node %s: %s", mid, hb.node, exc)
                continue
            if service.model_id != mid:
                log.warning("node %s reports instance %s of %s with a spec for %s; ignored",
                            hb.node, inst.instance_id, mid, service.model_id)
                continue
            if known is not None:
                if known.service == service:
                    continue
                log.warning(
                    "model %s: the cluster file's spec differs from the one node %s runs; keeping the running "
                    "spec so this restart changes nothing (PUT /v1/models/%s applies the file's)", mid, hb.node, mid
                )
            else:
                log.info("model %s recovered from node %s's report", mid, hb.node)
            self._store(service, "node")

    # ---- telemetry ----------------------------------------------------------------------------

    def record_telemetry(self, rec: TelemetryRecord) -> bool:
        """Store a record; False when it is older than the stored one (a reordered post)."""
        now = self.clock()
        old = self.telemetry.get(rec.instance_id)
        if old is not None and rec.seq < old.record.seq and rec.timestamp <= old.record.timestamp:
            # A lower seq with a later timestamp is a restarted sidecar counting from 0 again: accept it.
            return False
        first = old.first_received_at if old is not None else now
        self.telemetry[rec.instance_id] = InstanceTelemetry(rec, now, first)
        self._by_model.setdefault(rec.model_id, set()).add(rec.instance_id)
        changed = {rec.model_id}
        if old is not None and old.record.model_id != rec.model_id:
            changed.add(old.record.model_id)
            self._forget_index(old.record.model_id, rec.instance_id)
        self.on_change(changed)
        return True

    def eds_records(self, model_id: str, now: float) -> list[TelemetryRecord]:
        """The records of the model's instances that belong in EDS, sorted by instance id.

        In: state ready or draining, telemetry received in the last EDS_TELEMETRY_TTL_S, and not
        disowned by its node (a live node whose heartbeat, newer than the instance's first record,
        does not list it). A dead node's instances are judged by their own telemetry: sidecars that
        still report are the better evidence, and a node-host hiccup must not empty a model.
        """
        out = []
        for iid in sorted(self._by_model.get(model_id, ())):
            tel = self.telemetry[iid]
            if self.in_eds(tel, now):
                out.append(tel.record)
        return out

    def instances_of(self, model_id: str) -> list[InstanceTelemetry]:
        """Every instance of the model with telemetry (in EDS or not), sorted by instance id."""
        return [self.telemetry[iid] for iid in sorted(self._by_model.get(model_id, ()))]

    def _forget_index(self, model_id: str, instance_id: str) -> None:
        ids = self._by_model.get(model_id)
        if ids is not None:
            ids.discard(instance_id)
            if not ids:
                del self._by_model[model_id]

    def in_eds(self, tel: InstanceTelemetry, now: float) -> bool:
        if tel.record.state not in IN_EDS_STATES or now - tel.received_at > EDS_TELEMETRY_TTL_S:
            return False
        entry = self.models.get(tel.record.model_id)
        if entry is not None and entry.source == "kubernetes":
            # Kubernetes decides which pods exist and are ready; the node host on that node does not run them.
            return tel.record.instance_id in self.k8s_ready.get(tel.record.model_id, frozenset())
        node = self.nodes.get(tel.record.node)
        if node is not None and self.node_live(node, now) and node.last_seen > tel.first_received_at:
            return tel.record.instance_id in node.reported_ids
        return True

    # ---- housekeeping -------------------------------------------------------------------------

    def mark_synced(self) -> None:
        self.synced = True
        now = self.clock()
        self._replace_if_inputs_moved(now)
        log.info("registry synced: %d models, %d nodes, %d instances with telemetry",
                 len(self.models), len(self.nodes), len(self.telemetry))
        self.on_change(None)

    def sweep(self) -> None:
        """Forget long-silent instances and finish retiring deleted models."""
        now = self.clock()
        for iid in [i for i, t in self.telemetry.items() if now - t.received_at > FORGET_AFTER_S]:
            self._forget_index(self.telemetry.pop(iid).record.model_id, iid)
        expired = [m for m, (_, at) in self.retiring.items() if now - at >= self.retire_s]
        for mid in expired:
            del self.retiring[mid]
        if expired:
            self.on_change(None)
