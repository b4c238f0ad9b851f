"""Autoscaling under a load step: SIE's autoscaler against a fleet fixed at its floor and one fixed at its ceiling.

    python -m bench.autoscale [--quick] [--out PATH] [--modes fixed-min,fixed-max,sie] [--phase-s S]
    python -m bench.autoscale --engine vllm [--quick] ...   (real vLLM instances: bench/autoscale_vllm.py)

ONE STACK PER MODE, one after another in the same run on the same machine: `sie up -f <cluster>`
(xds_server, a real Envoy, the node host, sidecars, `sim` workers: an SGLang timing SIMULATOR, not a
model) with one model `chat` (service_type llm, resources.max_concurrent_requests 8, SLA p99 1000 ms),
started fresh for each mode so that no mode inherits another's instances or autoscaler memory:

  fixed-min  sla.min_replicas = max_replicas = 1: the fleet sized for the quiet load.
  fixed-max  sla.min_replicas = max_replicas = 6: the fleet sized for the peak, all the time.
  sie        sla.min_replicas 1, max_replicas 6, no spec.replicas: SIE's autoscaler moves the count
             (xds_server/autoscale: in-flight + queued per ready instance against
             autoscale.target_concurrency, default 0.7 x 8 = 5.6; up at once by at most max_step_up 4;
             down after scale_down_window_s, which the bench sets as a user would: a third of a phase).

Load: open-loop Poisson arrivals through Envoy's ingress in three phases of equal length, 1x -> 4x -> 1x
of ONE instance's capacity. "One instance's capacity" is the rate at which one instance holds the
autoscaler's target in flight, from the sim's own timing (core.py): a request costs its prefill
iteration (decode_base_ms; it yields the first token and stalls the batch) and its share of the
max_tokens - 1 decode iterations of the batch of c, each decode_base_ms + c x decode_ms_per_request,
so one instance serves 1000 / (decode_base_ms + (max_tokens - 1)(decode_base_ms + c x
decode_ms_per_request) / c) requests a second with c in flight: ~16 req/s at the target c = 5.6,
~20 req/s at 8 (saturation, 1.26x); the 4x phase needs four instances at the target. Beside it the bench reports the
end-to-end in flight it saw at 1x (Little's law: rate x mean latency through Envoy and the sidecar, so
a little above the worker's own figure) and the machine's CPU per part of the stack.

Every request is recorded (scheduled start, end, status, instance); latency is from the scheduled send
time, so queueing shows. GET <admin>/v1/status is polled every 0.5 s for the model's instances (ready
count), its autoscale block (desired, recommended, reason) and, at each phase boundary, the control
plane's `sie_autoscale_changes` counters (GET /metrics): the exact number of up and down changes per
phase. Instance-seconds integrate the number of ready instances over the three phases (the poll's
value holding until the next poll); "held" instance-seconds count every instance that holds processes
(pending, loading, ready, draining) and are reported beside them.

Targets (the issue's), for the sie mode against the fixed-max mode of the same run:
  - SLA attainment (requests answered 200 within sla.p99_latency_ms, of all scheduled in the phases)
    >= fixed-max's minus 1 point;
  - instance-seconds <= 65% of fixed-max's;
  - no flapping: within a phase the desired count never moves against the load's direction (phase 1
    rises from idle to 1x, phase 2 rises to 4x, phase 3 falls to 1x: no down change in phases 1-2, no
    up change in phase 3);
  - 0 failed requests (any answer but 200, or none).

Writes bench/results/autoscale.json (figures, setup, machine, `judged`), bench/results/autoscale.png
(per mode: offered load in units of one instance's capacity, ready and desired instances, p99 per
second) and prints a table and PASS/FAIL lines. Exits 0 whatever the verdicts.

`--engine vllm` runs the same modes, load shape and figures on real vLLM servers (its CPU build) with a
plan, a measured capacity and targets of its own (bench/autoscale_vllm.py); it writes
bench/results/autoscale-vllm.json. The engine-specific parts of a Plan (the backend, the cluster
settings, the request body, the capacity figure) are Plan methods that autoscale_vllm.VllmPlan overrides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.eviction import stop_stack
from bench.rollout import Machine, get_json
from bench.stack import Urls, start_cluster
from bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "chat"
MODES = ("fixed-min", "fixed-max", "sie")
LIVE = ("pending", "loading", "ready", "draining")  # instance states that hold processes
POLL_S = 0.5
BUCKET_S = 1.0
STALE_S = 5.0  # telemetry older than this: the instance is gone (sidecars report every second or so)


@dataclass(frozen=True)
class Plan:
    phase_s: float = 60.0
    multipliers: tuple[float, ...] = (1.0, 4.0, 1.0)
    max_tokens: int = 16
    decode_base_ms: float = 16.0
    decode_ms_per_request: float = 0.25
    max_concurrent: int = 8
    min_replicas: int = 1
    max_replicas: int = 6
    p99_latency_ms: float = 1000.0
    max_queue_time_ms: float = 1000.0
    scale_down_window_s: float = 20.0  # a user's choice: a third of a phase
    wake_ms: float = 150.0  # the sim's wake: the target for a 1.5B model's warm wake on a GPU
    settle_s: float = 3.0  # after the last phase, before the stack is stopped (answers still coming)
    ready_timeout_s: float = 150.0
    seed: int = 1
    settle_before_load: bool = False  # wait for exactly `want` ready, none pending or loading (slow starts)

    @property
    def target(self) -> float:
        return 0.7 * self.max_concurrent  # autoscale.target_concurrency's default

    def engine_ms_per_request(self, batch: float) -> float:
        """Engine time one request costs at `batch` in flight (the sim's scheduler, core.py): its own prefill
        iteration (decode_base_ms, the prompt's few tokens aside), which produces the first token and
        stalls the batch, and its share of the max_tokens - 1 decode iterations of the batch, each
        decode_base_ms + batch x decode_ms_per_request. The engine never idles while anything is in
        flight, so one instance serves 1000 / this requests a second with `batch` in flight."""
        decode = (self.max_tokens - 1) * (self.decode_base_ms + batch * self.decode_ms_per_request) / batch
        return self.decode_base_ms + decode

    @property
    def rate_1x(self) -> float:
        """One instance's capacity: the rate at which it holds the target concurrency in flight."""
        return round(1000.0 / self.engine_ms_per_request(self.target), 2)

    @property
    def saturation_rps(self) -> float:
        return round(1000.0 / self.engine_ms_per_request(self.max_concurrent), 2)

    # The engine-specific parts (bench/autoscale_vllm.VllmPlan overrides them).

    @property
    def workers(self) -> str:
        return "sim workers"

    def backend(self) -> dict[str, Any]:
        """The model's spec.backend."""
        return {
            "type": "sim",
            "config": {
                "decode_base_ms": self.decode_base_ms,
                "decode_ms_per_request": self.decode_ms_per_request,
                "max_running_requests": 32,  # the sidecar's limit (8) is the one that binds
                "wake_ms": self.wake_ms,  # a wake copies weights back: not free
            },
        }

    def model(self) -> dict[str, Any]:
        """The model's spec.model."""
        return {"name": MODEL, "version": "1.0", "service_type": "llm", "priority_level": "P1"}

    def cluster(self) -> dict[str, Any]:
        """The Cluster document's spec."""
        return {"host": "127.0.0.1"}

    def request_body(self, i: int) -> dict[str, Any]:
        """Request number i's chat completion body."""
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}: how many canaries fit in a mine"}],
            "max_tokens": self.max_tokens,
        }


