"""bench/autoscale on real vLLM: `python -m bench.autoscale --engine vllm [--quick]`.

The same three modes, each on a fresh `sie up` stack one after another (bench/autoscale.py: its load,
polls, figures, table and picture), with the instances real vLLM servers (its CPU build, started by SIE's
node host for `backend.type: vllm`, each bound to a core of its own) serving a random-weight Qwen2 of
hidden size 1024 (bench/vllm_fleet.tiny_model: at 1024 the engine's compute, not vLLM's per-request
bookkeeping or SIE's path, is most of a request's cost). This machine has two cores, so the fleet is at
most two instances:

  fixed-min  sla.min_replicas = max_replicas = 1;
  fixed-max  sla.min_replicas = max_replicas = 2;
  sie        min 1, max 2, warm_pool 1 (as the sim's: a user who expects bursts keeps the rest warm; on a
             CPU vLLM cannot sleep, so the warm instance is its sidecar with the server stopped, and its
             wake, like any scale-up here, is a start of vLLM: 20-40 s, FACTS.md).

Load: the sim's shape, open-loop Poisson through Envoy in three equal phases, 1x -> 2x -> 1x of ONE
instance's capacity: the 2x phase needs both instances, the 1x phases one. Each request is a chat
completion of MAX_TOKENS new tokens exactly (`ignore_eos`: a random-weight model may stop at once) after
a prompt of about 60 tokens that starts with the request's number (below vLLM's 128-token cache block:
no prefix-cache hits).

Capacity is measured, not computed from a simulator's formula: with the autoscaler's definition of
"one instance's worth" (sla-independent: autoscale.target_concurrency, 0.7 x max_concurrent_requests
= 7 here), 1x is the rate one instance completes requests with that many closed-loop callers through
Envoy and its sidecar (a PROBE_WARMUP_S warm-up, then PROBE_S counted), probed in the fixed-min stack
before its load (or in a stack of its own when fixed-min is not the first mode; `--rate-1x` skips
it). Beside it, not used for the load: one instance's saturation (max_concurrent callers) and, in the
fixed-max stack, the two instances' together at twice the target (on two cores shared with Envoy,
the sidecars, the control plane and the load generator, two instances are not quite two ones).

Phases: 60 s quick (~14 minutes in all), 180 s otherwise. At 60 s a scale-up's start is a third to
two thirds of the 2x phase (it matters), and the new instance still serves for a good part of it (the
scaling pays). scale_down_window_s is 40 s, as a user of an engine that takes up to 40 s to start would
set it: holding an idle instance for as long as a new one takes to start is the ski-rental rule (never
worse than twice the best choice in hindsight), and it lets phase 3 show the scale-down (and its drain:
vLLM ends in-flight requests with `abort` on SIGTERM unless the sidecar drained it first). SLA p99 2.5 s
and max_queue_time_ms 2.5 s: about 3x a request's latency at the target here, as the sim's 1000 ms is
to its 350 ms.

Judged, for the sie mode against the fixed-max mode of the same run (the sim's four targets, with the
limits a 20-40 s start on a 1..2 fleet allows; set before any run, not fitted to one):
  - SLA attainment >= fixed-max's minus 1 point minus half the start's exposure. A reactive scaler
    cannot serve the 2x phase's extra load until its new instance has started: START_BOUND_S (40 s) of
    it, a share E of all the run's requests (2 x 40 / (4 x phase_s): 1/3 quick, 1/9 full). The one
    instance already serving takes at least its 1x of the 2x meanwhile, so at most half of E misses
    the SLA; the sim's wake (150 ms) made E negligible and left only the 1 point. Anything else that
    costs SLA (the reaction, routing to the new instance, the scale-down's drain) must fit in the point.
  - instance-seconds <= 1 - (1 - ideal) / 2 of fixed-max's: SIE keeps at least half the saving an
    oracle that scaled at once and for free would (ideal = sum over the phases of the instances each
    needs, ceil(multiplier) within [min, max], over phases x max: 4/6 here, so the limit is 0.833). The
    sim's 65% is about the same rule for its 1x -> 4x -> 1x on six instances (ideal 6/18: 0.667); its
    own figure does not carry over, as a fleet of two can save at most a third.
  - no flapping: unchanged (within a phase the desired count never moves against the load).
  - no request lost: the sim's "0 failed" with one exception a start forces. While the one instance
    serves twice its capacity, its sidecar's bounded queue (4 x max_concurrent, max_queue_time_ms)
    refuses what it cannot hold, 429 queue_full or 503 queue_timeout/overloaded, never served and
    retryable (sie/README's Errors). Those refusals are allowed in the 2x phase's first START_BOUND_S;
    every other failure counts: any refusal outside that window, and anywhere a 5xx that is not a
    refusal, a transport error or no answer (a request accepted and then lost, e.g. by a drain).
  fixed-min is reported beside them (it is what not scaling costs), not judged.

Writes bench/results/autoscale-vllm.json (the engine named in `setup.engine`, the probes, figures per
mode and phase, `judged`) and its PNG, and prints the table and PASS/FAIL lines. Exits 0 whatever the
verdicts; vLLM's processes count as `other` in each mode's cores_by_part_mean.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench import autoscale
from bench.autoscale import MODEL, MODES, Plan, Request, Run, Watch, figures, model_service, plot, run_mode_with, table
from bench.eviction import stop_stack
from bench.stack import Urls
from bench.stats import percentile
from bench.vllm_fleet import HIDDEN_SIZE, find_vllm, tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
START_BOUND_S = 40.0  # a vLLM start here, to /health 200, at its slowest (FACTS.md: 20-40 s)
SLA_POINT = 0.01
# Answers that say the request was never served, so a client may send it again (sie/README's Errors).
REFUSALS = frozenset(
    {"queue_full", "queue_timeout", "overloaded", "no_instance", "draining", "unavailable", "wake_failed"}
)
# The sim's timing fields of a Plan: meaningless for vLLM, left out of the report.
SIM_ONLY = ("decode_base_ms", "decode_ms_per_request", "wake_ms")
PROMPT = "how many canaries fit in a mine, and what do they see there when the lamps go out? "


@dataclass(frozen=True)
class VllmPlan(Plan):
    """A Plan for real vLLM servers: capacity measured (capacity_rps, set after the probe), not computed."""

    phase_s: float = 180.0
    multipliers: tuple[float, ...] = (1.0, 2.0, 1.0)
    max_tokens: int = 32
    max_concurrent: int = 10  # so that the target, 0.7 x this, is a whole number of closed-loop callers
    min_replicas: int = 1
    max_replicas: int = 2
    p99_latency_ms: float = 2500.0
    max_queue_time_ms: float = 2500.0
    scale_down_window_s: float = 40.0
    settle_s: float = 5.0
    ready_timeout_s: float = 300.0  # two vLLM starts one after another, on a busy machine
    settle_before_load: bool = True  # the warm pool's instance may be starting (then stopped) first
    capacity_rps: float = 0.0  # one instance's, measured (module docstring); 0 until then
    saturation_measured_rps: float | None = None
    model_path: str = ""
    hidden_size: int = HIDDEN_SIZE
    layers: int = 8
    intermediate_size: int = 4096
    max_seq_len: int = 1024
    kv_cache_mb: int = 64  # 128 blocks of 128 tokens at hidden 1024: ten requests of < 128 tokens take 10
    prompt_repeats: int = 1
    probe_warmup_s: float = 5.0
    probe_s: float = 15.0
    saturation_probe_s: float = 10.0
    fleet_probe_s: float = 15.0

    @property
    def rate_1x(self) -> float:
        return self.capacity_rps

    @property
    def saturation_rps(self) -> float:
        return self.saturation_measured_rps or math.nan

    @property
    def workers(self) -> str:
        return "vLLM servers, CPU build, one core each"

    def backend(self) -> dict[str, Any]:
        return {"type": "vllm", "config": {"max_seq_len": self.max_seq_len, "kv_cache_mb": self.kv_cache_mb}}

    def model(self) -> dict[str, Any]:
        return {
            "name": MODEL,
            "version": "0.1.0",
            "path": self.model_path,
            "service_type": "llm",
            "priority_level": "P1",
        }

    def cluster(self) -> dict[str, Any]:
        return {"host": "127.0.0.1", "model_roots": [str(Path(self.model_path).parent)]}

    def request_body(self, i: int) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}: " + PROMPT * self.prompt_repeats}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }


QUICK = VllmPlan(phase_s=60.0)


def bench_model(workdir: Path, plan: VllmPlan) -> Path:
    """The served model, made once under `workdir`: bench/vllm_fleet's random-weight Qwen2 (its tokenizer,
    chat template and width) with `plan.layers` layers and an MLP of `plan.intermediate_size`, saved in
    bf16 (module docstring: why deeper than the other benchmarks' two layers)."""
    import torch  # noqa: PLC0415 - heavy, and only for making the model
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM  # noqa: PLC0415

    base = tiny_model(workdir, plan.hidden_size)
    path = workdir / f"qwen2-h{plan.hidden_size}-l{plan.layers}-i{plan.intermediate_size}"
    if (path / "config.json").is_file():
        return path
    config = AutoConfig.from_pretrained(base)
    config.num_hidden_layers, config.intermediate_size = plan.layers, plan.intermediate_size
    if getattr(config, "layer_types", None):  # one per layer (all full attention in the base model)
        config.layer_types = [config.layer_types[0]] * plan.layers
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: half the memory and the files of float32
    try:
        model = Qwen2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return path


# ---- capacity probes -----------------------------------------------------------------------------


@dataclass
class Probe:
    callers: int
    seconds: float
    done: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, status) counted
    usage: dict[str, Any] = field(default_factory=dict)  # one answer's usage (token counts)

    def summary(self) -> dict[str, Any]:
        ok = [(a, b) for a, b, s in self.done if s == 200]
        lat = [(b - a) * 1000.0 for a, b in ok]
        rps = len(ok) / self.seconds
        mean = sum(lat) / len(lat) if lat else None
        return {
            "callers": self.callers,
            "seconds": self.seconds,
            "completed": len(ok),
            "failed": len(self.done) - len(ok),
            "rps": round(rps, 2),
            "mean_ms": None if mean is None else round(mean, 1),
            "p50_ms": round(percentile(lat, 50), 1) if lat else None,
            "p99_ms": round(percentile(lat, 99), 1) if lat else None,
            "in_flight_littles_law": None if mean is None else round(rps * mean / 1000.0, 2),
            "usage": self.usage,
        }


