"""First-request latency for a model at zero: a warm wake (asleep, weights in host memory) against a cold
load (unloaded: the worker starts afresh), on the torch engine with the demo model.

    python -m bench.coldstart [--quick] [--trials N] [--out PATH]

ONE STACK (`sie up`: xds_server, a real Envoy, the node host, sidecars, torch workers serving the tiny
random-weight demo LLM, the same as `sie up -f examples/cluster.yaml`), two models side by side, both
`sla.min_replicas: 0` (scale to zero), `autoscale.idle_s` IDLE_S:

  warm   autoscale.sleep_mode offload: at zero the worker keeps running with its weights in host memory;
         a wake copies them back (the torch engine's sleep, node_host/backends/torch_engine/offload.py).
  cold   autoscale.sleep_mode unload: at zero the worker is stopped and only the sidecar stays; a wake
         starts the worker (python, torch, transformers, the weights from disk) and waits for it.

Per trial and model: wait until the model is asleep (its instance `sleeping`, the ingress's model list
says `asleep`), send ONE chat completion through Envoy (max_tokens 4) and time it to its answer (the
first request: held by the sleeping instance's sidecar through the wake, sidecar/waking.py), then at
once a second one (the same request on the awake instance: its own service time). The node host's
events give the wake itself (`woken`, took_s: from the node host's start of the wake to the instance
serving). Then nothing is sent until the autoscaler puts the model back to zero (idle_s).

Targets (the issue's):
  - every first request answers 200 without a client retry;
  - first-request p99 <= wake p99 + service p99 + 50 ms, for each mode (what holding costs beyond the
    wake itself);
  - warm wake at least 5x faster than a cold load: the cold mode's first-request p50 over the warm's.

Writes bench/results/coldstart.json (figures, setup, machine, `judged`) and prints a table and PASS/FAIL
lines. Exits 0 whatever the verdicts. The GPU variant (a Qwen2-1.5B-shaped model, NVML against the
ledger) is bench/coldstart_gpu.py, for a machine with an NVIDIA GPU.
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
from typing import Any

import aiohttp

from bench.eviction import stop_stack
from bench.rollout import get_json
from bench.stack import Urls, start_cluster
from bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODES = ("warm", "cold")
IDLE_S = 2.0  # how soon a model with no request goes back to zero (short: the trials wait for it)
HOLD_SLACK_MS = 50.0
SPEEDUP = 5.0


def model_service(mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": mode},
        "spec": {
            "model": {"name": mode, "version": "0.1.0", "path": f".sie/data/{mode}", "service_type": "llm"},
            "backend": {"type": "torch", "config": {"demo": True, "max_total_tokens": 2048, "max_seq_len": 256}},
            "resources": {"max_concurrent_requests": 4},
            "sla": {"min_replicas": 0, "max_replicas": 1, "p99_latency_ms": 5000, "max_queue_time_ms": 5000},
            "autoscale": {
                "idle_s": IDLE_S,
                "scale_down_window_s": 0,
                "wake_timeout_s": 60,
                "sleep_mode": "offload" if mode == "warm" else "unload",
            },
        },
    }


async def _status_model(session: aiohttp.ClientSession, urls: Urls, mode: str) -> dict[str, Any]:
    status = await get_json(session, urls.admin + "/v1/status", urls.headers) or {}
    return next((m for m in status.get("models", []) if m.get("model_id") == mode), {})


async def _listed(session: aiohttp.ClientSession, urls: Urls, mode: str) -> str | None:
    doc = await get_json(session, urls.envoy + "/v1/models", {}) or {}
    return next((m.get("state") for m in doc.get("data", []) if m.get("id") == mode), None)


async def until_asleep(session: aiohttp.ClientSession, urls: Urls, mode: str, timeout_s: float = 120.0) -> float:
    """Seconds waited until the model's one instance sleeps and the model list says asleep."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        model = await _status_model(session, urls, mode)
        states = [i.get("state") for i in model.get("instances", []) if i.get("state") != "stopped"]
        if states == ["sleeping"] and await _listed(session, urls, mode) == "asleep":
            return time.monotonic() - started
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{mode} did not go to sleep within {timeout_s:g} s: {await _status_model(session, urls, mode)}")


async def one_request(session: aiohttp.ClientSession, urls: Urls, mode: str, n: int) -> tuple[int, float, str]:
    body = {"model": mode, "messages": [{"role": "user", "content": f"trial {n}: wake up"}], "max_tokens": 4}
    started = time.perf_counter()
    async with session.post(urls.envoy + "/v1/chat/completions", json=body) as resp:
        payload = await resp.read()
        took_ms = (time.perf_counter() - started) * 1000.0
        return resp.status, took_ms, "" if resp.status == 200 else payload[:300].decode(errors="replace")


async def wake_took(session: aiohttp.ClientSession, urls: Urls, mode: str, since: float) -> float | None:
    doc = await get_json(session, f"{urls.node}/v1/events?since={since}", urls.headers) or {}
    took = [
        e.get("took_s")
        for e in doc.get("events", [])
        if e.get("kind") == "woken" and e.get("instance_id", "").startswith(f"{mode}-")
    ]
    return None if not took or took[-1] is None else float(took[-1]) * 1000.0


