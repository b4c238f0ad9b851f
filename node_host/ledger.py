"""The per-GPU memory ledger: what every instance holds on every GPU, as values.

Each GPU has a total, a headroom that is not ours (the driver, other tenants, what NVML showed as used
before node_host started), and one entry per instance on it. An entry holds its estimate until the
instance has loaded, then the measured figure (NVML's per-process memory), which later observations may
move (KV growth in engines that allocate as they go). A sleeping instance holds only its residue (a CUDA
context, ~0 when the engine releases everything); its weights wait in host memory.

Invariants the operations keep:
  * one load at a time per GPU: at most one LOADING entry per GPU (a wake is a load: it allocates);
  * nothing is reserved on, or woken on, a failed GPU (`fail`, sticky until the node host restarts);
  * admission within the high watermark: a reserve or wake succeeds only if the GPU's level (headroom
    plus what every entry holds) stays at or under `high x total` afterwards; otherwise a Refusal names
    the GPU, what was needed and what was there. Growth of a loaded instance is observed, not admitted,
    so a level may exceed the high watermark; `over_high` reports it and node_host picks victims.

Every operation returns a new Ledger; nothing is mutated. Sizes are MiB per GPU: an instance with
tp_size 2 has one entry on each of its two GPUs, each with its per-GPU share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from sie.errors import SIEError
from sie.spec import Priority
from sie.wire import GPUInfo


class LedgerError(SIEError, KeyError):
    """The caller asked about an instance the ledger does not hold, or in a state that forbids the step."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "ledger error"


class EntryState(str, Enum):
    LOADING = "loading"  # allocating: a fresh load, or a wake (resume)
    LOADED = "loaded"
    SLEEPING = "sleeping"  # released; holds only its residue on the GPU


@dataclass(frozen=True)
class Entry:
    instance_id: str
    model_id: str
    priority: Priority
    estimate_mb: float
    measured_mb: float | None = None
    state: EntryState = EntryState.LOADING
    last_used: float = 0.0  # monotonic seconds of the last request, as the caller's clock counts
    demand: int = 0  # requests in flight plus queued
    wake_cost_s: float = 0.0  # how long bringing it back takes (resume from host memory, or a reload)
    residue_mb: float = 0.0  # what it still holds while sleeping

    @property
    def awake_mb(self) -> float:
        return self.measured_mb if self.measured_mb is not None else self.estimate_mb

    @property
    def held_mb(self) -> float:
        return self.residue_mb if self.state is EntryState.SLEEPING else self.awake_mb

    @property
    def releasable_mb(self) -> float:
        """What putting it to sleep would free."""
        return max(0.0, self.held_mb - self.residue_mb)


@dataclass(frozen=True)
class GPULedger:
    index: int
    total_mb: float
    headroom_mb: float = 0.0
    entries: tuple[Entry, ...] = ()
    tier: str | None = None
    virtual: bool = False
    failed: str = ""  # why the GPU failed (Xid, ECC, lost, or failed through the API); "" while healthy

    @property
    def held_mb(self) -> float:
        return sum(e.held_mb for e in self.entries)

    @property
    def level_mb(self) -> float:
        """Everything on the GPU as the ledger sees it: headroom plus what each entry holds."""
        return self.headroom_mb + self.held_mb

    @property
    def loading(self) -> Entry | None:
        return next((e for e in self.entries if e.state is EntryState.LOADING), None)

    def entry(self, instance_id: str) -> Entry | None:
        return next((e for e in self.entries if e.instance_id == instance_id), None)


@dataclass(frozen=True)
class Watermarks:
    """Fractions of a GPU's total memory. Above `high`, node_host makes room; under `low`, sleepers may wake."""

    high: float = 0.90
    low: float = 0.75

    def __post_init__(self) -> None:
        if not 0.0 < self.low < self.high <= 1.0:
            raise ValueError(f"watermarks need 0 < low < high <= 1, got low={self.low} high={self.high}")


@dataclass(frozen=True)
class Shortfall:
    gpu_index: int
    needed_mb: float
    available_mb: float

    @property
    def missing_mb(self) -> float:
        return max(0.0, self.needed_mb - self.available_mb)

    def __str__(self) -> str:
        return (
            f"GPU {self.gpu_index} lacks {self.missing_mb:.0f} MiB "
            f"(needs {self.needed_mb:.0f}, has {self.available_mb:.0f} under the high watermark)"
        )


