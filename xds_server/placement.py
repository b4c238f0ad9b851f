"""Cluster-level placement: which node runs which model instance. Pure: values in, a placement out.

Rules, in order of precedence (they make a control-plane restart invisible to the data plane):

1. Every model wants `spec.desired_replicas` instances, named `<model_id>-<n>` for n = 0, 1, ... During
   a rollout a model has two builds (tracks), each wanting its own count: the stable one and the new
   one. A build's generation is in its instances' ids (`instance_ids`), so the two never share an id and
   an instance keeps its id when its build is promoted. A count is not "ids 0..n-1": of the build's
   instances placed now (or, with nothing placed, those live nodes report) and the lowest free ids,
   the n closest to serving stay (`_keep`: ready, then loading, sleeping or starting, then failed or
   unplaceable, then the rest; ties by placed-before, then id), so a count that falls never stops a
   ready instance while one that is not stays, and the one it does stop drains (DESIGN §11). Of a
   track with a warm pool, the `awake` closest to serving serve, the same way; the rest sleep
   (`Placement.asleep`).
2. An instance a live node already reports is ADOPTED where it runs: never moved, restarted or renamed,
   unless that node says it cannot run it. A node's report counts only for what it was given (the
   instance placed there, handed over from there, or its home), or for an instance placed nowhere yet
   (a control plane that just restarted); any other claim is ignored and its copy dropped (`NodeView.unplaceable`: refused, short of memory with nothing
   it may evict, its GPU failed). If two live nodes report the same instance id (a node came back after
   its instances were re-placed), the one it was last placed on keeps it (with `rebalance="return"`, its
   home: the node it ran on before that node was lost); otherwise the first node by name.
3. An instance placed on a live node that does not report it yet (the node is starting it) stays there.
4. Any other wanted instance goes to an eligible live node (xds_server.node_fit: nodeSelector, taints,
   tiers, `requires`, and GPU memory where the node and the model's need are known; never a node that
   says it cannot run it), chosen by: fewest instances of the same model there (replicas spread over
   nodes before they stack), then how it fits (without eviction, by evicting lower priorities, memory
   unknown), then binpack (the least room left on the GPUs it takes; fill a node before the next) or,
   where memory is unknown, the fewest instances; ties by node name. No eligible node: it is not
   placed, and its reason says what each node lacks. A node that runs MAX_PLACED_PER_NODE instances
   is given no more (sie.wire: half what its heartbeat can report; what it runs already stays, rule 2).
   An instance its node cannot run moves only to a node where it fits without eviction; otherwise it
   waits where it is, and its reason says why.
5. Node loss (a node that is known but not live: its heartbeats stopped): its instances are placed again
   by rule 4 on the live nodes, under the same ids. The node they ran on is remembered as their HOME
   (`Placement.homes`). When the home is live again, `rebalance` decides: "none" leaves them where they
   are now (the home's copies are dropped), "return" places them back on the home when they fit there.
6. New before old: whenever an instance moves between live nodes (a return home, a copy reported twice,
   a move off a node that cannot run it... but there nothing runs), the node that serves it now keeps it
   in its assignment (`Placement.leaving`) until the node it is placed on reports it ready. Only then
   is the old copy dropped, so a move never leaves a gap.
7. Everything else a node reports (model deleted, replicas lowered, a stray id) is left out of that
   node's assignment, which tells the node host to stop it.

A model's need per GPU is its spec's `resources.min_gpu_memory_mb`, else what the node hosts' ledgers
hold for a running instance of it (`needs`, from the heartbeats), else unknown. The node host still has
the last word on GPU fit: it reports an instance it cannot fit as unplaceable, with the reason, and rule 4
moves it. Every instance's placement carries its reason (`Placement.reasons`), shown by the admin API.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from sie.spec import ModelService
from sie.wire import MAX_PLACED_PER_NODE
from xds_server.node_fit import Fit, NodeTraits, Refused, fit


@dataclass(frozen=True)
class NodeView:
    """What placement needs to know about one node."""

    name: str
    live: bool
    reported: frozenset[tuple[str, str]]  # (instance_id, model_id) the node says it runs
    traits: NodeTraits = NodeTraits()  # labels, taints, GPUs and their room (node_fit)
    ready: frozenset[str] = frozenset()  # the instance ids it reports ready (serving)
    failed: frozenset[str] = frozenset()  # the instance ids it reports failed
    unplaceable: Mapping[str, str] = field(default_factory=dict)  # instance id -> why the node cannot run it


@dataclass(frozen=True)
class Placement:
    by_instance: Mapping[str, str]  # instance_id -> node
    model_of: Mapping[str, str]  # instance_id -> model_id
    reasons: Mapping[str, str] = field(default_factory=dict)  # instance_id -> why it is where it is, or not placed
    unplaced: Mapping[str, str] = field(default_factory=dict)  # instance_id -> model_id: wanted, no node takes it
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # the GPUs booked for it (advisory)
    # instance_id -> the node it ran on before that node was lost (rule 5), while it runs elsewhere
    homes: Mapping[str, str] = field(default_factory=dict)
    # instance_id -> the node that keeps serving it until the node it is placed on reports it ready (rule 6)
    leaving: Mapping[str, str] = field(default_factory=dict)
    asleep: frozenset[str] = frozenset()  # placed, kept asleep: a warm pool's (rule 1)

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
        """The node's complete assignment: instance ids, sorted (those it hands over included, rule 6)."""
        return sorted(
            {iid for iid, n in self.by_instance.items() if n == node}
            | {iid for iid, n in self.leaving.items() if n == node}
        )

    def holds(self, instance_id: str, node: str) -> bool:
        """Whether `node` may serve the instance now: it is placed there, or hands it over from there."""
        return self.by_instance.get(instance_id) == node or self.leaving.get(instance_id) == node

    def awake(self, instance_id: str) -> bool:
        """Whether the instance should serve (False: kept asleep, the warm pool's)."""
        return instance_id not in self.asleep


