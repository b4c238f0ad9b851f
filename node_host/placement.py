"""Where a new instance goes, pure: a Place, a NeedsEviction (with its victims), or a Refusal.

`place` checks, in this order, and stops at the first that fails:
  1. `backend.requires` against the node's facts (sie.requirements): a mismatch is a 409 with
     every unmet constraint named;
  2. tier: a spec naming `scheduling.tier` may only use GPUs of that tier; a tier listed as P0-only
     refuses P1/P2 with 409 and says so; a spec naming no tier may use any GPU outside P0-only tiers;
  3. size: an instance larger per GPU than any GPU of its pool admits under the high watermark is a 409
     (raising tp_size or lowering its budget is the fix; waiting is not);
  4. binpack: among GPUs with no load in progress, those where it fits under the high watermark, the
     fullest first (least room left after placing it), so a GPU fills before the next one opens;
     tp_size > 1 takes that many such GPUs;
  5. otherwise, rather than failing, the GPUs where evicting (victims.py) makes it fit, cheapest first:
     fewest busy victims, then victims of the lowest priority, then least total wake cost, then fewest
     victims. The answer is NeedsEviction; node_host has the victims' sidecars drain them, sleeps them,
     and asks again (the ledger re-checks admission on `reserve`);
  6. otherwise a 503 Refusal that names, per GPU, what is missing.

`plan_wake` answers the same question for a sleeping instance on the GPUs it already occupies, and
`plan_relief` for a GPU whose loaded instances grew (KV cache) above the high watermark.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from node_host.ledger import Entry, EntryState, GPULedger, Ledger, Refusal, wake_need_mb
from node_host.memory_estimate import MemoryEstimate
from node_host.victims import Eviction, choose_victims
from sie.requirements import unmet_requirements
from sie.spec import ModelService, Priority


@dataclass(frozen=True)
class PlacementRequest:
    instance_id: str
    model_id: str
    priority: Priority
    per_gpu_mb: float
    tp_size: int = 1
    tier: str | None = None
    requires: tuple[str, ...] = ()
    wake_cost_s: float = 0.0

    @classmethod
    def from_spec(
        cls, service: ModelService, instance_id: str, estimate: MemoryEstimate, *, wake_cost_s: float = 0.0
    ) -> PlacementRequest:
        spec = service.spec
        return cls(
            instance_id=instance_id,
            model_id=service.model_id,
            priority=spec.model.priority_level,
            per_gpu_mb=estimate.per_gpu_mb,
            tp_size=spec.backend.config.tp_size,
            tier=spec.scheduling.tier,
            requires=tuple(spec.backend.requires),
            wake_cost_s=wake_cost_s,
        )

    def entry(self, *, now: float = 0.0) -> Entry:
        """The ledger entry to `reserve` once the decision is a Place."""
        return Entry(
            instance_id=self.instance_id,
            model_id=self.model_id,
            priority=self.priority,
            estimate_mb=self.per_gpu_mb,
            last_used=now,
            wake_cost_s=self.wake_cost_s,
        )


@dataclass(frozen=True)
class Place:
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class NeedsEviction:
    gpu_indices: tuple[int, ...]
    evictions: tuple[Eviction, ...]  # one per GPU that needs room, victims in the order they should go

    @property
    def victims(self) -> tuple[str, ...]:
        """Every instance to put to sleep, once each (a tensor-parallel victim may appear on two GPUs)."""
        seen: dict[str, None] = {}
        for ev in self.evictions:
            for instance_id in ev.instance_ids:
                seen.setdefault(instance_id, None)
        return tuple(seen)


Decision = Place | NeedsEviction | Refusal


def place(
    ledger: Ledger,
    request: PlacementRequest,
    *,
    facts: Mapping[str, str | None],
    p0_only_tiers: Collection[str] = (),
) -> Decision:
    """Decide where `request` goes; see the module docstring for the order of the checks."""
    who = f"{request.model_id!r} ({request.priority.value})"
    unmet = unmet_requirements(request.requires, facts)
    if unmet:
        return Refusal(f"cannot place {who} on this node: " + "; ".join(unmet), status=409, retryable=False)

    pool = _pool(ledger, request, frozenset(p0_only_tiers))
    if isinstance(pool, Refusal):
        return pool
    if len(pool) < request.tp_size:
        return Refusal(
            f"{who} needs {request.tp_size} GPUs (tp_size) but its pool on this node has {len(pool)}; "
            "lower backend.config.tp_size or run it on a larger node",
            status=409,
            retryable=False,
            candidates=tuple(g.index for g in pool),
        )
    largest = max(ledger.high_mb(g) - g.headroom_mb for g in pool)
    if request.per_gpu_mb > largest:
        return Refusal(
            f"{who} needs {request.per_gpu_mb:.0f} MiB per GPU but the largest GPU of its pool admits {largest:.0f} MiB "
            "under the high watermark; raise backend.config.tp_size, or lower backend.config.max_total_tokens "
            "or resources.min_gpu_memory_mb",
            status=409,
            retryable=False,
            candidates=tuple(g.index for g in pool),
        )

    idle = [g for g in pool if g.loading is None]
    if len(idle) < request.tp_size:
        busy = ", ".join(f"GPU {g.index} ({g.loading.instance_id})" for g in pool if g.loading is not None)
        return Refusal(
            f"{who} must wait: one load at a time per GPU and {busy} are loading; retry when a load finishes",
            candidates=tuple(g.index for g in pool),
        )

    fits = sorted(
        (g for g in idle if ledger.room_mb(g) >= request.per_gpu_mb), key=lambda g: (ledger.room_mb(g), g.index)
    )
    if len(fits) >= request.tp_size:
        return Place(tuple(sorted(g.index for g in fits[: request.tp_size])))

    options: list[tuple[tuple, GPULedger, Eviction]] = []
    refusals: list[Refusal] = []
    for gpu in idle:
        need = request.per_gpu_mb - ledger.room_mb(gpu)
        choice = choose_victims(gpu, need, for_priority=request.priority, exclude={request.instance_id})
        if isinstance(choice, Refusal):
            refusals.append(choice)
        else:
            options.append((_eviction_cost(choice, gpu), gpu, choice))
    options.sort(key=lambda o: o[0])
    if len(options) >= request.tp_size:
        chosen = sorted(options[: request.tp_size], key=lambda o: o[1].index)
        return NeedsEviction(
            gpu_indices=tuple(o[1].index for o in chosen),
            evictions=tuple(o[2] for o in chosen if o[2].victims),
        )
    shortfalls = tuple(s for r in refusals for s in r.shortfalls)
    return Refusal(
        f"no room for {who} ({request.per_gpu_mb:.0f} MiB per GPU) even by evicting: "
        + " | ".join(r.reason for r in refusals),
        shortfalls=shortfalls,
        candidates=tuple(g.index for g in idle),
    )


def plan_wake(ledger: Ledger, instance_id: str) -> Place | NeedsEviction | Refusal:
    """Can a sleeping instance wake where it sleeps, and who must make way if not."""
    placed = ledger.placed(instance_id)
    if not placed or any(e.state is not EntryState.SLEEPING for _, e in placed):
        return Refusal(f"{instance_id!r} is not asleep in the ledger; nothing to wake", status=409, retryable=False)
    evictions = []
    for index, entry in placed:
        gpu = ledger.gpu(index)
        if gpu.loading is not None:
            return Refusal(
                f"waking {instance_id!r} must wait: GPU {index} is loading {gpu.loading.instance_id!r} (one load at a time per GPU)",
                candidates=(index,),
            )
        need = wake_need_mb(entry) - ledger.room_mb(gpu)
        choice = choose_victims(gpu, need, for_priority=entry.priority, exclude={instance_id})
        if isinstance(choice, Refusal):
            return Refusal(
                f"cannot wake {instance_id!r}: {choice.reason}", shortfalls=choice.shortfalls, candidates=(index,)
            )
        if choice.victims:
            evictions.append(choice)
    indices = tuple(i for i, _ in placed)
    return NeedsEviction(indices, tuple(evictions)) if evictions else Place(indices)


def plan_relief(ledger: Ledger, gpu_index: int, grower: str) -> Eviction | Refusal:
    """Victims that bring `gpu_index` back under its high watermark after `grower` grew (KV cache).

    Chosen as if `grower` were asking for the room, so its growth never evicts a higher priority.
    """
    gpu = ledger.gpu(gpu_index)
    entry = gpu.entry(grower)
    if entry is None:
        return Refusal(f"{grower!r} is not on GPU {gpu_index}", status=409, retryable=False)
    over = gpu.level_mb - ledger.high_mb(gpu)
    return choose_victims(gpu, over, for_priority=entry.priority, exclude={grower})


def _pool(ledger: Ledger, request: PlacementRequest, p0_only: frozenset[str]) -> list[GPULedger] | Refusal:
    """The healthy GPUs the request may use (its tier's, or any but P0-only ones); a Refusal when none."""
    pool = _tier_pool(ledger, request, p0_only)
    if isinstance(pool, Refusal):
        return pool
    healthy = [g for g in pool if not g.failed]
    if not healthy:
        failed = "; ".join(f"GPU {g.index}: {g.failed}" for g in pool)
        return Refusal(
            f"every GPU {request.model_id!r} may use on this node failed ({failed}); it runs on another node",
            status=409,
            retryable=False,
        )
    return healthy


def _tier_pool(ledger: Ledger, request: PlacementRequest, p0_only: frozenset[str]) -> list[GPULedger] | Refusal:
    who = f"{request.model_id!r} ({request.priority.value})"
    if request.tier is None:
        pool = [g for g in ledger.gpus if g.tier not in p0_only]
        if not pool:
            return Refusal(
                f"{who} names no scheduling.tier and every GPU on this node is in a P0-only tier "
                f"({', '.join(sorted(p0_only))}); set scheduling.tier or run it on another node",
                status=409,
                retryable=False,
            )
        return pool
    if request.tier in p0_only and request.priority is not Priority.P0:
        return Refusal(
            f"tier {request.tier!r} is reserved for P0 models and {who} is {request.priority.value}; "
            "set model.priority_level to P0 or choose another scheduling.tier",
            status=409,
            retryable=False,
        )
    pool = [g for g in ledger.gpus if g.tier == request.tier]
    if not pool:
        tiers = sorted({g.tier for g in ledger.gpus if g.tier}) or ["none"]
        return Refusal(
            f"{who} asks for tier {request.tier!r} but this node has no GPU in it (its tiers: {', '.join(tiers)})",
            status=409,
            retryable=False,
        )
    return pool


def _eviction_cost(choice: Eviction, gpu: GPULedger) -> tuple:
    victims = choice.victims
    busy = sum(1 for v in victims if v.demand > 0)
    most_important = min((v.priority.rank for v in victims), default=len(Priority))
    return (busy, -most_important, sum(v.wake_cost_s for v in victims), len(victims), choice.freed_mb, gpu.index)
