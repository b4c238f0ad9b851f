"""Which CPU cores each instance's processes may run on: tier isolation on one machine.

The node host's `--tier-cpus gold=0` reserves cores for a tier. An instance whose spec names a tier with
reserved cores (`scheduling.tier: gold`) runs on exactly those cores; every other instance runs on the
shared pool: the cores this node host may use (its own affinity, which its children inherit) less every
tier's reserved cores. So a P0-only tier's models never share a core with the rest of the node's models,
and the rest never use the reserved cores. With no tier cores configured nothing is pinned.

Reserved cores alone do not isolate a tier: its requests also pass through processes no tier pins
(Envoy, and the clients), which the kernel runs wherever there is room, and with the shared cores full
of an LLM it runs them on the tier's. So, with tier cores configured, the shared pool's P1 and P2
instances run in the background (`shared_pool_sched: idle`, Linux's SCHED_IDLE, with their autogroup at
the lowest weight where the kernel groups by session: sie.processes; any ordinary process that wakes on
their core runs at once, and the kernel places such processes there as on an idle core),
and the node host runs itself on the shared pool (`sie up` does the same for Envoy and the control
plane). A P0 instance in the shared pool keeps the ordinary policy. bench/tiers measures what each
part buys.

The affinity is set in the child between fork and exec (sie.processes.popen_in_own_session), so every
thread and process the worker or sidecar later starts inherits it; setting it from outside afterwards
would move only the main thread. The same child gets OMP_NUM_THREADS, MKL_NUM_THREADS and
OPENBLAS_NUM_THREADS set to its number of cores (unless the node host's environment already sets them),
so a BLAS or OpenMP pool is not sized for cores the process may not use (on a shared core, threads
beyond it only contend). An engine's own thread setting still wins: the torch engine calls
torch.set_num_threads(backend.config.num_threads).

    plan = CpuPlan.build(allowed=os.sched_getaffinity(0), tiers=parse_tier_cpus("gold=0"))  # ValueError naming tier_cpus
    plan.cpus_for("gold")   -> frozenset({0})
    plan.cpus_for(None)     -> frozenset({1, ...})   (the shared pool)
    plan.share_for(None, Priority.P2) -> CpuShare(frozenset({1, ...}), background=True)
    CpuPlan.none().cpus_for("gold") -> None          (no tier cores: no affinity set)

Pure but for `share_of`, the shell's check after a spawn.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from sie.cpu_lists import format_cpu_list
from sie.processes import AUTOGROUP_NICE, autogroup_nice
from sie.spec import Priority

__all__ = ["THREAD_ENV", "CpuPlan", "CpuShare", "share_of", "thread_env"]

# The thread-pool sizes a worker's numeric libraries read at start: OpenMP (torch's intra-op pool when
# the engine does not set one, scikit-learn's), MKL and OpenBLAS (numpy's BLAS).
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class CpuShare:
    """What an instance's processes get of the CPU: the only cores they may use, and whether they run in
    the background (SCHED_IDLE, and where the kernel has autogroups, their autogroup at nice 19)."""

    cpus: frozenset[int]
    background: bool = False

    def describe(self) -> str:
        """'0-1', or '2-3 (background)'."""
        return format_cpu_list(self.cpus) + (" (background)" if self.background else "")


@dataclass(frozen=True)
class CpuPlan:
    """The node's cores by tier. `tiers` empty: no isolation, and `cpus_for` is None for everyone."""

    allowed: frozenset[int]
    """The cores this node host may use (its own affinity at start)."""

    tiers: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """Each tier's reserved cores (a subset of `allowed`, no two tiers sharing one)."""

    background_shared: bool = True
    """Whether the shared pool's P1/P2 instances run in the background (SCHED_IDLE) while tiers have
    cores (the node host's shared_pool_sched)."""

    @classmethod
    def none(cls) -> CpuPlan:
        return cls(allowed=frozenset())

    @classmethod
    def build(
        cls,
        allowed: frozenset[int] | set[int],
        tiers: Mapping[str, frozenset[int]],
        background_shared: bool = True,
    ) -> CpuPlan:
        """The plan for `tiers` on a node host allowed `allowed`; ValueError("tier_cpus: ...") naming the
        tier and the reason when a core does not exist for this process, two tiers share one, or the
        tiers leave the shared pool nothing."""
        allowed = frozenset(allowed)
        owner: dict[int, str] = {}
        for name, cpus in sorted(tiers.items()):
            if not cpus:
                raise ValueError(f"tier_cpus: tier {name!r} has no CPUs")
            unknown = cpus - allowed
            if unknown:
                raise ValueError(
                    f"tier_cpus: tier {name!r} asks for CPU {format_cpu_list(unknown)}, not among the CPUs this "
                    f"node host may use ({format_cpu_list(allowed)}; its affinity, `taskset -p` shows it)"
                )
            for cpu in sorted(cpus):
                if cpu in owner:
                    raise ValueError(
                        f"tier_cpus: CPU {cpu} is given to both tier {owner[cpu]!r} and tier {name!r}; "
                        "a core belongs to one tier"
                    )
                owner[cpu] = name
        if tiers and not allowed - set(owner):
            raise ValueError(
                f"tier_cpus: the tiers take every CPU this node host may use ({format_cpu_list(allowed)}), "
                "leaving none for the shared pool (instances on no tier, and the other tiers); leave at least one"
            )
        return cls(allowed=allowed, tiers=dict(tiers), background_shared=background_shared)

    @property
    def isolating(self) -> bool:
        return bool(self.tiers)

    @property
    def shared(self) -> frozenset[int]:
        """The shared pool: the allowed cores no tier reserves."""
        reserved: set[int] = set()
        for cpus in self.tiers.values():
            reserved |= cpus
        return self.allowed - reserved

    def cpus_for(self, tier: str | None) -> frozenset[int] | None:
        """The cores an instance of `tier` (its spec's scheduling.tier) may use; None: leave it unpinned."""
        if not self.tiers:
            return None
        if tier is not None and tier in self.tiers:
            return self.tiers[tier]
        return self.shared

    def share_for(self, tier: str | None, priority: Priority) -> CpuShare | None:
        """The cores of an instance of `tier` and `priority`, and whether it runs in the background (a P1
        or P2 instance in the shared pool, when background_shared); None: leave it as it is."""
        cpus = self.cpus_for(tier)
        if cpus is None:
            return None
        in_pool = tier is None or tier not in self.tiers
        return CpuShare(cpus, background=self.background_shared and in_pool and priority is not Priority.P0)

    def describe(self) -> dict[str, str]:
        """For logs and the node host's API: {tier: cpu list, ..., "shared": cpu list}."""
        if not self.tiers:
            return {}
        return {
            **{t: format_cpu_list(c) for t, c in sorted(self.tiers.items())},
            "shared": format_cpu_list(self.shared),
        }