async def trials(urls: Urls, n_trials: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for n in range(n_trials):
            for mode in MODES:
                waited = await until_asleep(session, urls, mode)
                since = time.time() - 0.5
                status, first_ms, error = await one_request(session, urls, mode, n)
                again, service_ms, _ = await one_request(session, urls, mode, n)
                await asyncio.sleep(0.3)  # the node host's event log is read through its API
                wake_ms = await wake_took(session, urls, mode, since)
                row = {
                    "trial": n,
                    "status": status,
                    "first_ms": round(first_ms, 2),
                    "service_ms": round(service_ms, 2) if again == 200 else None,
                    "wake_ms": None if wake_ms is None else round(wake_ms, 2),
                    "waited_for_sleep_s": round(waited, 2),
                    "error": error,
                }
                out[mode].append(row)
                print(f"[{mode}] trial {n + 1}/{n_trials}: {row}", flush=True)
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def pct(key: str, q: float) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(percentile(values, q), 2) if values else None

    return {
        "trials": len(rows),
        "ok": sum(1 for r in rows if r["status"] == 200),
        **{f"{key}_p{q}": pct(key, q) for key in ("first_ms", "wake_ms", "service_ms") for q in (50, 99)},
    }


def judged(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def check(target: str, value: float | None, limit: float, holds: bool) -> None:
        out.append({"target": target, "value": value, "limit": limit, "holds": bool(holds and value is not None)})

    for mode in MODES:
        f = figures[mode]
        check(
            f"{mode}: every first request to the model at zero answers 200 without a client retry",
            f["ok"],
            f["trials"],
            f["ok"] == f["trials"],
        )
        parts = [f["wake_ms_p99"], f["service_ms_p99"]]
        limit = round(sum(p for p in parts if p is not None) + HOLD_SLACK_MS, 2)
        check(
            f"{mode}: first-request p99 <= wake p99 + service p99 + {HOLD_SLACK_MS:g} ms",
            f["first_ms_p99"],
            limit,
            None not in parts and f["first_ms_p99"] is not None and f["first_ms_p99"] <= limit,
        )
    warm, cold = figures["warm"]["first_ms_p50"], figures["cold"]["first_ms_p50"]
    ratio = round(cold / warm, 2) if warm and cold else None
    check(
        f"warm wake at least {SPEEDUP:g}x faster than a cold load (cold first-request p50 / warm)",
        ratio,
        SPEEDUP,
        ratio is not None and ratio >= SPEEDUP,
    )
    return out


def table(figures: dict[str, dict[str, Any]]) -> str:
    keys = [
        "trials",
        "ok",
        "first_ms_p50",
        "first_ms_p99",
        "wake_ms_p50",
        "wake_ms_p99",
        "service_ms_p50",
        "service_ms_p99",
    ]
    lines = [f"{'':<18}" + "".join(f"{m:>14}" for m in MODES)]
    for key in keys:
        lines.append(f"{key:<18}" + "".join(f"{str(figures[m].get(key)):>14}" for m in MODES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coldstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 trials per mode instead of 20")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "coldstart.json")
    parser.add_argument("--workdir", type=Path, default=None, help="run here and keep the stack's logs")
    args = parser.parse_args(argv)
    n_trials = args.trials or (5 if args.quick else 20)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="sie-bench-coldstart-") as tmp:
        work = Path(tmp) if args.workdir is None else args.workdir
        work.mkdir(parents=True, exist_ok=True)
        docs = [{"kind": "Cluster", "spec": {"host": "127.0.0.1"}}] + [model_service(m) for m in MODES]
        stack_started = time.monotonic()
        proc, urls = start_cluster(work, docs, timeout_s=300.0, name="coldstart")
        startup_s = time.monotonic() - stack_started
        try:
            rows = asyncio.run(trials(urls, n_trials))
        finally:
            stop_stack(proc)
    figures = {mode: summary(rows[mode]) for mode in MODES}
    verdicts = judged(figures)
    doc = {
        "benchmark": "coldstart",
        "setup": {
            "command": "python -m bench.coldstart" + (" --quick" if args.quick else ""),
            "trials": n_trials,
            "engine": "torch (embedded), the tiny random-weight demo LLM on CPU (backend.config.demo)",
            "modes": {m: model_service(m)["spec"]["autoscale"] for m in MODES},
            "first_ms": "one chat completion (max_tokens 4) through Envoy to the model at zero, sent to its answer",
            "service_ms": "the same request at once after, on the awake instance",
            "wake_ms": "the node host's `woken` event: from its start of the wake to the instance serving",
            "stack_startup_s": round(startup_s, 1),
        },
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "results": {"figures": figures, "trials": rows},
        "judged": verdicts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(figures))
    for v in verdicts:
        print(f"{'PASS' if v['holds'] else 'FAIL'}  {v['target']}: {v['value']} (limit {v['limit']})")
    print(f"\nwrote {args.out} in {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
