"""Routing quality: SIE's weights against Envoy's own balancing, on the real stack, in one run (issue #3).

    python -m bench.routing [--quick] [--repeats N] [--duration S] [--load F] [--engine sim|vllm]

One model (examples/routing.yaml), four instances of the `sim` backend (a SIMULATOR of an SGLang
server's timing, each a real worker process behind a real sidecar), one xds_server and one Envoy per
run, composed fresh for every run (bench/routing_stack.py). Three modes, the same control plane with
different flags:

    rr   --policy equal --lb-policy round_robin      Envoy ROUND_ROBIN
    lr   --policy equal --lb-policy least_request    Envoy LEAST_REQUEST with equal weights
    sie  --policy sie   --lb-policy least_request    SIE as shipped: LEAST_REQUEST with SIE's pushed weights,
                                                     and prefix affinity (the endpoint picker) for this LLM

Two scenarios: (a) four equal instances; (b) one instance has a quarter of the KV budget from the
start, and another becomes 3x slower half-way through the measured part (POST /sim/config). The
instances are picked by position (the second slowed, the fourth short of KV); the policy knows
nothing of it.

Load: open-loop Poisson at `--load` x the fleet's nominal capacity (four equal instances; capacity from
the simulator's own core, bench/routing_workload.py), the same schedule and the same requests for every
mode (same seeds). A warm-up at the same rate precedes the measured part and is not counted. Latency is
from the scheduled send time. Runs are interleaved: each repeat runs every mode of a scenario in a
rotated order, so the shared machine's noise falls on all of them; figures are medians over repeats.

`--engine vllm` runs the same modes, load and scenario (b)'s mid-run slowdown on two real vLLM servers,
the slowdown a real CPU cap (bench/routing_vllm.py), and writes bench/results/routing-vllm.json.

Writes bench/results/routing.json (figures, setup, machine, ratios, the judged targets),
bench/results/routing.png (latency CDFs, and the slowed instance's share of traffic over time) and a
table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.loadgen import Load, run_load
from bench.routing_report import (
    MODE_NAMES,
    MODES,
    SCENARIOS,
    Run,
    judged,
    median_figures,
    per_instance,
    plot,
    ratios,
    share_after,
    table,
    weight_reaction,
)
from bench.routing_stack import RoutingStack
from bench.routing_workload import Mix, body, capacity_rps
from node_host.backends.sim.worker import sim_params_from_spec
from sie.cluster import load_cluster

RESULTS = Path(__file__).resolve().parent / "results"
CLUSTER_FILE = Path(__file__).resolve().parents[1] / "examples" / "routing.yaml"
FLAGS = {"rr": ("equal", "round_robin"), "lr": ("equal", "least_request"), "sie": ("sie", "least_request")}
SLOWDOWN = 3.0
KV_FRACTION = 0.25
SLOWED, SHORT_OF_KV = 1, 3  # instance positions in scenario (b)
TIMELINE_EVERY_S = 0.25


async def run_once(
    mode: str,
    scenario: str,
    repeat: int,
    *,
    workdir: Path,
    rate: float,
    warmup_s: float,
    duration_s: float,
    seed: int,
    mix: Mix,
    kv_tokens: int,
) -> Run:
    policy, lb_policy = FLAGS[mode]
    # SIE as shipped: its weights and, for this LLM model, prefix affinity (the endpoint picker). The
    # workload shares no prefix (routing_workload.body), so the picker places by load here.
    async with RoutingStack(
        workdir / f"{scenario}-{mode}-{repeat}", CLUSTER_FILE, policy=policy, lb_policy=lb_policy, picker=mode == "sie"
    ) as stack:
        ids = stack.instance_ids
        slow_at = warmup_s + duration_s / 2
        events: list[tuple[float, str]] = []
        if scenario == "b":
            await stack.sim_config(ids[SHORT_OF_KV], {"kv_tokens": int(kv_tokens * KV_FRACTION)})
            events.append((-warmup_s, f"{ids[SHORT_OF_KV]} kv_tokens {int(kv_tokens * KV_FRACTION)}"))
        started = time.perf_counter()
        timeline: list[tuple[float, dict]] = []
        pending: list[asyncio.Task] = []

        def on_tick(at: float) -> None:
            if scenario == "b" and not pending and at >= slow_at:
                pending.append(
                    asyncio.create_task(stack.sim_config(ids[SLOWED], {"slowdown": SLOWDOWN}), name="slowdown")
                )
                events.append((at - warmup_s, f"{ids[SLOWED]} slowdown {SLOWDOWN:g}x"))

        async def watch() -> None:
            while True:
                hosts = await stack.envoy_hosts()
                timeline.append((time.perf_counter() - started - warmup_s, hosts))
                await asyncio.sleep(TIMELINE_EVERY_S)

        load = Load(
            stack.ingress_url + "/generate",
            rate,
            warmup_s + duration_s,
            lambda i: body(stack.model_id, mix, seed, i),
            timeout_s=60.0,
            seed=seed,
        )
        watcher = asyncio.create_task(watch(), name="envoy-weights-watch")
        connector = aiohttp.TCPConnector(limit=0)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                samples = await run_load(load, session, on_tick=on_tick)
            await asyncio.gather(*pending)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    measured = [
        type(s)(s.scheduled_s - warmup_s, s.latency_s, s.status, s.instance)
        for s in samples
        if s.scheduled_s >= warmup_s
    ]
    return Run(mode, scenario, repeat, measured, duration_s, timeline, events)


def _progress(run: Run, sla_ms: float) -> str:
    s = run.summary(sla_ms)
    return (
        f"  {run.scenario} {run.mode:<4} #{run.repeat}: p50 {s.p50_ms:.0f} ms, p99 {s.p99_ms:.0f} ms, "
        f"SLA {s.sla_attainment:.2%}, {s.throughput_rps:.1f} req/s, errors {s.errors}, "
        f"share {', '.join(f'{k}={v:.1%}' for k, v in s.share.items())}\n    per instance "
        + ", ".join(
            f"{k}: n={v['n']} p50={v['p50_ms']:.0f} p99={v['p99_ms']:.0f}" for k, v in per_instance(run).items()
        )
    )


async def main_async(args: argparse.Namespace) -> int:
    service = load_cluster(CLUSTER_FILE).services[0]
    params = sim_params_from_spec(service)
    mix = Mix()
    capacity = capacity_rps(params, mix)
    rate = args.load * 4 * capacity
    sla_ms = service.spec.sla.p99_latency_ms
    ids = [f"{service.model_id}-{i}" for i in range(4)]
    print(
        f"capacity {capacity:.1f} req/s per instance (simulated), offered {rate:.1f} req/s "
        f"= {args.load:.0%} of 4; {args.repeats} repeat(s) x {len(SCENARIOS)} scenarios x {len(MODES)} modes, "
        f"{args.warmup:g} s warm-up + {args.duration:g} s measured each",
        flush=True,
    )
    load_before = os.getloadavg()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for repeat in range(args.repeats):
            for scenario in SCENARIOS:
                order = MODES[repeat % 3 :] + MODES[: repeat % 3]
                for mode in order:
                    run = await run_once(
                        mode,
                        scenario,
                        repeat,
                        workdir=Path(tmp),
                        rate=rate,
                        warmup_s=args.warmup,
                        duration_s=args.duration,
                        seed=args.seed + repeat,
                        mix=mix,
                        kv_tokens=params.kv_tokens,
                    )
                    runs.append(run)
                    print(_progress(run, sla_ms), flush=True)

    results = {
        sc: {m: median_figures([r for r in runs if (r.mode, r.scenario) == (m, sc)], sla_ms) for m in MODES}
        for sc in SCENARIOS
    }
    slow_at = args.duration / 2
    reaction = {
        r.mode + f"#{r.repeat}": {
            **weight_reaction(r, ids[SLOWED], slow_at),
            "share_of_slowed_after_slowdown": share_after(r, ids[SLOWED], slow_at),
            "share_of_slowed_from_2s_after": share_after(r, ids[SLOWED], slow_at + 2.0),
        }
        for r in runs
        if r.scenario == "b"
    }
    r = ratios(results)
    checks = judged(results, r)
    print()
    print(table(results, sla_ms))
    print()
    for name, value in r.items():
        print(f"{name}: {value}")
    for c in checks:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "routing",
        "command": "python -m bench.routing" + (" --quick" if args.quick else "") + _flags(args),
        "note": "the instances are the `sim` backend, a simulator of an SGLang server's timing, not a model",
        "setup": {
            "cluster_file": str(CLUSTER_FILE.relative_to(CLUSTER_FILE.parents[1])),
            "model": service.model_id,
            "instances": ids,
            "sim_params": params.to_json(),
            "request_mix": {"prompt_words": mix.prompt_words, "max_new_tokens": mix.max_new_tokens},
            "capacity_rps_per_instance": round(capacity, 2),
            "capacity_source": "simulator core, saturated backlog",
            "load_fraction": args.load,
            "rate_rps": round(rate, 2),
            "warmup_s": args.warmup,
            "duration_s": args.duration,
            "repeats": args.repeats,
            "seed": args.seed,
            "sla_p99_ms": sla_ms,
            "scenario_b": {
                "slowed": ids[SLOWED],
                "slowdown": SLOWDOWN,
                "slowdown_at_s": slow_at,
                "short_of_kv": ids[SHORT_OF_KV],
                "kv_tokens": int(params.kv_tokens * KV_FRACTION),
            },
            "modes": {
                m: {"name": MODE_NAMES[m], "xds_server_flags": f"--policy {FLAGS[m][0]} --lb-policy {FLAGS[m][1]}"}
                for m in MODES
            },
            "envoy_concurrency": 1,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "results": results,
        "ratios": r,
        "judged": checks,
        "reaction_b": reaction,
        "runs": [
            {
                "mode": x.mode,
                "scenario": x.scenario,
                "repeat": x.repeat,
                **x.summary(sla_ms).to_json(),
                "events": x.events,
                "per_instance": per_instance(x),
                "weights": [(round(t, 2), {k: v["weight"] for k, v in h.items()}) for t, h in x.timeline],
            }
            for x in runs
        ],
    }
    (RESULTS / "routing.json").write_text(json.dumps(doc, indent=1))
    plot(
        RESULTS / "routing.png",
        runs,
        sla_ms,
        ids[SLOWED],
        slow_at,
        f"bench.routing: 4 sim instances, {rate:.0f} req/s open loop ({args.load:.0%} of capacity), "
        f"{args.duration:g} s per run, {args.repeats} repeat(s); simulated engines",
    )
    print(f"\nwrote {RESULTS / 'routing.json'} and {RESULTS / 'routing.png'}")
    return 0


def _flags(args: argparse.Namespace) -> str:
    return f" --repeats {args.repeats} --duration {args.duration:g} --warmup {args.warmup:g} --load {args.load:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short repeat (a few minutes)")
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="the instances: four sim workers (default) or two real vLLM servers (bench/routing_vllm.py)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats of every mode x scenario (default 3; 1 quick)"
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="measured seconds per run (default 60; 20 quick, 45 quick vLLM)"
    )
    parser.add_argument(
        "--warmup", type=float, default=None, help="unmeasured seconds before (default 5; 2 quick, 5 quick vLLM)"
    )
    parser.add_argument("--load", type=float, default=0.5, help="offered load as a fraction of the fleet's capacity")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--probe", type=float, default=None, help="vLLM: seconds of the capacity probe (default 20; 10 quick)"
    )
    parser.add_argument("--out", type=Path, default=None, help="vLLM: default bench/results/routing-vllm.json")
    args = parser.parse_args(argv)
    vllm = args.engine == "vllm"
    args.repeats = args.repeats or (1 if args.quick else 3)
    # vLLM's runs are longer: two instances serve fewer requests a second, and a p99 needs a few hundred.
    args.duration = args.duration or ((45.0 if vllm else 20.0) if args.quick else 60.0)
    args.warmup = args.warmup if args.warmup is not None else ((5.0 if vllm else 2.0) if args.quick else 5.0)
    args.probe = args.probe or (10.0 if args.quick else 20.0)
    if not 0 < args.load < 1.5 or args.repeats < 1 or args.duration <= 0 or args.probe <= 0:
        parser.error("need 0 < --load < 1.5, --repeats >= 1, --duration > 0 and --probe > 0")
    if vllm:
        from bench import routing_vllm

        return asyncio.run(routing_vllm.main_async(args))
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
