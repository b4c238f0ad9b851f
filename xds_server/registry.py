"""The model registry: models, nodes and instance telemetry, as the control plane currently knows them.

Three sources feed it: the cluster file and the admin API (models), node-host heartbeats (nodes, the
instances they run, and the spec of each, by digest once the registry has it: sie.wire), and sidecar
telemetry (instance state and load).

Restart safety: a fresh xds_server starts `synced=False`. Until `mark_synced()` (the end of the startup
sync window) heartbeat replies are non-authoritative, so node hosts change nothing, and the registry
absorbs what the data plane reports. Models the nodes run but nobody declared (added through the admin
API before a restart without a state directory, see state.py) come back from the nodes' reports, but
only during the sync window and unless deleted since this process started (a tombstone): after it, a
node's report never creates or changes a model. If the cluster file and a running instance disagree
on a model's spec during the sync window, the running spec wins, so a control-plane restart restarts
nothing; `PUT /v1/models/<id>` applies a new one. For the same reason a model taken from the file or the
reports takes the generation its running instances' ids carry (a build past a rollout runs as
`<model>.g<N>-<n>`), and at the end of the window an autoscaled model's count is raised to what the
nodes report serving of its stable build (`_seed_scales`), so the first placement stops and puts to
sleep nothing that served before the restart.

Trust (DESIGN §10): callers are authenticated before they get here (admin.py), and the registry holds
them to their identity. The address an instance gets in EDS is the one its node host registered in its
heartbeat (or, on Kubernetes, the pod address the controller saw), never the one its telemetry names,
and only when no other node is placed to run that instance: a node speaks for its own instances only.
Telemetry order is per reporting process (`reporter`, `seq`), and staleness is judged by when the
control plane received a record, so no value a record carries can lock the genuine sidecar out.

Not thread-safe: it lives on the event loop. Time comes from the injected monotonic `clock`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sie.errors import InputError, Problem, SpecError
from sie.spec import ModelService, spec_digest
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord, address_problem
from sie.wire import (
    MAX_SPEC_BYTES_PER_BEAT,
    Assignment,
    HeartbeatReply,
    InstanceReport,
    NodeHeartbeat,
    SpecDigests,
    spec_fits,
)
from xds_server.autoscale.policy import fleet_shape
from xds_server.node_fit import traits_of
from xds_server.placement import NodeView, Placement, Rebalance, Track, generation_of, place
from xds_server.rollout.machine import Phase, RolloutConflict, RolloutState, replica_counts
from xds_server.rollout.machine import start as start_rollout

log = logging.getLogger(__name__)

# An instance with no telemetry for this long leaves EDS (its sidecar is gone or cut off).
EDS_TELEMETRY_TTL_S = 10.0
# Telemetry of an instance not heard from for this long is forgotten (it disappears from /v1/endpoints).
FORGET_AFTER_S = 60.0
# A node not heard from for this long is forgotten, with everything it registered.
NODE_FORGET_AFTER_S = 600.0
IN_EDS_STATES = frozenset({InstanceState.READY, InstanceState.DRAINING})
# A model with no instance in those states gets its sleeping and loading ones as endpoints: their
# sidecars hold each request until the instance serves (scale to zero: the wake; a first load; an evicted
# model's wake answers 503 naming why when it cannot fit). sidecar/waking.py.
HOLDER_STATES = frozenset({InstanceState.SLEEPING, InstanceState.LOADING})


class Tokens(Protocol):
    """Issues the credentials heartbeat replies carry (xds_server.credentials.TokenIssuer)."""

    def issue(self, instance_id: str, model_id: str, node: str) -> str: ...

    def node_token(self, node: str) -> str: ...


class ChangeSink(Protocol):
    """Where the registry reports its changes: the control loop's pending changes
    (xds_server.control.PendingChanges), built before the registry and passed to it."""

    def notify(self, models: set[str] | None) -> None:
        """Something changed for these models (None: the set of models or their specs changed)."""
        ...


class IgnoreChanges:
    """A ChangeSink that drops every report: a registry nobody builds snapshots from (tests, tools)."""

    def notify(self, models: set[str] | None) -> None:
        pass


class ModelExists(InputError):
    """POST of a model id the registry already holds. Fix the input: another id, or PUT to replace it."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        super().__init__(
            "model_exists",
            f"model {model_id!r} already exists; use PUT /v1/models/{model_id} to replace it",
            status=409,
        )


@dataclass
class ModelEntry:
    service: ModelService  # the stable build: what serves the model outside a rollout
    source: str  # "file", "api", "node" (recovered from a node's report) or "kubernetes" (the controller)
    spec_dict: dict  # service.to_dict(), computed once: every heartbeat reply carries it
    generation: int = 0  # the stable build's generation (its instances' ids, placement.instance_ids)
    rollout: RolloutState | None = None  # the current or the last rollout
    target: ModelService | None = None  # the new build while a rollout is active
    target_dict: dict | None = None
    previous: ModelService | None = None  # the build before the last successful rollout (`undo`)
    # A rolled-back or aborted build still placed while the routes leave it: (generation, instances,
    # until when on the registry's clock). Stopping it at once could make its sidecars drain (and Envoy
    # take their hosts out) before Envoy has the routes without it (Registry.sweep ends it).
    lingering: tuple[int, int, float] | None = None
    scale: int | None = None  # the autoscaler's count (xds_server/autoscale); None: the spec's
    scale_decision: dict | None = None  # the autoscaler's last decision and why, for status

    @property
    def replicas(self) -> int:
        """How many instances of the stable build the fleet runs: the autoscaler's count, or the spec's."""
        if self.scale is not None and self.service.spec.autoscaled:
            sla = self.service.spec.sla
            return min(sla.max_replicas, max(sla.min_replicas, self.scale))
        return self.service.spec.desired_replicas

    @property
    def rolling(self) -> bool:
        return self.rollout is not None and self.rollout.phase.active and self.target is not None

    def tracks(self) -> list[Track]:
        """The builds node hosts should run and how many instances each."""
        if not self.rolling:
            out = [self._stable_track()]
            if self.lingering is not None:
                out.append(Track(self.lingering[0], self.lingering[1]))
            return out
        assert self.rollout is not None
        old, new = replica_counts(self.rollout)
        return [Track(self.generation, old), Track(self.rollout.generation, new)]

    def _stable_track(self) -> Track:
        spec = self.service.spec
        if not spec.autoscaled:
            return Track(self.generation, self.replicas)
        if self.source == "kubernetes":
            # A Deployment's pods have no node host to sleep and wake them: min_replicas 0 keeps one pod.
            return Track(self.generation, max(1, self.replicas))
        placed, awake = fleet_shape(spec, self.replicas)
        return Track(self.generation, placed, awake)

    def spec_of(self, generation: int) -> tuple[ModelService, dict]:
        """The spec an instance of this generation runs."""
        new_build = self.rolling or (self.lingering is not None and self.lingering[0] == generation)
        if new_build and self.rollout is not None and generation == self.rollout.generation:
            assert self.target is not None and self.target_dict is not None
            return self.target, self.target_dict
        return self.service, self.spec_dict