# 30 s phases: at 20 s the seconds a step takes to reach its new capacity, up and down, are a third of a
# phase, and one run's luck in them decided the judged SLA or cost figure.
QUICK = Plan(phase_s=30.0, scale_down_window_s=10.0)


def model_service(plan: Plan, mode: str) -> dict[str, Any]:
    low, high = {
        "fixed-min": (plan.min_replicas, plan.min_replicas),
        "fixed-max": (plan.max_replicas, plan.max_replicas),
        "sie": (plan.min_replicas, plan.max_replicas),
    }[mode]
    spec: dict[str, Any] = {
        "model": plan.model(),
        "backend": plan.backend(),
        "resources": {"max_concurrent_requests": plan.max_concurrent},
        "sla": {
            "p99_latency_ms": plan.p99_latency_ms,
            "max_queue_time_ms": plan.max_queue_time_ms,
            "min_replicas": low,
            "max_replicas": high,
        },
    }
    if mode == "sie":
        # A user who expects bursts up to max keeps that many warm: scaling up is then a wake, not a load.
        spec["autoscale"] = {
            "scale_down_window_s": plan.scale_down_window_s,
            "warm_pool": plan.max_replicas - plan.min_replicas,
        }
    return {"apiVersion": "sie.io/v1alpha1", "kind": "ModelService", "metadata": {"name": MODEL}, "spec": spec}


# ---- the stack -----------------------------------------------------------------------------------


def start_stack(workdir: Path, plan: Plan, mode: str, timeout_s: float = 150.0) -> tuple[subprocess.Popen, Urls]:
    """`sie up` on free ports (127.0.0.1) with the mode's model; returns once it serves."""
    docs = [{"kind": "Cluster", "spec": plan.cluster()}, model_service(plan, mode)]
    return start_cluster(workdir, docs, timeout_s, name="autoscale")


