"""Whether a node may run an instance of a model, and how well it fits there (pure; xds_server.placement).

A node is **eligible** when every constraint of the spec holds, checked in this order (the first that
fails is the refusal's reason):

1. `scheduling.nodeSelector`: every key=value is among the node's labels (node host `--labels`).
2. Taints: every NoSchedule/NoExecute taint of the node (`--taints`) is tolerated by one of the spec's
   `scheduling.tolerations`, matched as Kubernetes does (key, operator Equal/Exists, value, effect).
3. Tier: a spec naming `scheduling.tier` needs a GPU of that tier, or, for a model that asks for no GPU
   (no `min_gpu_memory_mb`, no GPU count, none measured: a scorer), CPU cores of that tier (the node
   host's `--tier-cpus`, the heartbeat's `cpu_tiers`); a tier in the node's P0-only tiers refuses P1/P2; a
   spec naming no tier is kept off P0-only GPUs (as the node host does). A failed GPU (the heartbeat's
   `failed`: Xid, ECC, device lost) takes nothing; a node whose every usable GPU failed is refused.
4. `backend.requires` against the node's facts (sie.requirements).
5. Memory, where both sides are known: the instance needs `need_mb` on each of `gpus` GPUs of its
   pool. A GPU's room is its high watermark less the ledger's level and what this placement already sent
   there. Room held by lower-priority instances counts too, as the node host may evict them (never for
   P2, never P0's); a fit that needs no eviction ranks first.

A node that reports no memory figures (an older node host) or a model whose need is unknown yet (no
`resources.min_gpu_memory_mb`, no instance running anywhere to measure) is eligible on 1-4 alone: the
node host then decides, as before. The score orders eligible nodes: fits without eviction, fits by
eviction, unknown; then the least room left on the GPUs it would use (binpack: fill a node before the
next).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sie.requirements import unmet_requirements
from sie.spec import ModelService, Priority, Toleration
from sie.wire import NodeHeartbeat


@dataclass(frozen=True)
class GpuView:
    index: int
    tier: str = ""
    room_mb: float | None = None  # high watermark less the ledger's level; None: the node does not say
    # MiB held by instances of each priority rank on this GPU (for eviction by a more important model).
    held_by_rank: Mapping[int, float] = field(default_factory=dict)
    failed: str = ""  # why the GPU is failed (Xid, ECC, lost); nothing is placed on it


@dataclass(frozen=True)
class NodeTraits:
    """What the node's heartbeat says about where instances may go on it."""

    gpus: tuple[GpuView, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[str, ...] = ()
    p0_only_tiers: frozenset[str] = frozenset()
    facts: Mapping[str, str] = field(default_factory=dict)
    cpu_tiers: frozenset[str] = frozenset()  # tiers with CPU cores reserved on the node (--tier-cpus)


@dataclass(frozen=True)
class Fit:
    """A node an instance may go to: its rank (smaller is better) and the GPUs it would take."""

    rank: tuple[int, float]  # (0 fits, 1 fits by eviction, 2 unknown; room left after, for binpack)
    gpus: tuple[int, ...]  # the GPUs the need is booked on (empty: unknown or no GPU need)
    why: str


@dataclass(frozen=True)
class Refused:
    why: str


def fit(svc: ModelService, need_mb: float | None, node: NodeTraits, booked: Mapping[int, float]) -> Fit | Refused:
    """How `svc`'s next instance fits on `node`, whose GPUs this placement already booked `booked` MiB on."""
    spec = svc.spec
    for key, value in sorted(spec.scheduling.node_selector.items()):
        if node.labels.get(key) != value:
            have = node.labels.get(key)
            return Refused(f"nodeSelector {key}={value}: the node has {key}={have}" if have else f"no label {key}")
    for taint in node.taints:
        t_key, t_value, effect = _parse_taint(taint)
        if effect != "PreferNoSchedule" and not any(
            _tolerates(t, t_key, t_value, effect) for t in spec.scheduling.tolerations
        ):
            return Refused(f"taint {taint} is not tolerated")
    everything, why = _pool(svc, node)
    if why:
        return Refused(why)
    tier = spec.scheduling.tier
    if tier is not None and not everything and (need_mb is not None or spec.resources.gpu_count > 0):
        return Refused(f"no GPU of tier {tier} (the node has CPU cores of it, for models that need no GPU)")
    unmet = unmet_requirements(spec.backend.requires, node.facts)
    if unmet:
        return Refused("; ".join(unmet))
    failed = _all_failed(everything)
    if failed and (need_mb is not None or spec.resources.gpu_count > 0):
        return Refused(failed)
    pool = [g for g in everything if not g.failed]
    count = max(1, spec.resources.gpu_count)
    if tier is not None and not everything:
        return Fit((2, 0.0), (), f"on the node's CPU cores of tier {tier}; needs no GPU")
    if need_mb is None or not pool or any(g.room_mb is None for g in pool):
        return Fit((2, 0.0), (), "memory not known: the node host decides")
    room = {g.index: (g.room_mb or 0.0) - booked.get(g.index, 0.0) for g in pool}
    free = sorted((g for g in pool if room[g.index] >= need_mb), key=lambda g: (room[g.index], g.index))
    if len(free) >= count:
        chosen = free[:count]
        left = min(room[g.index] for g in chosen) - need_mb
        return Fit((0, left), tuple(g.index for g in chosen), f"{need_mb:.0f} MiB fits on GPU {_list(chosen)}")
    rank = svc.spec.model.priority_level.rank
    if svc.spec.model.priority_level is not Priority.P2:
        evictable = {g.index: room[g.index] + sum(mb for r, mb in g.held_by_rank.items() if r > rank) for g in pool}
        by_eviction = sorted(
            (g for g in pool if evictable[g.index] >= need_mb), key=lambda g: (evictable[g.index], g.index)
        )
        if len(by_eviction) >= count:
            chosen = by_eviction[:count]
            return Fit(
                (1, min(evictable[g.index] for g in chosen) - need_mb),
                tuple(g.index for g in chosen),
                f"{need_mb:.0f} MiB fits on GPU {_list(chosen)} once lower priorities make way",
            )
    best = max(room.values())
    return Refused(f"needs {need_mb:.0f} MiB on {count} GPU(s); the most room is {max(best, 0.0):.0f} MiB")


def _pool(svc: ModelService, node: NodeTraits) -> tuple[Sequence[GpuView], str]:
    tier, p0 = svc.spec.scheduling.tier, svc.spec.model.priority_level is Priority.P0
    if tier is not None:
        if tier in node.p0_only_tiers and not p0:
            return (), f"tier {tier} is for P0 models only"
        pool = [g for g in node.gpus if g.tier == tier]
        return pool, "" if pool or tier in node.cpu_tiers else f"no GPU of tier {tier}"
    return [g for g in node.gpus if g.tier not in node.p0_only_tiers or p0], ""


def _all_failed(pool: Sequence[GpuView]) -> str:
    """Why none of the GPUs an instance may use can take it ("" when one is healthy or there are none)."""
    if not pool or any(not g.failed for g in pool):
        return ""
    return "every GPU it may use failed (" + "; ".join(f"GPU {g.index}: {g.failed}" for g in pool) + ")"


def _parse_taint(taint: str) -> tuple[str, str | None, str]:
    body, _, effect = taint.rpartition(":")
    key, sep, value = body.partition("=")
    return key, value if sep else None, effect


def _tolerates(t: Toleration, key: str, value: str | None, effect: str) -> bool:
    if t.effect is not None and t.effect != effect:
        return False
    if t.key is None:  # an empty key with Exists tolerates everything
        return t.operator == "Exists"
    if t.key != key:
        return False
    return t.operator == "Exists" or t.value == value


def _list(gpus: Sequence[GpuView]) -> str:
    return ",".join(str(g.index) for g in gpus)


def traits_of(hb: NodeHeartbeat) -> NodeTraits:
    """A heartbeat's placement traits. A GPU's room is known only when the node reports both its
    ledger level and high watermark; what each priority holds comes from the instances it reports."""
    held: dict[int, dict[int, float]] = {}
    for report in hb.instances:
        if report.gpu_index is None or report.reserved_mb is None:
            continue
        # A spec not received yet (asked for, sie.wire) counts as P0's until it comes: placement never
        # plans to evict what it cannot rank.
        rank = _rank(report.spec) if report.spec is not None else Priority.P0.rank
        by_rank = held.setdefault(report.gpu_index, {})
        by_rank[rank] = by_rank.get(rank, 0.0) + report.reserved_mb
    gpus = tuple(
        GpuView(
            index=g.index,
            tier=g.tier,
            room_mb=None if g.reserved_mb is None or g.high_mb is None else g.high_mb - g.reserved_mb,
            held_by_rank=held.get(g.index, {}),
            failed=g.failed,
        )
        for g in hb.gpus
    )
    return NodeTraits(
        gpus, dict(hb.labels), tuple(hb.taints), frozenset(hb.p0_only_tiers), dict(hb.facts), frozenset(hb.cpu_tiers)
    )


def _rank(spec: Mapping[str, object]) -> int:
    """The priority rank a reported instance's spec names (P2's, the lowest, when it does not say)."""
    inner = spec.get("spec")
    model = inner.get("model") if isinstance(inner, dict) else None
    level = model.get("priority_level") if isinstance(model, dict) else None
    try:
        return Priority(level).rank
    except ValueError:
        return Priority.P2.rank
