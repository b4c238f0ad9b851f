"""bench/prefix on real vLLM: `python -m bench.prefix --engine vllm [--quick]`.

The same modes (round_robin, least_request, sie, sie_prefix: bench/prefix.MODES), the same workloads'
shape (bench/prefix_workload.py: G groups of a long system prompt each and short questions; the control
with nothing shared), the same capacity probe and open-loop streamed load, but the instances are TWO real
vLLM servers (its CPU build, one core each: this machine has two), started once with the command line
and environment SIE's node host gives them (bench/vllm_fleet.py), serving a random-weight Qwen2 of hidden
size 1024 (vllm_fleet says why not the tests' 256). Every mode gets a fresh control plane, picker, Envoy
and sidecars over those engines (RoutingStack(..., engine="vllm", workers=fleet)), and before each the
engines' prefix caches are emptied by traffic (VllmFleet.flush), so each mode starts as cold as the sim's.

Sizes, in the model's own tokens (its tokenizer: the text is drawn from words that are one token each,
bench/prefix_workload.py). vLLM caches whole 128-token blocks only, so a group's system prompt is 11 whole
blocks (about 1,420 tokens) and a question 60 tokens: about 1,500 tokens a prompt, 94% of it in the
cache on a hit; 16 tokens out. Each instance's KV cache is KV_BLOCKS blocks: the 16 groups' prompts
(176 blocks) do not fit one instance, half of them (88) and the running requests' own blocks do, so a
cache-blind balancer makes both instances cycle through all groups while affinity can keep each group
on one. The run records the token counts it measured (`shape`).

Figures per mode and rate: bench/prefix's (TTFT p50/p90/p99, end-to-end p99, output tokens per second
from the usage vLLM reports, shares), the engines' own prefix-cache hit rate over the rate's run (the
deltas of vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total, in tokens, per instance and
pooled), the CPU each process and the machine's other users took meanwhile (`cpu`: `process_cores`,
`others_cores`, bench/proc_cpu.py: a run with much of the latter was disturbed), Envoy's weight of each
instance every second with the control plane's reason for any below full (`weights`: why SIE moved
traffic), and TTFT p90 per 10 s of the run (`ttft_p90_ms_by_10s`: where in the run the tail was).

Judged (issue 39 item 7): on the shared-prefix workload at 80% of LEAST_REQUEST's capacity, sie_prefix's
TTFT p90 at most 0.5x LEAST_REQUEST's; on the control at 80%, sie_prefix's end-to-end p99 within 5% of
LEAST_REQUEST's (what bench/prefix judges for the control); no request failed below LEAST_REQUEST's
capacity. Writes bench/results/prefix-vllm.json (and .png).
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench import prefix
from bench.prefix_workload import Sample, Workload, closed_loop, stream_load
from bench.proc_cpu import cpu_snapshot, cpu_use
from bench.routing_stack import RoutingStack
from bench.stats import percentile
from bench.vllm_fleet import BLOCK_TOKENS, HIDDEN_SIZE, VllmFleet, kv_cache_mb_for, tiny_model, usable_cores
from sie.cluster import load_cluster
from xds_server.policy import MAX_WEIGHT

MODEL = prefix.MODEL
INSTANCES = 2
CONCURRENT = 8  # resources.max_concurrent_requests per instance, and so vLLM's --max-num-seqs
MAX_SEQ_LEN = 2048
KV_BLOCKS = 112  # per instance: 8 groups' prompts (88 blocks) and 8 running requests' own blocks, with room
PREFIX_BLOCKS = 11
GROUPS, USERS = 16, 8
QUERY_TOKENS = 60
MAX_TOKENS = 16
JUDGED_FRACTION = prefix.JUDGED_FRACTION
TTFT_RATIO = 0.5
CONTROL_P99_RATIO = prefix.CONTROL_P99_RATIO


def vocabulary(model_path: Path) -> tuple[str, ...]:
    """Lower-case words of 3+ letters that are one token each (with their leading space) in the model's
    tokenizer, sorted: what the workloads' text is drawn from."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    words = sorted(w[1:] for w in tok.get_vocab() if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower())
    return tuple(w for w in words if len(w) >= 3 and len(tok(" " + w, add_special_tokens=False).input_ids) == 1)


