"""A CPU cap on processes by pid, for benchmarks that slow one real engine (bench/vllm_fleet.py):

    python -m bench.cpu_cap --fraction 0.333 [--period-ms 30] PID [PID ...]

lets the processes run for `fraction` of every period and holds them stopped (SIGSTOP) for the rest,
the way `cpulimit` does, until it is told to end (SIGTERM or SIGINT, which its starter sends; also
SIGTERM when its parent dies, sie.processes.die_with_parent), when it lets them run again (SIGCONT)
for good. A process that goes away meanwhile is dropped; when none is left it ends.

Why this and not the other ways to slow an engine for real:
  * cgroups' CPU quota (cpu.max, cpu.cfs_quota_us) needs root and a writable cgroup tree, which a
    benchmark on a shared machine or in a container cannot count on;
  * a busy loop sharing the engine's core takes that core from everything else scheduled there too (on
    a 2-core machine: Envoy, the sidecars, the load generator), so it slows the other instance's path as
    well, and what share the engine keeps is the scheduler's call (CFS favours a thread that slept);
  * SCHED_IDLE or nice only slow it while something else wants the core, i.e. by an unknown amount;
  * fewer `max_num_seqs` makes it queue, not compute slower, and needs a restart to change.
A stopped process uses no CPU at all, so everything else runs as fast as before, the engine gets its
fraction of wall time whatever else runs, and the cap starts and ends at a moment the benchmark picks
(mid-run, as bench/routing's simulated 3x slowdown does). The period is short (30 ms) against a
request (hundreds of ms), so a request sees an even slowdown, not a pause.

Runs as its own process so that its timing does not depend on the benchmark's event loop. A busy machine
wakes it late, which lengthens whichever phase it was sleeping in; so each stop lasts until the time held
stopped since the cap began is (1 - fraction) / fraction of the time let run (`stop_for`), and the
share holds over the run whatever the lateness (measured: 0.47-0.48 stopped instead of 2/3 under load
with fixed sleeps).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Iterable
from types import FrameType


class _End(Exception):
    pass


def duty(fraction: float, period_ms: float) -> tuple[float, float]:
    """(seconds running, seconds stopped) per period for a cap of `fraction` of the CPU."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if not period_ms > 0:
        raise ValueError(f"period_ms must be positive, got {period_ms!r}")
    period = period_ms / 1000
    return period * fraction, period * (1 - fraction)


def stop_for(ran_s: float, stopped_s: float, fraction: float) -> float:
    """How long the next stop lasts: until the time held stopped is (1 - fraction) / fraction of the time
    let run, both counted since the cap began (0 when it is already more)."""
    return max(0.0, ran_s * (1 - fraction) / fraction - stopped_s)


def _signal_all(pids: Iterable[int], sig: int) -> list[int]:
    """Signal each pid; the ones still there."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def run(pids: list[int], fraction: float, period_ms: float) -> int:
    running_s, stopped_s = duty(fraction, period_ms)

    def end(signum: int, frame: FrameType | None) -> None:
        raise _End

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    print(f"capping {pids} at {fraction:.3f} of the CPU ({period_ms:g} ms period)", flush=True)
    ran = held = 0.0
    try:
        while pids and stopped_s > 0:
            pids = _signal_all(pids, signal.SIGCONT)
            t0 = time.monotonic()
            time.sleep(running_s)
            pids = _signal_all(pids, signal.SIGSTOP)
            t1 = time.monotonic()
            ran += t1 - t0
            time.sleep(stop_for(ran, held, fraction))
            held += time.monotonic() - t1
        while pids:  # fraction 1, or nothing left: wait to be told to end
            time.sleep(1.0)
            pids = _signal_all(pids, 0)
    except _End:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _signal_all(pids, signal.SIGCONT)
    print("released", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_cap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, required=True, help="share of each period they may run, (0, 1]")
    parser.add_argument("--period-ms", type=float, default=30.0, help="length of one run + stop cycle (default 30)")
    parser.add_argument("pids", type=int, nargs="+")
    args = parser.parse_args(argv)
    try:
        duty(args.fraction, args.period_ms)
    except ValueError as exc:
        parser.error(str(exc))
    return run(args.pids, args.fraction, args.period_ms)


if __name__ == "__main__":
    sys.exit(main())
