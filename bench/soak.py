"""Soak: a long, steady load through the real stack, to catch what is rare (a lost answer, a held slot).

    python -m bench.soak [--rate 120] [--duration 500] [--lb-policy round_robin] [--quick] [--out PATH]

One bench.routing_stack.RoutingStack (xds_server, Envoy, 4 `sim` instances behind their sidecars, the
cluster of examples/routing.yaml) and a Poisson stream of short requests (8-64 prompt words, 2-16 new
tokens: tens of milliseconds each, so many requests per minute). Every request must be answered 200.

Reports how many were sent, every one that was not answered 200 (when it was sent, its status, the
instance, how long it took), the latency p50 / p99 / max, and what is still in flight once the load
has ended, at Envoy and at every sidecar (a leaked slot shows there). Writes bench/results/soak.json
(or --out); the exit code is 1 if any request failed or anything is left in flight.

This is a correctness run, not a performance claim: it compares nothing. It found the sim engine's lost
results (about 1 request in 10,000 answered 504 at the 35 s route timeout, and its sidecar slot held for
good) that no shorter test showed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen import Load, run_load
from bench.routing_stack import RoutingStack
from bench.routing_workload import Mix, body
from bench.stats import percentile

REPO = Path(__file__).resolve().parents[1]
CLUSTER_FILE = REPO / "examples" / "routing.yaml"
RESULTS = REPO / "bench" / "results"
CLIENT_TIMEOUT_S = 60.0  # above the model's 35 s route timeout, so Envoy's answer is what is seen
SHORT = Mix(prompt_words=(8, 64), max_new_tokens=(2, 16))  # tens of milliseconds each


async def left_in_flight(stack: RoutingStack, session: aiohttp.ClientSession) -> dict[str, dict[str, int]]:
    """Per instance: Envoy's active requests and the sidecar's in-flight and queued counts."""
    hosts = await stack.envoy_hosts()
    async with session.get(
        stack.admin_url + "/v1/endpoints", timeout=aiohttp.ClientTimeout(total=5), headers=stack.admin_headers()
    ) as resp:
        endpoints = (await resp.json())["endpoints"]
    records = {e["instance_id"]: e["record"] for e in endpoints}
    return {
        iid: {
            "envoy_active": hosts.get(iid, {}).get("active", -1),
            "sidecar_in_flight": records.get(iid, {}).get("in_flight", -1),
            "sidecar_queued": records.get(iid, {}).get("queued", -1),
        }
        for iid in stack.instance_ids
    }


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        async with RoutingStack(Path(tmp), CLUSTER_FILE, policy="equal", lb_policy=args.lb_policy) as stack:
            load = Load(
                stack.ingress_url + "/generate",
                args.rate,
                args.duration,
                lambda i: body(stack.model_id, SHORT, args.seed, i),
                timeout_s=CLIENT_TIMEOUT_S,
                seed=args.seed,
            )
            print(
                f"soak: {args.rate:g} req/s for {args.duration:g} s through Envoy ({args.lb_policy}) to "
                f"{len(stack.instance_ids)} sim instances",
                flush=True,
            )
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                samples = await run_load(load, session)
                await asyncio.sleep(1.0)  # a telemetry interval, so the sidecars' records are current
                left = await left_in_flight(stack, session)
    failed = [
        {
            "sent_s": round(s.scheduled_s, 3),
            "status": s.status,
            "instance": s.instance,
            "latency_s": round(s.latency_s, 3),
        }
        for s in samples
        if s.status != 200
    ]
    latencies = [s.latency_s * 1000.0 for s in samples if s.status == 200]
    doc: dict[str, Any] = {
        "benchmark": "soak",
        "command": f"python -m bench.soak --rate {args.rate:g} --duration {args.duration:g} --lb-policy {args.lb_policy} --seed {args.seed}",
        "note": "the instances are the `sim` backend, a simulator of an SGLang server's timing, not a model",
        "requests": len(samples),
        "ok": len(latencies),
        "failed": failed,
        "latency_ms": {
            "p50": round(percentile(latencies, 50), 1),
            "p99": round(percentile(latencies, 99), 1),
            "max": round(max(latencies, default=float("nan")), 1),
        },
        "left_in_flight": left,
    }
    doc["judged"] = judged(doc)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"{doc['requests']} requests, {doc['ok']} answered 200, {len(failed)} failed; latency ms {doc['latency_ms']}")
    for f in failed[:20]:
        print(f"  failed: {f}")
    print(f"left in flight after the load: {left}")
    print(f"wrote {args.out}")
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    return 0 if all(c["holds"] for c in doc["judged"]) else 1


def judged(doc: dict) -> list[dict]:
    """The soak's two targets: every request answered 200, and nothing left in flight once the load ended."""
    leaked = sorted(
        iid
        for iid, v in doc["left_in_flight"].items()
        if v["envoy_active"] or v["sidecar_in_flight"] or v["sidecar_queued"]
    )
    return [
        {
            "target": "every request answered 200",
            "value": len(doc["failed"]),
            "limit": 0,
            "holds": not doc["failed"] and doc["ok"] == doc["requests"],
        },
        {
            "target": "nothing left in flight at Envoy or any sidecar after the load (instances holding some)",
            "value": leaked,
            "limit": [],
            "holds": not leaked,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=120.0, help="requests per second (default 120)")
    parser.add_argument("--duration", type=float, default=500.0, help="seconds of load (default 500)")
    parser.add_argument("--lb-policy", default="round_robin", choices=("round_robin", "least_request"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="60 s instead of the default duration")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json", help="where to write the JSON report")
    args = parser.parse_args(argv)
    if args.quick:
        args.duration = 60.0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