class RolloutInProgress(InputError):
    """A change to a model whose rollout is still running: wait, or abort it first. 409."""

    def __init__(self, model_id: str, rollout: RolloutState):
        super().__init__(
            "rollout_in_progress",
            f"model {model_id!r} is rolling out {rollout.to_version} ({rollout.phase.value}, "
            f"{rollout.share}% of traffic); wait for it, or `sie rollout abort {model_id}` first",
            status=409,
        )


@dataclass
class NodeEntry:
    heartbeat: NodeHeartbeat
    last_seen: float
    reported_ids: frozenset[str] = frozenset()
    reports: dict[str, InstanceReport] = field(default_factory=dict)  # by instance id
    # The instances whose specs the last reply asked for (send_specs), and how many beats in a row have
    # come since an asked-for spec last came: the startup sync stops waiting for a node at SPEC_WAIT_BEATS.
    asked: frozenset[str] = frozenset()
    beats_without_spec: int = 0
    lost_at: float | None = None  # when its heartbeat timeout ran out (the registry's clock); None while live
    lost_wall: float | None = None  # the same moment on the wall clock, for operators


# Beats in a row a node may send none of the specs asked of it before the startup sync goes on without
# them (Registry.specs_awaited): it sends them with the beat after the reply that asks.
SPEC_WAIT_BEATS = 4

# The last node events (lost, back, GPU failed) kept for `sie status` and /v1/status.
NODE_EVENTS_KEPT = 200


@dataclass
class InstanceTelemetry:
    record: TelemetryRecord  # its timestamp is the control plane's wall clock at receipt
    received_at: float
    first_received_at: float