@dataclass(frozen=True)
class Track:
    """One build of a model and the instances it wants: its generation (0 for a model's first build,
    one more per rollout), a count, and how many of them are awake (an autoscaled model's warm pool
    sleeps, xds_server.autoscale.fleet_shape)."""

    generation: int
    replicas: int  # instances placed
    awake: int | None = None  # how many of them serve (those closest to serving, rule 1). None: all

    def awake_ids(self, model_id: str) -> list[str]:
        """The ids that serve when no instance of the track runs yet (what `place` starts from); once some
        run, `Placement.asleep` says which sleep."""
        return instance_ids(model_id, self.replicas if self.awake is None else self.awake, self.generation)


Rebalance = Literal["none", "return"]
_FITS, _BY_EVICTION = 0, 1  # Fit.rank[0]: fits as it is; fits once lower priorities make way (node_fit)

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
    *,
    homes: Mapping[str, str] | None = None,
    rebalance: Rebalance = "none",
    previous_leaving: Mapping[str, str] | None = None,
) -> Placement:
    """The placement of every wanted instance on the live nodes.

    `previous` is the last placement (instance_id -> node); it keeps pending instances where they were
    sent. `tracks` gives a model's builds and their counts (default: generation 0, desired_replicas).
    `needs` gives the MiB per GPU measured for a model's running instances (the spec's
    min_gpu_memory_mb wins). `homes` is the last placement's `homes` (rule 5) and `rebalance` what
    happens when a home is live again. Deterministic: the same inputs give the same placement.
    """
    live = sorted(name for name, view in nodes.items() if view.live)
    standing = _standing(nodes, live, previous, homes or {}, previous_leaving or {})
    live_set = frozenset(live)
    placed_now, reported_now = _by_stem(previous), _by_stem(iid for iid, _ in standing)
    wanted: dict[str, str] = {}  # instance_id -> model_id
    asleep: set[str] = set()
    # P0 first, so when nodes are unevenly loaded the most important models get the emptiest nodes.
    for model_id in sorted(models, key=lambda m: (models[m].spec.model.priority_level.rank, m)):
        builds = (tracks or {}).get(model_id) or [Track(0, models[model_id].spec.desired_replicas)]
        for track in builds:
            stem = model_id if track.generation == 0 else f"{model_id}.g{track.generation}"
            known = placed_now.get(stem, {}), reported_now.get(stem, {})
            ids, sleeping = _keep(model_id, stem, track, known, standing, previous, live_set)
            wanted.update(dict.fromkeys(ids, model_id))
            asleep.update(sleeping)

    def need_of(model_id: str) -> float | None:
        declared = models[model_id].spec.resources.min_gpu_memory_mb
        return float(declared) if declared is not None else (needs or {}).get(model_id)

    def cannot(name: str, iid: str) -> str:
        return nodes[name].unplaceable.get(iid, "")

    # Homes of instances still away from them, on nodes the registry still knows (rule 5).
    home_of = {iid: h for iid, h in (homes or {}).items() if iid in wanted and h in nodes}
    for iid, before in previous.items():
        if iid in wanted and before in nodes and not nodes[before].live:
            home_of.setdefault(iid, before)  # its node was lost: it will run elsewhere for now

    # instance_id -> live nodes reporting it with the right model, that may: a node speaks only for what
    # it was given (DESIGN §10). An instance placed nowhere yet (a control plane that just restarted) may
    # be claimed by any node; one placed somewhere only by that node, by the node it is handed over from,
    # or by its home (a lost node that came back still running it).
    was_leaving = dict(previous_leaving or {})
    reporters: dict[str, list[str]] = {}
    for name in live:
        for iid, model_id in nodes[name].reported:
            last = previous.get(iid)
            given = last is None or name in (last, home_of.get(iid), was_leaving.get(iid))
            if wanted.get(iid) == model_id and given:
                reporters.setdefault(iid, []).append(name)

    by_instance: dict[str, str] = {}
    reasons: dict[str, str] = {}
    unplaced: dict[str, str] = {}
    leaving: dict[str, str] = {}
    stuck: dict[str, str] = {}  # instance_id -> the node that cannot run it (rule 4's last sentence)

    def hand_over(iid: str, chosen: str, holders: Sequence[str]) -> None:
        """Rule 6: a node that serves the instance now keeps it until `chosen` reports it ready."""
        if iid in nodes[chosen].ready:
            return
        serving = [n for n in holders if n != chosen and iid in nodes[n].ready]
        if serving:
            leaving[iid] = serving[0]

    for iid, holders in reporters.items():
        able = [n for n in holders if not cannot(n, iid)]
        if not able:
            stuck[iid] = holders[0]
            continue
        last, home = previous.get(iid), home_of.get(iid)
        if rebalance == "return" and home is not None and home in able:
            chosen = home
        else:
            chosen = last if last is not None and last in able else able[0]
        by_instance[iid] = chosen
        reasons[iid] = f"runs on {chosen}"
        if len(able) > 1:
            hand_over(iid, chosen, able)
            others = ", ".join(n for n in able if n != chosen)
            reasons[iid] += f"; the copy on {others} is dropped" + (" once this one serves" if iid in leaving else "")

    booked: dict[str, dict[int, float]] = {name: {} for name in live}  # MiB sent, not yet in the ledger

    booked_gpus: dict[str, tuple[int, ...]] = {}

    def book(iid: str, name: str, model_id: str, chosen: Fit) -> None:
        booked_gpus[iid] = chosen.gpus
        need = need_of(model_id) or 0.0
        for gpu in chosen.gpus:
            booked[name][gpu] = booked[name].get(gpu, 0.0) + need

    for iid in wanted:
        sent = previous.get(iid)
        if iid in by_instance or iid in stuck or sent is None or sent not in live:
            continue
        if not cannot(sent, iid):
            name = by_instance[iid] = sent
            reasons[iid] = f"starting on {name}"
            kept = fit(models[wanted[iid]], need_of(wanted[iid]), nodes[name].traits, booked[name])
            if isinstance(kept, Fit):
                book(iid, name, wanted[iid], kept)
        else:
            stuck[iid] = sent  # sent there, and the node says it cannot run it

    load = {name: 0 for name in live}
    of_model: dict[tuple[str, str], int] = {}
    for iid, node in by_instance.items():
        load[node] += 1
        of_model[node, wanted[iid]] = of_model.get((node, wanted[iid]), 0) + 1

    def best(iid: str, model_id: str, exclude: str = "") -> tuple[str | None, dict[str, Fit], list[str]]:
        svc, need = models[model_id], need_of(model_id)
        fits: dict[str, Fit] = {}
        refusals: list[str] = []
        for name in live:
            why_not = cannot(name, iid) if name != exclude else cannot(name, iid) or "it cannot run it"
            if not why_not and load[name] >= MAX_PLACED_PER_NODE:
                why_not = f"it runs {load[name]} instances, the most one node is given"
            outcome = Refused(why_not) if why_not else fit(svc, need, nodes[name].traits, booked[name])
            if isinstance(outcome, Refused):
                refusals.append(f"{name}: {outcome.why}")
            else:
                fits[name] = outcome
        if not fits:
            return None, fits, refusals
        target = min(fits, key=lambda name: _score(name, fits[name], of_model.get((name, model_id), 0), load[name]))
        return target, fits, refusals

    def put(iid: str, model_id: str, target: str, chosen: Fit, why: str) -> None:
        by_instance[iid] = target
        reasons[iid] = why + (
            f"; spread: {of_model[target, model_id]} of {model_id} there already"
            if of_model.get((target, model_id))
            else ""
        )
        book(iid, target, model_id, chosen)
        load[target] += 1
        of_model[target, model_id] = of_model.get((target, model_id), 0) + 1

    for iid, model_id in wanted.items():
        if iid in by_instance:
            continue
        if iid in stuck:
            where = stuck[iid]
            target, fits, _ = best(iid, model_id, exclude=where)
            if target is None or fits[target].rank[0] == _BY_EVICTION:
                # Nowhere it fits without making others way: it waits where it was sent, saying why.
                by_instance[iid] = where
                reasons[iid] = f"waiting on {where}: {cannot(where, iid)}; no other node has room for it"
                continue
            put(iid, model_id, target, fits[target], f"moved to {target} ({cannot(where, iid)} on {where})")
            continue
        target, fits, refusals = best(iid, model_id)
        if target is None:
            reasons[iid] = "not placed: " + ("; ".join(refusals) if refusals else "no live node")
            unplaced[iid] = model_id
            continue
        lost = home_of.get(iid)
        why = f"placed on {target}: {fits[target].why}"
        if lost is not None and lost != target:
            why += f"; in place of its copy on {lost}, a lost node"
        put(iid, model_id, target, fits[target], why)

    # Spread repair: a model whose instances all run on one node while another live node can take one
    # (nodes that joined after it was placed, or came back) gets one moved there, new before old.
    per_model: dict[str, list[str]] = {}
    for iid in by_instance:
        per_model.setdefault(wanted[iid], []).append(iid)
    for model_id, iids in sorted(per_model.items()):
        if len(iids) < 2 or len({by_instance[i] for i in iids}) > 1 or any(i in leaving for i in iids):
            continue
        crowded = by_instance[iids[0]]
        # A copy another node already serves (it came back still running it) moves at no cost.
        served = [
            (i, n)
            for i in sorted(iids)
            for n in reporters.get(i, ())  # only a copy it may claim
            if n != crowded and i in nodes[n].ready and not cannot(n, i) and load[n] < MAX_PLACED_PER_NODE
        ]
        if served:
            mover, there = served[0]
            load[crowded] -= 1
            of_model[crowded, model_id] -= 1
            by_instance[mover] = there
            reasons[mover] = f"spread: runs on {there} too; the copy on {crowded} is dropped"
            load[there] += 1
            of_model[there, model_id] = of_model.get((there, model_id), 0) + 1
            continue
        mover = max(iids, key=lambda i: (i not in nodes[crowded].ready, i))  # a pending one, else the last
        target, fits, _ = best(mover, model_id, exclude=crowded)
        if target is None or fits[target].rank[0] != _FITS:
            continue  # only where it is known to fit without anyone making way: moving is not free
        load[crowded] -= 1
        of_model[crowded, model_id] -= 1
        put(mover, model_id, target, fits[target], f"spread: moved from {crowded} to {target}: {fits[target].why}")
        if mover in nodes[crowded].ready:
            leaving[mover] = crowded
            reasons[mover] += f"; {crowded} serves it until then"

    if rebalance == "return":
        for iid, home in sorted(home_of.items()):
            now_on = by_instance.get(iid)
            if now_on is None or now_on == home or home not in live or cannot(home, iid):
                continue
            if load[home] >= MAX_PLACED_PER_NODE:
                reasons[iid] += f"; stays off its home {home} (it runs {load[home]} instances)"
                continue
            model_id = wanted[iid]
            back = fit(models[model_id], need_of(model_id), nodes[home].traits, booked[home])
            if not isinstance(back, Fit) or back.rank[0] == _BY_EVICTION:
                reasons[iid] += f"; stays off its home {home} (no room there)"
                continue
            load[now_on] -= 1
            of_model[now_on, model_id] -= 1
            put(iid, model_id, home, back, f"back on its home {home} (rebalance: return)")
            if iid in nodes[now_on].ready:
                leaving[iid] = now_on
                reasons[iid] += f"; {now_on} serves it until then"

    placed = {iid: wanted[iid] for iid in by_instance}
    return Placement(
        by_instance=by_instance,
        model_of={**placed, **{iid: wanted[iid] for iid in leaving}},
        reasons=reasons,
        unplaced=unplaced,
        gpus=booked_gpus,
        # With "none" a home that is live again has had its say: its instances stay where they are.
        homes={
            iid: h
            for iid, h in home_of.items()
            if by_instance.get(iid) not in (None, h) and (rebalance == "return" or not nodes[h].live)
        },
        leaving={iid: n for iid, n in leaving.items() if by_instance.get(iid) != n},
        asleep=frozenset(iid for iid in asleep if iid in by_instance),
    )


