"""Who makes way when a GPU needs memory: victim choice, pure.

Order (the first to go first):
  1. lowest priority (P2 before P1 before P0);
  2. no demand (nothing in flight or queued) before busy;
  3. cheapest to bring back (smallest wake cost);
  4. least recently used;
  then the instance id, so the choice is deterministic.
Victims are taken in that order until enough is freed, and no more.

Who may be a victim at all, for a requester of priority R (the requester has work waiting):
  * a LOADED instance of lower priority than R, busy or not;
  * a LOADED instance with no demand (nothing in flight or queued), whatever its priority, except that
    an idle P0 makes way only for another P0;
  * never a busy instance of R's priority or higher: work in progress never makes way for equal or
    lower-priority work. So P0 never makes way for P1/P2 at all.
Why idle instances of higher priority may go: the warm pool keeps idle instances awake in memory nobody
else needs. Were an idle P1 untouchable for a P2 with traffic, the warm pool would starve the P2 (it
did in bench/packing: SIE then needed as many GPUs as static reservation). Sleeping an idle instance
loses no request; it costs that instance a wake (seconds, from host memory) when its traffic returns,
and then it may evict the lower-priority one in turn. The order above still takes every lower-priority
candidate first.
Instances that are loading (mid-allocation) or already sleeping free nothing and are never chosen.

"Freeing" means putting the victim to sleep: it keeps its residue (`Entry.residue_mb`) on the GPU, so
what it frees is `Entry.releasable_mb`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from node_host.ledger import Entry, EntryState, GPULedger, Refusal, Shortfall
from sie.spec import Priority


@dataclass(frozen=True)
class Eviction:
    gpu_index: int
    need_mb: float
    victims: tuple[Entry, ...]  # in the order they should go

    @property
    def freed_mb(self) -> float:
        return sum(v.releasable_mb for v in self.victims)

    @property
    def instance_ids(self) -> tuple[str, ...]:
        return tuple(v.instance_id for v in self.victims)


def may_evict(victim: Entry, for_priority: Priority) -> bool:
    """The eligibility rule of the module docstring."""
    if victim.state is not EntryState.LOADED or victim.releasable_mb <= 0:
        return False
    if victim.priority.rank > for_priority.rank:
        return True
    if victim.demand:
        return False  # busy at equal or higher priority
    return victim.priority is not Priority.P0 or for_priority is Priority.P0


def victim_order(entry: Entry) -> tuple[int, bool, float, float, str]:
    """Sort key: the first in sorted order is the first to go."""
    return (-entry.priority.rank, entry.demand > 0, entry.wake_cost_s, entry.last_used, entry.instance_id)


def choose_victims(
    gpu: GPULedger,
    need_mb: float,
    *,
    for_priority: Priority,
    exclude: Iterable[str] = (),
) -> Eviction | Refusal:
    """Victims on `gpu` that together free at least `need_mb`, or a Refusal saying what is missing.

    `exclude` names instances that must stay (the requester itself when it is already on the GPU, or
    victims already promised on another GPU for the same request).
    """
    if need_mb <= 0:
        return Eviction(gpu.index, need_mb, ())
    excluded = set(exclude)
    eligible = sorted(
        (e for e in gpu.entries if e.instance_id not in excluded and may_evict(e, for_priority)), key=victim_order
    )
    chosen: list[Entry] = []
    freed = 0.0
    for victim in eligible:
        if freed >= need_mb:
            break
        chosen.append(victim)
        freed += victim.releasable_mb
    if freed >= need_mb:
        return Eviction(gpu.index, need_mb, tuple(chosen))
    return Refusal(
        _shortfall_reason(gpu, need_mb, freed, for_priority, eligible, excluded),
        shortfalls=(Shortfall(gpu.index, need_mb, freed),),
        candidates=(gpu.index,),
    )


def _shortfall_reason(
    gpu: GPULedger, need: float, freed: float, for_priority: Priority, eligible: list[Entry], excluded: set[str]
) -> str:
    def describe(e: Entry) -> str:
        activity = f"{e.demand} waiting" if e.demand else "idle"
        return f"{e.instance_id} ({e.priority.value}, {activity}, {e.releasable_mb:.0f} MiB)"

    can = ", ".join(describe(e) for e in eligible) or "none"
    kept = [
        e for e in gpu.entries if e.instance_id not in excluded and e not in eligible and e.state is EntryState.LOADED
    ]
    cannot = ", ".join(describe(e) for e in kept)
    text = (
        f"GPU {gpu.index} needs {need:.0f} MiB freed for a {for_priority.value} instance but evicting every eligible "
        f"instance frees only {freed:.0f} MiB (missing {need - freed:.0f} MiB); eligible: {can}"
    )
    if cannot:
        text += f"; kept: {cannot} (busy at equal or higher priority, or P0 for a lower priority: never make way)"
    return text
