"""The node's GPU memory as the running node host keeps it: the ledger (ledger.py) and what feeds it.

What an instance asks of the GPUs (`gpu_need`):
  * nothing, when it has no GPU need: `resources.gpu_count == 0` and no `min_gpu_memory_mb`, and a
    backend that can run on the CPU (sklearn scorers, the CPU torch demo, a `sim` without a size).
    Such an instance is placed off-GPU and is never a victim;
  * otherwise a figure per GPU, from the first of: `resources.min_gpu_memory_mb` (source "spec"), the
    model directory's config.json through memory_estimate.py (source "config"), and, for the embedded
    backends only (torch, sim), DEFAULT_SMALL_MODEL_MB (source "default": a CUDA context plus a tiny
    model). SGLang without either figure is refused: guessing the size of a real LLM is how GPUs OOM.

`GPUManager.admit` turns placement.place's decision into what the node host does next: start it
(`Placed`, its memory already reserved as LOADING), make room first (`Evict`), try again later (`Wait`),
or never with this spec (`Refuse`, a 409). The figure held is the estimate until the instance has
loaded; then the measured one (NVML's per-process memory on real GPUs; on virtual GPUs nothing is
measured and the estimate stands, labelled so in the JSON view).

config.json is read only under the node's model roots (sie.model_files), only from a regular file and
only up to CONFIG_MAX_BYTES, and parsed with sie.strict_json: the model's files may be hostile (DESIGN
§10), and the read runs on the event loop, so it must neither block (a FIFO) nor take long (a huge file).
A real config.json (a few KiB) takes tens of microseconds; a pathological one at the cap (tens of thousands
of keys) up to a tenth of a second or two, once per admission decision, which the cap exists to bound.

Not thread-safe: it lives on the event loop. The ledger itself is immutable; this class only holds the
current value and the few facts around it (names, estimate sources).
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from node_host import ledger as ledger_ops
from node_host.ledger import EntryState, Ledger, Refusal, Watermarks
from node_host.memory_estimate import EstimateError, MemoryEstimate, estimate_for_spec
from node_host.placement import NeedsEviction, Place, PlacementRequest, place, plan_relief, plan_wake
from node_host.victims import Eviction
from sie import model_files, strict_json
from sie.errors import InputError, SpecError
from sie.model_files import ModelFilePolicy
from sie.requirements import unmet_requirements
from sie.spec import BackendType, ModelService, Priority
from sie.wire import GPUInfo

log = logging.getLogger(__name__)

# What a GPU instance of an embedded backend holds when its spec gives no figure and there is no
# config.json to compute one from: a CUDA context with cuBLAS workspaces (~0.5 GiB) plus a small model.
# Set resources.min_gpu_memory_mb for anything bigger.
DEFAULT_SMALL_MODEL_MB = 1024.0
# vLLM runs on a GPU when its spec asks for one (resources.gpus or min_gpu_memory_mb), else on the CPU (its CPU build).
_ALWAYS_GPU = {BackendType.SGLANG}
_DEFAULTABLE = {BackendType.TORCH, BackendType.SIM}
# A Hugging Face config.json is a few KiB (the largest multimodal ones tens of KiB); a bigger file is not one.
CONFIG_MAX_BYTES = 1024 * 1024

ReadConfig = Callable[[str | None], Mapping[str, Any] | None]

# Parsed config.json files by what identifies the file's content (path, device, inode, size, mtime):
# an instance waiting for memory is admitted again every supervision tick, and parsing a 1 MiB file
# takes ~25 ms of the node host's loop each time. A rewritten file has a new size or mtime (or inode).
_CONFIGS: dict[tuple[str, int, int, int, int], Mapping[str, Any]] = {}
_CONFIGS_KEPT = 64


@dataclass(frozen=True)
class Need:
    on_gpu: bool
    per_gpu_mb: float = 0.0
    tp_size: int = 1
    source: str = ""  # "spec", "config" or "default"


def read_model_config(path: str | None, files: ModelFilePolicy) -> Mapping[str, Any] | None:
    """The config.json in the model directory `path`, or None when there is none. Raises EstimateError
    for one this node may not or cannot read: outside the model roots, not a regular file, larger than
    CONFIG_MAX_BYTES, not bounded JSON."""
    if not path:
        return None
    try:
        real = model_files.resolve(Path(path) / "config.json", files)
    except SpecError as exc:
        raise EstimateError("cannot read its config.json: " + "; ".join(p.reason for p in exc.problems)) from None
    try:
        # Non-blocking, so that opening a FIFO returns at once (then refused as not a regular file);
        # no symlink, so that the file opened is the one resolve() put under a root.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise EstimateError(f"cannot read {real}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise EstimateError(f"{real} is not a regular file; a model's config.json must be one")
        key = (str(real), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if key in _CONFIGS:
            return _CONFIGS[key]
        data = _read_at_most(fd, CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise EstimateError(f"cannot read {real}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > CONFIG_MAX_BYTES:
        raise EstimateError(f"{real} is larger than {CONFIG_MAX_BYTES} bytes, too large for a config.json")
    try:
        config = strict_json.loads(data, what=str(real))
    except InputError as exc:
        raise EstimateError(str(exc)) from None
    if not isinstance(config, dict):
        raise EstimateError(f"{real} holds a JSON {type(config).__name__}, not an object")
    if len(_CONFIGS) >= _CONFIGS_KEPT:
        _CONFIGS.pop(next(iter(_CONFIGS)))  # the oldest
    _CONFIGS[key] = config = MappingProxyType(config)  # shared between calls: read-only
    return config


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def gpu_need(service: ModelService, read_config: ReadConfig) -> Need:
    """What `service` asks of the GPUs (see the module docstring). Raises EstimateError with the fix."""
    spec = service.spec
    backend = spec.backend.type
    declared = spec.resources.min_gpu_memory_mb
    if backend not in _ALWAYS_GPU and spec.resources.gpu_count == 0 and not declared:
        return Need(on_gpu=False)
    tp = spec.backend.config.tp_size
    if declared:
        return Need(True, estimate_for_spec(service, None).per_gpu_mb, tp, "spec")
    try:
        config = read_config(spec.model.path)
    except EstimateError as exc:
        if backend is not BackendType.SIM:
            raise
        # A simulator loads no model file, so its path may lie outside the model roots (the supervisor
        # lets it): a config.json the node may not read sizes it as no config.json does.
        log.debug("%s: %s; using the default size", service.model_id, exc)
        config = None
    if config is not None:
        estimate: MemoryEstimate = estimate_for_spec(service, config)
        return Need(True, estimate.per_gpu_mb, tp, "config")
    if backend in _DEFAULTABLE:
        return Need(True, DEFAULT_SMALL_MODEL_MB / tp, tp, "default")
    return Need(True, estimate_for_spec(service, None).per_gpu_mb, tp, "config")  # raises, naming the fields


# ---- admission outcomes -------------------------------------------------------------------------


@dataclass(frozen=True)
class OffGPU:
    """Runs without a GPU; nothing reserved."""


@dataclass(frozen=True)
class Placed:
    gpu_indices: tuple[int, ...]
    per_gpu_mb: float


@dataclass(frozen=True)
class Evict:
    """It fits once `victims` are asleep; nothing is reserved until they are."""

    decision: NeedsEviction

    @property
    def victims(self) -> tuple[str, ...]:
        return self.decision.victims


@dataclass(frozen=True)
class Wait:
    """Not now; the same spec may fit later (a load in progress, or memory that others hold)."""

    reason: str
    short_of_memory: bool  # False: only waiting for another load on the GPU to finish


@dataclass(frozen=True)
class Refuse:
    """Never with this spec on this node (tier, requirements, larger than any GPU): a 409."""

    reason: str
    status: int = 409


Admission = OffGPU | Placed | Evict | Wait | Refuse


class GPUManager:
    def __init__(
        self,
        gpus: list[GPUInfo],
        *,
        facts: Mapping[str, str | None],
        watermarks: Watermarks | None = None,
        tiers: Mapping[int, str] | None = None,
        p0_only_tiers: Collection[str] = (),
        files: ModelFilePolicy = ModelFilePolicy(),
        read_config: ReadConfig | None = None,
    ):
        """`files`: the node's model roots, the only place config.json is read from; `read_config`
        replaces the reading (tests)."""
        self.ledger = Ledger.from_gpus(gpus, tiers=tiers, watermarks=watermarks)
        self.gpus = {g.index: g for g in gpus}
        self.facts = dict(facts)
        self.p0_only_tiers = frozenset(p0_only_tiers)
        self._read_config = read_config or functools.partial(read_model_config, files=files)
        self.sources: dict[str, str] = {}  # instance id -> where its estimate came from

    # ---- decisions --------------------------------------------------------------------------------

    def admit(self, instance_id: str, service: ModelService, now: float) -> Admission:
        """Decide for a new instance, and reserve its memory (LOADING) when the answer is Placed."""
        if self.ledger.placed(instance_id):
            return Placed(tuple(i for i, _ in self.ledger.placed(instance_id)), self.held_mb(instance_id))
        who = f"{service.model_id!r} ({service.spec.model.priority_level.value})"
        try:
            need = gpu_need(service, self._read_config)
        except EstimateError as exc:
            return Refuse(f"cannot budget GPU memory for {who}: {exc}")
        if not need.on_gpu:
            unmet = unmet_requirements(service.spec.backend.requires, self.facts)
            if unmet:
                return Refuse(f"cannot run {who} on this node: " + "; ".join(unmet))
            tier = service.spec.scheduling.tier
            if tier in self.p0_only_tiers and service.spec.model.priority_level is not Priority.P0:
                # Off the GPUs a P0-only tier still means its CPU cores (node_host.cpus): P0 alone there.
                return Refuse(
                    f"tier {tier!r} is reserved for P0 models and {who} is not; "
                    "set model.priority_level to P0 or choose another scheduling.tier"
                )
            return OffGPU()
        if not self.ledger.gpus:
            return Refuse(
                f"{who} needs GPU memory ({need.per_gpu_mb:.0f} MiB per GPU, from the {need.source}) but this node "
                "reports no GPU; run it on a GPU node, or start the node host with --virtual-gpus to simulate one"
            )
        spec = service.spec
        request = PlacementRequest(
            instance_id=instance_id,
            model_id=service.model_id,
            priority=spec.model.priority_level,
            per_gpu_mb=need.per_gpu_mb,
            tp_size=need.tp_size,
            tier=spec.scheduling.tier,
            requires=tuple(spec.backend.requires),
        )
        decision = place(self.ledger, request, facts=self.facts, p0_only_tiers=self.p0_only_tiers)
        if isinstance(decision, Refusal):
            if not decision.retryable:
                return Refuse(decision.reason, decision.status)
            return Wait(decision.reason, short_of_memory=bool(decision.shortfalls))
        if isinstance(decision, NeedsEviction):
            return Evict(decision)
        assert isinstance(decision, Place)
        reserved = ledger_ops.reserve(self.ledger, decision.gpu_indices, request.entry(now=now))
        if isinstance(reserved, Refusal):  # place() and reserve() check the same rules; kept honest anyway
            return Wait(reserved.reason, short_of_memory=bool(reserved.shortfalls))
        self.ledger = reserved
        self.sources[instance_id] = need.source
        log.info(
            "placed %s (%s) on GPU %s: %.0f MiB per GPU (estimate from the %s)",
            instance_id,
            who,
            ",".join(map(str, decision.gpu_indices)),
            need.per_gpu_mb,
            need.source,
        )
        return Placed(decision.gpu_indices, need.per_gpu_mb)

    def fail_gpu(self, index: int, reason: str) -> tuple[str, ...]:
        """Mark GPU `index` failed (NVML: an Xid, uncorrected ECC errors, the device lost; or, for a virtual
        GPU, the node host's API). Returns the instances that hold memory on it: their workers are gone
        with it, and they must run elsewhere. Raises LedgerError for a GPU the node does not have."""
        gpu = self.ledger.gpu(index)
        if gpu.failed:
            return ()
        self.ledger = ledger_ops.fail(self.ledger, index, reason)
        log.error(
            "GPU %d failed: %s; its instances %s go elsewhere", index, reason, [e.instance_id for e in gpu.entries]
        )
        return tuple(e.instance_id for e in gpu.entries)

    def has_gpu(self, index: int) -> bool:
        return any(g.index == index for g in self.ledger.gpus)

    def failed_gpus(self) -> dict[int, str]:
        return {g.index: g.failed for g in self.ledger.gpus if g.failed}

    def wake_candidates(self) -> tuple[str, ...]:
        return ledger_ops.wake_candidates(self.ledger)

    def sleepers(self) -> tuple[tuple[str, str], ...]:
        """(instance id, model id) of every sleeping instance, once each."""
        seen: dict[str, str] = {}
        for gpu in self.ledger.gpus:
            for e in gpu.entries:
                if e.state is EntryState.SLEEPING:
                    seen.setdefault(e.instance_id, e.model_id)
        return tuple(seen.items())

    def fits_awake(self, instance_id: str) -> bool:
        """Whether it could wake now under the high watermark without anyone making way."""
        return isinstance(plan_wake(self.ledger, instance_id), Place)

    def relief(self) -> Eviction | None:
        """Victims that bring the first GPU above its high watermark back under it (loaded instances
        grew: KV cache, or a measured figure above the estimate). The grower is the entry that grew the
        most past its estimate, so its priority decides who may make way. None when nothing is over,
        or nothing may go (then it is logged, and the next measurement decides again)."""
        for index, over_mb in ledger_ops.over_high(self.ledger):
            gpu = self.ledger.gpu(index)
            loaded = [e for e in gpu.entries if e.state is EntryState.LOADED]
            if not loaded:
                continue
            grower = max(loaded, key=lambda e: (e.held_mb - e.estimate_mb, -e.priority.rank, e.instance_id))
            choice = plan_relief(self.ledger, index, grower.instance_id)
            if isinstance(choice, Refusal):
                log.warning(
                    "GPU %d is %.0f MiB over its high watermark and nothing may make way: %s", index, over_mb, choice
                )
                continue
            if choice.victims:
                return choice
        return None

    # ---- ledger steps (each keeps the ledger's invariants; see ledger.py) -------------------------

    def gpu_of(self, instance_id: str) -> int | None:
        """The (first) GPU the instance holds memory on; None for an off-GPU instance."""
        placed = self.ledger.placed(instance_id)
        return placed[0][0] if placed else None

    def holds(self, instance_id: str) -> bool:
        return bool(self.ledger.placed(instance_id))

    def state_of(self, instance_id: str) -> EntryState | None:
        placed = self.ledger.placed(instance_id)
        return placed[0][1].state if placed else None

    def held_mb(self, instance_id: str) -> float:
        placed = self.ledger.placed(instance_id)
        return placed[0][1].held_mb if placed else 0.0

    def engine_sizing(self, instance_id: str) -> dict[str, float]:
        """For an engine that sizes itself from the memory free when it starts (SGLang, vLLM): its budget
        per GPU (what the ledger reserved for it), the memory free on its GPU as the ledger sees it (the
        total less everything else held; one load at a time per GPU keeps that true while it starts), the
        GPU's total and how many GPUs it holds. Empty for an instance the ledger does not hold."""
        placed = self.ledger.placed(instance_id)
        if not placed:
            return {}
        index, entry = placed[0]
        gpu = self.ledger.gpu(index)
        return {
            "budget_mb": entry.awake_mb,
            "free_mb": gpu.total_mb - (gpu.level_mb - entry.held_mb),
            "total_mb": gpu.total_mb,  # vLLM sizes its start-up check as a fraction of the GPU's whole memory
            "gpus": len(placed),
        }

    def loaded(self, instance_id: str, measured_mb: Mapping[int, float] | None = None) -> None:
        if self.state_of(instance_id) is EntryState.LOADING:
            self.ledger = ledger_ops.mark_loaded(self.ledger, instance_id, measured_mb)

    def observe(
        self,
        instance_id: str,
        *,
        demand: int | None = None,
        last_used: float | None = None,
        measured_mb: Mapping[int, float] | None = None,
    ) -> None:
        if self.holds(instance_id):
            self.ledger = ledger_ops.observe(
                self.ledger, instance_id, demand=demand, last_used=last_used, measured_mb=measured_mb
            )

    def sleep(self, instance_id: str, residue_mb: float = 0.0) -> float:
        """Mark it asleep; returns the MiB per GPU that became free."""
        before = self.held_mb(instance_id)
        self.ledger = ledger_ops.sleep(self.ledger, instance_id, residue_mb)
        return before - self.held_mb(instance_id)

    def begin_wake(self, instance_id: str) -> Refusal | None:
        woken = ledger_ops.wake(self.ledger, instance_id)
        if isinstance(woken, Refusal):
            return woken
        self.ledger = woken
        return None

    def abort_wake(self, instance_id: str) -> None:
        """A wake that failed: the instance is still asleep; give the memory back."""
        if self.state_of(instance_id) is EntryState.LOADING:
            self.ledger = ledger_ops.mark_loaded(self.ledger, instance_id)
            self.ledger = ledger_ops.sleep(self.ledger, instance_id)

    def release(self, instance_id: str) -> None:
        if self.holds(instance_id):
            self.ledger = ledger_ops.release(self.ledger, instance_id)
        self.sources.pop(instance_id, None)

    # ---- views ------------------------------------------------------------------------------------

    def gpu_infos(self, real: list[GPUInfo] | None = None) -> list[GPUInfo]:
        """The heartbeat's GPU list, with the ledger's tier, level and high watermark for the control
        plane's placement. Virtual GPUs report the ledger's level as their use (there is nothing else to
        measure); real ones NVML's reading, when `real` is given."""
        measured = {g.index: g for g in real or []}
        out = []
        for g in self.ledger.gpus:
            info, seen = self.gpus[g.index], measured.pop(g.index, None)
            out.append(
                GPUInfo(
                    index=g.index,
                    name=info.name,
                    total_mb=seen.total_mb if seen else g.total_mb,
                    used_mb=seen.used_mb if seen else round(g.level_mb, 1),
                    utilization=seen.utilization if seen else info.utilization,
                    virtual=info.virtual,
                    tier=g.tier or "",
                    reserved_mb=round(g.level_mb, 1),
                    high_mb=round(self.ledger.high_mb(g), 1),
                    temperature_c=seen.temperature_c if seen else None,
                    failed=g.failed or (seen.failed if seen else ""),
                    # What sleeping instances still hold on it (their residue; part of reserved_mb).
                    sleeping_mb=round(sum(e.held_mb for e in g.entries if e.state is EntryState.SLEEPING), 1),
                )
            )
        return out + [measured[i] for i in sorted(measured)]  # NVML shows more than the ledger holds

    def reserved_mb(self, instance_id: str) -> float | None:
        """What the ledger holds for the instance over its GPUs; None when it is not in the ledger."""
        placed = self.ledger.placed(instance_id)
        return round(sum(e.held_mb for _, e in placed), 1) if placed else None

    def to_json(self) -> dict[str, Any]:
        led = self.ledger
        return {
            "watermarks": {"high": led.watermarks.high, "low": led.watermarks.low},
            "p0_only_tiers": sorted(self.p0_only_tiers),
            "gpus": [
                {
                    "index": g.index,
                    "name": self.gpus[g.index].name,
                    "virtual": g.virtual,
                    "tier": g.tier,
                    "total_mb": g.total_mb,
                    "headroom_mb": round(g.headroom_mb, 1),
                    "level_mb": round(g.level_mb, 1),
                    "high_mb": round(led.high_mb(g), 1),
                    "low_mb": round(led.low_mb(g), 1),
                    "room_mb": round(led.room_mb(g), 1),
                    "failed": g.failed,
                    "loading": g.loading.instance_id if g.loading else None,
                    "instances": [
                        {
                            "instance_id": e.instance_id,
                            "model_id": e.model_id,
                            "priority": e.priority.value,
                            "state": e.state.value,
                            "estimate_mb": round(e.estimate_mb, 1),
                            "estimate_source": self.sources.get(e.instance_id, "?"),
                            "measured_mb": None if e.measured_mb is None else round(e.measured_mb, 1),
                            "measured": "not measured: virtual GPU"
                            if g.virtual
                            else ("NVML" if e.measured_mb is not None else "not yet"),
                            "held_mb": round(e.held_mb, 1),
                            "demand": e.demand,
                        }
                        for e in g.entries
                    ],
                }
                for g in led.gpus
            ],
        }


def worker_gpu_memory(worker_pid: int, nvml: Any = None) -> dict[int, float] | None:
    """MiB per GPU held by the worker's processes (its session: SGLang forks a scheduler per rank, and
    NVML lists that child, not the launcher). None when NVML says nothing about them. Blocking: run it
    in an executor."""
    from node_host import gpus  # noqa: PLC0415 - NVML only on nodes with real GPUs

    try:
        rows = gpus.process_memory(nvml)
    except gpus.GPUInventoryError as exc:
        log.warning("cannot measure the memory of worker %d: %s", worker_pid, exc)
        return None
    out: dict[int, float] = {}
    for row in rows:
        if row.used_mb is not None and _session_of(row.pid) == worker_pid:
            out[row.gpu_index] = out.get(row.gpu_index, 0.0) + row.used_mb
    return out or None


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone, or another container's pid
        return None