# ---- load and observation ------------------------------------------------------------------------


@dataclass
class Request:
    start: float  # wall clock of the scheduled send
    phase: int
    end: float = math.nan
    status: int = -1  # HTTP status; 0 a transport error; -1 not answered
    instance: str = ""
    error: str = ""

    @property
    def latency_ms(self) -> float:
        return (self.end - self.start) * 1000.0


class StepLoad:
    """Poisson arrivals at rate_1x x multiplier[k] during phase k, from t0 for len(multipliers) phases."""

    def __init__(self, session: aiohttp.ClientSession, url: str, plan: Plan):
        self._session, self._url, self._plan = session, url, plan
        self.requests: list[Request] = []
        self._tasks: set[asyncio.Task] = set()

    async def run(self, t0: float) -> None:
        plan, rng = self._plan, random.Random(self._plan.seed)
        timeout = aiohttp.ClientTimeout(total=40)
        for k, mult in enumerate(plan.multipliers):
            begin, end = t0 + k * plan.phase_s, t0 + (k + 1) * plan.phase_s
            rate = plan.rate_1x * mult
            at = begin + rng.expovariate(rate)  # memoryless: restarting at the boundary keeps it Poisson
            while at < end:
                delay = at - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                req = Request(at, k)
                self.requests.append(req)
                task = asyncio.create_task(self._one(req, len(self.requests), timeout))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                at += rng.expovariate(rate)
        await asyncio.gather(*list(self._tasks))

    async def _one(self, req: Request, i: int, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self._session.post(self._url, json=self._plan.request_body(i), timeout=timeout) as resp:
                payload = await resp.read()
                req.status, req.instance = resp.status, resp.headers.get("x-sie-instance", "")
                if resp.status != 200:
                    req.error = payload[:160].decode(errors="replace")
        except (TimeoutError, aiohttp.ClientError) as exc:
            req.status, req.error = 0, repr(exc)[:160]
        req.end = time.time()


@dataclass
class Poll:
    at: float
    ready: int
    held: int
    desired: int | None
    recommended: int | None
    reason: str
    states: dict[str, str] = field(default_factory=dict)
    rows: dict[str, list[Any]] = field(default_factory=dict)  # instance -> [in_eds, weight, in_flight, queued]
    asleep: int = 0  # the warm pool: loaded, asleep (host memory, no GPU memory)


class Watch:
    """GET /v1/status every POLL_S: the model's instances and its autoscale block."""

    def __init__(self, session: aiohttp.ClientSession, urls: Urls):
        self._session, self._urls = session, urls
        self.polls: list[Poll] = []

    async def once(self) -> Poll | None:
        status = await get_json(self._session, self._urls.admin + "/v1/status", self._urls.headers)
        for model in (status or {}).get("models", []):
            if model.get("model_id") != MODEL:
                continue
            # A stopped instance's row lingers with its last telemetry (often `draining`): rows whose telemetry
            # is older than STALE_S are not counted (a pending instance has none yet and counts).
            states = {
                i["instance_id"]: str(i.get("state"))
                for i in model.get("instances", [])
                if i.get("telemetry_age_s") is None or i["telemetry_age_s"] < STALE_S
            }
            rows = {
                i["instance_id"]: [i.get("in_eds"), i.get("weight"), i.get("in_flight"), i.get("queued")]
                for i in model.get("instances", [])
                if i["instance_id"] in states
            }
            scale = model.get("autoscale") or {}
            poll = Poll(
                time.time(),
                sum(1 for s in states.values() if s == "ready"),
                sum(1 for s in states.values() if s in LIVE),
                scale.get("desired"),
                scale.get("recommended"),
                str(scale.get("reason", "")),
                states,
                rows,
                sum(1 for s in states.values() if s == "sleeping"),
            )
            self.polls.append(poll)
            return poll
        return None

    async def run(self) -> None:
        next_at = time.time()
        while True:
            await self.once()
            next_at += POLL_S
            await asyncio.sleep(max(0.0, next_at - time.time()))


async def scale_counters(session: aiohttp.ClientSession, urls: Urls) -> dict[str, float]:
    """The control plane's sie_autoscale_changes counters for the model, by direction."""
    try:
        async with session.get(
            urls.admin + "/metrics", headers=urls.headers, timeout=aiohttp.ClientTimeout(total=3)
        ) as resp:
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return {}
    out = {"up": 0.0, "down": 0.0}
    for line in text.splitlines():
        if line.startswith("sie_autoscale_changes") and f'model="{MODEL}"' in line and "_created" not in line:
            for d in ("up", "down"):
                if f'direction="{d}"' in line:
                    out[d] = float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Run:
    mode: str
    t0: float
    requests: list[Request]
    polls: list[Poll]
    counters: list[dict[str, float]]  # at t0 and at each phase's end
    startup_s: float
    ready_before: int


async def drive(urls: Urls, plan: Plan, mode: str, startup_s: float) -> Run:
    want = plan.max_replicas if mode == "fixed-max" else plan.min_replicas
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        watch = Watch(session, urls)
        deadline = time.time() + plan.ready_timeout_s
        while True:  # every instance of the starting count ready before the load starts
            poll = await watch.once()
            if poll is not None and (
                # exactly the starting count serving and nothing on its way (a warm-pool instance that starts
                # before it sleeps), or at least the starting count
                (poll.ready == want and not any(s in ("pending", "loading") for s in poll.states.values()))
                if plan.settle_before_load
                else poll.ready >= want
            ):
                break
            if time.time() > deadline:
                raise RuntimeError(f"{mode}: {want} instances not ready in {plan.ready_timeout_s:g} s: {poll}")
            await asyncio.sleep(0.5)
        ready_before = poll.ready
        await asyncio.sleep(2.0)  # let the routes settle (EDS) before the clock starts
        watch.polls.clear()
        load = StepLoad(session, urls.envoy + "/v1/chat/completions", plan)
        watcher = asyncio.create_task(watch.run(), name="watch")  # polls from before the load's start
        await asyncio.sleep(1.0)
        t0 = time.time() + 0.5
        counters = [await scale_counters(session, urls)]
        loader = asyncio.create_task(load.run(t0), name="load")
        try:
            for k in range(len(plan.multipliers)):
                await asyncio.sleep(max(0.0, t0 + (k + 1) * plan.phase_s - time.time()))
                counters.append(await scale_counters(session, urls))
                print(f"[{mode}] phase {k + 1} done: {watch.polls[-1].ready if watch.polls else '?'} ready", flush=True)
            await asyncio.wait_for(asyncio.shield(loader), timeout=60)
            await asyncio.sleep(plan.settle_s)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            if not loader.done():
                loader.cancel()
                await asyncio.gather(loader, return_exceptions=True)
    return Run(mode, t0, load.requests, watch.polls, counters, startup_s, ready_before)


# ---- figures -------------------------------------------------------------------------------------


def _p(values: list[float], q: float) -> float | None:
    return None if not values else round(percentile(values, q), 1)


def _mean(values: list[Any]) -> float | None:
    got = [v for v in values if isinstance(v, (int, float))]
    return round(sum(got) / len(got), 2) if got else None


def _counts(keys: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:
        out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def requests_figures(reqs: list[Request], sla_ms: float) -> dict[str, Any]:
    ok = [r for r in reqs if r.status == 200]
    lat = [r.latency_ms for r in ok]
    within = sum(1 for r in ok if r.latency_ms <= sla_ms)
    return {
        "requests": len(reqs),
        "ok": len(ok),
        "failed": len(reqs) - len(ok),
        "within_sla": within,
        "sla_attainment": round(within / len(reqs), 5) if reqs else None,
        "p50_ms": _p(lat, 50),
        "p99_ms": _p(lat, 99),
        "max_ms": round(max(lat), 1) if lat else None,
        "statuses": _counts(str(r.status) for r in reqs),
    }


def integrate(polls: list[Poll], t0: float, t1: float, attr: str) -> float:
    """Sum of attr x dt over [t0, t1], each poll's value holding until the next (the first from t0)."""
    if not polls:
        return 0.0
    total = 0.0
    pts = [p for p in polls if p.at < t1]
    for i, p in enumerate(pts):
        a = max(t0, p.at if i else t0)
        b = min(t1, pts[i + 1].at if i + 1 < len(pts) else t1)
        if b > a:
            total += getattr(p, attr) * (b - a)
    return total


def phase_figures(run: Run, plan: Plan, k: int) -> dict[str, Any]:
    begin, end = run.t0 + k * plan.phase_s, run.t0 + (k + 1) * plan.phase_s
    reqs = [r for r in run.requests if r.phase == k]
    polls = [p for p in run.polls if begin <= p.at < end]
    before = [p for p in run.polls if p.at < begin]
    prev = before[-1] if before else None
    out: dict[str, Any] = {
        "multiplier": plan.multipliers[k],
        "offered_rps": round(plan.rate_1x * plan.multipliers[k], 2),
        "measured_rps": round(len(reqs) / plan.phase_s, 2),
        **requests_figures(reqs, plan.p99_latency_ms),
        "instance_seconds": round(integrate(run.polls, begin, end, "ready"), 1),
        "held_instance_seconds": round(integrate(run.polls, begin, end, "held"), 1),
        "asleep_instance_seconds": round(integrate(run.polls, begin, end, "asleep"), 1),
        "ready_min_max": [min((p.ready for p in polls), default=None), max((p.ready for p in polls), default=None)],
    }
    # The autoscaler's own words: each poll whose (desired, recommended, kind of reason) differs from the last.
    said, last = [], None
    for p in polls:
        kind = (p.desired, p.recommended, p.reason.split(" ", 1)[0], "p99" in p.reason, "queue wait" in p.reason)
        if kind != last and p.desired is not None:
            said.append(
                {"s": round(p.at - begin, 2), "desired": p.desired, "recommended": p.recommended, "reason": p.reason}
            )
            last = kind
    out["decisions"] = said[:40]
    # Where the requests went, and what each instance reported (diagnostics).
    out["by_instance"] = _counts(r.instance or "-" for r in reqs)
    per: dict[str, list[list[Any]]] = {}
    for p in polls:
        for iid, row in p.rows.items():
            per.setdefault(iid, []).append(row)
    out["instances_polled"] = {
        iid: {
            "polls": len(rs),
            "in_eds_share": round(sum(1 for r in rs if r[0]) / len(rs), 2),
            "weight_mean": _mean([r[1] for r in rs]),
            "in_flight_mean": _mean([r[2] for r in rs]),
            "queued_mean": _mean([r[3] for r in rs]),
        }
        for iid, rs in sorted(per.items())
    }
    # Scale events: the control plane's counters (exact), and the desired count as the polls saw it.
    c0, c1 = (
        (run.counters[k] if k < len(run.counters) else {}),
        (run.counters[k + 1] if k + 1 < len(run.counters) else {}),
    )
    if c0 and c1:
        out["scale_changes"] = {d: int(c1.get(d, 0) - c0.get(d, 0)) for d in ("up", "down")}
    seq = ([prev.desired] if prev and prev.desired is not None else []) + [
        p.desired for p in polls if p.desired is not None
    ]
    path = [seq[0]] if seq else []
    for n in seq[1:]:
        if n != path[-1]:
            path.append(n)
    out["desired_path"] = path
    out["polled_changes"] = {
        "up": sum(1 for a, b in zip(path, path[1:]) if b > a),
        "down": sum(1 for a, b in zip(path, path[1:]) if b < a),
    }
    # Time from the step to the new capacity serving.
    first_ready: dict[str, float] = {}
    for p in run.polls:
        for iid, state in p.states.items():
            if state == "ready":
                first_ready.setdefault(iid, p.at)
    was_ready = {iid for iid, s in (prev.states.items() if prev else ()) if s == "ready"}
    new = {iid: at for iid, at in first_ready.items() if begin <= at < end and iid not in was_ready}
    out["new_instances_ready_s"] = {iid: round(at - begin, 2) for iid, at in sorted(new.items(), key=lambda kv: kv[1])}
    out["step_to_last_new_ready_s"] = round(max(new.values()) - begin, 2) if new else None
    drops = [p.at for a, p in zip(polls, polls[1:]) if p.ready < a.ready]
    out["step_to_last_removed_s"] = round(max(drops) - begin, 2) if drops else None
    changed = [p.at for p in polls if prev is not None and p.desired is not None and p.desired != prev.desired]
    out["step_to_first_desired_change_s"] = round(changed[0] - begin, 2) if changed else None
    return out


def direction(plan: Plan, k: int) -> str:
    before = plan.multipliers[k - 1] if k else 0.0  # phase 1 starts from an idle stack
    now = plan.multipliers[k]
    return "up" if now > before else "down" if now < before else "flat"


def figures(run: Run, plan: Plan) -> dict[str, Any]:
    n = len(plan.multipliers)
    t1 = run.t0 + n * plan.phase_s
    phases = [phase_figures(run, plan, k) for k in range(n)]
    out: dict[str, Any] = {
        "mode": run.mode,
        "stack_startup_s": round(run.startup_s, 1),
        "ready_before_load": run.ready_before,
        **requests_figures(run.requests, plan.p99_latency_ms),
        "instance_seconds": round(integrate(run.polls, run.t0, t1, "ready"), 1),
        "held_instance_seconds": round(integrate(run.polls, run.t0, t1, "held"), 1),
        "asleep_instance_seconds": round(integrate(run.polls, run.t0, t1, "asleep"), 1),
        "polls": len([p for p in run.polls if run.t0 <= p.at < t1]),
        "phases": phases,
        "failed_first": [
            {"s": round(r.start - run.t0, 3), "status": r.status, "instance": r.instance, "error": r.error}
            for r in run.requests
            if r.status != 200
        ][:10],
    }
    against = 0
    for k, ph in enumerate(phases):
        d = direction(plan, k)
        ph["load_direction"] = d
        changes = ph.get("scale_changes") or ph["polled_changes"]
        polled = ph["polled_changes"]
        bad = {"up": "down", "down": "up"}.get(d)
        ph["changes_against_load"] = (
            max(changes.get(bad, 0), polled.get(bad, 0)) if bad else changes.get("up", 0) + changes.get("down", 0)
        )
        against += ph["changes_against_load"]
    out["changes_against_load"] = against
    # Little's law check of the capacity figure: at 1x with one instance, in flight = rate x latency.
    ph0 = [r for r in run.requests if r.phase == 0 and r.status == 200]
    if ph0:
        mean_s = sum(r.latency_ms for r in ph0) / len(ph0) / 1000.0
        out["phase1_mean_latency_ms"] = round(mean_s * 1000.0, 1)
        out["phase1_in_flight_end_to_end"] = round(len(ph0) / plan.phase_s * mean_s, 2)
    out["timeline"] = timeline(run, plan)
    return out


def timeline(run: Run, plan: Plan) -> list[list[Any]]:
    """[seconds from t0, requests scheduled, failed, p99 ms of the 200s, ready, held, desired] per BUCKET_S."""
    n = int(len(plan.multipliers) * plan.phase_s / BUCKET_S)
    buckets: list[list[Request]] = [[] for _ in range(n)]
    for r in run.requests:
        i = int((r.start - run.t0) // BUCKET_S)
        if 0 <= i < n:
            buckets[i].append(r)
    rows = []
    for i, b in enumerate(buckets):
        at = run.t0 + (i + 1) * BUCKET_S
        seen = [p for p in run.polls if p.at <= at]
        last = seen[-1] if seen else None
        rows.append(
            [
                round(i * BUCKET_S, 1),
                len(b),
                sum(1 for r in b if r.status != 200),
                _p([r.latency_ms for r in b if r.status == 200], 99),
                last.ready if last else None,
                last.held if last else None,
                last.desired if last else None,
            ]
        )
    return rows


# ---- judged targets ------------------------------------------------------------------------------


def judged(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def check(target: str, value: Any, limit: Any, holds: bool) -> None:
        checks.append({"target": target, "value": value, "limit": limit, "holds": bool(holds)})

    sie, top = results.get("sie"), results.get("fixed-max")
    if sie is None:
        return checks
    if top is not None:
        a, b = sie.get("sla_attainment"), top.get("sla_attainment")
        limit = None if b is None else round(b - 0.01, 5)
        check(
            "SIE's SLA attainment >= fixed-max's minus 1 point (200 within sla.p99_latency_ms, all requests)",
            a,
            limit,
            a is not None and limit is not None and a >= limit,
        )
        s, m = sie.get("instance_seconds"), top.get("instance_seconds")
        limit = None if not m else round(0.65 * m, 1)
        check(
            "SIE's instance-seconds (ready instances integrated over the three phases) <= 65% of fixed-max's",
            s,
            limit,
            s is not None and limit is not None and s <= limit,
        )
    against = sie.get("changes_against_load")
    check(
        "no flapping: within a phase SIE's desired count never moves against the load's direction "
        "(no down change in the 1x-from-idle and 4x phases, no up change in the final 1x phase)",
        against,
        0,
        against == 0,
    )
    failed = sie.get("failed")
    check("SIE mode: failed requests == 0", failed, 0, failed == 0)
    return checks


# ---- output --------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(results: dict[str, dict[str, Any]], plan: Plan) -> str:
    def ph(k: int, key: str) -> Any:
        return lambda r: r["phases"][k].get(key) if len(r.get("phases", [])) > k else None

    rows: list[tuple[str, Any]] = [
        ("requests", lambda r: r.get("requests")),
        ("failed", lambda r: r.get("failed")),
        (
            "SLA attainment %",
            lambda r: None if r.get("sla_attainment") is None else round(100 * r["sla_attainment"], 2),
        ),
        ("p50 ms", lambda r: r.get("p50_ms")),
        ("p99 ms", lambda r: r.get("p99_ms")),
        ("instance-seconds (ready)", lambda r: r.get("instance_seconds")),
        ("instance-seconds (held)", lambda r: r.get("held_instance_seconds")),
        ("instance-seconds (asleep, warm pool)", lambda r: r.get("asleep_instance_seconds")),
        ("changes against load", lambda r: r.get("changes_against_load")),
    ]
    for k, m in enumerate(plan.multipliers):
        tag = f"ph{k + 1} {m:g}x"
        rows += [
            (f"{tag} SLA % / p99 ms", lambda r, k=k: _slash(_pct(ph(k, "sla_attainment")(r)), ph(k, "p99_ms")(r))),
            (f"{tag} failed", ph(k, "failed")),
            (f"{tag} ready min..max", lambda r, k=k: "..".join(map(_fmt, ph(k, "ready_min_max")(r) or []))),
            (f"{tag} inst-s", ph(k, "instance_seconds")),
            (f"{tag} changes up/down", lambda r, k=k: _updown(ph(k, "scale_changes")(r) or ph(k, "polled_changes")(r))),
            (f"{tag} desired path", lambda r, k=k: "->".join(map(str, ph(k, "desired_path")(r) or [])) or "-"),
            (
                f"{tag} step->last new ready s",
                lambda r, k=k: ph(k, "step_to_last_new_ready_s")(r) or ph(k, "step_to_last_removed_s")(r),
            ),
        ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{m:>16}" for m in results)]
    for name, cell in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{_fmt(cell(r)):>16}" for r in results.values()))
    return "\n".join(lines)


def _pct(v: Any) -> Any:
    return None if v is None else round(100 * v, 2)


def _slash(a: Any, b: Any) -> str:
    return f"{_fmt(a)} / {_fmt(b)}"


def _updown(c: dict[str, int] | None) -> str:
    return "-" if not c else f"{c.get('up', 0)}/{c.get('down', 0)}"


def plot(results: dict[str, dict[str, Any]], plan: Plan, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only when writing the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), squeeze=False, sharex=True)
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        rows = r.get("timeline", [])
        xs = [row[0] + BUCKET_S / 2 for row in rows]
        nan = float("nan")
        rows = [[nan if v is None else v for v in row] for row in rows]
        ax.step(
            xs,
            [row[1] / BUCKET_S / plan.rate_1x for row in rows],
            where="mid",
            color="tab:gray",
            lw=0.8,
            label="offered load (x one instance's capacity)",
        )
        ax.step(xs, [row[4] for row in rows], where="mid", color="tab:green", lw=1.6, label="ready instances")
        ax.step(xs, [row[6] for row in rows], where="mid", color="tab:purple", lw=1.0, ls="--", label="desired")
        for k in range(1, len(plan.multipliers)):
            ax.axvline(k * plan.phase_s, color="black", lw=0.8, alpha=0.6)
        bad = [(row[0] + BUCKET_S / 2, row[2]) for row in rows if row[2]]
        if bad:
            ax.scatter(
                [b[0] for b in bad],
                [plan.max_replicas + 0.5] * len(bad),
                marker="x",
                color="tab:red",
                s=14,
                label="bucket with failed requests",
            )
        ax.set_ylim(0, plan.max_replicas + 2.4)
        ax.set_ylabel("instances / load")
        lat = ax.twinx()
        lat.plot(xs, [row[3] for row in rows], color="tab:blue", lw=0.8, alpha=0.7, label="p99 ms per second")
        lat.axhline(plan.p99_latency_ms, color="tab:blue", lw=0.6, ls=":", label="SLA p99")
        lat.set_yscale("log")
        lat.set_ylabel("p99 ms (log)", color="tab:blue", fontsize=8)
        att = r.get("sla_attainment")
        ax.set_title(
            f"{name}: SLA attainment {_fmt(None if att is None else 100 * att)}%, p99 {_fmt(r.get('p99_ms'))} ms, "
            f"failed {r.get('failed')}, instance-seconds {_fmt(r.get('instance_seconds'))}",
            fontsize=9,
            loc="left",
        )
        if ax is axes[0, 0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = lat.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, ncol=4, loc="upper left", framealpha=0.9)
    axes[-1, 0].set_xlabel(f"seconds from the load's start ({plan.workers}; {plan.rate_1x:g} req/s = 1x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_mode(plan: Plan, mode: str) -> tuple[Run, dict[str, Any]]:
    run, meter, _ = run_mode_with(plan, mode)
    return run, meter


def run_mode_with(
    plan: Plan, mode: str, prepare: Callable[[Urls], Awaitable[Plan]] | None = None
) -> tuple[Run, dict[str, Any], Plan]:
    """One mode on a fresh stack. `prepare`, when given, runs once the stack serves and before the load
    (bench/autoscale_vllm's capacity probe) and returns the plan the load then follows, returned too."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"sie-bench-autoscale-{mode}-") as tmp:
        proc, urls = start_stack(Path(tmp), plan, mode, timeout_s=plan.ready_timeout_s)
        try:
            startup = time.time() - started
            print(f"[{mode}] stack up in {startup:.1f} s", flush=True)
            machine = Machine(proc.pid)
            meter_box: dict[str, Any] = {}

            async def go() -> tuple[Run, Plan]:
                meter = asyncio.create_task(machine.run())
                try:
                    driven = await prepare(urls) if prepare is not None else plan
                    return await drive(urls, driven, mode, startup), driven
                finally:
                    meter.cancel()
                    await asyncio.gather(meter, return_exceptions=True)

            run, plan = asyncio.run(go())
            n = len(plan.multipliers)
            meter_box["load"] = machine.summary(run.t0, run.t0 + n * plan.phase_s)
            meter_box["phases"] = [
                machine.summary(run.t0 + k * plan.phase_s, run.t0 + (k + 1) * plan.phase_s) for k in range(n)
            ]
        finally:
            stop_stack(proc)
    return run, meter_box, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 s phases (~6 minutes in all; vLLM: 90 s, ~14)")
    parser.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="the instances: sim workers (default) or real vLLM servers (bench/autoscale_vllm.py)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help=f"subset of {','.join(MODES)}, in order (default all three; vLLM: its own, bench/autoscale_vllm.py)",
    )
    parser.add_argument(
        "--phase-s", type=float, default=None, help="phase length (sim: the window follows, a third of it)"
    )
    parser.add_argument(
        "--rate-1x", type=float, default=None, help="vLLM: one instance's capacity in req/s (skips the probe)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/autoscale[-vllm].json")
    args = parser.parse_args(argv)
    if args.engine == "vllm":
        from bench import autoscale_vllm  # noqa: PLC0415 - only for that engine

        return autoscale_vllm.main(args, parser)
    if args.rate_1x is not None:
        parser.error("--rate-1x is for --engine vllm (the sim's capacity follows from its timing)")
    args.out = args.out or RESULTS / "autoscale.json"
    plan = QUICK if args.quick else Plan()
    if args.phase_s:
        plan = Plan(**{**asdict(plan), "phase_s": args.phase_s, "scale_down_window_s": round(args.phase_s / 3, 1)})
    modes = (args.modes or ",".join(MODES)).split(",")
    if any(m not in MODES for m in modes):
        parser.error(f"--modes takes {','.join(MODES)}")
    wall = time.time()
    print(
        f"1x = {plan.rate_1x:g} req/s (one instance at {plan.target:g} in flight; it saturates at "
        f"{plan.saturation_rps:g} req/s); phases {plan.phase_s:g} s at "
        + " -> ".join(f"{m:g}x" for m in plan.multipliers),
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for mode in modes:
        try:
            run, machine = run_mode(plan, mode)
        except Exception as exc:  # noqa: BLE001 - a mode that could not run is reported, the others still run
            errors[mode] = repr(exc)[:2000]
            print(f"[{mode}] failed to run: {exc!r}"[:2000], flush=True)
            continue
        r = figures(run, plan)
        r["machine"] = machine
        results[mode] = r
    doc: dict[str, Any] = {
        "benchmark": "autoscale",
        "setup": {
            "command": "python -m bench.autoscale" + (" --quick" if args.quick else ""),
            "quick": args.quick,
            "plan": asdict(plan),
            "rate_1x_rps": plan.rate_1x,
            "saturation_rps_one_instance": plan.saturation_rps,
            "target_concurrency": plan.target,
            "capacity": "one instance's capacity = 1000 / (decode_base_ms + (max_tokens - 1) x (decode_base_ms + "
            "c x decode_ms_per_request) / c) req/s at c = target_concurrency: the rate at which one instance "
            "holds the autoscaler's target in flight (the sim's scheduler: one prefill iteration per request, "
            "decode iterations shared by the batch)",
            "stacks": "one fresh `sie up` stack per mode, one after another (xds_server, Envoy, node host, sidecars)",
            "workers": "sim (SGLang timing simulator), not real models",
            "models": {m: model_service(plan, m)["spec"] for m in modes},
            "load": "open-loop Poisson through Envoy, "
            + " -> ".join(f"{plan.rate_1x * m:g} req/s" for m in plan.multipliers)
            + f", {plan.phase_s:g} s each, max_tokens {plan.max_tokens}",
            "instance_seconds": f"ready instances from GET /v1/status every {POLL_S:g} s, integrated over the phases",
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "run": {"wall_s": round(time.time() - wall, 1), "errors": errors},
        "results": results,
        "judged": judged(results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    picture = args.out.with_suffix(".png")
    if results:
        plot(results, plan, picture)
        print(table(results, plan))
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    print(f"\nwrote {args.out} and {picture} in {doc['run']['wall_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