@dataclass(frozen=True)
class Refusal:
    """A decision not to do something, with the reason a person can act on.

    `status` is the HTTP status an API answers with: 409 when the request conflicts with the node (tier,
    requirements, too big for any GPU) and retrying will not help; 503 when memory or a load in progress
    is in the way and a later retry may succeed (`retryable`).
    """

    reason: str
    status: int = 503
    retryable: bool = True
    shortfalls: tuple[Shortfall, ...] = ()
    candidates: tuple[int, ...] = ()  # the GPUs that were considered

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Ledger:
    gpus: tuple[GPULedger, ...]
    watermarks: Watermarks = field(default_factory=Watermarks)

    @classmethod
    def from_gpus(
        cls,
        gpus: Iterable[GPUInfo],
        *,
        reserve_mb: float = 0.0,
        tiers: Mapping[int, str] | None = None,
        watermarks: Watermarks | None = None,
    ) -> Ledger:
        """A fresh ledger; each GPU's headroom is `reserve_mb` plus what NVML showed as used at start."""
        tiers = tiers or {}
        return cls(
            gpus=tuple(
                GPULedger(
                    index=g.index,
                    total_mb=g.total_mb,
                    headroom_mb=reserve_mb + g.used_mb,
                    tier=tiers.get(g.index),
                    virtual=g.virtual,
                )
                for g in gpus
            ),
            watermarks=watermarks or Watermarks(),
        )

    def gpu(self, index: int) -> GPULedger:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise LedgerError(f"no GPU {index} in the ledger (it has {[g.index for g in self.gpus]})")

    def high_mb(self, gpu: GPULedger) -> float:
        return self.watermarks.high * gpu.total_mb

    def low_mb(self, gpu: GPULedger) -> float:
        return self.watermarks.low * gpu.total_mb

    def room_mb(self, gpu: GPULedger) -> float:
        """What may still be admitted on `gpu` without crossing the high watermark."""
        return self.high_mb(gpu) - gpu.level_mb

    def placed(self, instance_id: str) -> tuple[tuple[int, Entry], ...]:
        """(gpu index, entry) for every GPU the instance is on; empty when it is not in the ledger."""
        return tuple((g.index, e) for g in self.gpus for e in g.entries if e.instance_id == instance_id)


def reserve(ledger: Ledger, gpu_indices: Iterable[int], entry: Entry) -> Ledger | Refusal:
    """Admit a new instance (state LOADING) on each of `gpu_indices`, holding the entry's figure on each."""
    indices = tuple(gpu_indices)
    if ledger.placed(entry.instance_id):
        return Refusal(
            f"instance {entry.instance_id!r} is already in the ledger; release it first", status=409, retryable=False
        )
    entry = replace(entry, state=EntryState.LOADING)
    refusal = _admission(ledger, indices, entry.instance_id, lambda gpu: entry.awake_mb)
    if refusal is not None:
        return refusal
    return _map(ledger, indices, lambda gpu: replace(gpu, entries=gpu.entries + (entry,)))


def wake(ledger: Ledger, instance_id: str) -> Ledger | Refusal:
    """SLEEPING -> LOADING on the same GPUs, admitted like a load (it allocates its memory again)."""
    placed = _require(ledger, instance_id, EntryState.SLEEPING, "wake")
    indices = tuple(i for i, _ in placed)
    refusal = _admission(ledger, indices, instance_id, lambda gpu: _wake_need_on(gpu, instance_id))
    if refusal is not None:
        return refusal
    return _update(ledger, instance_id, lambda e: replace(e, state=EntryState.LOADING))


def mark_loaded(ledger: Ledger, instance_id: str, measured_mb: float | Mapping[int, float] | None = None) -> Ledger:
    """LOADING -> LOADED; the measured figure (per GPU, or one figure for all its GPUs) replaces the estimate."""
    _require(ledger, instance_id, EntryState.LOADING, "mark loaded")

    def loaded(e: Entry, mb: float | None) -> Entry:
        return replace(e, state=EntryState.LOADED, measured_mb=mb if mb is not None else e.measured_mb)

    return _update_per_gpu(ledger, instance_id, measured_mb, loaded)


def observe(
    ledger: Ledger,
    instance_id: str,
    *,
    measured_mb: float | Mapping[int, float] | None = None,
    demand: int | None = None,
    last_used: float | None = None,
) -> Ledger:
    """Fold in what was seen: memory now held (KV growth), demand, last use. No admission: it already happened."""
    _require(ledger, instance_id, None, "observe")

    def apply(e: Entry, mb: float | None) -> Entry:
        return replace(
            e,
            measured_mb=mb if mb is not None and e.state is not EntryState.SLEEPING else e.measured_mb,
            demand=e.demand if demand is None else demand,
            last_used=e.last_used if last_used is None else last_used,
        )

    return _update_per_gpu(ledger, instance_id, measured_mb, apply)


def sleep(ledger: Ledger, instance_id: str, residue_mb: float = 0.0) -> Ledger:
    """LOADED -> SLEEPING, keeping `residue_mb` on each GPU (what the process still holds when released)."""
    _require(ledger, instance_id, EntryState.LOADED, "put to sleep")
    return _update(
        ledger, instance_id, lambda e: replace(e, state=EntryState.SLEEPING, residue_mb=residue_mb, demand=0)
    )


def release(ledger: Ledger, instance_id: str) -> Ledger:
    """Forget the instance on every GPU (it was stopped or unloaded), whatever its state."""
    _require(ledger, instance_id, None, "release")
    return Ledger(
        gpus=tuple(
            replace(g, entries=tuple(e for e in g.entries if e.instance_id != instance_id)) for g in ledger.gpus
        ),
        watermarks=ledger.watermarks,
    )


