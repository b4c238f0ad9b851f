"""CPU use over a window, from /proc (Linux): each watched process's cores, each core's busy share, and
the CPU that processes outside a given tree (this benchmark's) used meanwhile, another user of the
machine whose work is noise in the figures.

    before = cpu_snapshot({"envoy": pid, ...}, cpus=[0, 1], roots=[os.getpid()])
    ...
    cpu_use(before, cpu_snapshot(...))  -> {"cores_busy", "process_cores", "ours_cores", "others_cores"}
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from sie.processes import ProcStat, all_processes, descendants, proc_stat

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_ticks(pid: int) -> int | None:
    """utime + stime of a process (all its threads), in clock ticks; None when it is gone."""
    stat = proc_stat(pid)
    return None if stat is None else stat.ticks


def core_ticks(cpus: list[int]) -> dict[str, tuple[int, int, int]]:
    """Per core and for "all": (busy, total, in processes) jiffies from /proc/stat; "in processes" is user,
    nice and system time (busy less interrupts, softirqs and steal), which processes' own figures add to."""
    out: dict[str, tuple[int, int, int]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name == "cpu" or (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            v = [int(x) for x in values[:8]]
            idle = v[3] + v[4]  # idle + iowait
            out[name[3:] or "all"] = (sum(v) - idle, sum(v), v[0] + v[1] + v[2])
    return out


def tree(roots: list[int], procs: dict[int, ProcStat] | None = None) -> set[int]:
    """`roots` and every process below them."""
    procs = all_processes() if procs is None else procs
    return set(roots).union(*(descendants(root, procs) for root in roots))


def signal_tree(root: int, sig: int) -> None:
    """Send `sig` to `root` and every process below it, parents first (SIGSTOP freezes a whole `sie up`
    stack at once, SIGCONT thaws it); those gone meanwhile are skipped."""
    for pid in [root, *descendants(root)]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def tree_ticks(roots: list[int]) -> int:
    """CPU ticks of `roots` and every process below them (everything this benchmark started)."""
    procs = all_processes()
    return sum(procs[pid].ticks for pid in tree(roots, procs) if pid in procs)


def cpu_snapshot(pids: dict[str, int], cpus: list[int], roots: list[int]) -> dict[str, Any]:
    return {
        "at": time.monotonic(),
        "procs": {k: process_ticks(p) for k, p in pids.items()},
        "cores": core_ticks(cpus),
        "ours": tree_ticks(roots),
    }


def cpu_use(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Between two snapshots: each watched process's cores, each core's busy share, and the cores that
    processes this benchmark did not start used (another user of the machine: noise in the figures)."""
    seconds = after["at"] - before["at"]
    procs = {
        name: round((after["procs"][name] - ticks) / CLK_TCK / seconds, 3)
        for name, ticks in before["procs"].items()
        if ticks is not None and after["procs"].get(name) is not None
    }
    cores = {}
    for cpu, (busy, total, _) in before["cores"].items():
        busy2, total2, _ = after["cores"][cpu]
        if cpu != "all":
            cores[cpu] = round((busy2 - busy) / max(1, total2 - total), 3)
    in_processes = (after["cores"]["all"][2] - before["cores"]["all"][2]) / CLK_TCK / seconds
    ours = (after["ours"] - before["ours"]) / CLK_TCK / seconds
    return {
        "cores_busy": cores,
        "process_cores": procs,
        "ours_cores": round(ours, 3),
        "others_cores": round(max(0.0, in_processes - ours), 3),
    }
