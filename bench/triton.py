"""A Triton scorer through SIE against the same Triton called directly, at 500 requests/s, in one run
(issue 39).

    python -m bench.triton [--quick] [--engines-dir DIR]

One `sie up` stack (bench/stack.py) with one ModelService: the demo text scorer (HashingVectorizer +
logistic regression, node_host/backends/sklearn_engine/demo_scorer.py) under `backend.type: triton`.
The node host writes the model repository with SIE's writer (triton_server/repository.py) and starts
the real `tritonserver` 2.51 of nvidia-pytriton from $SIE_ENGINES_DIR/triton (--engines-dir), with its
sidecar; Envoy, xds_server and the endpoint picker run as `sie up` runs them. Two paths to that one
server, alternating in short rounds (the order flips each round) so the shared machine's noise falls on
both:

    direct    KServe v2 JSON POSTs to Triton's /v2/models/<model>/infer with the worker-key header: the
              bytes SIE's TritonCodec sends for the same row (so both paths ask Triton the same thing)
    sie       SIE's /infer JSON ({"text": ...}, header x-sie-model) to Envoy -> sidecar (checks the
              input schema, translates to KServe v2 and back) -> Triton

Why `sie up` rather than composing the parts as bench/routing_stack.py does: the judged figure is SIE
as a user runs it (Envoy's concurrency, the picker beside it, the node host's core placement and probes,
the sidecar's flags as the node host gives them), and the direct path still reaches the very server
the node host started (its address from the node host's /v1/instances, its key from the run
directory), so the ratio is SIE's hops alone, against one Triton process, not two that could differ.

Rounds are short (2 s per path quick, 3 s full): another tenant's burst on this shared machine comes
and goes within seconds, and short alternating windows spread it over both paths. The judged p99 is each
path's over the whole run (its rounds pooled); the p99 over the rounds that no other tenant disturbed
(`quiet`) is reported beside it, not judged. The figures are bench/triton_report.py's.

Load: open-loop Poisson at 500 requests/s (the same arrival schedule for both paths in a round),
latency from the SCHEDULED send time, by bench/rawhttp.py (pre-built requests, asyncio protocols; an
aiohttp client costs about as much CPU per request as a scorer does and would measure itself). How
late the client's own event loop wakes is sampled every 10 ms beside the load (`client_lag_p99_ms`):
where it nears the direct path's p99, the client, not Triton, sets that figure. Each round also records
the cores each part used (`cpu_us_per_request`: what each hop costs) and those that processes outside
this run took (`others_cores`: another tenant's work, noise on both paths).

Writes bench/results/triton.json (figures, setup, machine, `judged`) and a table on stdout; exits 1
when a judged target fails.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench import rawhttp
from bench.eviction import stop_stack
from bench.loadgen import schedule
from bench.proc_cpu import cpu_snapshot, cpu_use
from bench.stack import Urls, start_cluster
from bench.triton_report import LABELS, PATHS, Measured, compare, cpu_per_request, judged, table
from node_host.backends.sklearn_engine.demo_scorer import ensure_demo_scorer
from node_host.engines import Engines, find_engines
from sie.engines.triton import INFER_PATH, KEY_HEADER, codec
from sie.processes import all_processes, descendants
from sie.spec import ModelService
from sie_testing.ports import free_port

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
MODEL = "triton-scorer"
LAG_SAMPLE_S = 0.01
# Rows the requests take in turn (both paths, the same order): short reviews as the demo scorer scores them.
TEXTS = (
    "order 17: the parcel arrived late and the box was damaged, refund requested",
    "great friendly service, the courier called ahead and everything was in perfect shape",
    "terrible rude staff at the counter, nobody could tell me where my delivery was",
    "ok product, nothing special, delivery took the promised three days",
    "the replacement part fits and works, thank you for the quick help",
    "broken on arrival again, this is the second time and support never answered",
    "love it, will order again for the whole team next month",
    "slow shipping but the quality is excellent and the price was fair",
)


@dataclass(frozen=True)
class Plan:
    rate_rps: float
    round_s: float
    rounds: int
    warmup_s: float


# Short windows: another tenant's burst on this shared machine comes and goes within seconds, so windows of
# 2-3 s alternating spread it over both paths where one of 5-10 s lands on one path alone.
PLANS = {
    "quick": Plan(rate_rps=500, round_s=2, rounds=8, warmup_s=1),
    "full": Plan(rate_rps=500, round_s=3, rounds=20, warmup_s=2),
}


def service_doc(model_path: Path) -> dict[str, Any]:
    """The ModelService: the demo scorer on Triton, Triton batching what is already waiting (no added delay)."""
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"name": MODEL, "path": str(model_path), "service_type": "scoring", "priority_level": "P0"},
            "backend": {"type": "triton", "config": {"demo": True, "dynamic_batching": {}}},
            "resources": {"max_concurrent_requests": 64},
            "input_schema": {"type": "json", "fields": [{"name": "text", "type": "string", "max_length": 4096}]},
            "output_schema": {"type": "json", "fields": [{"name": "score", "type": "float32", "range": [0.0, 1.0]}]},
            "sla": {"p99_latency_ms": 50, "max_queue_time_ms": 1000, "min_replicas": 1, "max_replicas": 1},
        },
    }


async def _loop_lag(samples: list[float], stop: asyncio.Event) -> None:
    """How late this event loop wakes a timer, every LAG_SAMPLE_S: the open-loop client's own send lag."""
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(LAG_SAMPLE_S)
        samples.append((time.perf_counter() - started - LAG_SAMPLE_S) * 1000)