async def closed_loop(
    session: aiohttp.ClientSession, url: str, plan: Plan, callers: int, warmup_s: float, seconds: float, first: int
) -> Probe:
    """`callers` back-to-back callers for warmup_s + seconds; counts the answers that END in the last
    `seconds` (the rate) with their latencies."""
    probe = Probe(callers, seconds)
    begin = time.time() + warmup_s
    stop = begin + seconds
    numbers = iter(range(first, first + 10**8))
    timeout = aiohttp.ClientTimeout(total=60)

    async def caller() -> None:
        while time.time() < stop:
            start, status = time.time(), 0
            try:
                async with session.post(url, json=plan.request_body(next(numbers)), timeout=timeout) as resp:
                    payload = await resp.read()
                    status = resp.status
                    if status == 200 and not probe.usage:
                        probe.usage = json.loads(payload).get("usage") or {}
            except (TimeoutError, aiohttp.ClientError):
                pass
            end = time.time()
            if begin <= end < stop:
                probe.done.append((start, end, status))
            if status != 200:
                await asyncio.sleep(0.1)  # a refusal comes back at once: no busy loop

    await asyncio.gather(*(caller() for _ in range(callers)))
    return probe


async def wait_ready(session: aiohttp.ClientSession, urls: Urls, want: int, timeout_s: float) -> None:
    watch, deadline = Watch(session, urls), time.time() + timeout_s
    while True:
        poll = await watch.once()
        starting = poll is not None and any(s in ("pending", "loading") for s in poll.states.values())
        if poll is not None and poll.ready >= want and not starting:
            return
        if time.time() > deadline:
            raise RuntimeError(f"{want} instance(s) not ready in {timeout_s:g} s: {poll}")
        await asyncio.sleep(0.5)


