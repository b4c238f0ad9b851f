"""Rollouts under load: a good build goes live step by step, a bad one rolls back by itself (DESIGN §11).

    python -m bench.rollout [--quick] [--out PATH] [--scenarios good,slow,errors]

ONE stack for the whole run: `sie up -f <cluster>` (xds_server, a real Envoy, the node host, sidecars,
`sim` workers: an SGLang timing SIMULATOR, not a model) with one model `chat` (service_type llm, two
replicas, SLA p99 2000 ms) at version 1.0. Open-loop Poisson load at a fixed rate runs through Envoy's
ingress from the first second to the last; every request's scheduled start, end, status and the
instance that answered (`x-sie-instance`) are recorded. Latency is from the scheduled send time. Then,
in order, each a `PUT /v1/models/chat` with the admin token `sie up` made (what `sie apply` does):

  good    1.0 -> 2.0, the same engine: it must go live with no failed request, p99 during the rollout
          within 1.1x the steady p99 right before it (same rate, a window of the rollout's length), and
          reach 100% within the configured steps x holds + 10 s (instance start-up is part of it).
  slow    2.0 -> 3.0-slow, `slowdown: 3` (3x slower): it must roll back during its first step's hold,
          serve no more than that step's share of the requests meanwhile, fail no request, and leave
          2.0 serving everything.
  errors  2.0 -> 3.1-errors, `error_rate: 0.05` (5% answered 500): the same, and no failed request
          beyond the 500s the bad build itself returned.

Between scenarios the bench waits for the retiring build's instances to be gone, then runs steady load
again before the next apply. Instance builds are told apart by their ids (placement.generation_of:
`chat-0` is generation 0, `chat.g1-0` generation 1, ...); rollout events are the control plane's own
(GET /v1/models/chat/rollout, wall-clock `at`, the same clock as the bench's on this machine).

How the targets are measured. "During the rollout" is from the apply to the control plane's `succeeded`
event; the steady window is the same length right before the apply. Failed requests are every answer
but a 200 (retryable 503s included) from the apply to the end of the tail, so the retiring build's drain
counts. A bad build's hold is from its `step 1/N` event (its share live) to its `rolled_back` event; the
share it served there is compared with its step's share through the binomial 99% bound for that many
requests, since Envoy draws each request's cluster independently (at 25% of ~150 requests, 28% is an
ordinary draw, 34% is not). "Back at 100%" counts the requests from `grace_s` after the rollback (the
route push) to the end of the tail. Diagnostics beside the targets: the CPU each part of the stack used
(Machine), the p99 without the requests in flight while a new instance started, and Envoy's count of
requests that found no healthy host.

Writes bench/results/rollout.json (figures, setup, machine and the `judged` targets),
bench/results/rollout.png (per scenario: the new build's share of served requests per 0.5 s bucket,
the configured share, the rollout's events) and bench/results/rollout.requests.csv.gz (every request),
and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gzip
import http.client
import io
import json
import math
import os
import platform
import random
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.eviction import stop_stack
from bench.stack import Urls, start_cluster
from bench.stats import percentile
from sie.processes import all_processes, descendants
from xds_server.envoy_process import admin_request_async
from xds_server.placement import generation_of

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "chat"
ENGINE = {"decode_base_ms": 4.0, "decode_ms_per_request": 0.25, "max_running_requests": 32}
SCENARIOS = ("good", "slow", "errors")
TERMINAL = ("succeeded", "rolled_back", "aborted")
LIVE = ("pending", "loading", "ready", "draining")  # instance states that still hold a process
BUCKET_S = 0.5


@dataclass(frozen=True)
class Plan:
    rate_rps: float = 150.0
    max_tokens: int = 16  # ~110 ms p50 through Envoy and a sidecar on the sim engine at these rates
    steps: tuple[int, ...] = (10, 25, 50, 100)
    hold_s: float = 10.0
    min_requests: int = 50  # answers each build needs in its sidecars' windows before a gate is judged
    warmup_s: float = 10.0  # load before anything is measured
    steady_good_s: float = 50.0  # load before the good apply: the steady window is its last <rollout> seconds
    steady_bad_s: float = 20.0  # load before each bad apply; the steady p99 is over all of it
    tail_s: float = 10.0  # load after a rollout ended and the retiring build is gone
    grace_s: float = 1.0  # after a rollback, before "subsequent" requests are counted (the route push)
    rollout_timeout_s: float = 150.0
    retire_timeout_s: float = 45.0
    seed: int = 1

    @property
    def holds_s(self) -> float:
        return len(self.steps) * self.hold_s


QUICK = Plan(
    rate_rps=100.0,
    steps=(25, 50, 100),
    # 6 s holds: on 2 cores a new instance's start takes ~1.3 cores for ~1 s and slows everything beside it;
    # in shorter windows that one second decides the rollout's p99 (it did in half the runs with 3 s).
    hold_s=6.0,
    min_requests=20,
    warmup_s=4.0,
    steady_good_s=30.0,
    steady_bad_s=8.0,
    tail_s=4.0,
    rollout_timeout_s=60.0,
    retire_timeout_s=30.0,
)


def model_service(plan: Plan, version: str, **engine: float) -> dict[str, Any]:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": MODEL},
        "spec": {
            "model": {"name": MODEL, "version": version, "service_type": "llm", "priority_level": "P1"},
            "backend": {"type": "sim", "config": {**ENGINE, **engine}},
            "resources": {"max_concurrent_requests": 32},
            "sla": {"p99_latency_ms": 2000, "max_queue_time_ms": 1000, "min_replicas": 2, "max_replicas": 2},
            "rollout": {
                "steps": list(plan.steps),
                "hold_s": plan.hold_s,
                "gates": {"min_requests": plan.min_requests},
            },
        },
    }


def builds(plan: Plan) -> dict[str, dict[str, Any]]:
    """Scenario -> the ModelService it applies."""
    return {
        "good": model_service(plan, "2.0"),
        "slow": model_service(plan, "3.0-slow", slowdown=3.0),
        "errors": model_service(plan, "3.1-errors", error_rate=0.05),
    }


# ---- the stack -----------------------------------------------------------------------------------


def start_stack(workdir: Path, plan: Plan, timeout_s: float = 120.0) -> tuple[subprocess.Popen, Urls]:
    """`sie up` on free ports with chat 1.0; returns once it serves."""
    docs = [{"kind": "Cluster", "spec": {"host": "127.0.0.1"}}, model_service(plan, "1.0")]
    return start_cluster(workdir, docs, timeout_s, name="rollout")


# ---- load and observation ------------------------------------------------------------------------


@dataclass
class Request:
    start: float  # wall clock of the scheduled send
    end: float = math.nan  # wall clock of the answer's end
    status: int = -1  # HTTP status; 0 a transport error; -1 not answered yet
    instance: str = ""
    error: str = ""
    retryable: bool = False  # a refusal the client is told to retry (x-sie-retryable or Retry-After)

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1000.0

    @property
    def generation(self) -> int | None:
        return generation_of(self.instance) if self.instance else None


class OpenLoop:
    """Poisson arrivals at a fixed rate until stopped; every request kept, answered or not."""

    def __init__(self, session: aiohttp.ClientSession, url: str, plan: Plan):
        self._session, self._url, self._plan = session, url, plan
        self.requests: list[Request] = []
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        rng, start, offset = random.Random(self._plan.seed), time.time(), 0.0
        timeout = aiohttp.ClientTimeout(total=30)
        while not self._stop.is_set():
            offset += rng.expovariate(self._plan.rate_rps)
            delay = start + offset - time.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                    break
                except TimeoutError:
                    pass
            req = Request(start + offset)
            self.requests.append(req)
            task = asyncio.create_task(self._one(req, len(self.requests), timeout))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.gather(*list(self._tasks))

    async def _one(self, req: Request, i: int, timeout: aiohttp.ClientTimeout) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}: tell me about canaries"}],
            "max_tokens": self._plan.max_tokens,
        }
        try:
            async with self._session.post(self._url, json=body, timeout=timeout) as resp:
                payload = await resp.read()
                req.status, req.instance = resp.status, resp.headers.get("x-sie-instance", "")
                req.retryable = resp.headers.get("x-sie-retryable") == "true" or "Retry-After" in resp.headers
                if resp.status != 200:
                    req.error = payload[:160].decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError) as exc:
            req.status, req.error = 0, repr(exc)[:160]
        req.end = time.time()

    def stop(self) -> None:
        self._stop.set()


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3), headers=headers) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def envoy_counters(session: aiohttp.ClientSession, urls: Urls) -> dict[str, int]:
    """Envoy's own counters of requests that found no healthy host, per cluster (its UH answers)."""
    try:
        _, body = await admin_request_async(urls.envoy_admin, "/stats?filter=upstream_cx_none_healthy", timeout=3)
    except (OSError, http.client.HTTPException):
        return {}
    text = body.decode(errors="replace")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit() and int(value) > 0:
            out[name.strip()] = int(value)
    return out


