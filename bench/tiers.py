"""Tier isolation on one machine: a P0 scorer beside a loaded LLM, without and with SIE's tier cores (issue 16).

    python -m bench.tiers [--quick] [--repeats N] [--duration S] [--rate R]

Two `sie up` stacks, each a node host running the same pair of models (bench/tiers_setup.py): an LR
scorer (the sklearn demo scorer, P0, on the P0-only tier `gold`) and an LLM (the torch engine's demo
tiny random model, P1, one torch thread per core). Stack `shared` is SIE without tier cores (today's
default: every process may use every core). Stack `tiers` runs its node with `tier_cpus:
gold=<first core>`: its scorer's worker and sidecar run on that core alone; its LLM on the other cores,
SCHED_IDLE (a P1 in the shared pool); its node host, control plane and Envoy on the other cores too
(node_host/cpus.py). Both stacks are up for the whole run, but only one runs at a time: the other is
frozen (SIGSTOP of its whole process tree), so each scenario has the machine to itself and the scenarios
still interleave (each repeat runs them in a rotated order, so slow drifts of the shared machine fall on
all of them):

  a   stack shared: the scorer under open-loop Poisson load (--rate, 200 req/s), nothing else
  b   stack shared: the same, while its LLM is kept busy by a closed-loop generation load
  c   stack tiers: the same scorer load, while its LLM is kept busy the same way; the load generators
      run on the cores no tier reserves
  c0  (diagnostic, not in --quick) c with the load generators wherever the kernel puts them, the tier's
      core included
  a1  (diagnostic, not in --quick) stack tiers, the scorer alone: on its tier's core, the LLM idle.
      c/a splits into a1/a (what confining the scorer's sidecar and worker to one core costs) and
      c/a1 (what the LLM on the other cores still costs it: what CPU affinity does not isolate)

Requests take the normal SIE path: client -> Envoy -> the instance's sidecar -> its worker. Latency is
from the scheduled send time, over the measured window after a warm-up. The load generators are clients,
not SIE: the scorer's runs in this process, the LLM's in its own (bench/tiers_llm.py). The scorer's is
bench/rawhttp.py's open loop (pre-built requests on keep-alive connections, a few tens of microseconds
of CPU a request), not aiohttp's client (about 0.4 ms a request here, as much as the scorer's worker): a
client that slow measures itself, and in c it shares its core with the LLM. In a and b (no tier cores)
nothing pins them. In c they run on the cores no tier reserves, as any software that is not the tier's
should on a machine with reserved cores (SIE keeps its own processes there; other software is the
operator's to place, and a client would normally be on another machine); c0 shows what happens when they
are not kept off. Per run it also reads each core's busy share, each process's CPU, and the CPU that
processes this benchmark did not start used (another user of the machine: a run where that exceeds
--max-noise is run again, and said so in the JSON).

Judged (issue 16): with tiers, the scorer's p99 beside the loaded LLM is at most 1.3x its p99 alone
(c/a); no request failed. The no-tier figure (b/a) is reported beside it. Writes
bench/results/tiers.json and a table on stdout; exits 1 when a judged target fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import rawhttp
from bench.eviction import stop_stack
from bench.loadgen import schedule
from bench.proc_cpu import cpu_snapshot, cpu_use, signal_tree
from bench.stack import Urls, start_cluster
from bench.stats import Sample, summarize
from bench.tiers_report import QUICK, SCENARIOS, counted, judged, llm_figures, pooled, ratios, table
from bench.tiers_setup import SCENARIO, SCORER_SLA_MS, STACKS, cluster_docs
from sie.cpu_lists import format_cpu_list

RESULTS = Path(__file__).resolve().parent / "results"
LLM_LEAD_S = 3.0  # the LLM's load starts this long before the scorer's, so the engine is busy throughout
SETTLE_S = 2.0  # after a stack says it is up, before its first run (its first telemetry and pushes)


# ---- the stack ----------------------------------------------------------------------------------


async def processes(
    http: aiohttp.ClientSession, stack: str, urls: Urls, run_dir: Path
) -> tuple[dict[str, int], dict[str, str]]:
    """A stack's pids to watch ({"scorer-tiers.worker": pid, ..., "tiers.envoy": pid}) and each instance's
    cores as its node host reports them."""
    async with http.get(urls.admin + "/v1/status", headers=urls.headers) as resp:
        status = await resp.json()
    pids: dict[str, int] = {}
    cpus: dict[str, str] = {}
    for node in status["nodes"]:
        async with http.get(node["address"] + "/v1/instances", headers=urls.headers) as resp:
            for row in (await resp.json())["instances"]:
                cpus[row["model_id"]] = row.get("cpus") or "all"
                for role in ("worker", "sidecar"):
                    if (row.get(role) or {}).get("pid"):
                        pids[f"{row['model_id']}.{role}"] = row[role]["pid"]
    state = json.loads((run_dir / "sie.json").read_text())
    pids.update({f"{stack}.{name}": pid for name, pid in state["children"].items() if pid})
    return pids, cpus


BODIES = 512  # distinct scorer requests, built before a run and sent in turn


def scorer_body(i: int) -> dict:
    return {"text": f"wire transfer {i} to a new account, urgent, reference {i * 7919 % 100000}"}


async def run_scenario(
    scenario: str,
    repeat: int,
    urls: Urls,
    http: aiohttp.ClientSession,
    pids: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    # Other software is the operator's to keep off a tier's cores (SIE keeps its own off them): in the
    # tiered scenario the clients run on the other cores, this process (the scorer's) and the LLM's,
    # which inherits it; afterwards, and before anything else starts from here, every core again.
    clients = frozenset(args.cpus[1:]) if SCENARIO[scenario].clients_off_tier else frozenset(args.cpus)
    _pin_self(clients)
    try:
        run = await _run_scenario(scenario, repeat, urls, http, pids, args)
    finally:
        _pin_self(frozenset(args.cpus))
    return {**run, "clients_cpus": format_cpu_list(clients)}


def _pin_self(cpus: frozenset[int]) -> None:
    """Every thread of this process (threads it starts later inherit it, and so do its children)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