async def probe_one(urls: Urls, plan: VllmPlan, out: dict[str, Any]) -> VllmPlan:
    """One instance's capacity at the target (then its saturation); the plan with capacity_rps set."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_ready(session, urls, 1, plan.ready_timeout_s)
        url = urls.envoy + "/v1/chat/completions"
        callers = round(plan.target)
        target = await closed_loop(session, url, plan, callers, plan.probe_warmup_s, plan.probe_s, 10**9)
        saturated = await closed_loop(session, url, plan, plan.max_concurrent, 1.0, plan.saturation_probe_s, 2 * 10**9)
    out["one_instance_at_target"] = target.summary()
    out["one_instance_saturated"] = saturated.summary()
    rate = out["one_instance_at_target"]["rps"]
    if not rate:
        raise RuntimeError(f"the capacity probe completed nothing: {out}")
    print(
        f"  probe: one instance {rate:g} req/s with {callers} callers (p50 {target.summary()['p50_ms']} ms), "
        f"{saturated.summary()['rps']:g} req/s with {plan.max_concurrent}",
        flush=True,
    )
    return replace(plan, capacity_rps=rate, saturation_measured_rps=out["one_instance_saturated"]["rps"])


async def probe_fleet(urls: Urls, plan: VllmPlan, out: dict[str, Any]) -> VllmPlan:
    """The fixed-max fleet's rate at the target on every instance (reported, not used); the plan as is."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_ready(session, urls, plan.max_replicas, plan.ready_timeout_s)
        callers = round(plan.target) * plan.max_replicas
        got = await closed_loop(
            session, urls.envoy + "/v1/chat/completions", plan, callers, 3.0, plan.fleet_probe_s, 3 * 10**9
        )
    out["fleet_at_target"] = got.summary()
    if plan.capacity_rps:
        out["fleet_over_one_instance"] = round(got.summary()["rps"] / plan.capacity_rps, 3)
    print(f"  probe: {plan.max_replicas} instances {got.summary()['rps']:g} req/s with {callers} callers", flush=True)
    return plan