def thread_env(cpus: frozenset[int] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The thread-pool sizes for a child pinned to `cpus`, leaving out those `environ` (the node host's
    own environment, which the child inherits) already sets; {} for an unpinned child."""
    if cpus is None:
        return {}
    return {name: str(len(cpus)) for name in THREAD_ENV if name not in environ}


def share_of(pid: int) -> CpuShare | None:
    """What the kernel says process `pid` (its main thread) may use now: its cores and whether it runs in
    the background (SCHED_IDLE, and where the kernel has autogroups, its autogroup at the lowest weight:
    sie.processes); None when it is gone."""
    try:
        cpus = frozenset(os.sched_getaffinity(pid))
        idle = os.sched_getscheduler(pid) == os.SCHED_IDLE
    except OSError:  # gone (ProcessLookupError), or not ours to read
        return None
    group = autogroup_nice(pid)
    return CpuShare(cpus, idle and (group is None or group == AUTOGROUP_NICE))


def least_used_core(used: Iterable[Iterable[int]], available: Iterable[int] | None = None) -> int:
    """The core of `available` (default: the cores this process may use) that the fewest of `used` (each
    an engine's cores) hold; the lowest-numbered among equals. For engines that bind their threads to the
    cores they are given (vLLM's CPU build: one server a core, FACTS), where two on one core halve both."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if not cores:
        raise ValueError("no core to choose from")
    counts = dict.fromkeys(cores, 0)
    for held in used:
        for core in held:
            if core in counts:
                counts[core] += 1
    return min(cores, key=lambda core: (counts[core], core))