# How far an instance is from serving (rule 1's order): the lower, the sooner it is kept and woken.
_READY, _PRESENT, _FAILED, _ABSENT = 0, 1, 2, 3


def _standing(
    nodes: Mapping[str, NodeView],
    live: Sequence[str],
    previous: Mapping[str, str],
    homes: Mapping[str, str],
    leaving: Mapping[str, str],
) -> dict[tuple[str, str], int]:
    """(instance_id, model_id) -> how far it is from serving, as the live nodes that may speak for it
    say (rule 2: the node it was placed on, handed over from, or its home; any node for one placed
    nowhere). Ready, else present (loading, sleeping, draining), else failed (it failed, or its node
    cannot run it). Absent when no such node reports it (`_keep` counts one starting as present)."""
    out: dict[tuple[str, str], int] = {}
    for name in live:
        view = nodes[name]
        for iid, model_id in view.reported:
            last = previous.get(iid)
            if last is not None and name not in (last, homes.get(iid), leaving.get(iid)):
                continue
            if iid in view.ready:
                rank = _READY
            elif iid in view.failed or iid in view.unplaceable:
                rank = _FAILED
            else:
                rank = _PRESENT
            out[iid, model_id] = min(rank, out.get((iid, model_id), _ABSENT))
    return out


def _keep(
    model_id: str,
    stem: str,
    track: Track,
    known: tuple[Mapping[str, int], Mapping[str, int]],
    standing: Mapping[tuple[str, str], int],
    previous: Mapping[str, str],
    live: frozenset[str],
) -> tuple[list[str], list[str]]:
    """(kept, asleep): the track's instances to place, by id, and those of them kept asleep (rule 1).

    `known`: the ids with the track's stem placed now, and those the live nodes report (id -> n).
    Candidates: the track's instances placed now and its lowest `replicas` ids. Only when none is
    placed now (a control plane that just restarted, a new model) do other ids the live nodes report
    count too, so a restart adopts what serves; otherwise a node cannot add an id by claiming it."""
    placed, reported = known
    candidates = dict(placed)
    if not placed:
        candidates.update({iid: n for iid, n in reported.items() if (iid, model_id) in standing})
    for n in range(track.replicas):
        candidates.setdefault(f"{stem}-{n}", n)

    def order(iid: str) -> tuple[int, bool, int]:
        rank = standing.get((iid, model_id), _ABSENT)
        if rank == _ABSENT and previous.get(iid) in live:
            rank = _PRESENT  # placed on a live node that has not reported it yet: starting there
        return (rank, iid not in placed, candidates[iid])

    chosen = sorted(candidates, key=order)[: track.replicas]
    awake = len(chosen) if track.awake is None else track.awake
    return sorted(chosen, key=candidates.__getitem__), chosen[awake:]


def _by_stem(ids: Iterable[str]) -> dict[str, dict[str, int]]:
    """stem -> {id: n} of the ids spelt `<stem>-<n>` as instance_ids spells them (others are left out)."""
    out: dict[str, dict[str, int]] = {}
    for iid in ids:
        stem, _, tail = iid.rpartition("-")
        if stem and tail.isascii() and tail.isdigit() and len(tail) <= 9 and str(int(tail)) == tail:
            out.setdefault(stem, {})[iid] = int(tail)
    return out


def _score(name: str, chosen: Fit, same_model: int, instances: int) -> tuple[int, int, float, str]:
    """Rule 4's order: spread, then how it fits, then binpack (or the fewest instances), then name."""
    kind, left = chosen.rank
    return (same_model, kind, left if kind < 2 else float(instances), name)