def probe_stack(plan: VllmPlan, out: dict[str, Any]) -> VllmPlan:
    """The capacity probe on a stack of its own (fixed-min's spec), for when fixed-min does not run first."""
    with tempfile.TemporaryDirectory(prefix="sie-bench-autoscale-probe-") as tmp:
        proc, urls = autoscale.start_stack(Path(tmp), plan, "fixed-min", timeout_s=plan.ready_timeout_s)
        try:
            return asyncio.run(probe_one(urls, plan, out))
        finally:
            stop_stack(proc)


# ---- figures and targets -------------------------------------------------------------------------


def error_kind(req: Request) -> str:
    """What a failed request got: SIE's error type, or the status, or the transport error."""
    if req.status == 200:
        return "ok"
    got = re.search(r'"type"\s*:\s*"([^"]+)"', req.error)
    if got:
        return got.group(1)
    return {0: "transport error", -1: "no answer"}.get(req.status, f"HTTP {req.status}")


def step_phase(plan: Plan) -> int:
    """The phase the load steps up into (the first with the largest multiplier)."""
    return plan.multipliers.index(max(plan.multipliers))


def exposure(plan: Plan) -> float:
    """The share of the run's requests offered in the step phase's first START_BOUND_S (module docstring)."""
    k = step_phase(plan)
    return plan.multipliers[k] * min(START_BOUND_S, plan.phase_s) / (sum(plan.multipliers) * plan.phase_s)


def ideal_fraction(plan: Plan) -> float:
    """Instance-seconds of an oracle (each phase at the count it needs, at once) over fixed-max's."""
    need = [min(plan.max_replicas, max(plan.min_replicas, math.ceil(m - 1e-9))) for m in plan.multipliers]
    return sum(need) / (len(need) * plan.max_replicas)


