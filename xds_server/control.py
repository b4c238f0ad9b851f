"""The control loop: registry changes -> weight decisions -> a new snapshot, coalesced over a debounce window.

The registry reports every change (a telemetry record, a heartbeat whose instance list changed, a model
added or deleted) into PendingChanges, its ChangeSink: the composition root builds that first and passes
it to both the registry and the loop. The loop waits `debounce_s` after the first change of a burst, then
asks the DecisionPolicy for a new decision for each model that changed, builds resources (only the
changed ones are rebuilt, see resources.ResourceCache) and publishes a snapshot if any version moved.
The ADS streams then send only what changed.

A periodic sweep catches changes that time alone makes: an instance's telemetry ages past
STALE_AFTER_S (the policy must see it as saturated) or past the EDS TTL (it must leave EDS), and deleted
models finish retiring.

Nothing is published before the registry is synced (end of the startup sync window), so Envoy never
sees a configuration built from a partial registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping

from sie.telemetry import STALE_AFTER_S, InstanceState, TelemetryRecord
from xds_server.ingress import IngressConfig, canary_cluster_name, cluster_name
from xds_server.metrics import ControlPlaneMetrics
from xds_server.placement import generation_of
from xds_server.policy.decisions import DecisionPolicy, EqualWeights, Health, ModelDecision
from xds_server.registry import ModelEntry, Registry
from xds_server.resources import CanaryInputs, ModelInputs, ResourceCache
from xds_server.rollout.machine import Phase
from xds_server.snapshots import Snapshot, SnapshotCache

log = logging.getLogger(__name__)


class PendingChanges:
    """What changed since the last build: some models, or the model set itself. Built first and handed
    to both sides: the registry reports into it (`notify`, as its registry.ChangeSink), the control loop
    takes from it."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._dirty: set[str] = set()
        self._all = True
        self.changed_at: float | None = None
        self.wake = asyncio.Event()

    def notify(self, models: set[str] | None) -> None:
        """Something changed for these models (None: the set of models or their specs changed)."""
        if models is None:
            self._all = True
        else:
            self._dirty |= models
        if self.changed_at is None:
            self.changed_at = self._clock()
        self.wake.set()

    def take(self, known: set[str]) -> tuple[set[str], float | None]:
        """The models to decide again (of `known`), and when the oldest change happened; resets."""
        dirty = set(known) if self._all else self._dirty & known
        changed_at = self.changed_at
        self._dirty, self._all, self.changed_at = set(), False, None
        return dirty, changed_at

    def put_back(self, models: set[str], changed_at: float | None) -> None:
        """Return what `take` gave to a build that failed, so the next build decides those models again.
        It does not wake the loop: a build that fails for good would otherwise run every debounce window;
        the next change (telemetry comes every 0.5 s) brings them along."""
        self._dirty |= models
        if changed_at is not None and (self.changed_at is None or changed_at < self.changed_at):
            self.changed_at = changed_at


def sanitize(decision: ModelDecision, records: list[TelemetryRecord]) -> ModelDecision:
    """Hold a policy's decision to the facts: only instances it was given, at the address their node host
    registered (the records carry it, see Registry.eds_records), DRAINING whatever the policy said
    when the sidecar says it drains (it refuses new requests), and HEALTHY when it sleeps or loads: such
    an instance is in EDS only as its model's holder (nothing of the model serves), and its sidecar holds
    each request until it serves (sidecar/waking.py)."""
    by_id = {r.instance_id: r for r in records}
    endpoints = {}
    for iid, ep in decision.endpoints.items():
        rec = by_id.get(iid)
        if rec is None:
            continue
        health = (
            Health.DRAINING
            if rec.state is InstanceState.DRAINING
            else Health.HEALTHY
            if rec.state in (InstanceState.SLEEPING, InstanceState.LOADING)
            else ep.health
        )
        endpoints[iid] = dataclasses.replace(ep, address=rec.address, health=health)
    return dataclasses.replace(decision, endpoints=endpoints)


def serving_state(records: list[TelemetryRecord]) -> str:
    """The model's state in the ingress's model list, from its EDS records: serving (an instance ready
    or draining), loading, asleep (scale to zero: its first request wakes it) or unavailable."""
    states = {r.state for r in records}
    if states & {InstanceState.READY, InstanceState.DRAINING}:
        return "serving"
    if InstanceState.LOADING in states:
        return "loading"
    return "asleep" if InstanceState.SLEEPING in states else "unavailable"