async def instance_rows(session: aiohttp.ClientSession, urls: Urls) -> list[dict[str, Any]]:
    status = await get_json(session, urls.admin + "/v1/status", urls.headers)
    for model in (status or {}).get("models", []):
        if model.get("model_id") == MODEL:
            return list(model.get("instances", []))
    return []


PARTS = (
    ("node_host.backends.sim", "sim workers"),
    ("-m sidecar", "sidecars"),
    ("-m xds_server", "xds_server"),
    ("-m node_host", "node host"),
    ("envoy", "envoy"),
    ("-m sie", "sie up"),
)


class Machine:
    """Where the 2 cores go: every `interval_s` the machine's busy share (/proc/stat, steal included: the
    hypervisor giving the CPU to a neighbour) and its steal share, the CPU each part of the stack used
    (its processes' utime + stime from /proc, a new process's start-up included) and anything else on
    the machine, and how late the bench's own event loop ran its timers (if it stalls, every request in
    flight is late)."""

    def __init__(self, root_pid: int, interval_s: float = 0.5):
        self.root_pid, self.interval_s = root_pid, interval_s
        self.tick = os.sysconf("SC_CLK_TCK")
        self.samples: list[dict[str, Any]] = []  # {"at", "busy", "parts": {part: cores}}
        self.lags: list[tuple[float, float]] = []  # (wall, ms) of each timer that ran over 2 ms late
        self._ticks: dict[int, int] = {}
        self._parts: dict[int, str] = {}
        self._stat: tuple[int, int, int] | None = None
        self._last: float | None = None

    def _part(self, pid: int) -> str:
        if pid not in self._parts:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = ""
            self._parts[pid] = next((name for key, name in PARTS if key in cmd), "other")
        return self._parts[pid]

    def sample(self) -> None:
        now = time.perf_counter()
        elapsed = now - self._last if self._last is not None else self.interval_s
        self._last = now
        procs = all_processes()
        ours = {self.root_pid, *descendants(self.root_pid, procs)}
        parts: dict[str, float] = {}
        for pid, stat in procs.items():
            before = self._ticks.get(pid, 0)  # a new process: all its CPU so far (the first sample is dropped)
            self._ticks[pid] = stat.ticks
            if pid == os.getpid():
                part = "bench"
            elif pid in ours:
                part = self._part(pid)
            else:
                part = "other: " + stat.name  # anything else on the machine, by its name
            parts[part] = parts.get(part, 0.0) + (stat.ticks - before) / self.tick / elapsed
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        total, idle, steal = sum(cpu), cpu[3] + cpu[4], cpu[7]
        busy = stolen = None
        if self._stat is not None and total > self._stat[0]:
            busy = 1.0 - (idle - self._stat[1]) / (total - self._stat[0])
            stolen = (steal - self._stat[2]) / (total - self._stat[0])
        self._stat = (total, idle, steal)
        if busy is not None:
            kept = {k: round(v, 3) for k, v in parts.items() if not k.startswith("other") or v >= 0.02}
            self.samples.append({"at": time.time(), "busy": busy, "steal": stolen, "parts": kept})

    async def run(self) -> None:
        next_sample = time.perf_counter()
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            late = time.perf_counter() - before - 0.01
            if late > 0.002:
                self.lags.append((time.time(), late * 1000.0))
            if time.perf_counter() >= next_sample:
                next_sample += self.interval_s
                self.sample()

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        got = [s for s in self.samples if t0 <= s["at"] - self.interval_s and s["at"] <= t1]
        lags = [ms for at, ms in self.lags if t0 <= at < t1]
        parts: dict[str, float] = {}
        for s in got:
            for k, v in s["parts"].items():
                parts[k] = parts.get(k, 0.0) + v / len(got)
        busy = [s["busy"] for s in got if s["busy"] is not None]
        steal = [s["steal"] for s in got if s["steal"] is not None]
        return {
            "machine_steal_mean": round(sum(steal) / len(steal), 3) if steal else None,
            "machine_busy_mean": round(sum(busy) / len(busy), 3) if busy else None,
            "machine_busy_max": round(max(busy), 3) if busy else None,
            "cores_by_part_mean": {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "bench_loop_late_max_ms": round(max(lags), 1) if lags else 0.0,
            "bench_loop_late_over_20ms": sum(1 for ms in lags if ms > 20),
        }


@dataclass
class Episode:
    """One scenario as the bench drove it: when it applied, what the control plane said, when it ended."""

    name: str
    to_version: str
    steady_from: float
    applied_at: float
    put_status: int
    rollout: dict[str, Any] = field(default_factory=dict)  # the last GET .../rollout
    finished_seen_at: float | None = None  # when the bench first saw a terminal phase
    retired_at: float | None = None  # no retiring instance left in /v1/status
    ended_at: float = 0.0  # end of the tail
    instances_seen: dict[str, str] = field(default_factory=dict)  # instance -> "build role/state" last seen
    none_healthy: dict[str, int] = field(default_factory=dict)  # Envoy's counters at the end of the tail


class Watch:
    """Polls the rollout (every 0.2 s) and the model's instances (every 0.4 s) for the WHOLE run, so the
    bench's own load on the control plane is the same in the steady windows as during a rollout."""

    def __init__(self, session: aiohttp.ClientSession, urls: Urls):
        self._session, self._urls = session, urls
        self.rollout: dict[str, Any] | None = None
        self.rows: list[dict[str, Any]] = []
        self.rows_at = 0.0
        self.ready_at: dict[str, float] = {}  # instance -> when /v1/status first showed it ready

    async def run(self) -> None:
        tick = 0
        while True:
            doc = await get_json(self._session, f"{self._urls.admin}/v1/models/{MODEL}/rollout", self._urls.headers)
            if doc is not None:
                self.rollout = doc
            if tick % 2 == 0:
                self.rows, self.rows_at = await instance_rows(self._session, self._urls), time.time()
                for row in self.rows:
                    if row.get("state") == "ready":
                        self.ready_at.setdefault(row["instance_id"], self.rows_at)
            tick += 1
            await asyncio.sleep(0.2)

    async def fresh_rows(self) -> list[dict[str, Any]]:
        seen = self.rows_at
        while self.rows_at == seen:
            await asyncio.sleep(0.05)
        return self.rows


async def run_scenario(
    session: aiohttp.ClientSession, urls: Urls, watch: Watch, plan: Plan, name: str, service: dict[str, Any]
) -> Episode:
    steady_s = plan.steady_good_s if name == "good" else plan.steady_bad_s
    steady_from = time.time()
    await asyncio.sleep(steady_s)
    applied_at = time.time()
    async with session.put(f"{urls.admin}/v1/models/{MODEL}", json=service, headers=urls.headers) as resp:
        put_status = resp.status
        put_body = await resp.text()
    ep = Episode(name, service["spec"]["model"]["version"], steady_from, applied_at, put_status)
    print(f"[{name}] PUT {ep.to_version}: HTTP {put_status}", flush=True)
    if put_status != 202:
        ep.rollout = {"error": put_body[:500]}
        ep.ended_at = time.time()
        return ep
    deadline = applied_at + plan.rollout_timeout_s
    while time.time() < deadline:
        doc = watch.rollout
        if doc is not None and doc.get("to_version") == ep.to_version and doc.get("started_at", 0) >= applied_at - 5:
            ep.rollout = doc
            if doc["phase"] in TERMINAL:
                ep.finished_seen_at = time.time()
                break
        await asyncio.sleep(0.1)
    else:
        print(f"[{name}] no terminal phase within {plan.rollout_timeout_s:g} s; aborting it", flush=True)
        async with session.post(f"{urls.admin}/v1/models/{MODEL}/rollout/abort", headers=urls.headers) as resp:
            await resp.read()
    deadline = time.time() + plan.retire_timeout_s
    while time.time() < deadline:
        try:
            rows = await asyncio.wait_for(watch.fresh_rows(), 5.0)
        except TimeoutError:
            continue
        for row in rows:
            ep.instances_seen[row["instance_id"]] = f"{row.get('build', '?')}/{row.get('state', '?')}"
        # Rows of stopped instances linger (their last telemetry); gone means none serves or drains.
        if rows and not any(r.get("build") != "stable" and (r.get("in_eds") or r.get("state") in LIVE) for r in rows):
            ep.retired_at = time.time()
            break
    await asyncio.sleep(plan.tail_s)
    ep.ended_at = time.time()
    ep.none_healthy = await envoy_counters(session, urls)
    final = await get_json(session, f"{urls.admin}/v1/models/{MODEL}/rollout", urls.headers)
    if final is not None and final.get("to_version") == ep.to_version:
        ep.rollout = final
    gone = f"{ep.retired_at - applied_at:.1f} s" if ep.retired_at else "not"
    print(
        f"[{name}] {ep.rollout.get('phase')} ({ep.rollout.get('reason', '')}); retiring build gone {gone}", flush=True
    )
    return ep


async def drive(
    urls: Urls, plan: Plan, scenarios: list[str], machine: Machine
) -> tuple[list[Request], list[Episode], float, list[dict[str, Any]], dict[str, float]]:
    specs = builds(plan)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = OpenLoop(session, urls.envoy + "/v1/chat/completions", plan)
        watch = Watch(session, urls)
        loader = asyncio.create_task(load.run(), name="load")
        watcher = asyncio.create_task(watch.run(), name="watch")
        meter = asyncio.create_task(machine.run(), name="machine")
        episodes: list[Episode] = []
        started = time.time()
        try:
            await asyncio.sleep(plan.warmup_s)
            for name in scenarios:
                episodes.append(await run_scenario(session, urls, watch, plan, name, specs[name]))
        finally:
            load.stop()
            await loader
            watcher.cancel()
            meter.cancel()
            await asyncio.gather(watcher, meter, return_exceptions=True)
        got = await get_json(session, f"{urls.node}/v1/events?since={started - 60}", urls.headers)
    node_events = [e for e in (got or {}).get("events", []) if str(e.get("instance_id", "")).startswith(MODEL)]
    return load.requests, episodes, started, node_events, watch.ready_at


# ---- figures -------------------------------------------------------------------------------------


def _events(ep: Episode) -> list[dict[str, Any]]:
    return list(ep.rollout.get("events", []))


def _first(events: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    return next((e for e in events if e["what"].startswith(prefix)), None)


def _within(reqs: list[Request], t0: float, t1: float) -> list[Request]:
    return [r for r in reqs if t0 <= r.start < t1]


def _p(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 1)


def window(reqs: list[Request], t0: float, t1: float, new_gen: int | None = None) -> dict[str, Any]:
    """Requests scheduled in [t0, t1): counts, latency percentiles of the 200s, who served them."""
    got = _within(reqs, t0, t1)
    ok = [r for r in got if r.status == 200]
    lat = [r.latency_ms for r in ok]
    out: dict[str, Any] = {
        "from": round(t0, 3),
        "seconds": round(t1 - t0, 2),
        "requests": len(got),
        "ok": len(ok),
        "failed": len(got) - len(ok),
        "p50_ms": _p(lat, 50),
        "p99_ms": _p(lat, 99),
        "max_ms": round(max(lat), 1) if lat else None,
        "statuses": _counts(str(r.status) for r in got),
        "by_instance": _counts(r.instance or "-" for r in got),
    }
    if new_gen is not None:
        new = [r for r in got if r.generation == new_gen]
        out["served_by_new"] = len(new)
        out["new_share"] = round(len(new) / len(got), 4) if got else None
        out["p99_ms_new"] = _p([r.latency_ms for r in new if r.status == 200], 99)
        out["p99_ms_old"] = _p([r.latency_ms for r in ok if r.generation != new_gen], 99)
    return out


def _counts(keys: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def binomial_upper(n: int, p: float, alpha: float = 0.01) -> int:
    """The smallest k with P(X > k) <= alpha for X ~ Binomial(n, p): the most requests a build given
    share p of n independent draws serves, but for a 1-in-100 chance."""
    if n <= 0 or p <= 0:
        return 0
    if p >= 1:
        return n

    def pmf(k: int) -> float:
        log = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
        return math.exp(log + k * math.log(p) + (n - k) * math.log1p(-p))

    above = 0.0  # P(X > k), summed from the top down
    for k in range(n, -1, -1):
        if above + pmf(k) > alpha:
            return k
        above += pmf(k)
    return 0


def figures(
    ep: Episode, reqs: list[Request], plan: Plan, machine: Machine, starts: dict[str, tuple[float, float | None]]
) -> dict[str, Any]:
    doc, events = ep.rollout, _events(ep)
    new_gen = doc.get("generation")
    old_gen = doc.get("from_generation")
    phase = doc.get("phase")
    out: dict[str, Any] = {
        "to_version": ep.to_version,
        "from_version": doc.get("from_version"),
        "put_status": ep.put_status,
        "phase": phase,
        "reason": doc.get("reason"),
        "failed_gate": doc.get("failed_gate"),
        "from_generation": old_gen,
        "generation": new_gen,
        "events": [{**e, "s": round(e["at"] - ep.applied_at, 3)} for e in events],
        "applied_at": round(ep.applied_at, 3),
        "retiring_gone_s": None if ep.retired_at is None else round(ep.retired_at - ep.applied_at, 2),
        "instances_seen": ep.instances_seen,
        "envoy_no_healthy_host_total": ep.none_healthy,  # cumulative over the run, read after this scenario
    }
    if new_gen is None:
        return out
    finished = doc.get("finished_at")
    end = finished if finished is not None else ep.ended_at
    # Every request of the episode: from the apply to the end of the tail (the retiring build's drain in it).
    episode = window(reqs, ep.applied_at, ep.ended_at, new_gen)
    out["episode"] = episode
    failed = [r for r in _within(reqs, ep.applied_at, ep.ended_at) if r.status != 200]
    from_new = [r for r in failed if r.generation == new_gen]
    out["failed"] = {
        "total": len(failed),
        "from_new_build": len(from_new),
        "beyond_new_builds_own": len(failed) - len(from_new),
        "retryable_refusals": sum(1 for r in failed if r.retryable),
        "statuses": _counts(f"{r.status} {r.instance or '-'}" for r in failed),
        "first": [
            {
                "s": round(r.start - ep.applied_at, 3),
                "status": r.status,
                "instance": r.instance,
                "retryable": r.retryable,
                "error": r.error,
            }
            for r in failed[:10]
        ],
    }
    if ep.name == "good":
        during = window(reqs, ep.applied_at, end, new_gen)
        length = end - ep.applied_at
        steady_from = max(ep.steady_from, ep.applied_at - length)
        steady = window(reqs, steady_from, ep.applied_at)
        out["steady"] = steady
        out["during"] = during
        out["machine"] = {
            "steady": machine.summary(steady_from, ep.applied_at),
            "during": machine.summary(ep.applied_at, end),
        }
        out["after"] = window(reqs, end, ep.ended_at, new_gen)
        out["p99_ratio"] = (
            round(during["p99_ms"] / steady["p99_ms"], 3) if during["p99_ms"] and steady["p99_ms"] else None
        )
        # A diagnostic, not a target: the same p99 without the requests in flight while a new instance's
        # processes started (node host `placed` -> /v1/status `ready`), when the 2 cores are saturated.
        spans = [(a, b) for iid, (a, b) in starts.items() if generation_of(iid) == new_gen and b is not None]
        calm = [
            r.latency_ms
            for r in _within(reqs, ep.applied_at, end)
            if r.status == 200 and not any(r.start < b and r.end > a for a, b in spans)
        ]
        out["new_instance_startups_s"] = [[round(a - ep.applied_at, 2), round(b - ep.applied_at, 2)] for a, b in spans]
        out["p99_ms_outside_startups"] = _p(calm, 99)
        out["requests_outside_startups"] = len(calm)
        out["time_to_100_s"] = None
        if phase == "succeeded":
            if finished is None:  # the rollout machine sets finished_at with the phase
                raise RuntimeError(f"the {ep.name} rollout's status says succeeded without a finished_at: {doc}")
            out["time_to_100_s"] = round(finished - ep.applied_at, 2)
        out["limit_s"] = plan.holds_s + 10.0
        live = [e for e in events if e["what"].startswith("step ")]
        out["step_live_s"] = {e["what"]: round(e["at"] - ep.applied_at, 2) for e in live}
        return out
    steady = window(reqs, ep.steady_from, ep.applied_at)
    out["steady"] = steady
    step1 = _first(events, "step 1/")
    rolled = _first(events, "rolled_back")
    later_steps = [e for e in events if e["what"].startswith("step ") and not e["what"].startswith("step 1/")]
    out["later_steps"] = [e["what"] for e in later_steps]
    if step1 is None or rolled is None:
        return out
    live_at, back_at = step1["at"], rolled["at"]
    share = int(step1["share"])
    hold = window(reqs, live_at, back_at, new_gen)
    n = hold["requests"]
    bound = binomial_upper(n, share / 100.0)
    hold["step_share"] = share / 100.0
    hold["binomial_99_bound"] = bound
    hold["share_bound"] = round(bound / n, 4) if n else None
    out["hold"] = hold
    out["machine"] = {
        "steady": machine.summary(ep.steady_from, ep.applied_at),
        "apply_to_rollback": machine.summary(ep.applied_at, back_at),
        "after": machine.summary(back_at, ep.ended_at),
    }
    out["live_to_rollback_s"] = round(back_at - live_at, 3)
    out["apply_to_live_s"] = round(live_at - ep.applied_at, 3)
    out["episode_live"] = window(reqs, live_at, back_at + plan.tail_s, new_gen)
    new_reqs = [r for r in reqs if r.generation == new_gen]
    out["route_lag_s"] = {
        "first_new_after_live": round(min(r.start for r in new_reqs) - live_at, 3) if new_reqs else None,
        "last_new_after_rollback": round(max(r.start for r in new_reqs) - back_at, 3) if new_reqs else None,
    }
    after = window(reqs, back_at + plan.grace_s, ep.ended_at, new_gen)
    after["served_by_old"] = sum(
        1 for r in _within(reqs, back_at + plan.grace_s, ep.ended_at) if r.generation == old_gen
    )
    out["after"] = after
    return out


def timeline(ep: Episode, reqs: list[Request], new_gen: int | None) -> list[list[Any]]:
    """[seconds from apply, requests, served by the new build, failed, p99 ms of the 200s] per BUCKET_S of
    scheduled start."""
    if new_gen is None:
        return []
    t0 = ep.steady_from
    buckets: dict[int, list[Request]] = {}
    for r in _within(reqs, t0, ep.ended_at):
        buckets.setdefault(int((r.start - t0) // BUCKET_S), []).append(r)
    return [
        [
            round(t0 + k * BUCKET_S - ep.applied_at, 2),
            len(b),
            sum(1 for r in b if r.generation == new_gen),
            sum(1 for r in b if r.status != 200),
            _p([r.latency_ms for r in b if r.status == 200], 99),
        ]
        for k, b in sorted(buckets.items())
    ]


def instance_events(ep: Episode, node_events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The node host's placed/loaded/released events of the episode, seconds from the apply."""
    return [
        {"s": round(e["at"] - ep.applied_at, 3), "kind": e["kind"], "instance_id": e["instance_id"]}
        for e in node_events
        if ep.steady_from <= e["at"] <= ep.ended_at
    ]


# ---- judged targets ------------------------------------------------------------------------------


def judged(results: dict[str, dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def check(target: str, value: Any, limit: Any, holds: bool) -> None:
        checks.append({"target": target, "value": value, "limit": limit, "holds": bool(holds)})

    good = results.get("good")
    if good is not None:
        failed = good.get("failed", {}).get("total")
        check("(a) good build: failed requests during the rollout == 0", failed, 0, failed == 0)
        ratio = good.get("p99_ratio")
        check(
            "(a) good build: p99 during the rollout <= 1.1 x the steady p99 right before it",
            ratio,
            1.1,
            ratio is not None and ratio <= 1.1,
        )
        took = good.get("time_to_100_s")
        steps = "/".join(map(str, plan.steps))
        check(
            f"(a) good build: apply -> 100% (phase succeeded) <= steps x holds + 10 s "
            f"({len(plan.steps)} steps [{steps}] x {plan.hold_s:g} s + 10 s)",
            took,
            plan.holds_s + 10.0,
            took is not None and took <= plan.holds_s + 10.0,
        )
    for key, label in (("slow", "(b) 3x slower build"), ("errors", "(c) 5%-errors build")):
        r = results.get(key)
        if r is None:
            continue
        took = r.get("live_to_rollback_s")
        rolled = r.get("phase") == "rolled_back" and not r.get("later_steps")
        check(
            f"{label}: rolled back during its first step's hold (step 1 live -> rollback <= hold_s, no step 2)",
            took,
            plan.hold_s,
            rolled and took is not None and took <= plan.hold_s,
        )
        hold = r.get("hold", {})
        share, bound = hold.get("new_share"), hold.get("share_bound")
        check(
            f"{label}: share of the hold's requests it served <= its first step's share "
            f"{plan.steps[0]}% (limit: the binomial 99% bound for the hold's "
            f"{hold.get('requests', 0)} requests, Envoy drawing each request's cluster at "
            f"{plan.steps[0]}%)",
            share,
            bound,
            share is not None and bound is not None and share <= bound,
        )
        failed = r.get("failed", {})
        if key == "slow":
            n = failed.get("total")
            check(f"{label}: failed requests == 0", n, 0, n == 0)
        else:
            n = failed.get("beyond_new_builds_own")
            check(
                f"{label}: failed requests beyond the bad build's own 500s == 0 "
                f"(it returned {failed.get('from_new_build')})",
                n,
                0,
                n == 0,
            )
        after = r.get("after", {})
        not_old = None if not after else after["requests"] - after["served_by_old"]
        check(
            f"{label}: old version back at 100% afterwards (phase rolled_back; requests from "
            f"{plan.grace_s:g} s after the rollback to the end of the tail not served by an old-build "
            f"instance, or failed)",
            not_old,
            0,
            r.get("phase") == "rolled_back" and not_old == 0 and after.get("failed") == 0,
        )
    return checks


# ---- output --------------------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]]) -> str:
    def get(r: dict[str, Any], *path: str) -> Any:
        for p in path:
            if not isinstance(r, dict):
                return None
            r = r.get(p)  # type: ignore[assignment]
        return r

    rows = [
        ("version", lambda r: f"{r.get('from_version')}->{r.get('to_version')}"),
        ("phase", lambda r: r.get("phase")),
        ("failed gate", lambda r: get(r, "failed_gate", "name") or "-"),
        ("requests (apply..tail)", lambda r: get(r, "episode", "requests")),
        ("failed (apply..tail)", lambda r: get(r, "failed", "total")),
        ("  of them the new build's", lambda r: get(r, "failed", "from_new_build")),
        ("steady p99 ms", lambda r: get(r, "steady", "p99_ms")),
        ("p99 ms during rollout", lambda r: get(r, "during", "p99_ms")),
        ("p99 ratio", lambda r: r.get("p99_ratio")),
        ("  p99 ms outside start-ups", lambda r: r.get("p99_ms_outside_startups")),
        (
            "machine busy steady/during",
            lambda r: _pair(
                get(r, "machine", "steady", "machine_busy_mean"),
                get(r, "machine", "during", "machine_busy_mean")
                or get(r, "machine", "apply_to_rollback", "machine_busy_mean"),
            ),
        ),
        ("apply -> 100% s", lambda r: r.get("time_to_100_s")),
        ("  limit s", lambda r: r.get("limit_s")),
        ("apply -> step 1 live s", lambda r: r.get("apply_to_live_s")),
        ("step 1 live -> rollback s", lambda r: r.get("live_to_rollback_s")),
        ("hold: requests", lambda r: get(r, "hold", "requests")),
        ("hold: new build share", lambda r: get(r, "hold", "new_share")),
        ("hold: p99 ms (all)", lambda r: get(r, "hold", "p99_ms")),
        ("live..rollback+tail p99 ms", lambda r: get(r, "episode_live", "p99_ms")),
        ("hold: p99 ms new / old", lambda r: _pair(get(r, "hold", "p99_ms_new"), get(r, "hold", "p99_ms_old"))),
        ("after rollback: not old", lambda r: _not_old(r)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{m:>16}" for m in results)]
    for name, cell in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{_fmt(cell(r)):>16}" for r in results.values()))
    return "\n".join(lines)


def _pair(a: Any, b: Any) -> str | None:
    return None if a is None and b is None else f"{_fmt(a)} / {_fmt(b)}"


def _not_old(r: dict[str, Any]) -> int | None:
    after = r.get("after") or {}
    return after["requests"] - after["served_by_old"] if "served_by_old" in after else None


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only when writing the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.0 * len(results)), squeeze=False)
    colors = {"step": "tab:green", "succeeded": "tab:blue", "rolled_back": "tab:red", "started": "black"}
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        points = r.get("timeline", [])
        xs = [p[0] + BUCKET_S / 2 for p in points]
        ax.plot(xs, [p[2] / p[1] if p[1] else 0 for p in points], color="tab:orange", lw=1.2, label="served by new")
        # The configured share over time, from the rollout's events.
        sx, sy = [points[0][0] if points else 0.0], [0.0]
        for e in r.get("events", []):
            sx.append(e["s"])
            sy.append(sy[-1])
            sx.append(e["s"])
            sy.append(e["share"] / 100.0)
        sx.append(points[-1][0] + BUCKET_S if points else 1.0)
        sy.append(sy[-1])
        ax.plot(sx, sy, color="tab:gray", lw=1, ls="--", label="configured share")
        busy = [(m[0] - 0.25, m[1]) for m in r.get("machine_timeline", []) if m[1] is not None]
        ax.fill_between(
            [b[0] for b in busy],
            [b[1] for b in busy],
            step="mid",
            color="tab:gray",
            alpha=0.15,
            lw=0,
            label="machine CPU busy (of 2 cores)",
        )
        bad = [(p[0] + BUCKET_S / 2, p[3]) for p in points if p[3]]
        if bad:
            ax.scatter([b[0] for b in bad], [1.05] * len(bad), marker="x", color="tab:red", s=20, label="failed")
        for e in r.get("events", []):
            kind = "step" if e["what"].startswith("step") else e["what"]
            ax.axvline(e["s"], color=colors.get(kind, "tab:purple"), lw=0.8, alpha=0.8)
            ax.text(e["s"], 1.1, e["what"], rotation=90, fontsize=7, va="bottom", ha="right")
        lat = ax.twinx()
        lat.plot(xs, [p[4] for p in points], color="tab:blue", lw=0.6, alpha=0.5)
        lat.set_ylabel("p99 ms per bucket", fontsize=7, color="tab:blue")
        lat.tick_params(labelsize=7)
        lat.set_ylim(0, max([p[4] or 0 for p in points] + [1]) * 1.6)
        marks = {"placed": ("^", "tab:green"), "loaded": ("o", "tab:green"), "released": ("v", "tab:brown")}
        for e in r.get("instances", []):
            if e["kind"] in marks:
                marker, color = marks[e["kind"]]
                ax.scatter([e["s"]], [-0.0], marker=marker, color=color, s=18, zorder=5, clip_on=False)
                ax.text(e["s"], 0.03, e["instance_id"], fontsize=6, rotation=90, color=color)
        if r.get("retiring_gone_s") is not None:
            ax.axvline(r["retiring_gone_s"], color="tab:brown", lw=0.8, ls=":", label="retiring build gone")
        ax.axvline(0.0, color="black", lw=1.0, label="apply")
        gate = (r.get("failed_gate") or {}).get("name")
        ax.set_title(
            f"{name}: {r.get('from_version')} -> {r.get('to_version')}: {r.get('phase')}"
            + (f" (gate {gate})" if gate else "")
            + f"; failed {r.get('failed', {}).get('total')}",
            fontsize=9,
            loc="left",
        )
        ax.set_ylim(-0.02, 1.5)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        ax.set_ylabel("share of requests")
    axes[-1, 0].set_xlabel(f"seconds from the apply (per {BUCKET_S:g} s of scheduled start; sim workers)")
    axes[0, 0].legend(fontsize=7, ncol=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_requests(reqs: list[Request], path: Path, t0: float) -> None:
    buf = io.StringIO()
    out = csv.writer(buf)
    out.writerow(["start_s", "end_s", "status", "instance"])
    for r in reqs:
        out.writerow([f"{r.start - t0:.4f}", f"{r.end - t0:.4f}", r.status, r.instance])
    with gzip.open(path, "wt", compresslevel=9) as fh:
        fh.write(buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lower rate, short holds (~2-3 minutes)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}, in order")
    parser.add_argument("--out", type=Path, default=RESULTS / "rollout.json")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    scenarios = args.scenarios.split(",")
    if any(s not in SCENARIOS for s in scenarios):
        parser.error(f"--scenarios takes {','.join(SCENARIOS)}")
    wall = time.time()
    with tempfile.TemporaryDirectory(prefix="sie-bench-rollout-") as tmp:
        proc, urls = start_stack(Path(tmp), plan)
        try:
            print(f"stack up in {time.time() - wall:.1f} s; load {plan.rate_rps:g} req/s", flush=True)
            machine = Machine(proc.pid)
            reqs, episodes, started, node_events, ready_at = asyncio.run(drive(urls, plan, scenarios, machine))
        finally:
            stop_stack(proc)
    results: dict[str, dict[str, Any]] = {}
    placed = {e["instance_id"]: e["at"] for e in node_events if e["kind"] == "placed"}
    starts = {iid: (at, ready_at.get(iid)) for iid, at in placed.items()}
    for ep in episodes:
        r = figures(ep, reqs, plan, machine, starts)
        r["instances"] = instance_events(ep, node_events)
        r["timeline"] = timeline(ep, reqs, r.get("generation"))
        r["machine_timeline"] = [
            [round(m["at"] - ep.applied_at, 2), m["busy"] and round(m["busy"], 3), m["parts"]]
            for m in machine.samples
            if ep.steady_from <= m["at"] <= ep.ended_at
        ]
        results[ep.name] = r
    answered = [r for r in reqs if r.status >= 0]
    doc: dict[str, Any] = {
        "benchmark": "rollout",
        "setup": {
            "command": "python -m bench.rollout" + (" --quick" if args.quick else ""),
            "quick": args.quick,
            "plan": asdict(plan),
            "stack": "one `sie up` stack for every scenario, in order (xds_server, Envoy, node host, sidecars)",
            "workers": "sim (SGLang timing simulator), not real models; 2 replicas per build",
            "builds": {k: v["spec"] for k, v in builds(plan).items() if k in scenarios},
            "load": f"open-loop Poisson {plan.rate_rps:g} req/s through Envoy, max_tokens {plan.max_tokens}",
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "run": {
            "started_at": round(started, 3),  # the zero of rollout.requests.csv.gz
            "wall_s": round(time.time() - wall, 1),
            "requests": len(reqs),
            "answered": len(answered),
            "failed_whole_run": sum(1 for r in reqs if r.status != 200),
            "load_s": round(max((r.start for r in reqs), default=started) - started, 1),
        },
        "results": results,
        "judged": judged(results, plan),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    picture = args.out.with_suffix(".png")
    plot(results, picture)
    requests_file = args.out.with_suffix(".requests.csv.gz")
    write_requests(reqs, requests_file, started)
    print(table(results))
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    print(f"\nwrote {args.out}, {picture} and {requests_file} in {doc['run']['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