def workloads(words: tuple[str, ...]) -> dict[str, Workload]:
    # A few words over the 11 blocks: the system prompt's segment must hold all of them whole.
    prefix_words = PREFIX_BLOCKS * BLOCK_TOKENS + 12
    return {
        name: Workload(
            shared=name == "shared",
            groups=GROUPS,
            users=USERS,
            prefix_words=prefix_words,
            query_words=QUERY_TOKENS,
            max_tokens=MAX_TOKENS,
            engine="vllm",
            vocabulary=words,
        )
        for name in ("shared", "control")
    }


def shape(model_path: Path, workload: Workload, samples: int = 64) -> dict[str, Any]:
    """The prompts' sizes in the model's tokens (its chat template applied), over `samples` requests, and
    the whole 128-token blocks of a group's system prompt: what a cache hit can skip."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))

    def count(messages: list[dict], generation: bool) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        return len(tok(text, add_special_tokens=False).input_ids)

    prompts = [count(workload.body(MODEL, i)["messages"], True) for i in range(samples)]
    system = [count([{"role": "system", "content": workload.group_prefix(g)}], False) for g in range(workload.groups)]
    blocks = min(system) // BLOCK_TOKENS  # leading whole blocks inside every group's system segment
    return {
        "prompt_tokens": [min(prompts), max(prompts)],
        "system_segment_tokens": [min(system), max(system)],
        "shared_whole_blocks": blocks if workload.shared else 0,
        "cacheable_fraction": round(blocks * BLOCK_TOKENS / max(prompts), 3) if workload.shared else 0.0,
        "vocabulary_words": len(workload.vocabulary),
    }


def cluster_doc(model_path: Path) -> dict[str, Any]:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"name": MODEL, "version": "1.0", "path": str(model_path), "service_type": "llm"},
            "backend": {
                "type": "vllm",
                "config": {"max_seq_len": MAX_SEQ_LEN, "kv_cache_mb": kv_cache_mb_for(KV_BLOCKS)},
            },
            "resources": {"max_concurrent_requests": CONCURRENT},
            "sla": {"p99_latency_ms": 60000, "max_queue_time_ms": 60000, "min_replicas": INSTANCES},
            "routing": {"prefix_affinity": {"balance_factor": 1.5}},
        },
    }


def hit_rates(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """vLLM's prefix-cache hit rate between two readings of its counters (tokens hit / tokens looked up),
    per instance and pooled; None where nothing was looked up."""
    per: dict[str, float | None] = {}
    hits = queries = 0.0
    for iid, (h1, q1) in after.items():
        h0, q0 = before.get(iid, (0.0, 0.0))
        per[iid] = round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else None
        hits, queries = hits + h1 - h0, queries + q1 - q0
    return {"per_instance": per, "pooled": round(hits / queries, 3) if queries > 0 else None}


async def run_mode(
    work: Path,
    fleet: VllmFleet,
    cluster: Path,
    mode: str,
    workload: Workload,
    rates: list[float],
    duration_s: float,
    probe_s: float | None,
) -> dict[str, Any]:
    stackdir = work / f"{mode}-{'shared' if workload.shared else 'control'}"
    out: dict[str, Any] = {"rates": {}}
    await fleet.flush(seed=zlib.crc32(stackdir.name.encode()))
    async with RoutingStack(
        stackdir,
        cluster,
        policy="sie",
        lb_policy="least_request",
        instances=INSTANCES,
        xds_flags=prefix.MODES[mode],
        picker=mode == "sie_prefix",
        engine="vllm",
        workers=fleet,
    ) as stack:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            if probe_s is not None:
                clients = 2 * INSTANCES * CONCURRENT
                await closed_loop(session, stack.ingress_url, MODEL, workload, clients, probe_s / 3)
                out["capacity_rps"] = round(
                    await closed_loop(session, stack.ingress_url, MODEL, workload, clients, probe_s), 2
                )
                await prefix.drained(stack)
                return out
            first = 0
            for rate in rates:
                counters = await fleet.counters()
                pids = {"bench": os.getpid(), **stack.pids(), **fleet.pids()}
                cpu = cpu_snapshot(pids, usable_cores(), [os.getpid()])
                weights: list[tuple[float, dict[str, Any]]] = []
                watcher = asyncio.create_task(_watch(stack, weights), name="envoy-weights-watch")
                try:
                    samples = await stream_load(session, stack.ingress_url, MODEL, workload, rate, duration_s, first)
                finally:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                used = cpu_use(cpu, cpu_snapshot(pids, usable_cores(), [os.getpid()]))
                await prefix.drained(stack)
                first += len(samples) + 1
                figures = prefix.summary(samples, duration_s, stack.instance_ids)
                hits = hit_rates(counters, await fleet.counters())
                figures["cache_hit_rate"] = hits["per_instance"]
                figures["cache_hit_rate_mean"] = hits["pooled"]
                figures["cpu"] = used
                figures["weights"] = weights  # Envoy's weight of each instance, every WATCH_EVERY_S
                figures["ttft_p90_ms_by_10s"] = _ttft_p90_by(samples, 10.0)
                out["rates"][f"{rate:.2f}"] = figures
                print(
                    f"  {mode:<14} {rate:6.2f} req/s  TTFT p50 {figures['ttft_p50_ms']} p90 {figures['ttft_p90_ms']} "
                    f"ms  e2e p99 {figures['e2e_p99_ms']} ms  {figures['output_tokens_per_s']} tok/s  hit "
                    f"{hits['pooled']} {hits['per_instance']}  shares {figures['shares']}  failed "
                    f"{figures['failed']}  others' CPU {used['others_cores']} cores",
                    flush=True,
                )
    return out


WATCH_EVERY_S = 1.0


async def _watch(stack: RoutingStack, into: list[tuple[float, dict[str, Any]]]) -> None:
    """Every WATCH_EVERY_S: Envoy's weight of each instance, and the control plane's reason for any weight
    below the full one (the policy's own words: slowness, saturation...)."""
    started = time.perf_counter()
    while True:
        hosts = await stack.envoy_hosts()
        entry: dict[str, Any] = {k: v["weight"] for k, v in hosts.items()}
        if any(w is not None and w < MAX_WEIGHT for w in entry.values()):
            entry["why"] = {
                k: d["reason"] for k, d in (await stack.decisions()).items() if (d["weight"] or 0) < MAX_WEIGHT
            }
        into.append((round(time.perf_counter() - started, 1), entry))
        await asyncio.sleep(WATCH_EVERY_S)


def _ttft_p90_by(samples: list[Sample], bin_s: float) -> list[float | None]:
    """TTFT p90 (ms) of the requests scheduled in each `bin_s` of the run: where in the run the tail was."""
    bins: dict[int, list[float]] = {}
    for s in samples:
        if s.ttft_s is not None:
            bins.setdefault(int(s.scheduled_s // bin_s), []).append(1000 * s.ttft_s)
    last = max(bins, default=-1)
    return [round(percentile(bins[k], 90), 1) if k in bins else None for k in range(last + 1)]


async def run(quick: bool, work: Path, only: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results, setup) of the whole run: the fleet started once, every workload and mode over it."""
    fractions = [JUDGED_FRACTION] if quick else [0.4, 0.6, JUDGED_FRACTION, 1.0, 1.5]
    duration = 30.0 if quick else 60.0
    probe = 15.0 if quick else 30.0
    model_path = await asyncio.to_thread(tiny_model, work)
    words = await asyncio.to_thread(vocabulary, model_path)
    loads = workloads(words)
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(cluster_doc(model_path), sort_keys=False))
    service = load_cluster(cluster).services[0]
    ids = [f"{service.model_id}-{i}" for i in range(INSTANCES)]  # RoutingStack's instance ids
    results: dict[str, Any] = {}
    setup: dict[str, Any] = {"model": {"path": model_path.name, "hidden_size": HIDDEN_SIZE}}
    async with VllmFleet(work / "vllm", service, ids) as fleet:
        setup["vllm"] = {
            "version": fleet.engines.vllm_version,
            "cores": fleet.cores,
            "start_s": fleet.start_s,
            "kv_cache_blocks": KV_BLOCKS,
        }
        for name, workload in loads.items():
            if only is not None and name != only:
                continue
            seconds = 1.5 * duration if name == "control" else duration
            print(f"{name}: measuring LEAST_REQUEST's capacity", flush=True)
            probe_out = await run_mode(work, fleet, cluster, "least_request", workload, [], 0.0, probe)
            capacity = probe_out["capacity_rps"]
            rates = [round(f * capacity, 2) for f in fractions]
            print(f"{name}: LEAST_REQUEST capacity {capacity} req/s; rates {rates}", flush=True)
            block: dict[str, Any] = {
                "workload": {k: v for k, v in workload.__dict__.items() if k != "vocabulary"}
                | {"shape": await asyncio.to_thread(shape, model_path, workload)},
                "capacity_rps": capacity,
                "judged_rate": f"{round(JUDGED_FRACTION * capacity, 2):.2f}",
                "top_rate": f"{rates[-1]:.2f}",
                "duration_s": seconds,
                "modes": {},
            }
            for mode in prefix.MODES:
                block["modes"][mode] = await run_mode(work, fleet, cluster, mode, workload, rates, seconds, None)
            results[name] = block
    return results, setup


def judged(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    shared, control = results["shared"], results["control"]
    at = shared["judged_rate"]
    lr, sp = shared["modes"]["least_request"]["rates"][at], shared["modes"]["sie_prefix"]["rates"][at]
    ratio = sp["ttft_p90_ms"] / lr["ttft_p90_ms"] if lr["ttft_p90_ms"] and sp["ttft_p90_ms"] else math.inf
    out.append(
        {
            "target": f"vLLM, shared prefix at {JUDGED_FRACTION:.0%} of LEAST_REQUEST's capacity ({at} req/s): "
            f"sie_prefix TTFT p90 / LEAST_REQUEST's <= {TTFT_RATIO}",
            "value": round(ratio, 3),
            "limit": TTFT_RATIO,
            "holds": ratio <= TTFT_RATIO,
        }
    )
    cat = control["judged_rate"]
    lr_c, sp_c = control["modes"]["least_request"]["rates"][cat], control["modes"]["sie_prefix"]["rates"][cat]
    p99 = sp_c["e2e_p99_ms"] / lr_c["e2e_p99_ms"] if lr_c["e2e_p99_ms"] and sp_c["e2e_p99_ms"] else math.inf
    out.append(
        {
            "target": f"vLLM, control (nothing shared) at {JUDGED_FRACTION:.0%} of LEAST_REQUEST's capacity "
            f"({cat} req/s): sie_prefix end-to-end p99 / LEAST_REQUEST's <= {CONTROL_P99_RATIO}",
            "value": round(p99, 3),
            "limit": CONTROL_P99_RATIO,
            "holds": p99 <= CONTROL_P99_RATIO,
        }
    )
    below = [
        r["failed"]
        for w in (shared, control)
        for m in w["modes"].values()
        for key, r in m["rates"].items()
        if float(key) < w["capacity_rps"]
    ]
    out.append(
        {
            "target": "vLLM: no request failed in any mode below LEAST_REQUEST's capacity",
            "value": sum(below),
            "limit": 0,
            "holds": sum(below) == 0,
        }
    )
    return out


def document(results: dict[str, Any], setup: dict[str, Any], quick: bool, started: float) -> dict[str, Any]:
    return {
        "benchmark": "prefix",
        "engine": "vllm",
        "setup": {
            "command": "python -m bench.prefix --engine vllm" + (" --quick" if quick else ""),
            "engine": "vllm",
            "instances": INSTANCES,
            "workers": f"real vLLM {setup['vllm']['version']} (CPU build), one core each, serving a random-weight "
            f"Qwen2 (hidden {HIDDEN_SIZE}, 2 layers), started once; prefix caches emptied by traffic before each mode",
            **setup,
            "spec": cluster_doc(Path(setup["model"]["path"]))["spec"],
            "modes": {m: " ".join(f) for m, f in prefix.MODES.items()},
            "load": "open-loop Poisson through Envoy, streamed chat completions (ignore_eos, usage in the last "
            "chunk); TTFT to the first chunk with a choice (vLLM sends it with the first token)",
            "capacity": f"LEAST_REQUEST's completions per second with {2 * INSTANCES * CONCURRENT} closed-loop "
            "callers, after a warm-up",
            "hit_rate": "vLLM's own counters over each rate's run: vllm:prefix_cache_hits_total / "
            "vllm:prefix_cache_queries_total (tokens), per instance and pooled",
            "duration_s": round(time.time() - started, 1),
        },
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "results": results,
        "judged": judged(results),
    }