async def _measure(
    host: str, port: int, requests: list[bytes], times: list[float]
) -> tuple[rawhttp.Result, list[float]]:
    lags: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_loop_lag(lags, stop), name="client-loop-lag")
    try:
        result = await rawhttp.open_loop(host, port, requests, times)
    finally:
        stop.set()
        await sampler
    return result, lags


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    requests: list[bytes]


def _children(root: int, marks: dict[str, str]) -> dict[str, int]:
    """name -> the pid of the process below `root` whose command line holds its mark (left out: none)."""
    procs = all_processes()
    found = {}
    for pid in descendants(root, procs):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for name, mark in marks.items():
            if name not in found and mark in argv:
                found[name] = pid
    return found


async def _triton_instance(session: aiohttp.ClientSession, urls: Urls) -> dict[str, Any]:
    async with session.get(urls.node + "/v1/instances", headers=urls.headers) as resp:
        doc = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"the node host's /v1/instances answered {resp.status}: {doc}")
    rows = [row for row in doc["instances"] if row["model_id"] == MODEL]
    if len(rows) != 1:
        raise RuntimeError(f"expected one instance of {MODEL}, the node host lists {rows}")
    return dict(rows[0])


async def _same_answer(
    session: aiohttp.ClientSession, urls: Urls, worker: str, key: str, service: ModelService
) -> bool:
    """Both paths answer 200 and the same score for the same text (the direct one read back by SIE's codec)."""
    translate = codec(service)
    doc = {"text": TEXTS[0]}
    async with session.post(
        urls.envoy + "/infer", json=doc, headers={"x-sie-model": MODEL, "Accept-Encoding": "identity"}
    ) as resp:
        via_sie = (resp.status, await resp.read())
    async with session.post(
        f"http://{worker}{INFER_PATH.replace('{model}', MODEL)}",
        data=translate.request(doc),
        # Triton compresses its answer when asked to (aiohttp asks by default); rawhttp's requests do not ask
        headers={"Content-Type": "application/json", "Accept-Encoding": "identity", KEY_HEADER: key},
    ) as resp:
        direct = translate.response(resp.status, await resp.read())
    if via_sie[0] != 200 or direct[0] != 200:
        raise RuntimeError(f"a path failed before the run: through SIE {via_sie}, direct {direct}")
    return abs(json.loads(via_sie[1])["score"] - json.loads(direct[1])["score"]) < 1e-6