async def _run_scenario(
    scenario: str,
    repeat: int,
    urls: Urls,
    http: aiohttp.ClientSession,
    pids: dict[str, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    plan = SCENARIO[scenario]
    stack, scorer, llm = plan.stack, plan.scorer, plan.llm
    ingress = urls.envoy
    workdir: Path = args.workdir
    llm_out = workdir / f"llm-{scenario}-{repeat}.jsonl"
    llm_proc = None
    if llm is not None:
        with open(workdir / f"llm-{scenario}-{repeat}.log", "wb") as llm_log:
            llm_proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.tiers_llm",
                    "--url",
                    ingress,
                    "--model",
                    llm,
                    "--concurrency",
                    str(args.llm_concurrency),
                    "--duration-s",
                    str(LLM_LEAD_S + args.warmup + args.duration + 2.0),  # it outlasts the measured window
                    "--out",
                    str(llm_out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=llm_log,
            )
        pids = {**pids, "LLM load generator": llm_proc.pid}
        await asyncio.sleep(LLM_LEAD_S)
    snaps: dict[str, Any] = {}
    window: dict[str, float] = {}
    roots = [os.getpid()] + ([llm_proc.pid] if llm_proc is not None else [])  # sie up is this process's child

    async def mark_start() -> None:
        await asyncio.sleep(args.warmup)
        window["start"] = time.time()
        snaps["before"] = cpu_snapshot(pids, args.cpus, roots)

    marker = asyncio.create_task(mark_start(), name="window-start")
    try:
        host, port = ingress.removeprefix("http://").rsplit(":", 1)
        answered = await rawhttp.open_loop(
            host,
            int(port),
            [rawhttp.post(f"/v1/models/{scorer}/infer", json.dumps(scorer_body(i)).encode()) for i in range(BODIES)],
            schedule(args.rate, args.warmup + args.duration, args.seed + repeat),
        )
        samples = [
            Sample(*each)
            for each in zip(answered.scheduled_s, answered.latencies_s, answered.statuses, answered.instances)
        ]
        await marker
        snaps["after"] = cpu_snapshot(pids, args.cpus, roots)
        window["end"] = time.time()
    finally:
        marker.cancel()
        if llm_proc is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, llm_proc.wait, 90)
            except subprocess.TimeoutExpired:
                llm_proc.kill()
                llm_proc.wait()
    measured = [
        Sample(s.scheduled_s - args.warmup, s.latency_s, s.status, s.instance)
        for s in samples
        if s.scheduled_s >= args.warmup
    ]
    llm_rows = (
        [json.loads(line) for line in llm_out.read_text().splitlines() if line.strip()] if llm_out.exists() else []
    )
    run = {
        "scenario": scenario,
        "repeat": repeat,
        "stack": stack,
        "scorer_model": scorer,
        "llm_model": llm,
        "scorer": summarize(measured, SCORER_SLA_MS, args.duration).to_json(),
        "scorer_latencies_ms": [round(s.latency_s * 1000, 3) for s in measured if s.status == 200],
        "scorer_failed": sum(1 for s in measured if s.status != 200),
        "llm": llm_figures(llm_rows, window["start"], window["end"]) if llm is not None else None,
        "cpu": cpu_use(snaps["before"], snaps["after"]),
    }
    if llm_proc is not None and llm_proc.returncode not in (0, None):
        run["llm_load_exit"] = llm_proc.returncode
    return run


def _progress(run: dict[str, Any]) -> str:
    s, llm, cpu = run["scorer"], run["llm"], run["cpu"]
    text = (
        f"  {run['scenario']} #{run['repeat']}: scorer p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, "
        f"{s['requests']} requests, {run['scorer_failed']} failed"
    )
    if llm is not None:
        text += f"; LLM {llm['requests_per_s']:.2f} req/s, {llm['tokens_per_s']:.0f} tok/s, {llm['failed']} failed"
    cores = ", ".join(f"cpu{c} {b:.0%}" for c, b in cpu["cores_busy"].items())
    return text + f"; busy {cores}; other users of the machine {cpu['others_cores']:.2f} cores"


async def main_async(args: argparse.Namespace) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print(f"bench.tiers needs at least 2 CPUs (a tier's core and the rest); this process may use {cpus}")
        return 2
    args.cpus = cpus
    gold = format_cpu_list(cpus[:1])
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    instance_cpus: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
        args.workdir = Path(tmp)
        procs: dict[str, subprocess.Popen] = {}
        urls: dict[str, Urls] = {}
        try:
            for stack in STACKS:  # one after the other: on two cores, together they take longer
                workdir = args.workdir / stack
                workdir.mkdir()
                docs = cluster_docs(
                    stack, gold=gold, llm_threads=args.llm_threads, llm_concurrency=args.llm_concurrency
                )
                started = time.monotonic()
                procs[stack], urls[stack] = start_cluster(workdir, docs, timeout_s=300.0, name=stack)
                print(f"stack {stack} up in {time.monotonic() - started:.0f} s", flush=True)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
                pids: dict[str, int] = {"scorer load generator (this process)": os.getpid()}
                for stack in STACKS:
                    found, cores = await processes(http, stack, urls[stack], args.workdir / stack / "run")
                    pids.update(found)
                    instance_cpus.update(cores)
                await asyncio.sleep(SETTLE_S)
                for repeat in range(args.repeats):
                    order = (
                        args.scenarios[repeat % len(args.scenarios) :] + args.scenarios[: repeat % len(args.scenarios)]
                    )
                    for scenario in order:
                        stack = SCENARIO[scenario].stack
                        # One SIE on the machine at a time: the other stack is frozen meanwhile (SIGSTOP), so
                        # the stacks alternate run by run without a restart, and neither disturbs the other.
                        for name, proc in procs.items():
                            signal_tree(proc.pid, signal.SIGCONT if name == stack else signal.SIGSTOP)
                        await asyncio.sleep(SETTLE_S)  # a thawed stack catches up (heartbeats, telemetry)
                        for attempt in range(args.noise_retries + 1):
                            run = await run_scenario(scenario, repeat, urls[stack], http, pids, args)
                            run["attempt"] = attempt
                            run["noisy"] = run["cpu"]["others_cores"] > args.max_noise
                            runs.append(run)
                            print(_progress(run) + (" [noisy: run again]" if run["noisy"] else ""), flush=True)
                            await asyncio.sleep(1.0)  # the LLM's last requests drain
                            if not run["noisy"]:
                                break
        finally:
            for proc in procs.values():  # a frozen stack would not hear its stop
                signal_tree(proc.pid, signal.SIGCONT)
            for proc in procs.values():
                stop_stack(proc)
    print("cores per instance: " + ", ".join(f"{m} {c}" for m, c in sorted(instance_cpus.items())))

    chosen = {sc: counted(runs, sc) for sc in args.scenarios}
    figures = {sc: pooled(chosen[sc]) for sc in args.scenarios}
    noisy_figures = [sc for sc in args.scenarios if all(r["noisy"] for r in chosen[sc])]
    r = ratios(figures)
    checks = judged(figures, r, noisy_figures)
    print()
    print(table(figures, r))
    print()
    for c in checks:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")

    doc = {
        "benchmark": "tiers",
        "command": "python -m bench.tiers" + (" --quick" if args.quick else "") + _flags(args),
        "setup": {
            "stacks": {
                "shared": "sie up, one node host without tier cores (today's default: every process may use "
                "every core)",
                "tiers": f"sie up, one node host with tier_cpus gold={gold}: the gold tier's instances on core "
                f"{gold}; the shared pool (the other cores) holds the LLM (SCHED_IDLE: a P1 instance), the node "
                "host, xds_server and Envoy",
            },
            "models": {
                "scorer": "sklearn demo scorer (logistic regression), P0, scheduling.tier gold (P0-only)",
                "llm": f"torch engine, demo tiny random Qwen2-architecture model, P1, num_threads {args.llm_threads}",
            },
            "instance_cpus": instance_cpus,
            "scorer_load": f"open-loop Poisson {args.rate:g} req/s to /v1/models/<scorer>/infer through Envoy",
            "llm_load": f"closed loop, {args.llm_concurrency} clients, chat completions of 64 prompt words and "
            "max_tokens 64, through Envoy (bench/tiers_llm.py, its own process)",
            "generators": "a, b: not pinned; c: on the cores no tier reserves (as other software should be on a "
            "machine with reserved cores; SIE keeps its own there); c0: c with them not pinned",
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "repeats": args.repeats,
            "llm_lead_s": LLM_LEAD_S,
            "order": "both stacks up; the one not measured is frozen (SIGSTOP of its process tree, heartbeat "
            "timeout 3600 s so a frozen node host is not lost); each repeat runs the scenarios rotated by the "
            "repeat number; the scorer's figures pool every repeat's samples, the LLM's and the CPU figures are "
            "means",
            "scenarios": args.scenarios,
            "settle_s": SETTLE_S,
            "seed": args.seed,
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": cpus,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "noise": {
            "max_noise_cores": args.max_noise,
            "rule": "a run during which processes this benchmark did not start used more than max_noise_cores "
            "(another user of the machine) is marked noisy and run again, up to noise_retries times; a "
            "scenario's figures count its clean runs, or, if it has none, every run (listed in noisy_figures)",
            "noise_retries": args.noise_retries,
            "noisy_runs": sum(1 for run in runs if run["noisy"]),
            "noisy_figures": noisy_figures,
        },
        "results": figures,
        "ratios": r,
        "judged": checks,
        "runs": [{k: v for k, v in run.items() if k != "scorer_latencies_ms"} for run in runs],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tiers.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwrote {RESULTS / 'tiers.json'}")
    return 0 if all(c["holds"] for c in checks) else 1


def _flags(args: argparse.Namespace) -> str:
    return (
        f" --repeats {args.repeats} --duration {args.duration:g} --warmup {args.warmup:g} --rate {args.rate:g}"
        f" --llm-concurrency {args.llm_concurrency} --llm-threads {args.llm_threads} --max-noise {args.max_noise:g}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tiers", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="two repeats of a, b and c, 12 s each (about two and a half minutes)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="repeats of every scenario (default 3; 2 quick)")
    parser.add_argument("--duration", type=float, default=None, help="measured seconds per run (default 40; 12 quick)")
    parser.add_argument("--warmup", type=float, default=None, help="unmeasured seconds before (default 5; 3 quick)")
    parser.add_argument("--rate", type=float, default=200.0, help="the scorer's open-loop rate, req/s (default 200)")
    parser.add_argument("--llm-concurrency", type=int, default=8, help="the LLM's closed-loop clients (default 8)")
    parser.add_argument(
        "--llm-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="the LLM's torch intra-op threads (backend.config.num_threads; default one per core, as torch's own)",
    )
    parser.add_argument(
        "--max-noise",
        type=float,
        default=0.15,
        help="cores other users of the machine may take during a run before it is run again (default 0.15)",
    )
    parser.add_argument("--noise-retries", type=int, default=2, help="runs again of a noisy run (default 2)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.duration = args.duration or (12.0 if args.quick else 40.0)
    args.scenarios = QUICK if args.quick else SCENARIOS
    args.warmup = args.warmup if args.warmup is not None else (3.0 if args.quick else 5.0)
    if args.repeats < 1 or args.duration <= 0 or not 0 < args.rate <= 1000 or args.llm_concurrency < 1:
        parser.error("need --repeats >= 1, --duration > 0, 0 < --rate <= 1000 and --llm-concurrency >= 1")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
