"""Cluster-level placement: which node runs which model instance. Pure: values in, a placement out.

Rules, in order of precedence (they make a control-plane restart invisible to the data plane):

1. Every model wants `spec.desired_replicas` instances, named `<model_id>-<n>` for n = 0, 1, ... During
   a rollout a model has two builds (tracks), each wanting its own count: the stable one and the new
   one. A build's generation is in its instances' ids (`instance_ids`), so the two never share an id and
   an instance keeps its id when its build is promoted.
2. An instance a live node already reports is ADOPTED where it runs: never moved, restarted or renamed.
   If two live nodes report the same instance id (a node came back after its instances were re-placed),
   the one it was last placed on keeps it; otherwise the first node by name.
3. An instance placed on a live node that does not report it yet (the node is starting it) stays there.
4. Any other wanted instance goes to an eligible live node (xds_server.node_fit: nodeSelector, taints,
   tiers, `requires`, and GPU memory where the node and the model's need are known), chosen by:
   fewest instances of the same model there (replicas spread over nodes before they stack), then
   how it fits (without eviction, by evicting lower priorities, memory unknown), then binpack (the
   least room left on the GPUs it takes; fill a node before the next) or, where memory is unknown,
   the fewest instances; ties by node name. No eligible node: it is not placed, and its reason says
   what each node lacks.
5. Everything else a node reports (model deleted, replicas lowered, a stray id) is left out of that
   node's assignment, which tells the node host to stop it.

A model's need per GPU is its spec's `resources.min_gpu_memory_mb`, else what the node hosts' ledgers
hold for a running instance of it (`needs`, from the heartbeats), else unknown. The node host still has
the last word on GPU fit: it reports an instance it cannot fit as failed, with the reason.
Every instance's placement carries its reason (`Placement.reasons`), shown by the admin API.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from sie.spec import ModelService
from xds_server.node_fit import Fit, NodeTraits, Refused, fit


@dataclass(frozen=True)
class NodeView:
    """What placement needs to know about one node."""

    name: str
    live: bool
    reported: frozenset[tuple[str, str]]  # (instance_id, model_id) the node says it runs
    traits: NodeTraits = NodeTraits()  # labels, taints, GPUs and their room (node_fit)


@dataclass(frozen=True)
class Placement:
    by_instance: Mapping[str, str]  # instance_id -> node
    model_of: Mapping[str, str]  # instance_id -> model_id
    reasons: Mapping[str, str] = field(default_factory=dict)  # instance_id -> why it is where it is, or not placed
    unplaced: Mapping[str, str] = field(default_factory=dict)  # instance_id -> model_id: wanted, no node takes it
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # the GPUs booked for it (advisory)

    @cached_property
    def _by_model(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for iid in sorted(self.model_of):
            out.setdefault(self.model_of[iid], []).append(iid)
        return out

    def of_model(self, model_id: str) -> list[str]:
        """The model's placed instance ids, sorted."""
        return self._by_model.get(model_id, [])

    def for_node(self, node: str) -> list[str]:
        """The node's complete assignment: instance ids, sorted."""
        return sorted(iid for iid, n in self.by_instance.items() if n == node)


@dataclass(frozen=True)
class Track:
    """One build of a model and the instances it wants: its generation (0 for a model's first build,
    one more per rollout), a count, and how many of them are awake (an autoscaled model's warm pool
    sleeps, xds_server.autoscale.fleet_shape)."""

    generation: int
    replicas: int  # instances placed
    awake: int | None = None  # how many of them serve (the lowest numbered); the rest sleep. None: all

    def awake_ids(self, model_id: str) -> list[str]:
        return instance_ids(model_id, self.replicas if self.awake is None else self.awake, self.generation)


_GENERATION = re.compile(r"^[a-z0-9-]+\.g([0-9]{1,9})-[0-9]+$")


def instance_ids(model_id: str, replicas: int, generation: int = 0) -> list[str]:
    """Generation 0 keeps the plain `<model>-<n>`; generation g > 0 is `<model>.g<g>-<n>`. A model id
    is a DNS-1123 label (no dot), so the forms never collide across models."""
    stem = model_id if generation == 0 else f"{model_id}.g{generation}"
    return [f"{stem}-{n}" for n in range(replicas)]


def generation_of(instance_id: str) -> int:
    """The generation an instance id names: 0 for `<model>-<n>` and for ids SIE did not make (pods)."""
    match = _GENERATION.match(instance_id)
    return int(match.group(1)) if match else 0