def retire_stage(entry: ModelEntry, wall: float, retire_s: float) -> int:
    """Where a finished rollout's canary cluster is: 0 within `retire_s` of the end, 1 within twice that,
    2 after (gone); 2 with no rollout or one still running."""
    rollout = entry.rollout
    if rollout is None or rollout.finished_at is None or entry.rolling:
        return 2
    return min(2, int((wall - rollout.finished_at) // retire_s)) if retire_s > 0 else 2


def picker_view(inputs: Mapping[str, ModelInputs]) -> dict[str, dict]:
    """Per cluster of a model with prefix affinity, the instances the endpoint picker may choose: those in
    its EDS now and HEALTHY (never a draining one), with their pushed weights, and the model's balance
    factor. What Envoy would take from the picker is a subset of what it has, so a stale view costs at
    most a fallback to least request (override_host takes only hosts of the cluster)."""
    out: dict[str, dict] = {}
    for mid, model in inputs.items():
        if not model.routed or not model.service.spec.prefix_affinity:
            continue
        builds = [(cluster_name(mid), model.service, model.decision)]
        if model.canary is not None:
            builds.append((canary_cluster_name(mid), model.canary.service, model.canary.decision))
        for name, service, decision in builds:
            out[name] = {
                "model_id": mid,
                "balance_factor": service.spec.routing.prefix_affinity.balance_factor,
                "endpoints": [
                    {"instance_id": iid, "address": ep.address, "weight": ep.weight}
                    for iid, ep in sorted(decision.endpoints.items())
                    if ep.health is Health.HEALTHY
                ],
            }
    return out


def split_by_build(
    entry: ModelEntry,
    decision: ModelDecision,
    wall: float,
    retire_s: float,
    generation: Callable[[str], int] = generation_of,
) -> ModelInputs:
    """One model's resources inputs from its decision (made over all its instances, so shedding and the
    fleet reference are the model's).

    During a rollout the stable build's endpoints are in `model.<id>` and the new build's in
    `model.<id>.canary`, which the routes give its share. Endpoints of any other build (the old one after
    a promotion, the new one after a rollback) are DRAINING where they were, so they take no new request
    while their node host stops them.

    A promotion changes `model.<id>` (the new build's spec and endpoints), and Envoy re-warms a changed
    cluster, so the routes keep pointing at the canary for `retire_s` after it, until `model.<id>` has
    warmed with its new endpoints; then they move back to `model.<id>`, and the canary cluster outlives
    them by another `retire_s` (routes before clusters, FACTS.md). After a rollback the routes move at
    once: `model.<id>` did not change. `generation` tells an instance's build (Registry.generation)."""
    rollout = entry.rollout
    canary_gen = rollout.generation if rollout is not None and rollout.generation > entry.generation else None
    promoted_gen = rollout.generation if rollout is not None and rollout.phase is Phase.SUCCEEDED else None
    stage = retire_stage(entry, wall, retire_s)
    stable: dict = {}
    canary: dict = {}
    for iid, ep in decision.endpoints.items():
        gen = generation(iid)
        if canary_gen is not None and gen == canary_gen:
            # After a rollback the routes leave the canary in this very push, but Envoy may apply the
            # endpoints before the routes: a request still drawn to the canary must find its hosts, so they
            # stay as they are for retire_s (their sidecars report draining once their node host stops them).
            keep = entry.rolling or stage == 0
            canary[iid] = ep if keep else dataclasses.replace(ep, health=Health.DRAINING)
            continue
        stable[iid] = ep if gen == entry.generation else dataclasses.replace(ep, health=Health.DRAINING)
        if promoted_gen is not None and gen == promoted_gen and stage < 2:
            canary[iid] = ep  # the promoted build serves from both clusters while the routes move
    stable_decision = dataclasses.replace(decision, endpoints=stable)
    if rollout is None or not (entry.rolling or canary or stage < 2):
        return ModelInputs(entry.service, stable_decision)
    if entry.rolling:
        share: int | None = rollout.share
    elif rollout.phase is Phase.SUCCEEDED and stage == 0:
        share = 100
    else:
        share = None
    service = entry.target if entry.target is not None else entry.service
    return ModelInputs(
        entry.service,
        stable_decision,
        canary=CanaryInputs(service, dataclasses.replace(decision, endpoints=canary), share),
    )


class ControlLoop:
    def __init__(
        self,
        registry: Registry,
        policy: DecisionPolicy,
        cache: SnapshotCache,
        metrics: ControlPlaneMetrics,
        ingress: IngressConfig,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        debounce_s: float = 0.05,
        lb_policy: str = "least_request",
        *,
        changes: PendingChanges,
        retire_s: float = 2.0,
        prefix_affinity: bool = True,
        picker: str | None = None,
    ):
        self.registry = registry
        self.changes = changes  # the registry reports into the same object (built first, see main)
        self.policy = policy
        self.cache = cache
        self.metrics = metrics
        self.ingress = ingress
        self._clock = clock
        self._wall = wall_clock
        self.debounce_s = debounce_s
        self.retire_s = retire_s
        self.decisions: dict[str, ModelDecision] = {}
        # Per model, the resource inputs of its last good build, and why its newest could not be made:
        # one model's bad data (a record, a report) keeps that model's last config and stops nothing else.
        self._inputs: dict[str, ModelInputs] = {}
        self._input_errors: dict[str, str] = {}
        self._sweep_errors: dict[str, str] = {}
        self.states: dict[str, str] = {}  # model -> serving_state, for the model list
        self.snapshot: Snapshot | None = None
        self._resources = ResourceCache(lb_policy=lb_policy, prefix_affinity=prefix_affinity, picker=picker)
        # What the endpoint picker may choose from, per model cluster with prefix affinity (picker_view).
        self.picker_view: dict[str, dict] = {}
        self._eligibility: dict[str, tuple] = {}
        self._fallback = EqualWeights()

    @property
    def resource_errors(self) -> dict[str, str]:
        """Models whose Envoy resources could not be built, with why (their last good ones are served)."""
        return {**self._resources.errors, **self._input_errors}

    def notify(self, models: set[str] | None) -> None:
        """Something changed for these models (None: the set of models or their specs changed)."""
        self.changes.notify(models)

    def republish(self) -> None:
        """Publish the built snapshot again even if unchanged (e.g. after a test forced a bad one)."""
        self.snapshot = None
        self.notify(None)

    def rebuild(self) -> Snapshot | None:
        """Decide and publish now. Returns the published snapshot, or None when nothing was published.

        Never raises: a failure while building is logged and the last good snapshot stays published
        (Envoy keeps what it has), so no input can stop the loop or the models it did not touch."""
        if not self.registry.synced:
            return None
        dirty, changed_at = self.changes.take(set(self.registry.models))
        try:
            return self._rebuild(dirty, changed_at)
        except Exception:  # noqa: BLE001 - the loop must outlive any one bad build
            log.exception("building the xDS snapshot failed; Envoy keeps the last good configuration")
            self.changes.put_back(dirty, changed_at)
            return None

    def _rebuild(self, dirty: set[str], changed_at: float | None) -> Snapshot | None:
        started = self._clock()
        now, wall = started, self._wall()
        models = self.registry.models
        for gone in set(self.decisions) - set(models) - set(self.registry.retiring):
            del self.decisions[gone]
            self.states.pop(gone, None)
            self.policy.forget(gone)  # a stateful policy drops the model's state
        for gone in set(self._inputs) - set(models):
            del self._inputs[gone]
        for gone in set(self._input_errors) - set(models):
            del self._input_errors[gone]
        inputs: dict[str, ModelInputs] = {}
        for mid, entry in sorted(models.items()):
            try:
                inputs[mid] = self._model_inputs(mid, entry, mid in dirty, now, wall)
                self._input_errors.pop(mid, None)
            except Exception as exc:  # noqa: BLE001 - one model's bad data must not stop the others
                # Its last good inputs stand, so Envoy keeps serving it as before: its cluster, endpoints
                # and route stay as a whole (never a route without its cluster, never a serving model
                # emptied for one bad record). A model never built is left out with its route, as
                # ResourceCache does. It is decided again with the next build, which any change brings.
                why = f"its endpoints could not be decided: {exc}"
                if self._input_errors.get(mid) != why:
                    log.exception("model %s: %s; keeping its last good configuration", mid, why)
                self._input_errors[mid] = why
                self.changes.put_back({mid}, changed_at)
                if mid in self._inputs:
                    inputs[mid] = self._inputs[mid]
        self._inputs = dict(inputs)
        for mid, (service, _) in self.registry.retiring.items():
            if mid not in inputs:
                inputs[mid] = ModelInputs(service, self.decisions.get(mid, ModelDecision(mid)), routed=False)
        snapshot = Snapshot.build(self._resources.build(inputs, self.ingress), changed_at=changed_at)
        self.picker_view = picker_view(inputs) if self._resources.affinity else {}
        self.metrics.build_seconds.observe(self._clock() - started)
        self.metrics.eds_endpoints.set(sum(len(d.endpoints) for d in self.decisions.values()))
        if self.snapshot is not None and self.snapshot.versions == snapshot.versions:
            return None
        self.snapshot = snapshot
        self.cache.set_snapshot(snapshot)
        log.debug("published snapshot %s (%d resources rebuilt)", dict(snapshot.versions), self._resources.rebuilt)
        return snapshot

    def _model_inputs(self, mid: str, entry: ModelEntry, dirty: bool, now: float, wall: float) -> ModelInputs:
        """One model's resource inputs: a new decision over its EDS records when it changed, split by build."""
        if dirty:
            service = entry.service
            records = self.registry.eds_records(mid, now)
            try:
                decision = self.policy.decide(service, records, wall)
            except Exception:
                log.exception("weight policy failed for model %s; using equal weights for this round", mid)
                decision = self._fallback.decide(service, records, wall)
            self.decisions[mid] = sanitize(decision, records)
            self.states[mid] = serving_state(records)
        decision = self.decisions.get(mid, ModelDecision(mid))
        generation = functools.partial(self.registry.generation, mid)
        split = split_by_build(entry, decision, wall, self.retire_s, generation)
        return dataclasses.replace(split, state=self.states.get(mid, "unavailable"))

    async def run(self) -> None:
        """Rebuild after each burst of changes, at most once per debounce window."""
        while True:
            await self.changes.wake.wait()
            await asyncio.sleep(self.debounce_s)
            self.changes.wake.clear()
            self.rebuild()

    def sweep(self) -> None:
        """Time-driven changes: staleness, EDS TTL, retiring models; and the registry gauges."""
        self.registry.sweep()
        now, wall = self._clock(), self._wall()
        for mid, entry in list(self.registry.models.items()):
            try:
                key = tuple(
                    (r.instance_id, wall - r.timestamp > STALE_AFTER_S) for r in self.registry.eds_records(mid, now)
                ) + (retire_stage(entry, wall, self.retire_s),)
                self._sweep_errors.pop(mid, None)
            except Exception as exc:  # noqa: BLE001 - the sweep task is fatal: one model must not end the process
                if self._sweep_errors.get(mid) != str(exc):
                    log.exception("sweeping model %s failed; its endpoints wait for its next change", mid)
                self._sweep_errors[mid] = str(exc)
                continue
            if self._eligibility.get(mid) != key:
                self._eligibility[mid] = key
                self.notify({mid})
        for gone in set(self._eligibility) - set(self.registry.models):
            del self._eligibility[gone]
        for gone in set(self._sweep_errors) - set(self.registry.models):
            del self._sweep_errors[gone]
        self._update_gauges(now)

    async def run_sweeps(self, interval_s: float = 0.5, lost_every_s: float = 0.1) -> None:
        """The full sweep every interval_s; lost nodes are looked for every lost_every_s, so a node is
        declared lost within that of its heartbeat timeout (bench.failover judges it to one heartbeat)."""
        waited = 0.0
        while True:
            await asyncio.sleep(lost_every_s)
            waited += lost_every_s
            if waited + 1e-9 >= interval_s:
                waited = 0.0
                self.sweep()
            else:
                self.registry.notice_lost_nodes()

    def _update_gauges(self, now: float) -> None:
        reg, m = self.registry, self.metrics
        m.models.set(len(reg.models))
        live = sum(1 for n in reg.nodes.values() if reg.node_live(n, now))
        m.nodes.labels("true").set(live)
        m.nodes.labels("false").set(len(reg.nodes) - live)
        m.node_event_counts(reg.node_event_counts)
        counts = {s.value: 0 for s in InstanceState}
        for tel in reg.telemetry.values():
            counts[tel.record.state.value] += 1
        for state, n in counts.items():
            m.instances.labels(state).set(n)