@dataclass
class Registry:
    clock: Callable[[], float]
    heartbeat_timeout_s: float = 30.0  # a node not heard from for this long is lost (settings.ControlLoopSettings)
    rebalance: Rebalance = "none"  # what a lost node gets back when it returns (placement rule 5)
    retire_s: float = 2.0
    changes: ChangeSink = field(default_factory=IgnoreChanges)  # told of every change (see ChangeSink)
    tokens: Tokens | None = None  # signs each assignment's sidecar credential
    wall_clock: Callable[[], float] = time.time
    synced: bool = False
    models: dict[str, ModelEntry] = field(default_factory=dict)
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    telemetry: dict[str, InstanceTelemetry] = field(default_factory=dict)
    # Other copies of an instance that report while another copy holds `telemetry`'s slot: instance id ->
    # node -> record. Two copies run only while an instance moves (placement rule 6: the old one serves
    # until the new one is ready) or while a lost node that still runs it has not been told to stop.
    copies: dict[str, dict[str, InstanceTelemetry]] = field(default_factory=dict)
    # Lost, back and GPU-failed events, newest last: {"at": wall seconds, "node", "kind", "detail"}.
    node_events: deque = field(default_factory=lambda: deque(maxlen=NODE_EVENTS_KEPT))
    node_event_counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, kind) -> how many, ever
    # Models deleted recently: their cluster stays in xDS (without routes) until `retire_s` has passed, so
    # Envoy drops the routes before the cluster (removal order of FACTS.md).
    retiring: dict[str, tuple[ModelService, float]] = field(default_factory=dict)
    _tombstones: set[str] = field(default_factory=set)
    # Kubernetes-managed models: the pods the controller reports ready, per model, with the address
    # (podIP:sidecar port) the API server gives each. Kubernetes runs these models (one Deployment
    # each), so node hosts never get them, and only ready pods may enter EDS, at that address.
    k8s_ready: dict[str, dict[str, str]] = field(default_factory=dict)
    k8s_control: dict[str, dict[str, str]] = field(default_factory=dict)  # the same pods' control listeners
    k8s_generation: dict[str, dict[str, int]] = field(default_factory=dict)  # the same pods' builds
    # Told the model id when what should run of it changes (a rollout's counts or phase): the Kubernetes
    # controller resizes that model's Deployments (node hosts learn it from their heartbeat replies).
    on_builds_changed: Callable[[str], None] = lambda model_id: None
    # Why a spec may not be taken (the admin API's own checks: the cluster's model-file policy, Envoy
    # resources that build), given the other models' specs; [] if it may. Run on a spec recovered from a
    # node's report as on one PUT through the API: a node speaks for what it runs, not for what the
    # cluster allows (main wires it; the default takes everything).
    admission: Callable[[ModelService, list[ModelService]], list[Problem]] = lambda service, others: []
    _by_model: dict[str, set[str]] = field(default_factory=dict)  # model_id -> instance ids with telemetry
    _placement: Placement = field(default_factory=lambda: Placement({}, {}))
    # Placement is a pure function of (models, node views, previous placement); node hosts heartbeat every
    # 0.5 s and almost always change nothing, so it is recomputed only when its inputs moved, and each
    # node's reply body is kept until then (building it deep-copies every assigned spec).
    _models_gen: int = 0
    _placement_key: tuple | None = None
    _reply_cache: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    _digest: SpecDigests = field(default_factory=SpecDigests)  # of the builds' spec dicts: see _figures

    # ---- models -------------------------------------------------------------------------------

    def add_model(self, service: ModelService, source: str) -> None:
        if service.model_id in self.models:
            raise ModelExists(service.model_id)
        self._store(service, source)

    def put_model(self, service: ModelService, source: str) -> bool:
        """Create or replace at once (a restart restoring state, Kubernetes, tests); True when created.
        An update that should go live gradually goes through `update_model`."""
        created = service.model_id not in self.models
        self._store(service, source)
        return created

    def update_model(self, service: ModelService, source: str) -> str:
        """Create ("created"), replace in place ("replaced"), or start a rollout ("rollout").

        A changed build (ModelServiceSpec.build_identity: version, image, weights, backend) of a model node
        hosts run, whose stable build has a ready instance, is a rollout; any other change applies in
        place, as does a new build of a model with nothing serving (there is nothing to protect).
        RolloutInProgress while the model's rollout runs."""
        mid = service.model_id
        entry = self.models.get(mid)
        if entry is None:
            self._store(service, source)
            return "created"
        if entry.rolling:
            assert entry.rollout is not None
            raise RolloutInProgress(mid, entry.rollout)
        rebuild = entry.service.spec.build_identity() != service.spec.build_identity()
        if rebuild and self.ready_instances(mid, entry.generation):
            self.begin_rollout(entry, service, source)
            return "rollout"
        self._store(service, source, keep=entry)
        return "replaced"

    def begin_rollout(self, entry: ModelEntry, service: ModelService, source: str) -> RolloutState:
        state = start_rollout(
            entry.service.model_id,
            from_generation=max(entry.generation, entry.rollout.generation if entry.rollout else 0),
            from_version=entry.service.spec.model.version,
            to_version=service.spec.model.version,
            policy=service.spec.rollout,
            replicas=entry.replicas if service.spec.autoscaled else service.spec.desired_replicas,
            now=self.wall_clock(),
        )
        # The new build's generation is past every earlier one, so no id of a rolled-back build comes back.
        state = dataclasses.replace(state, from_generation=entry.generation)
        entry.rollout, entry.target, entry.target_dict = state, service, service.to_dict()
        entry.source = source
        entry.lingering = None
        self._models_gen += 1
        log.info("model %s: rollout %s -> %s started", service.model_id, state.from_version, state.to_version)
        self.changes.notify(None)
        self.on_builds_changed(service.model_id)
        return state

    def set_rollout(self, model_id: str, state: RolloutState) -> None:
        """Apply the rollout machine's next state: counts, share, and at the end promotion or rollback."""
        entry = self.models[model_id]
        before = entry.rollout
        entry.rollout = state
        if before is not None and replica_counts(before) == replica_counts(state) and before.phase is state.phase:
            if before.share != state.share:
                self.changes.notify({model_id})  # the split in the routes
            if before.events[-1:] != state.events[-1:]:
                self.on_builds_changed(model_id)  # the record the controller keeps moved
            return
        if state.phase is Phase.SUCCEEDED and entry.target is not None:
            log.info("model %s: %s promoted; the old build drains", model_id, state.to_version)
            entry.previous = entry.service
            entry.service, entry.spec_dict = entry.target, entry.target_dict or entry.target.to_dict()
            entry.generation = state.generation
            entry.target = entry.target_dict = None
        elif not state.phase.active:
            # The new build leaves the routes now and the placement retire_s later (ModelEntry.lingering);
            # its spec stays in `target` while its cluster drains (control.split_by_build).
            log.info("model %s: rollout %s (%s)", model_id, state.phase.value, state.reason)
            if before is not None and before.phase.active:
                _, placed = replica_counts(before)
                entry.lingering = (state.generation, placed, self.clock() + self.retire_s)
        self._models_gen += 1
        self.changes.notify(None)
        self.on_builds_changed(model_id)

    def set_scale(self, model_id: str, replicas: int, decision: dict | None = None) -> None:
        """The autoscaler's count for a model's stable build: a change re-places it (new instances
        start where they fit; the highest numbered ones are dropped, and their node hosts drain them)."""
        entry = self.models[model_id]
        entry.scale_decision = decision
        if entry.scale == replicas:
            return
        entry.scale = replicas
        self._models_gen += 1
        self.changes.notify({model_id})
        self.on_builds_changed(model_id)

    def rollout_undo(self, model_id: str) -> RolloutState:
        """A rollout back to the build before the last successful one."""
        entry = self.models[model_id]
        if entry.rolling:
            assert entry.rollout is not None
            raise RolloutInProgress(model_id, entry.rollout)
        if entry.previous is None:
            raise RolloutConflict(f"model {model_id!r} has no earlier build to go back to")
        return self.begin_rollout(entry, entry.previous, entry.source)

    def restore_model(
        self,
        service: ModelService,
        source: str,
        *,
        generation: int = 0,
        rollout: RolloutState | None = None,
        target: ModelService | None = None,
        previous: ModelService | None = None,
        scale: int | None = None,
    ) -> None:
        """A model as the state file recorded it, rollout included, so a restart resumes the rollout;
        `scale`: the autoscaler's count as recorded (see restore_scale)."""
        self._store(service, source)
        entry = self.models[service.model_id]
        entry.generation, entry.rollout, entry.previous = generation, rollout, previous
        if target is not None and rollout is not None and rollout.phase.active:
            entry.target, entry.target_dict = target, target.to_dict()
        if scale is not None:
            self._restored_scale(entry, scale)
        self.on_builds_changed(service.model_id)

    def restore_scale(self, model_id: str, scale: int) -> None:
        """The autoscaler's count as recorded before a restart (state.py, a ModelService's status.build),
        so the fleet keeps its size rather than falling back to min_replicas while the autoscaler climbs
        back one step at a time. Ignored for a model that is gone or no longer autoscaled."""
        entry = self.models.get(model_id)
        if entry is None or not self._restored_scale(entry, scale):
            return
        self._models_gen += 1
        self.changes.notify({model_id})
        self.on_builds_changed(model_id)

    @staticmethod
    def _restored_scale(entry: ModelEntry, scale: int) -> bool:
        if not entry.service.spec.autoscaled or scale < 0:
            return False
        entry.scale = scale
        entry.scale_decision = {"desired": entry.replicas, "reason": f"recorded before the restart: {scale}"}
        return True

    def generation(self, model_id: str, instance_id: str) -> int:
        """The build an instance runs: from its id (placement.instance_ids), or for a Kubernetes pod from
        its label as the controller saw it."""
        pods = self.k8s_generation.get(model_id)
        if pods is not None and instance_id in pods:
            return pods[instance_id]
        return generation_of(instance_id)

    def ready_instances(self, model_id: str, generation: int) -> int:
        return sum(
            1
            for tel in self.instances_of(model_id)
            if tel.record.state is InstanceState.READY
            and self.generation(model_id, tel.record.instance_id) == generation
        )

    def waiting_for_memory(self, model_id: str, generation: int) -> str:
        """Why a node host holds back an instance of this build for memory, if one does ("" if none)."""
        for node in self.nodes.values():
            for report in node.reports.values():
                if (
                    report.model_id == model_id
                    and generation_of(report.instance_id) == generation
                    and report.state in (InstanceState.LOADING, InstanceState.FAILED)
                    and (report.detail or "").startswith("pending")  # node_host/agent.py: held back for admission
                    and "memory" in (report.detail or "")
                ):
                    return f"{report.instance_id} on {node.heartbeat.node}: {report.detail}"
        return ""

    def delete_model(self, model_id: str) -> bool:
        entry = self.models.pop(model_id, None)
        if entry is None:
            return False
        self.k8s_ready.pop(model_id, None)
        self.k8s_control.pop(model_id, None)
        self.k8s_generation.pop(model_id, None)
        self._models_gen += 1
        self._tombstones.add(model_id)
        self.retiring[model_id] = (entry.service, self.clock())
        log.info("model %s deleted; its cluster leaves xDS in %.1f s", model_id, self.retire_s)
        self.changes.notify(None)
        return True

    def _store(self, service: ModelService, source: str, keep: ModelEntry | None = None) -> None:
        """Store `service` as the model's stable build; `keep`: the entry it replaces in place, whose
        generation and rollout history carry over."""
        self._tombstones.discard(service.model_id)
        self.retiring.pop(service.model_id, None)
        entry = ModelEntry(service, source, service.to_dict())
        if keep is not None:
            entry.generation, entry.rollout, entry.previous = keep.generation, keep.rollout, keep.previous
            entry.scale, entry.scale_decision = keep.scale, keep.scale_decision
        self.models[service.model_id] = entry
        self._models_gen += 1
        self.changes.notify(None)
        self.on_builds_changed(service.model_id)

    # ---- nodes --------------------------------------------------------------------------------

    def heartbeat(self, hb: NodeHeartbeat) -> HeartbeatReply:
        """Store a node's heartbeat (the caller has checked it comes from that node) and answer it."""
        now = self.clock()
        previous = self.nodes.get(hb.node)
        hb, missing = self._with_specs(hb, previous)
        reports = {inst.instance_id: inst for inst in hb.instances}
        reported = frozenset(reports)
        asked = frozenset(missing)
        delivered = previous is not None and bool(previous.asked - asked)
        stalled = previous.beats_without_spec + 1 if previous is not None and asked and not delivered else 0
        self.nodes[hb.node] = NodeEntry(hb, now, reported, reports, asked=asked, beats_without_spec=stalled)
        if previous is not None and previous.lost_at is not None:
            away = now - previous.lost_at + self.heartbeat_timeout_s
            self._node_event(
                hb.node, "back", f"heartbeats again after {away:.1f} s; rebalance {self.rebalance}", log.warning
            )
        self._note_gpu_failures(previous, hb)
        if (
            previous is None
            or previous.lost_at is not None
            or previous.reported_ids != reported
            or self._addresses(previous) != self._addresses(self.nodes[hb.node])
        ):
            # What the node runs, and where, decides EDS membership of its instances (see in_eds).
            self.changes.notify(
                {inst.model_id for inst in hb.instances}
                | {r.model_id for r in (previous.reports.values() if previous else ())}
                | {t.record.model_id for t in self.telemetry.values() if t.record.node == hb.node}
            )
        if not self.synced:
            self._recover_models(hb)
        if not self.synced:
            # Change nothing: echo what runs, so even a node host that ignored `authoritative` keeps it.
            # (without specs: the node has each of them).
            return HeartbeatReply(
                authoritative=False,
                assignments=[
                    Assignment(i.instance_id, i.model_id, None, spec_digest=i.spec_digest) for i in hb.instances
                ],
                send_specs=missing,
            )
        self._replace_if_inputs_moved(now)
        return HeartbeatReply(
            authoritative=True,
            assignments=self.assignments_for(hb.node),
            node_token=self.tokens.node_token(hb.node) if self.tokens is not None else "",
            send_specs=missing,
        )

    def _with_specs(self, hb: NodeHeartbeat, previous: NodeEntry | None) -> tuple[NodeHeartbeat, list[str]]:
        """The heartbeat with each report's spec where the control plane has it, and the instances whose
        spec it does not have (the reply's send_specs; sie.wire). A report that carries its spec has its
        digest computed here, never taken from the node. One that carries only a digest gets a spec with
        that digest which this node sent (in this heartbeat, or in its last one) or the model's own build:
        never a spec another node sent."""
        before = previous.reports if previous is not None else {}
        # (model id, digest) -> spec, of what this node has sent: a digest resolves within its model only
        sent: dict[tuple[str, str], dict] = {}
        for report in before.values():
            if report.spec is not None:
                sent[report.model_id, report.spec_digest] = report.spec
        instances: list[InstanceReport] = []
        for report in hb.instances:
            carried = report.spec
            if carried is not None:
                last = before.get(report.instance_id)
                # The same decoded body as the last beat (admin.HeartbeatBodies) holds the same dict.
                digest = last.spec_digest if last is not None and last.spec is carried else spec_digest(carried)
                if digest != report.spec_digest:
                    report = dataclasses.replace(report, spec_digest=digest)
                sent[report.model_id, digest] = carried
            instances.append(report)
        missing: list[str] = []
        for index, report in enumerate(instances):
            if report.spec is None:
                spec = sent.get((report.model_id, report.spec_digest)) or self._build_with(
                    report.model_id, report.spec_digest
                )
                if spec is None:
                    missing.append(report.instance_id)
                else:
                    instances[index] = dataclasses.replace(report, spec=spec)
        if all(a is b for a, b in zip(instances, hb.instances)):
            return hb, missing
        return dataclasses.replace(hb, instances=instances), missing

    def specs_missing(self) -> int:
        """Reported instances of live nodes whose spec the control plane has asked for and not received."""
        return sum(len(entry.asked) for entry in self.nodes.values() if entry.lost_at is None)

    def specs_awaited(self) -> int:
        """specs_missing, less those of nodes that sent none of the asked-for specs in SPEC_WAIT_BEATS
        beats in a row: what the startup sync waits for, since a model is recovered from its instances'
        specs. Counted in each node's own beats, whatever its heartbeat interval; a node sends up to
        4 MiB of specs a beat, so a large backlog is waited for as long as it keeps coming."""
        return sum(
            len(entry.asked)
            for entry in self.nodes.values()
            if entry.lost_at is None and entry.beats_without_spec < SPEC_WAIT_BEATS
        )

    def _build_with(self, model_id: str, digest: str) -> dict | None:
        """The model's stable or new build whose spec has this digest, if it has one."""
        entry = self.models.get(model_id)
        for spec in (entry.spec_dict, entry.target_dict) if entry is not None else ():
            if spec is not None and self._figures(spec)[0] == digest:
                return spec
        return None

    def _figures(self, spec: dict) -> tuple[str, int]:
        """(spec_digest, spec_size) of one of the registry's own spec dicts (a build's), remembered while
        the build is held: each reply names every assignment's spec."""
        if len(self._digest) > 2 * len(self.models) + 16:
            self._digest.retain(d for e in self.models.values() for d in (e.spec_dict, e.target_dict) if d is not None)
        return self._digest(spec), self._digest.size(spec)

    def _node_event(self, node: str, kind: str, detail: str, say: Callable[..., None] = log.info) -> None:
        self.node_events.append({"at": round(self.wall_clock(), 3), "node": node, "kind": kind, "detail": detail})
        self.node_event_counts[node, kind] = self.node_event_counts.get((node, kind), 0) + 1
        say("node %s %s: %s", node, kind, detail)

    def _note_gpu_failures(self, previous: NodeEntry | None, hb: NodeHeartbeat) -> None:
        before = {g.index: g.failed for g in previous.heartbeat.gpus} if previous is not None else {}
        for gpu in hb.gpus:
            if gpu.failed and before.get(gpu.index) != gpu.failed:
                self._node_event(
                    hb.node, "gpu_failed", f"GPU {gpu.index}: {gpu.failed}; its instances go elsewhere", log.warning
                )

    @staticmethod
    def _addresses(entry: NodeEntry) -> dict[str, str | None]:
        return {iid: r.sidecar_address for iid, r in entry.reports.items()}

    def heartbeat_json(self, hb: NodeHeartbeat) -> dict:
        """heartbeat(hb).to_json(), with the authoritative reply body cached until placement changes."""
        reply = self.heartbeat(hb)
        if not reply.authoritative:
            return reply.to_json()
        # The body changes when placement moves, a token is renewed (the node's, or any sidecar's: each is
        # re-signed on its own schedule, and a body cached past that would carry one to its expiry), or
        # what the node reported changes which specs travel (sie.wire).
        key = (
            reply.node_token,
            tuple((a.instance_id, a.spec_digest, a.spec is None, a.token) for a in reply.assignments),
            tuple(reply.send_specs),
        )
        cached = self._reply_cache.get(hb.node)
        if cached is None or cached[0] != key:
            cached = self._reply_cache[hb.node] = (key, reply.to_json())
        return cached[1]

    def _replace_if_inputs_moved(self, now: float) -> None:
        views = self.node_views(now)
        key = (
            self._models_gen,
            tuple(
                sorted(
                    (
                        v.name,
                        v.live,
                        v.reported,
                        v.ready,
                        v.failed,
                        tuple(sorted(v.unplaceable.items())),
                        tuple(g.failed for g in v.traits.gpus),
                    )
                    for v in views.values()
                )
            ),
        )
        # An instance no node could take is tried again with every heartbeat: room may have come free.
        if key != self._placement_key or self._placement.unplaced:
            tracks = {mid: e.tracks() for mid, e in self.models.items() if e.source != "kubernetes"}
            before = self._placement
            self._placement = place(
                self.node_models(),
                views,
                before.by_instance,
                tracks,
                needs=self.memory_needs(),
                homes=before.homes,
                rebalance=self.rebalance,
                previous_leaving=before.leaving,
            )
            self._placement_key = key
            self._reply_cache.clear()
            moved = {
                iid
                for iid, node in self._placement.by_instance.items()
                if before.by_instance.get(iid) not in (None, node)
            }
            for iid in sorted(moved):
                log.info("instance %s: %s", iid, self._placement.reasons.get(iid, "moved"))
            if moved or before.leaving != self._placement.leaving:
                # Which node's copy may serve changed (registered_address): EDS follows at once.
                models = {
                    self._placement.model_of.get(i) or before.model_of.get(i, "") for i in moved | set(before.leaving)
                }
                self.changes.notify(models - {""})

    def node_models(self) -> dict[str, ModelService]:
        """The models node hosts run: all but the Kubernetes-managed ones (their Deployments run them)."""
        return {mid: e.service for mid, e in self.models.items() if e.source != "kubernetes"}

    def set_k8s_ready(
        self,
        model_id: str,
        endpoints: dict[str, str],
        control: dict[str, str] | None = None,
        generations: dict[str, int] | None = None,
    ) -> None:
        """The controller's view of a Kubernetes model's ready pods: instance id (pod name) -> address
        (and -> control listener address, -> the build it runs)."""
        self.k8s_control[model_id] = dict(control or {})
        self.k8s_generation[model_id] = dict(generations or {})
        if self.k8s_ready.get(model_id) != endpoints:
            self.k8s_ready[model_id] = dict(endpoints)
            self.changes.notify({model_id})

    def assignments_for(self, node: str) -> list[Assignment]:
        """What the node should run; an assignment carries its spec unless the node's last heartbeat
        reported an instance with the same digest or an earlier assignment of this reply carries it, up to
        MAX_SPEC_BYTES_PER_BEAT of specs."""
        node_entry = self.nodes.get(node)
        # Specs the node holds (it reported an instance with them) or that this reply carries already: the
        # node fills in the assignments without one (NodeAgent._with_specs).
        held = {r.spec_digest for r in node_entry.reports.values()} if node_entry is not None else set()
        budget = MAX_SPEC_BYTES_PER_BEAT  # the rest in the next replies, as the node takes these (sie.wire)
        out = []
        for iid in self._placement.for_node(node):
            entry = self.models.get(self._placement.model_of[iid])
            if entry is not None:
                token = self.tokens.issue(iid, entry.service.model_id, node) if self.tokens is not None else ""
                _, spec = entry.spec_of(generation_of(iid))
                digest, size = self._figures(spec)
                sent = None
                if digest not in held and spec_fits(size, budget):
                    sent, budget = spec, budget - size
                    held.add(digest)
                out.append(
                    Assignment(
                        iid, entry.service.model_id, sent, token, awake=self._placement.awake(iid), spec_digest=digest
                    )
                )
        return out

    def node_views(self, now: float) -> dict[str, NodeView]:
        return {
            name: NodeView(
                name=name,
                live=self.node_live(entry, now),
                reported=frozenset((i.instance_id, i.model_id) for i in entry.heartbeat.instances),
                traits=traits_of(entry.heartbeat),
                ready=frozenset(i.instance_id for i in entry.heartbeat.instances if i.state is InstanceState.READY),
                unplaceable={i.instance_id: i.unplaceable for i in entry.heartbeat.instances if i.unplaceable},
                failed=frozenset(i.instance_id for i in entry.heartbeat.instances if i.state is InstanceState.FAILED),
            )
            for name, entry in self.nodes.items()
        }

    def memory_needs(self) -> dict[str, float]:
        """MiB per GPU that a running instance of each model holds, as its node host's ledger says (the
        largest, should instances differ): what the next one will need.

        A node speaks only for what it was given (DESIGN §10): only reports of instances the placement
        lets that node hold count, and none above the memory of the node's largest GPU, so no report
        can make a model need more than any GPU of the node running it has."""
        out: dict[str, float] = {}
        placement = self._placement
        for name, entry in self.nodes.items():
            largest = max((g.total_mb for g in entry.heartbeat.gpus), default=None)
            for report in entry.heartbeat.instances:
                model = self.models.get(report.model_id)
                if report.reserved_mb is None or model is None or report.state is not InstanceState.READY:
                    continue
                iid = report.instance_id
                if placement.model_of.get(iid) != report.model_id or not placement.holds(iid, name):
                    continue
                per_gpu = report.reserved_mb / max(1, model.service.spec.resources.gpu_count)
                if largest:
                    per_gpu = min(per_gpu, largest)
                out[report.model_id] = max(out.get(report.model_id, 0.0), per_gpu)
        return out

    def node_live(self, entry: NodeEntry, now: float) -> bool:
        return now - entry.last_seen <= self.heartbeat_timeout_s

    @property
    def placement(self) -> Placement:
        return self._placement

    def _recover_models(self, hb: NodeHeartbeat) -> None:
        """During the startup sync: models from what the nodes run (see the module docstring), each at
        the generation its running instances carry in their ids (_adopt_generation)."""
        for inst in hb.instances:
            mid = inst.model_id
            known = self.models.get(mid)
            if mid in self._tombstones or self.synced or inst.spec is None:
                continue  # spec None: asked for in this reply (send_specs), it comes with the next heartbeat
            if (
                known is not None
                and known.source in ("file", "node")
                and inst.spec_digest == self._figures(known.spec_dict)[0]
            ):
                self._adopt_generation(known, inst.instance_id)
                continue
            if known is not None and known.source != "file":
                continue
            try:
                service = parse_model_service(inst.spec, f"node {hb.node} instance {inst.instance_id}")
            except SpecError as exc:
                log.warning("cannot recover model %s from node %s: %s", mid, hb.node, exc)
                continue
            if service.model_id != mid:
                log.warning(
                    "node %s reports instance %s of %s with a spec for %s; ignored",
                    hb.node,
                    inst.instance_id,
                    mid,
                    service.model_id,
                )
                continue
            if known is not None and known.service == service:
                self._adopt_generation(known, inst.instance_id)
                continue
            others = [e.service for m, e in self.models.items() if m != mid]
            problems = self.admission(service, others)
            if problems:
                log.warning(
                    "model %s: node %s runs a spec this control plane does not admit (%s); not recovered",
                    mid,
                    hb.node,
                    "; ".join(str(p) for p in problems[:5]),
                )
                continue
            if known is not None:
                log.warning(
                    "model %s: the cluster file's spec differs from the one node %s runs; keeping the running "
                    "spec so this restart changes nothing (PUT /v1/models/%s applies the file's)",
                    mid,
                    hb.node,
                    mid,
                )
            else:
                log.info("model %s recovered from node %s's report", mid, hb.node)
            self._store(service, "node")
            self._adopt_generation(self.models[mid], inst.instance_id)

    def _adopt_generation(self, entry: ModelEntry, instance_id: str) -> None:
        """A model taken from the cluster file or the nodes' reports starts at generation 0, but after a
        rollout its instances run under a later generation's ids (`<model>.g<N>-<n>`): placement would
        want `<model>-<n>` and stop every one of them at once. The stable build takes the latest
        generation that its running instances (those with its spec) carry."""
        generation = generation_of(instance_id)
        if generation <= entry.generation:
            return
        log.info(
            "model %s: its nodes run generation %d of its build (%s); kept",
            entry.service.model_id,
            generation,
            instance_id,
        )
        entry.generation = generation
        self._models_gen += 1
        self.changes.notify(None)

    # ---- telemetry ----------------------------------------------------------------------------

    def record_telemetry(self, rec: TelemetryRecord) -> bool:
        """Store a record (the caller has checked it comes from that instance's sidecar); False when it
        is older than the stored one of the same sidecar process (a reordered post).

        While two copies of an instance report (it moves between nodes, or a lost node still runs it),
        `telemetry` holds the copy on the node the instance is placed on, or else the newest reporter,
        and `copies` the other, so neither overwrites the other's record."""
        now = self.clock()
        iid = rec.instance_id
        old = self.telemetry.get(iid)
        if old is not None and old.record.node != rec.node:
            placed = self._placement.by_instance.get(iid)
            if placed == old.record.node:
                return self._record_copy(rec, now)
            self.copies.setdefault(iid, {})[old.record.node] = old  # the newcomer takes the slot
            mine = self.copies[iid].pop(rec.node, None)
            if not self.copies[iid]:
                del self.copies[iid]
            old_model = old.record.model_id
            old = mine
        else:
            old_model = old.record.model_id if old is not None else rec.model_id
        if old is not None and rec.reporter == old.record.reporter and rec.seq <= old.record.seq:
            return False
        rec = dataclasses.replace(rec, timestamp=self.wall_clock())
        first = old.first_received_at if old is not None else now
        self.telemetry[iid] = InstanceTelemetry(rec, now, first)
        self._by_model.setdefault(rec.model_id, set()).add(iid)
        changed = {rec.model_id}
        if old_model != rec.model_id:
            changed.add(old_model)
            self._forget_index(old_model, iid)
        self.changes.notify(changed)
        return True

    def _record_copy(self, rec: TelemetryRecord, now: float) -> bool:
        mine = self.copies.setdefault(rec.instance_id, {})
        old = mine.get(rec.node)
        if old is not None and rec.reporter == old.record.reporter and rec.seq <= old.record.seq:
            return False
        rec = dataclasses.replace(rec, timestamp=self.wall_clock())
        mine[rec.node] = InstanceTelemetry(rec, now, old.first_received_at if old is not None else now)
        self.changes.notify({rec.model_id})
        return True

    def all_copies(self, instance_id: str) -> list[InstanceTelemetry]:
        """Every reporting copy of the instance: the one in `telemetry` first, then the others by node."""
        main = self.telemetry.get(instance_id)
        others = self.copies.get(instance_id, {})
        return ([main] if main is not None else []) + [others[n] for n in sorted(others)]

    def eds_records(self, model_id: str, now: float) -> list[TelemetryRecord]:
        """The records of the model's instances that belong in EDS, sorted by instance id, at most one per
        instance, each carrying the address its node host registered (see `registered_address`).

        In: state ready or draining (or sleeping or loading, when none of the model's instances is ready
        or draining: the holders, HOLDER_STATES), telemetry received in the last EDS_TELEMETRY_TTL_S, an address
        registered for it by a node the placement lets serve it, a node that is live (a lost node's
        instances leave EDS at once), and not disowned by its node (a live node whose heartbeat, newer
        than the instance's first record, does not list it). Of two copies (an instance that moves), the
        one on the node it is placed on serves once it is in EDS; until then the one it leaves does.

        Last resort: when nothing else of the model would be in EDS, copies on lost nodes whose sidecars
        still report ready serve at the address their node last registered. A node cut off from the
        control plane may still serve, and nothing else can until the instances placed elsewhere are up.
        """
        out = []
        ids = sorted(
            set(self._by_model.get(model_id, ())) | {i for i in self.copies if self._model_of_copy(i) == model_id}
        )
        entry = self.models.get(model_id)
        chosen = {iid: self._serving_copy(iid, now) for iid in ids}
        # Kubernetes pods have no node host to wake them, so their sidecars hold nothing (no --wake-url).
        holders = (entry is None or entry.source != "kubernetes") and not any(chosen.values())
        for iid in ids:
            pick = chosen[iid] or (self._serving_copy(iid, now, sleeping=True) if holders else None)
            if pick is not None:
                out.append(pick)
        if not out and entry is not None and entry.source != "kubernetes":
            out = [r for r in (self._stranded(iid, now) for iid in ids) if r is not None]
        return out

    def _model_of_copy(self, instance_id: str) -> str:
        return next((t.record.model_id for t in self.copies.get(instance_id, {}).values()), "")

    def _serving_copy(self, instance_id: str, now: float, sleeping: bool = False) -> TelemetryRecord | None:
        """The copy of the instance EDS gets (the placed node's first), with its registered address."""
        placed = self._placement.by_instance.get(instance_id)
        copies = sorted(self.all_copies(instance_id), key=lambda t: t.record.node != placed)
        for tel in copies:
            if not self.in_eds(tel, now, sleeping=sleeping):
                continue
            address = self.registered_address(tel.record)
            if address is not None:
                return tel.record if address == tel.record.address else dataclasses.replace(tel.record, address=address)
        return None

    def _stranded(self, instance_id: str, now: float) -> TelemetryRecord | None:
        """A ready copy on a lost node whose sidecar still reports (eds_records' last resort)."""
        for tel in self.all_copies(instance_id):
            node = self.nodes.get(tel.record.node)
            if node is None or self.node_live(node, now) or tel.record.state is not InstanceState.READY:
                continue
            if now - tel.received_at > EDS_TELEMETRY_TTL_S:
                continue
            report = node.reports.get(instance_id)
            address = report.sidecar_address if report is not None and report.model_id == tel.record.model_id else None
            if address is not None and address_problem(address) is None:
                return dataclasses.replace(tel.record, address=address)
        return None

    def registered_address(self, rec: TelemetryRecord) -> str | None:
        """The address EDS may give this instance: what its node host (or Kubernetes) registered for it.

        None when nothing was registered, the address is not an IP literal, or the placement does not
        let the claiming node serve it (placed on another node, and not handed over from this one): a
        node speaks only for what it was given."""
        entry = self.models.get(rec.model_id)
        if entry is not None and entry.source == "kubernetes":
            address = self.k8s_ready.get(rec.model_id, {}).get(rec.instance_id)
        else:
            node = self.nodes.get(rec.node)
            report = node.reports.get(rec.instance_id) if node is not None else None
            if report is None or report.model_id != rec.model_id:
                return None
            placed = self._placement.by_instance.get(rec.instance_id)
            if placed is not None and not self._placement.holds(rec.instance_id, rec.node):
                return None
            address = report.sidecar_address
        if address is None or address_problem(address) is not None:
            return None
        return address

    def control_address(self, rec: TelemetryRecord) -> str | None:
        """Where the instance's sidecar serves its control endpoints (metrics), as registered."""
        if self.registered_address(rec) is None:
            return None
        entry = self.models.get(rec.model_id)
        if entry is not None and entry.source == "kubernetes":
            address = self.k8s_control.get(rec.model_id, {}).get(rec.instance_id)
        else:
            report = self.nodes[rec.node].reports[rec.instance_id]
            address = report.control_address
        if address is None or address_problem(address) is not None:
            return None
        return address

    def instances_of(self, model_id: str) -> list[InstanceTelemetry]:
        """Every instance of the model with telemetry (in EDS or not), sorted by instance id."""
        return [self.telemetry[iid] for iid in sorted(self._by_model.get(model_id, ()))]

    def _forget_index(self, model_id: str, instance_id: str) -> None:
        ids = self._by_model.get(model_id)
        if ids is not None:
            ids.discard(instance_id)
            if not ids:
                del self._by_model[model_id]

    def in_eds(self, tel: InstanceTelemetry, now: float, sleeping: bool = False) -> bool:
        """Whether the instance belongs in EDS; `sleeping`: as a wake holder (state sleeping), which
        eds_records asks only for a model with no instance in EDS otherwise."""
        states = HOLDER_STATES if sleeping else IN_EDS_STATES
        if tel.record.state not in states or now - tel.received_at > EDS_TELEMETRY_TTL_S:
            return False
        entry = self.models.get(tel.record.model_id)
        if entry is not None and entry.source == "kubernetes":
            # Kubernetes decides which pods exist and are ready; the node host on that node does not run them.
            return tel.record.instance_id in self.k8s_ready.get(tel.record.model_id, {})
        node = self.nodes.get(tel.record.node)
        if node is not None and not self.node_live(node, now):
            return False  # its node is lost: out at once (eds_records' last resort aside)
        if node is not None and node.last_seen > tel.first_received_at:
            return tel.record.instance_id in node.reported_ids
        return True

    # ---- housekeeping -------------------------------------------------------------------------

    def notice_lost_nodes(self, now: float | None = None) -> None:
        """A node whose heartbeat timeout ran out is lost: its endpoints leave EDS (in_eds) and its
        instances are placed on the live nodes (placement rule 5), now rather than at the next heartbeat."""
        now = self.clock() if now is None else now
        lost = [name for name, entry in self.nodes.items() if entry.lost_at is None and not self.node_live(entry, now)]
        for name in lost:
            entry = self.nodes[name]
            entry.lost_at, entry.lost_wall = now, self.wall_clock()
            running = sorted(entry.reported_ids)
            self._node_event(
                name,
                "lost",
                f"no heartbeat for {now - entry.last_seen:.1f} s (timeout {self.heartbeat_timeout_s:g} s): unhealthy; "
                f"its endpoints leave EDS and its {len(running)} instance(s) are placed elsewhere",
                log.warning,
            )
        if lost:
            self.changes.notify(
                {r.model_id for name in lost for r in self.nodes[name].reports.values()}
                | {t.record.model_id for t in self.telemetry.values() if t.record.node in lost}
            )
            if self.synced:
                self._replace_if_inputs_moved(now)

    def mark_synced(self) -> None:
        self.synced = True
        now = self.clock()
        self._seed_scales(now)
        self._replace_if_inputs_moved(now)
        log.info(
            "registry synced: %d models, %d nodes, %d instances with telemetry",
            len(self.models),
            len(self.nodes),
            len(self.telemetry),
        )
        self.changes.notify(None)

    def _seed_scales(self, now: float) -> None:
        """At the end of the startup sync, before the first placement: an autoscaled model's count is at
        least the number of instances of its stable build that live node hosts report serving, so the
        first authoritative reply neither stops nor puts to sleep what served before the restart (nor
        does the autoscaler start from less: its first look takes `replicas`). The count recorded before
        the restart (restore_scale) may be higher (instances still loading); min_replicas is the floor
        and max_replicas the ceiling. Kubernetes models are sized by their record (k8s_source.py)."""
        serving: dict[str, set[str]] = {}
        for node in self.nodes.values():
            if self.node_live(node, now):
                for report in node.reports.values():
                    if report.state is InstanceState.READY:
                        serving.setdefault(report.model_id, set()).add(report.instance_id)
        for mid, entry in self.models.items():
            sla = entry.service.spec.sla
            if not entry.service.spec.autoscaled or entry.source == "kubernetes":
                continue
            awake = sum(1 for iid in serving.get(mid, ()) if generation_of(iid) == entry.generation)
            scale = min(sla.max_replicas, max(awake, entry.scale or 0, sla.min_replicas))
            if scale == entry.replicas:
                continue  # what it would run anyway (a first start finds nothing serving)
            log.info("model %s: %d instances after the restart (%d serving of its build)", mid, scale, awake)
            entry.scale = scale
            entry.scale_decision = {"desired": scale, "reason": f"after the restart: {awake} serving"}
            self._models_gen += 1

    def sweep(self) -> None:
        """Notice lost nodes, forget long-silent instances and finish retiring deleted models."""
        now = self.clock()
        self.notice_lost_nodes(now)
        for iid in [i for i, t in self.telemetry.items() if now - t.received_at > FORGET_AFTER_S]:
            self._forget_index(self.telemetry.pop(iid).record.model_id, iid)
        for iid, others in list(self.copies.items()):
            for node in [n for n, t in others.items() if now - t.received_at > EDS_TELEMETRY_TTL_S]:
                del others[node]  # a copy that stopped reporting (stopped, or its node is gone)
            if not others:
                del self.copies[iid]
        gone = [name for name, entry in self.nodes.items() if now - entry.last_seen > NODE_FORGET_AFTER_S]
        for name in gone:
            log.info("node %s not heard from for %.0f s: forgotten", name, NODE_FORGET_AFTER_S)
            del self.nodes[name]
            self._reply_cache.pop(name, None)
        if gone:
            self.changes.notify(None)
        lingered = [e for e in self.models.values() if e.lingering is not None and now >= e.lingering[2]]
        for entry in lingered:
            entry.lingering = None
        if lingered:
            self._models_gen += 1  # the rolled-back builds leave the placement: their node hosts stop them
            self.changes.notify(None)
        expired = [m for m, (_, at) in self.retiring.items() if now - at >= self.retire_s]
        for mid in expired:
            del self.retiring[mid]
        if expired:
            self.changes.notify(None)