def place(
    models: Mapping[str, ModelService],
    nodes: Mapping[str, NodeView],
    previous: Mapping[str, str],
    tracks: Mapping[str, Sequence[Track]] | None = None,
    needs: Mapping[str, float] | None = None,
) -> Placement:
    """The placement of every wanted instance on the live nodes.

    `previous` is the last placement (instance_id -> node); it keeps pending instances where they were
    sent. `tracks` gives a model's builds and their counts (default: generation 0, desired_replicas).
    `needs` gives the MiB per GPU measured for a model's running instances (the spec's
    min_gpu_memory_mb wins). Deterministic: the same inputs give the same placement.
    """
    live = sorted(name for name, view in nodes.items() if view.live)
    wanted: dict[str, str] = {}  # instance_id -> model_id
    # P0 first, so when nodes are unevenly loaded the most important models get the emptiest nodes.
    for model_id in sorted(models, key=lambda m: (models[m].spec.model.priority_level.rank, m)):
        builds = (tracks or {}).get(model_id) or [Track(0, models[model_id].spec.desired_replicas)]
        for track in builds:
            for iid in instance_ids(model_id, track.replicas, track.generation):
                wanted[iid] = model_id

    def need_of(model_id: str) -> float | None:
        declared = models[model_id].spec.resources.min_gpu_memory_mb
        return float(declared) if declared is not None else (needs or {}).get(model_id)

    reporters: dict[str, list[str]] = {}  # instance_id -> live nodes reporting it with the right model
    for name in live:
        for iid, model_id in nodes[name].reported:
            if wanted.get(iid) == model_id:
                reporters.setdefault(iid, []).append(name)

    by_instance: dict[str, str] = {}
    reasons: dict[str, str] = {}
    unplaced: dict[str, str] = {}
    for iid, where in reporters.items():
        before = previous.get(iid)
        by_instance[iid] = before if before in where else where[0]
        reasons[iid] = f"runs on {by_instance[iid]}"

    booked: dict[str, dict[int, float]] = {name: {} for name in live}  # MiB sent, not yet in the ledger

    booked_gpus: dict[str, tuple[int, ...]] = {}

    def book(iid: str, name: str, model_id: str, chosen: Fit) -> None:
        booked_gpus[iid] = chosen.gpus
        need = need_of(model_id) or 0.0
        for gpu in chosen.gpus:
            booked[name][gpu] = booked[name].get(gpu, 0.0) + need

    for iid in wanted:
        if iid not in by_instance and previous.get(iid) in live:
            name = by_instance[iid] = previous[iid]
            reasons[iid] = f"starting on {name}"
            kept = fit(models[wanted[iid]], need_of(wanted[iid]), nodes[name].traits, booked[name])
            if isinstance(kept, Fit):
                book(iid, name, wanted[iid], kept)

    load = {name: 0 for name in live}
    of_model: dict[tuple[str, str], int] = {}
    for iid, node in by_instance.items():
        load[node] += 1
        of_model[node, wanted[iid]] = of_model.get((node, wanted[iid]), 0) + 1
    for iid, model_id in wanted.items():
        if iid in by_instance:
            continue
        svc, need = models[model_id], need_of(model_id)
        fits: dict[str, Fit] = {}
        refusals: list[str] = []
        for name in live:
            outcome = fit(svc, need, nodes[name].traits, booked[name])
            if isinstance(outcome, Refused):
                refusals.append(f"{name}: {outcome.why}")
            else:
                fits[name] = outcome
        if not fits:
            reasons[iid] = "not placed: " + ("; ".join(refusals) if refusals else "no live node")
            unplaced[iid] = model_id
            continue

        target = min(fits, key=lambda name: _score(name, fits[name], of_model.get((name, model_id), 0), load[name]))
        by_instance[iid] = target
        reasons[iid] = f"placed on {target}: {fits[target].why}" + (
            f"; spread: {of_model[target, model_id]} of {model_id} there already"
            if of_model.get((target, model_id))
            else ""
        )
        book(iid, target, model_id, fits[target])
        load[target] += 1
        of_model[target, model_id] = of_model.get((target, model_id), 0) + 1

    return Placement(
        by_instance=by_instance,
        model_of={iid: wanted[iid] for iid in by_instance},
        reasons=reasons,
        unplaced=unplaced,
        gpus=booked_gpus,
    )


def _score(name: str, chosen: Fit, same_model: int, instances: int) -> tuple[int, int, float, str]:
    """Rule 4's order: spread, then how it fits, then binpack (or the fewest instances), then name."""
    kind, left = chosen.rank
    return (same_model, kind, left if kind < 2 else float(instances), name)