def fail(ledger: Ledger, index: int, reason: str) -> Ledger:
    """Mark GPU `index` failed (sticky: a failed GPU stays failed until the node host restarts). Its
    entries stay until their instances are stopped and released; nothing new is reserved or woken there."""
    gpu = ledger.gpu(index)
    if gpu.failed:
        return ledger
    return _map(ledger, (index,), lambda g: replace(g, failed=reason or "failed"))


def over_high(ledger: Ledger) -> tuple[tuple[int, float], ...]:
    """(gpu index, MiB over the high watermark) for each GPU above it."""
    return tuple((g.index, g.level_mb - ledger.high_mb(g)) for g in ledger.gpus if g.level_mb > ledger.high_mb(g))


def wake_candidates(ledger: Ledger) -> tuple[str, ...]:
    """Sleepers that could wake now and keep every GPU they are on under the LOW watermark.

    Ordered by demand (most waiting first), then priority, then most recently used. Waking under the
    low watermark only, and evicting at the high one, leaves a band between them so an instance is not
    put to sleep and woken again on every small change.
    """
    sleepers: dict[str, Entry] = {}
    for gpu in ledger.gpus:
        for e in gpu.entries:
            if e.state is EntryState.SLEEPING:
                sleepers.setdefault(e.instance_id, e)
    fit = []
    for instance_id, first in sleepers.items():
        gpus = [ledger.gpu(i) for i, _ in ledger.placed(instance_id)]
        if all(
            not g.failed and g.loading is None and g.level_mb + _wake_need_on(g, instance_id) <= ledger.low_mb(g)
            for g in gpus
        ):
            fit.append(first)
    fit.sort(key=lambda e: (-e.demand, e.priority.rank, -e.last_used, e.instance_id))
    return tuple(e.instance_id for e in fit)


def wake_need_mb(entry: Entry) -> float:
    """What waking adds on a GPU: the awake figure less the residue it already holds."""
    return max(0.0, entry.awake_mb - entry.residue_mb)


# --- helpers -------------------------------------------------------------------------------------


def _wake_need_on(gpu: GPULedger, instance_id: str) -> float:
    """`wake_need_mb` of the instance's entry on a GPU that `Ledger.placed` named for it."""
    entry = gpu.entry(instance_id)
    assert entry is not None, f"GPU {gpu.index} holds no entry for {instance_id!r}"
    return wake_need_mb(entry)


def _admission(
    ledger: Ledger, indices: tuple[int, ...], instance_id: str, need_of: Callable[[GPULedger], float]
) -> Refusal | None:
    if not indices:
        return Refusal(f"no GPU given for {instance_id!r}", status=409, retryable=False)
    shortfalls = []
    for index in indices:
        gpu = ledger.gpu(index)
        if gpu.failed:
            return Refusal(
                f"GPU {index} failed ({gpu.failed}): nothing loads or wakes there", status=409, retryable=False
            )
        busy = gpu.loading
        if busy is not None and busy.instance_id != instance_id:
            return Refusal(
                f"GPU {index} is loading {busy.instance_id!r}; one load at a time per GPU (each engine sizes itself "
                "from the memory free when it starts), retry when that load finishes",
                candidates=indices,
            )
        need = need_of(gpu)
        room = ledger.room_mb(gpu)
        if need > room:
            shortfalls.append(Shortfall(index, need, max(0.0, room)))
    if shortfalls:
        detail = "; ".join(str(s) for s in shortfalls)
        return Refusal(
            f"not enough GPU memory for {instance_id!r}: {detail}", shortfalls=tuple(shortfalls), candidates=indices
        )
    return None


def _require(ledger: Ledger, instance_id: str, state: EntryState | None, verb: str) -> tuple[tuple[int, Entry], ...]:
    placed = ledger.placed(instance_id)
    if not placed:
        raise LedgerError(f"cannot {verb} {instance_id!r}: the ledger does not hold it")
    if state is not None:
        wrong = [e.state.value for _, e in placed if e.state is not state]
        if wrong:
            raise LedgerError(f"cannot {verb} {instance_id!r}: it is {wrong[0]}, not {state.value}")
    return placed


def _map(ledger: Ledger, indices: tuple[int, ...], change: Callable[[GPULedger], GPULedger]) -> Ledger:
    chosen = set(indices)
    return Ledger(gpus=tuple(change(g) if g.index in chosen else g for g in ledger.gpus), watermarks=ledger.watermarks)


def _update(ledger: Ledger, instance_id: str, change: Callable[[Entry], Entry]) -> Ledger:
    return _update_per_gpu(ledger, instance_id, None, lambda e, _mb: change(e))


def _update_per_gpu(
    ledger: Ledger,
    instance_id: str,
    per_gpu: float | Mapping[int, float] | None,
    change: Callable[[Entry, float | None], Entry],
) -> Ledger:
    def figure(index: int) -> float | None:
        if isinstance(per_gpu, Mapping):
            return per_gpu.get(index)
        return per_gpu

    gpus = tuple(
        replace(g, entries=tuple(change(e, figure(g.index)) if e.instance_id == instance_id else e for e in g.entries))
        for g in ledger.gpus
    )
    return Ledger(gpus=gpus, watermarks=ledger.watermarks)