def start_window(run: Run, plan: Plan) -> dict[str, Any]:
    """The requests of the step phase's first START_BOUND_S and what became of every failed request."""
    k = step_phase(plan)
    begin = run.t0 + k * plan.phase_s

    def inside(r: Request) -> bool:
        return r.phase == k and r.start - begin < START_BOUND_S

    failed = [r for r in run.requests if r.status != 200]
    lost = [r for r in failed if not (inside(r) and error_kind(r) in REFUSALS)]
    window = [r for r in run.requests if inside(r)]
    return {
        "step_phase": k + 1,
        "seconds": START_BOUND_S,
        "requests": len(window),
        "within_sla": sum(1 for r in window if r.status == 200 and r.latency_ms <= plan.p99_latency_ms),
        "failed": sum(1 for r in window if r.status != 200),
        "failed_kinds": autoscale._counts(error_kind(r) for r in failed),
        "failed_outside_window": sum(1 for r in failed if not inside(r)),
        "lost": len(lost),
        "lost_first": [
            {"s": round(r.start - run.t0, 3), "kind": error_kind(r), "instance": r.instance, "error": r.error}
            for r in lost
        ][:10],
    }


def judged(results: dict[str, dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def check(target: str, value: Any, limit: Any, holds: bool) -> None:
        checks.append({"target": target, "value": value, "limit": limit, "holds": bool(holds)})

    sie, top = results.get("sie"), results.get("fixed-max")
    if sie is None:
        return checks
    if top is not None:
        a, b = sie.get("sla_attainment"), top.get("sla_attainment")
        allowance = SLA_POINT + exposure(plan) / 2
        limit = None if b is None else round(b - allowance, 5)
        check(
            f"SIE's SLA attainment >= fixed-max's minus 1 point minus half the share of requests offered in the "
            f"{START_BOUND_S:g} s a scale-up's vLLM start takes (the step phase's first {START_BOUND_S:g} s: "
            f"{exposure(plan):.3f} of all; 200 within sla.p99_latency_ms, all requests)",
            a,
            limit,
            a is not None and limit is not None and a >= limit,
        )
        s, m = sie.get("instance_seconds"), top.get("instance_seconds")
        share = 1 - (1 - ideal_fraction(plan)) / 2
        limit = None if not m else round(share * m, 1)
        check(
            f"SIE's instance-seconds (ready instances integrated over the phases) <= {share:.3f} x fixed-max's "
            f"(half the saving of an oracle that scales at once, whose share is {ideal_fraction(plan):.3f})",
            s,
            limit,
            s is not None and limit is not None and s <= limit,
        )
    against = sie.get("changes_against_load")
    check(
        "no flapping: within a phase SIE's desired count never moves against the load's direction "
        "(no down change in the 1x-from-idle and 2x phases, no up change in the final 1x phase)",
        against,
        0,
        against == 0,
    )
    lost = (sie.get("start_window") or {}).get("lost")
    check(
        "SIE mode: no request lost: failed requests other than refusals of never-served requests (429/503 "
        f"queue_full, queue_timeout, overloaded, ...) in the step phase's first {START_BOUND_S:g} s == 0",
        lost,
        0,
        lost == 0,
    )
    return checks


# ---- the run -------------------------------------------------------------------------------------


def prober(mode: str, plan: VllmPlan, probes: dict[str, Any]) -> Callable[[Urls], Awaitable[Plan]] | None:
    """What runs in a mode's stack before its load: the capacity probe in fixed-min's (unless the
    capacity is known), the fleet's in fixed-max's."""
    if mode == "fixed-min" and not plan.capacity_rps:
        return lambda urls: probe_one(urls, plan, probes)
    if mode == "fixed-max":
        return lambda urls: probe_fleet(urls, plan, probes)
    return None


def report_plan(plan: VllmPlan) -> dict[str, Any]:
    return {k: v for k, v in asdict(plan).items() if k not in SIM_ONLY}


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan = QUICK if args.quick else VllmPlan()
    if args.phase_s:
        plan = replace(plan, phase_s=args.phase_s)  # the window stays: it is the engine's start, not the phase's
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes):
        parser.error(f"--modes takes {','.join(MODES)}")
    if args.rate_1x is not None and args.rate_1x <= 0:
        parser.error("--rate-1x must be > 0")
    out_path = args.out or RESULTS / "autoscale-vllm.json"
    engines = find_vllm()  # fails here, naming how to install it, rather than in the first stack
    wall = time.time()
    probes: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="sie-bench-autoscale-vllm-"))
    try:
        model = bench_model(work, plan)
        plan = replace(plan, model_path=str(model))
        if args.rate_1x is not None:
            plan = replace(plan, capacity_rps=args.rate_1x)
            probes["given_rate_1x"] = args.rate_1x
        elif modes[0] != "fixed-min":
            plan = probe_stack(plan, probes)
        for mode in modes:
            probe = prober(mode, plan, probes)
            try:
                run, machine, driven = run_mode_with(plan, mode, probe)
            except Exception as exc:  # noqa: BLE001 - a mode that could not run is reported, the others still run
                errors[mode] = repr(exc)[:2000]
                print(f"[{mode}] failed to run: {exc!r}"[:2000], flush=True)
                measured = (probes.get("one_instance_at_target") or {}).get("rps")
                if not plan.capacity_rps and measured:
                    plan = replace(plan, capacity_rps=measured)  # the probe ran; the load did not
                if not plan.capacity_rps:
                    break  # no capacity figure: no other mode can run its load
                continue
            assert isinstance(driven, VllmPlan)
            if mode == "fixed-min" and not plan.capacity_rps:
                plan = driven
                print(f"1x = {plan.rate_1x:g} req/s; phases {plan.phase_s:g} s at 1x -> 2x -> 1x", flush=True)
            r = figures(run, plan)
            r["start_window"] = start_window(run, plan)
            r["machine"] = machine
            results[mode] = r
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {
        "benchmark": "autoscale",
        "setup": {
            "engine": "vllm",
            "vllm": {"python": str(engines.vllm_python), "version": engines.vllm_version},
            "command": "python -m bench.autoscale --engine vllm" + (" --quick" if args.quick else ""),
            "quick": args.quick,
            "plan": report_plan(plan),
            "rate_1x_rps": plan.rate_1x,
            "target_concurrency": plan.target,
            "capacity": "measured: one instance's completions per second with round(target_concurrency) "
            f"closed-loop callers through Envoy and its sidecar ({plan.probe_warmup_s:g} s warm-up, then "
            f"{plan.probe_s:g} s counted), in the fixed-min stack before its load",
            "probes": probes,
            "start_bound_s": START_BOUND_S,
            "exposure": round(exposure(plan), 4),
            "ideal_instance_seconds_fraction": round(ideal_fraction(plan), 4),
            "stacks": "one fresh `sie up` stack per mode, one after another (xds_server, Envoy, node host, "
            "sidecars, vLLM servers started by the node host)",
            "workers": f"vLLM {engines.vllm_version} (CPU build), a random-weight Qwen2 of hidden size "
            f"{plan.hidden_size}, each server bound to one core",
            "models": {m: model_service(plan, m)["spec"] for m in modes},
            "load": "open-loop Poisson through Envoy, "
            + " -> ".join(f"{plan.rate_1x * m:.4g} req/s" for m in plan.multipliers)
            + f", {plan.phase_s:g} s each, chat completions of exactly {plan.max_tokens} new tokens",
            "instance_seconds": f"ready instances from GET /v1/status every {autoscale.POLL_S:g} s, "
            "integrated over the phases",
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "run": {"wall_s": round(time.time() - wall, 1), "errors": errors},
        "results": results,
        "judged": judged(results, plan),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    picture = out_path.with_suffix(".png")
    if results:
        plot(results, plan, picture)
        print(table(results, plan))
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']} (limit {c['limit']})")
    print(f"\nwrote {out_path} and {picture} in {doc['run']['wall_s']} s")
    return 0