async def run(plan: Plan, mode: str, workdir: Path, engines: Engines) -> dict[str, Any]:
    model_path = ensure_demo_scorer(workdir / ".sie" / "data" / f"{MODEL}.skops")  # sie up: the model root
    doc = service_doc(model_path)
    service = ModelService.model_validate(doc)
    load_before = os.getloadavg()
    cpus = list(range(os.cpu_count() or 1))
    proc, urls = start_cluster(
        workdir,
        [{"kind": "Cluster", "spec": {"host": "127.0.0.1"}}, doc],
        timeout_s=120.0,
        name="triton",
        extra=("--picker-port", str(free_port())),
    )
    rounds: list[dict[str, Measured]] = []
    cpu_rounds: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as session:
            inst = await _triton_instance(session, urls)
            key = (workdir / "run" / "secrets" / f"{inst['instance_id']}.worker-key").read_text().strip()
            same = await _same_answer(session, urls, inst["worker_address"], key, service)
        translate = codec(service)
        w_host, w_port = inst["worker_address"].rsplit(":", 1)
        e_host, e_port = urls.envoy.removeprefix("http://").rsplit(":", 1)
        targets = {
            "direct": Target(
                w_host,
                int(w_port),
                [
                    rawhttp.post(
                        INFER_PATH.replace("{model}", MODEL), translate.request({"text": t}), headers={KEY_HEADER: key}
                    )
                    for t in TEXTS
                ],
            ),
            "sie": Target(
                e_host,
                int(e_port),
                [
                    rawhttp.post("/infer", json.dumps({"text": t}).encode(), headers={"x-sie-model": MODEL})
                    for t in TEXTS
                ],
            ),
        }
        # The parts `sie up` started, for the cores each used (bench/proc_cpu.py); the Python backend's stub
        # is Triton's child, so it is named apart.
        marks = {
            "envoy": "bin/envoy -c",
            "picker": "-m xds_server.picker",
            "xds_server": "-m xds_server --cluster-file",
            "node_host": "-m node_host",
            "triton_python_stub": "triton_python_backend_stub",
        }
        pids = {
            "tritonserver": inst["worker"]["pid"],
            "sidecar": inst["sidecar"]["pid"],
            **_children(proc.pid, marks),
            "client": os.getpid(),
        }
        for p in PATHS:  # warm: connections, Triton's first executes, the sidecar's first translations
            t = targets[p]
            await rawhttp.open_loop(t.host, t.port, t.requests, schedule(plan.rate_rps, plan.warmup_s, 99))
        run_before = cpu_snapshot(pids, cpus, [os.getpid()])
        for r in range(plan.rounds):
            times = schedule(plan.rate_rps, plan.round_s, 1000 + r)  # the same arrivals for both paths
            order = PATHS if r % 2 == 0 else PATHS[::-1]
            measured: dict[str, Measured] = {}
            cpu_round: dict[str, Any] = {"round": r, "order": list(order)}
            for p in order:
                t = targets[p]
                before = cpu_snapshot(pids, cpus, [os.getpid()])
                result, lag = await _measure(t.host, t.port, t.requests, times)
                cpu_round[p] = cpu = cpu_use(before, cpu_snapshot(pids, cpus, [os.getpid()]))
                measured[p] = Measured(
                    tuple(result.ok_latencies_ms),
                    len(result.statuses),
                    result.ok,
                    result.span_s,
                    tuple(lag),
                    cpu["others_cores"],
                )
            rounds.append(measured)
            cpu_rounds.append(cpu_round)
            now = compare([measured])
            print(
                f"round {r}: p99 direct {now['direct']['p99_ms']} ms, through SIE {now['sie']['p99_ms']} ms "
                f"(x{now['p99_ratio']}); errors {now['direct']['errors']}/{now['sie']['errors']}; other tenants "
                f"{measured['direct'].others_cores}/{measured['sie'].others_cores} cores",
                file=sys.stderr,
                flush=True,
            )
        whole = cpu_use(run_before, cpu_snapshot(pids, cpus, [os.getpid()]))
    finally:
        stop_stack(proc)

    figures = compare(rounds)
    for entry, cpu_round in zip(figures["rounds"], cpu_rounds):
        entry["order"] = cpu_round["order"]
        entry["cpu"] = {p: cpu_round[p] for p in PATHS}
    figures["cpu_us_per_request"] = {
        p: cpu_per_request([(e["cpu"][p]["process_cores"], e[p]["achieved_rps"]) for e in figures["rounds"]])
        for p in PATHS
    }
    return {
        "benchmark": "triton",
        "mode": mode,
        "rate_rps": plan.rate_rps,
        "setup": {
            "stack": "sie up (bench/stack.py): xds_server, Envoy, picker, node host; the node host writes the "
            "model repository and starts tritonserver and the sidecar",
            "model": f"{MODEL}: demo text scorer (HashingVectorizer 4096 + LogisticRegression), backend.type triton",
            "backend_config": doc["spec"]["backend"]["config"],
            "spec_resources": doc["spec"]["resources"],
            "triton": f"tritonserver of nvidia-pytriton {engines.triton_version} ({engines.triton_venv})",
            "instance": {k: inst.get(k) for k in ("instance_id", "cpus", "background")},
            "paths": LABELS,
            "texts": len(TEXTS),
            "body_bytes": {p: sorted({len(r.split(b"\r\n\r\n", 1)[1]) for r in targets[p].requests}) for p in PATHS},
            "rate_rps": plan.rate_rps,
            "round_s": plan.round_s,
            "rounds": plan.rounds,
            "warmup_s": plan.warmup_s,
            "order": "alternating per round (direct first in even rounds); the same Poisson schedule for both "
            "paths in a round",
            "client": "bench/rawhttp.py open_loop (latency from the scheduled send time), one process",
            "same_answer_both_paths": same,
        },
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "cpu_whole_run": whole,
        **figures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.triton", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run that still shows the effect")
    parser.add_argument(
        "--engines-dir",
        type=Path,
        default=Path(os.environ.get("SIE_ENGINES_DIR") or REPO / ".sie" / "engines"),
        help="where the triton venv is (DIR/triton; default $SIE_ENGINES_DIR, else .sie/engines)",
    )
    args = parser.parse_args(argv)
    engines_dir = args.engines_dir.absolute()
    engines = find_engines(engines_dir)
    if engines.triton_venv is None:
        print(f"no Triton engine in {engines_dir}: run scripts/install-engines (or --engines-dir)", file=sys.stderr)
        return 2
    os.environ["SIE_ENGINES_DIR"] = str(engines_dir)  # `sie up`'s node host reads it (it runs in the workdir)
    mode = "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory(prefix="sie-bench-triton-") as tmp:
        try:
            result = asyncio.run(run(PLANS[mode], mode, Path(tmp), engines))
        except Exception:
            for log in sorted((Path(tmp) / "run" / "logs").glob("**/*.log")):  # the node host's and each instance's
                print(f"--- {log}\n{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)
            raise
    result["judged"] = judged(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "triton.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    for c in result["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    print(f"wrote {RESULTS / 'triton.json'}")
    return 0 if all(c["holds"] for c in result["judged"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
