"""Prefix-cache-aware routing: SIE with prefix affinity against Envoy's balancers and cache-blind SIE, on
a shared-prefix workload and a control workload with nothing shared.

    python -m bench.prefix [--quick] [--out PATH] [--workdir DIR] [--engine sim|vllm]

`--engine vllm` runs the same modes and workloads' shape on two real vLLM servers instead of the sim
(bench/prefix_vllm.py: its setup, sizes and judged targets) and writes bench/results/prefix-vllm.json.
What follows is the sim's run (`--engine sim`, the default).

FOUR `sim` INSTANCES behind their sidecars, xds_server and a real Envoy (bench/routing_stack.py, a
fresh stack per mode). The sim models SGLang's RadixAttention (node_host/backends/sim/prefix_cache.py):
cached prompt pages live in the KV budget, are evicted LRU, and a request prefills only its uncached
tokens. Prefill dominates, as it does for real LLMs: PREFILL_MS_PER_TOKEN per uncached token against a
few milliseconds per decode step.

Modes (one run, one after another):
  round_robin     Envoy ROUND_ROBIN, equal weights
  least_request   Envoy LEAST_REQUEST, equal weights
  sie             SIE's weights (LEAST_REQUEST over the pushed weights), cache-blind (prefix affinity off)
  sie_prefix      SIE's weights and prefix affinity (the endpoint picker, xds_server/picker: the instance
                  holding the prompt's longest prefix, under a bounded load)

Workloads (bench/prefix_workload.py): shared-prefix (G groups, each a long system prompt of its own that
is over 75% of every prompt's tokens, U users per group asking short questions) and control (the same
sizes, nothing shared). Per workload, LEAST_REQUEST's capacity is measured first (a closed-loop
saturation probe), then every mode is driven open loop (Poisson arrivals) at fractions of it, streamed.

Per mode, workload and rate: TTFT p50/p90/p99, end-to-end p99, output tokens per second, the instances'
prefix-cache hit rate (their own sglang:cache_hit_rate, /v1/loads) and each instance's share.

Targets (issue 15): at 80% of LEAST_REQUEST's capacity on the shared-prefix workload, sie_prefix has TTFT
p90 at most 0.3x LEAST_REQUEST's and no instance serves more than 1.5x the mean share; output throughput
at least 1.3x LEAST_REQUEST's where throughput is bounded by the servers (the highest rate, above
LEAST_REQUEST's capacity: below it both serve everything they are sent); on the control workload at 80%,
end-to-end p99 within 5% of LEAST_REQUEST's. Writes bench/results/prefix.json (with `judged`) and
prefix.png (TTFT p90 against rate per mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import prefix_guidellm
from bench.prefix_workload import Sample, Workload, closed_loop, stream_load
from bench.routing_stack import RoutingStack
from bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "chat"
INSTANCES = 4
CONCURRENT = 8  # resources.max_concurrent_requests per instance
PREFILL_MS_PER_TOKEN = 0.25
SIM = {
    "prefix_cache": True,
    "page_size": 16,
    "prefill_ms_per_token": PREFILL_MS_PER_TOKEN,
    "decode_base_ms": 8.0,
    "decode_ms_per_request": 0.5,
    "kv_tokens": 12288,
    "max_running_requests": 32,
    "admit_reserve_ratio": 0.3,
}
MODES: dict[str, tuple[str, ...]] = {
    "round_robin": ("--policy", "equal", "--lb-policy", "round_robin"),
    "least_request": ("--policy", "equal", "--lb-policy", "least_request", "--prefix-affinity", "false"),
    "sie": ("--policy", "sie", "--lb-policy", "least_request", "--prefix-affinity", "false"),
    "sie_prefix": ("--policy", "sie", "--lb-policy", "least_request", "--prefix-affinity", "true"),
}
JUDGED_FRACTION = 0.8
TTFT_RATIO = 0.3
THROUGHPUT_RATIO = 1.3
SHARE_RATIO = 1.5
CONTROL_P99_RATIO = 1.05


def cluster_doc(workload: Workload) -> dict[str, Any]:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"name": MODEL, "version": "1.0", "service_type": "llm"},
            "backend": {"type": "sim", "config": SIM},
            # 8 at a time per instance: what its KV budget holds of cache-missing prompts (8 x 1,302 tokens), so
            # an overload queues at the sidecar instead of thrashing the cache (retractions), for every mode.
            "resources": {"max_concurrent_requests": CONCURRENT},
            "sla": {"p99_latency_ms": 60000, "max_queue_time_ms": 60000, "min_replicas": INSTANCES},
            "routing": {"prefix_affinity": {"balance_factor": 1.5}},
        },
    }


async def cache_hit_rates(session: aiohttp.ClientSession, stack: RoutingStack) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for iid, url in stack.worker_urls.items():
        try:
            async with session.get(
                url + "/v1/loads", headers={"Authorization": f"Bearer {stack.worker_keys[iid]}"}
            ) as resp:
                out[iid] = (await resp.json()).get("cache_hit_rate")
        except (TimeoutError, aiohttp.ClientError, ValueError):
            out[iid] = None
    return out


def summary(samples: list[Sample], duration_s: float, instances: list[str]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200 and s.ttft_s is not None]
    ttft = [1000 * s.ttft_s for s in ok if s.ttft_s is not None]
    e2e = [1000 * s.e2e_s for s in ok]
    served = Counter(s.instance for s in ok)
    shares = {iid: served.get(iid, 0) / max(1, len(ok)) for iid in instances}
    mean = 1 / len(instances)
    return {
        "requests": len(samples),
        "ok": len(ok),
        "failed": len(samples) - len(ok),
        "ttft_p50_ms": round(percentile(ttft, 50), 1) if ttft else None,
        "ttft_p90_ms": round(percentile(ttft, 90), 1) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99), 1) if ttft else None,
        "e2e_p99_ms": round(percentile(e2e, 99), 1) if e2e else None,
        "output_tokens_per_s": round(sum(s.tokens for s in ok) / duration_s, 1),
        "shares": {k: round(v, 3) for k, v in shares.items()},
        "max_share_over_mean": round(max(shares.values()) / mean, 3) if ok else None,
    }


async def drained(stack: RoutingStack, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hosts = await stack.envoy_hosts()
        if hosts and all(h["active"] == 0 for h in hosts.values()):
            return
        await asyncio.sleep(0.2)


async def run_mode(
    work: Path,
    mode: str,
    workload: Workload,
    rates: list[float],
    duration_s: float,
    probe_s: float | None,
    guidellm_at: tuple[str, float] | None = None,
) -> dict[str, Any]:
    cluster = work / f"{mode}-{'shared' if workload.shared else 'control'}.yaml"
    cluster.write_text(yaml.safe_dump(cluster_doc(workload), sort_keys=False))
    stackdir = work / cluster.stem
    out: dict[str, Any] = {"rates": {}}
    async with RoutingStack(
        stackdir, cluster, policy="sie", lb_policy="least_request", xds_flags=MODES[mode], picker=mode == "sie_prefix"
    ) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            if probe_s is not None:
                # LEAST_REQUEST's capacity: completions per second of 64 back-to-back callers, after a
                # warm-up that fills the caches as steady traffic would.
                await closed_loop(session, stack.ingress_url, MODEL, workload, 64, probe_s / 3)
                out["capacity_rps"] = round(
                    await closed_loop(session, stack.ingress_url, MODEL, workload, 64, probe_s), 2
                )
                await drained(stack)
                return out
            first = 0
            for rate in rates:
                samples = await stream_load(session, stack.ingress_url, MODEL, workload, rate, duration_s, first)
                first += len(samples) + 1
                figures = summary(samples, duration_s, stack.instance_ids)
                figures["cache_hit_rate"] = await cache_hit_rates(session, stack)
                hits = [v for v in figures["cache_hit_rate"].values() if v is not None]
                figures["cache_hit_rate_mean"] = round(sum(hits) / len(hits), 3) if hits else None
                out["rates"][f"{rate:.2f}"] = figures
                print(
                    f"  {mode:<14} {rate:6.2f} req/s  TTFT p90 {figures['ttft_p90_ms']} ms  e2e p99 "
                    f"{figures['e2e_p99_ms']} ms  {figures['output_tokens_per_s']} tok/s  hit "
                    f"{figures['cache_hit_rate_mean']}  max share/mean {figures['max_share_over_mean']}",
                    flush=True,
                )
                await drained(stack)
            if guidellm_at is not None:
                exe, rate = guidellm_at
                gl_work = work / f"guidellm-{mode}"
                gl_work.mkdir(parents=True, exist_ok=True)
                out["guidellm"] = await asyncio.to_thread(
                    prefix_guidellm.run, exe, stack.ingress_url, MODEL, rate, duration_s, workload, gl_work
                )
                print(f"  {mode:<14} GuideLLM at {rate} req/s: {out['guidellm']}", flush=True)
    return out


def judged(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    shared, control = results["shared"], results["control"]
    at = shared["judged_rate"]
    lr, sp = shared["modes"]["least_request"]["rates"][at], shared["modes"]["sie_prefix"]["rates"][at]
    ratio = sp["ttft_p90_ms"] / lr["ttft_p90_ms"] if lr["ttft_p90_ms"] else math.inf
    out.append(
        {
            "target": f"shared prefix at {JUDGED_FRACTION:.0%} of LEAST_REQUEST's capacity ({at} req/s): "
            f"sie_prefix TTFT p90 / LEAST_REQUEST's <= {TTFT_RATIO}",
            "value": round(ratio, 3),
            "limit": TTFT_RATIO,
            "holds": ratio <= TTFT_RATIO,
        }
    )
    out.append(
        {
            "target": f"shared prefix at {at} req/s: no instance serves more than {SHARE_RATIO}x the mean share (sie_prefix)",
            "value": sp["max_share_over_mean"],
            "limit": SHARE_RATIO,
            "holds": sp["max_share_over_mean"] is not None and sp["max_share_over_mean"] <= SHARE_RATIO,
        }
    )
    top = shared["top_rate"]
    lr_top, sp_top = shared["modes"]["least_request"]["rates"][top], shared["modes"]["sie_prefix"]["rates"][top]
    tput = sp_top["output_tokens_per_s"] / max(1e-9, lr_top["output_tokens_per_s"])
    out.append(
        {
            "target": f"shared prefix at {top} req/s (above LEAST_REQUEST's capacity, where the servers bound "
            f"throughput): sie_prefix output tokens/s / LEAST_REQUEST's >= {THROUGHPUT_RATIO}",
            "value": round(tput, 3),
            "limit": THROUGHPUT_RATIO,
            "holds": tput >= THROUGHPUT_RATIO,
        }
    )
    cat = control["judged_rate"]
    lr_c, sp_c = control["modes"]["least_request"]["rates"][cat], control["modes"]["sie_prefix"]["rates"][cat]
    p99 = sp_c["e2e_p99_ms"] / lr_c["e2e_p99_ms"] if lr_c["e2e_p99_ms"] else math.inf
    out.append(
        {
            "target": f"control (nothing shared) at {JUDGED_FRACTION:.0%} of LEAST_REQUEST's capacity ({cat} req/s): "
            f"sie_prefix end-to-end p99 / LEAST_REQUEST's <= {CONTROL_P99_RATIO}",
            "value": round(p99, 3),
            "limit": CONTROL_P99_RATIO,
            "holds": p99 <= CONTROL_P99_RATIO,
        }
    )
    out.append(
        {
            "target": "no request failed in any mode below LEAST_REQUEST's capacity",
            "value": sum(
                r["failed"]
                for w in (shared, control)
                for m in w["modes"].values()
                for key, r in m["rates"].items()
                if float(key) < w["capacity_rps"]
            ),
            "limit": 0,
            "holds": all(
                r["failed"] == 0
                for w in (shared, control)
                for m in w["modes"].values()
                for key, r in m["rates"].items()
                if float(key) < w["capacity_rps"]
            ),
        }
    )
    return out


def plot(
    results: dict[str, Any],
    path: Path,
    title: str = "bench.prefix: 4 sim instances (SGLang timing, RadixAttention cache) through Envoy",
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, name in zip(axes, ("shared", "control")):
        block = results[name]
        for mode, figures in block["modes"].items():
            rates = sorted(figures["rates"], key=float)
            ax.plot(
                [float(r) for r in rates], [figures["rates"][r]["ttft_p90_ms"] for r in rates], marker="o", label=mode
            )
        ax.axvline(block["capacity_rps"], color="grey", linestyle=":", label="LEAST_REQUEST capacity")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (requests per second, Poisson)")
        ax.set_ylabel("TTFT p90 (ms, log)")
        ax.set_title(f"{name} {'prefix' if name == 'shared' else '(nothing shared)'}")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(quick: bool, work: Path, guidellm: str | None = None, only: str | None = None) -> dict[str, Any]:
    # The top rate is twice LEAST_REQUEST's capacity, so both modes are bound by their servers there: the
    # throughput each can give, not what the load offers.
    fractions = [JUDGED_FRACTION, 2.0] if quick else [0.4, 0.6, JUDGED_FRACTION, 1.0, 1.5, 2.0]
    duration = 30.0 if quick else 60.0
    probe = 15.0 if quick else 30.0
    workloads = {"shared": Workload(shared=True), "control": Workload(shared=False)}
    results: dict[str, Any] = {}
    for name, workload in workloads.items():
        if only is not None and name != only:
            continue
        # The control's judged figure is a p99 at one rate: twice the time, for twice the requests behind it.
        seconds = 2 * duration if name == "control" else duration
        print(f"{name}: measuring LEAST_REQUEST's capacity", flush=True)
        probe_out = await run_mode(work, "least_request", workload, [], 0.0, probe)
        capacity = probe_out["capacity_rps"]
        rates = [round(f * capacity, 2) for f in fractions]
        if name == "control" and quick:
            rates = [round(JUDGED_FRACTION * capacity, 2)]
        print(f"{name}: LEAST_REQUEST capacity {capacity} req/s; rates {rates}", flush=True)
        block: dict[str, Any] = {
            "workload": workload.__dict__
            | {"prompt_tokens": workload.prompt_tokens, "shared_fraction": round(workload.shared_fraction, 3)},
            "capacity_rps": capacity,
            "judged_rate": f"{round(JUDGED_FRACTION * capacity, 2):.2f}",
            "top_rate": f"{rates[-1]:.2f}",
            "modes": {},
        }
        for mode in MODES:
            # A standard tool at the judged rate, beside ours, for SIE and its least-request baseline.
            at = (guidellm, float(block["judged_rate"])) if guidellm and name == "shared" else None
            at = at if mode in ("least_request", "sie_prefix") else None
            block["modes"][mode] = await run_mode(work, mode, workload, rates, seconds, None, guidellm_at=at)
        results[name] = block
    return results


def table(results: dict[str, Any]) -> str:
    lines = []
    for name, block in results.items():
        lines.append(f"{name} (LEAST_REQUEST capacity {block['capacity_rps']} req/s)")
        lines.append(
            f"  {'mode':<14} {'rate':>6} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'e2e p99':>8} {'tok/s':>7} {'hit':>5} {'share':>6}"
        )
        for mode, figures in block["modes"].items():
            for rate, f in sorted(figures["rates"].items(), key=lambda kv: float(kv[0])):
                lines.append(
                    f"  {mode:<14} {rate:>6} {f['ttft_p50_ms']:>9} {f['ttft_p90_ms']:>8} {f['ttft_p99_ms']:>8} "
                    f"{f['e2e_p99_ms']:>8} {f['output_tokens_per_s']:>7} {f['cache_hit_rate_mean']!s:>5} "
                    f"{f['max_share_over_mean']!s:>6}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two rates, 30 s each, the control at one rate (vLLM: the judged rate only)",
    )
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="the instances: sim workers (default) or real vLLM servers (bench/prefix_vllm.py)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/prefix[-vllm].json")
    parser.add_argument("--workdir", type=Path, default=None, help="run here and keep the stacks' logs")
    parser.add_argument("--only", choices=("shared", "control"), help="one workload (no verdicts)")
    parser.add_argument(
        "--guidellm",
        default=None,
        help="a guidellm executable (default: `guidellm` on PATH; none: that step is skipped)",
    )
    args = parser.parse_args(argv)
    started = time.time()
    if args.engine == "vllm":
        return _main_vllm(args, started)
    args.out = args.out or RESULTS / "prefix.json"
    guidellm = prefix_guidellm.find(args.guidellm)
    with tempfile.TemporaryDirectory(prefix="sie-bench-prefix-") as tmp:
        work = Path(tmp) if args.workdir is None else args.workdir
        work.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args.quick, work, guidellm, args.only))
    if args.only is not None:
        print(json.dumps(results, indent=1)[:6000])
        return 0
    verdicts = judged(results)
    doc = {
        "benchmark": "prefix",
        "setup": {
            "command": "python -m bench.prefix" + (" --quick" if args.quick else ""),
            "instances": INSTANCES,
            "sim": SIM,
            "modes": {m: " ".join(f) for m, f in MODES.items()},
            "workers": "sim (SGLang timing simulator with a RadixAttention-style prefix cache), not real models",
            "load": "open-loop Poisson through Envoy, streamed chat completions; TTFT to the first streamed chunk",
            "capacity": "LEAST_REQUEST's completions per second with instances x max_concurrent_requests closed-loop callers, after a warm-up",
            "guidellm": (
                f"{guidellm}: GuideLLM at the judged rate on the shared-prefix workload (least_request, sie_prefix)"
                if guidellm
                else "not run: no guidellm executable (pip install guidellm in its own venv; --guidellm PATH)"
            ),
            "duration_s": round(time.time() - started, 1),
        },
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "results": results,
        "judged": verdicts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    for v in verdicts:
        print(f"{'PASS' if v['holds'] else 'FAIL'}  {v['target']}: {v['value']} (limit {v['limit']})")
    return 0


def _main_vllm(args: argparse.Namespace, started: float) -> int:
    from bench import prefix_vllm

    if args.guidellm:
        print("--guidellm is for the sim run only: not run against vLLM")
    with tempfile.TemporaryDirectory(prefix="sie-bench-prefix-vllm-") as tmp:
        work = Path(tmp) if args.workdir is None else args.workdir
        work.mkdir(parents=True, exist_ok=True)
        results, setup = asyncio.run(prefix_vllm.run(args.quick, work, args.only))
    if args.only is not None:
        print(json.dumps(results, indent=1)[:6000])
        return 0
    doc = prefix_vllm.document(results, setup, args.quick, started)
    out = args.out or RESULTS / "prefix-vllm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(
        results,
        out.with_suffix(".png"),
        "bench.prefix --engine vllm: 2 real vLLM servers (CPU, one core each) through Envoy",
    )
    print(table(results))
    for v in doc["judged"]:
        print(f"{'PASS' if v['holds'] else 'FAIL'}  {v['target']}: {v['value']} (limit {v['limit']})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
