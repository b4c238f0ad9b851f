"""bench/autoscale on real vLLM: `python -m bench.autoscale --engine vllm [--quick]`.

The sim's modes, each on a fresh `sie up` stack one after another (bench/autoscale.py: its load, polls,
figures, table and picture), with real vLLM servers (its CPU build, started by SIE's node host for
`backend.type: vllm`, each bound to a core of its own). This machine has two cores, so the fleet is at
most two instances:

  fixed-max  sla.min_replicas = max_replicas = 2 (first: the capacity probe runs in its stack);
  fixed-min  sla.min_replicas = max_replicas = 1 (full runs only: what not scaling costs, not judged;
             `--modes fixed-max,fixed-min,sie` adds it to a quick run, about 5 minutes more);
  sie        min 1, max 2, warm_pool 1 (as the sim's: a user who expects bursts keeps the rest warm; vLLM
             cannot sleep on a CPU, so the warm instance is its sidecar with the server stopped, and its
             wake, like any scale-up here, is a start of vLLM).

The model: a random-weight Qwen2 of hidden size 1024 (bench/vllm_fleet.tiny_model's width, tokenizer
and chat template) with 8 layers and an MLP of 4096 (126M parameters, 250 MB in bf16), made once per
run. With the two layers of the other benchmarks, vLLM's per-step bookkeeping and its API server (which
no core binding covers) cost more than the model, and two servers on two cores serve hardly more than
one (FACTS.md: 4.1-5.0k tokens/s for two, 4.2k for one); at 8 layers the bound compute dominates: a
calibration on the idle machine (2026-12-07, 7 callers each, straight to the servers) gave 7.5 req/s for
one server alone and 4.7 + 7.0 for two together (1.56x). A start of it took 42-47 s there.

Load: the sim's shape, open-loop Poisson through Envoy in three equal phases, 1x -> 2x -> 1x, each
request a chat completion of MAX_TOKENS new tokens exactly (`ignore_eos`: a random-weight model may stop
at once) after a 74-token prompt that starts with the request's number (below vLLM's 128-token cache
block: no prefix-cache hits). 1x is one instance's capacity as the autoscaler counts it (its target,
autoscale.target_concurrency = 0.7 x max_concurrent_requests = 7 in flight), MEASURED rather than
computed from a simulator's formula, and measured in the full fleet: the fixed-max stack's completions
per second with 7 closed-loop callers per instance through Envoy and the sidecars (a warm-up, then
PROBE_S counted), divided by two. On two shared cores one instance alone serves more than its half of a
full fleet (above); with 1x its alone capacity, the 2x phase would overload fixed-max too and the bench
would measure the machine, not the autoscaler. So the 2x phase needs both instances at their target,
and one instance serves a 1x phase below its own. Beside it, reported only: in the fixed-min stack, one
instance alone at its target and at saturation (max_concurrent callers).

Phases: 90 s quick (~13 minutes in all), 180 s otherwise: a scale-up's start (45-60 s on this machine
with an instance serving beside it) then takes one to two thirds of the 2x phase, so it matters, and
the new instance still serves a good part of it, so scaling pays. scale_down_window_s 60 s, as a user of
an engine that takes about that long to start would set it: hold an idle instance for as long as a new
one takes to start (the ski-rental rule: never worse than twice the best choice in hindsight). SLA
p99 4 s and max_queue_time_ms 4 s: about 3x a request's mean latency at the target in a full fleet here
(1.0-1.7 s), as the sim's 1000 ms is to its 350 ms.

Judged, for the sie mode against the fixed-max mode of the same run: the sim's four targets, with the
limits that a start of tens of seconds on a 1..2 fleet allows, set before any run:
  - SLA attainment >= fixed-max's minus 1 point minus half the scale-up's exposure E. Until its new
    instance serves, a reactive scaler cannot serve the 2x phase's extra load: E is the share of all the
    run's requests offered in the first REACTION_S + start seconds of the 2x phase, where start is the
    run's own (from the autoscaler's decision to the new instance ready in /v1/status: the engine's
    start, which SIE does not make faster; the decision itself must come within REACTION_S of the step,
    or the lateness costs SLA outside the allowance). The instance already serving takes at least its
    1x of the 2x meanwhile, so at most half of E misses; the sim's wake (150 ms) made E negligible and
    left only the point, which here must cover the rest (routing to the new instance, the scale-down's
    drain). The start's length is reported beside it.
  - instance-seconds <= 1 - (1 - ideal) / 2 of fixed-max's: SIE keeps at least half the saving of an
    oracle that scaled at once and for free (ideal = the instances each phase needs, ceil(multiplier)
    within [min, max], summed over phases x max: 4/6 here, so the limit is 0.833). The sim's 65% is about
    the same rule for its 1x -> 4x -> 1x on six instances (ideal 6/18: 0.667); its figure itself does
    not carry over, as a fleet of two can save at most a third.
  - no flapping: unchanged (within a phase the desired count never moves against the load).
  - no request lost: the sim's "0 failed" with the one exception a start forces. While the one instance
    takes twice its share, its sidecar's bounded queue (4 x max_concurrent, max_queue_time_ms) refuses
    what it cannot hold, 429 queue_full or 503 queue_timeout/overloaded: never served, retryable
    (sie/README's Errors). Those refusals are allowed in the exposure window above; every other failure
    counts: a refusal outside it, and anywhere a 5xx that is not a refusal, a transport error or no
    answer (a request accepted and then lost, e.g. by a drain: vLLM ends in-flight requests with
    `abort` on SIGTERM unless the sidecar drained it first).

Writes bench/results/autoscale-vllm.json (the engine named in `setup.engine`, the probes, figures per
mode and phase, the scale-up's timing, `judged`) and its PNG, and prints the table and PASS/FAIL lines.
Exits 0 whatever the verdicts. vLLM's processes count as `other` in each mode's cores_by_part_mean.
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
REACTION_S = 5.0  # from the step to the autoscaler's decision, at most (the sim's new instances serve in 4 s)
SLA_POINT = 0.01
QUICK_MODES = ("fixed-max", "sie")
FULL_MODES = ("fixed-max", "fixed-min", "sie")
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
    p99_latency_ms: float = 4000.0
    max_queue_time_ms: float = 4000.0
    scale_down_window_s: float = 60.0
    settle_s: float = 5.0
    ready_timeout_s: float = 300.0  # two vLLM starts one after another, on a busy machine
    settle_before_load: bool = True  # the warm pool's instance starts before it sleeps
    capacity_rps: float = 0.0  # one instance's, measured (module docstring); 0 until then
    model_path: str = ""
    hidden_size: int = HIDDEN_SIZE
    layers: int = 8
    intermediate_size: int = 4096
    max_seq_len: int = 1024
    kv_cache_mb: int = 64  # 32 blocks of 128 tokens at 8 layers: a request (< 128 tokens) takes one
    probe_warmup_s: float = 5.0
    probe_s: float = 20.0

    @property
    def rate_1x(self) -> float:
        return self.capacity_rps

    @property
    def saturation_rps(self) -> float:
        return math.nan  # measured for one instance alone only (the fixed-min stack's probe), reported there

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
            "messages": [{"role": "user", "content": f"request {i}: {PROMPT}"}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }


QUICK = VllmPlan(phase_s=90.0)


def bench_model(workdir: Path, plan: VllmPlan) -> Path:
    """The served model, made once under `workdir`: bench/vllm_fleet's random-weight Qwen2 (its tokenizer,
    chat template and width) with `plan.layers` layers and an MLP of `plan.intermediate_size`, in bf16
    (module docstring: why deeper than the other benchmarks' two layers)."""
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
        if poll is not None and poll.ready == want and not starting:
            return
        if time.time() > deadline:
            raise RuntimeError(f"{want} instance(s) not ready in {timeout_s:g} s: {poll}")
        await asyncio.sleep(0.5)


async def probe_fleet(urls: Urls, plan: VllmPlan, out: dict[str, Any]) -> VllmPlan:
    """The full fleet's rate with the target in flight at every instance; the plan with capacity_rps set
    to its share per instance (module docstring)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_ready(session, urls, plan.max_replicas, plan.ready_timeout_s)
        callers = round(plan.target) * plan.max_replicas
        got = await closed_loop(
            session, urls.envoy + "/v1/chat/completions", plan, callers, plan.probe_warmup_s, plan.probe_s, 10**9
        )
    out["fleet_at_target"] = summary = got.summary()
    if not summary["rps"]:
        raise RuntimeError(f"the capacity probe completed nothing: {summary}")
    rate = round(summary["rps"] / plan.max_replicas, 2)
    print(
        f"  probe: {plan.max_replicas} instances {summary['rps']:g} req/s with {callers} callers: 1x = {rate:g} req/s",
        flush=True,
    )
    return replace(plan, capacity_rps=rate)


async def probe_alone(urls: Urls, plan: VllmPlan, out: dict[str, Any]) -> VllmPlan:
    """One instance alone, at its target and saturated (reported, not used); the plan as it is."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_ready(session, urls, 1, plan.ready_timeout_s)
        url = urls.envoy + "/v1/chat/completions"
        for key, callers, first in (
            ("one_instance_alone_at_target", round(plan.target), 2 * 10**9),
            ("one_instance_alone_saturated", plan.max_concurrent, 3 * 10**9),
        ):
            got = await closed_loop(session, url, plan, callers, 3.0, plan.probe_s / 2, first)
            out[key] = got.summary()
            print(f"  probe: one instance alone {got.summary()['rps']:g} req/s with {callers} callers", flush=True)
    if plan.capacity_rps and out["one_instance_alone_at_target"]["rps"]:
        out["alone_over_1x"] = round(out["one_instance_alone_at_target"]["rps"] / plan.capacity_rps, 3)
    return plan


def probe_stack(plan: VllmPlan, out: dict[str, Any]) -> VllmPlan:
    """The capacity probe on a stack of its own (fixed-max's spec), when fixed-max does not run first."""
    with tempfile.TemporaryDirectory(prefix="sie-bench-autoscale-probe-") as tmp:
        proc, urls = autoscale.start_stack(Path(tmp), plan, "fixed-max", timeout_s=plan.ready_timeout_s)
        try:
            return asyncio.run(probe_fleet(urls, plan, out))
        finally:
            stop_stack(proc)


def prober(mode: str, plan: VllmPlan, probes: dict[str, Any]) -> Callable[[Urls], Awaitable[Plan]] | None:
    """What runs in a mode's stack before its load: the capacity probe in fixed-max's (unless the capacity
    is known), one instance alone in fixed-min's; never anything in sie's (its autoscaler would react)."""
    if mode == "fixed-max" and not plan.capacity_rps:
        return lambda urls: probe_fleet(urls, plan, probes)
    if mode == "fixed-min":
        return lambda urls: probe_alone(urls, plan, probes)
    return None


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


def exposure(plan: Plan, window_s: float) -> float:
    """The share of the run's requests offered in the step phase's first `window_s` (module docstring)."""
    k = step_phase(plan)
    return plan.multipliers[k] * min(max(window_s, 0.0), plan.phase_s) / (sum(plan.multipliers) * plan.phase_s)


def ideal_fraction(plan: Plan) -> float:
    """Instance-seconds of an oracle (each phase at the count it needs, at once) over fixed-max's."""
    need = [min(plan.max_replicas, max(plan.min_replicas, math.ceil(m - 1e-9))) for m in plan.multipliers]
    return sum(need) / (len(need) * plan.max_replicas)


def scale_up(run: Run, plan: Plan) -> dict[str, Any]:
    """The step phase's scale-up as the polls saw it: when the desired count first rose (the decision),
    when the last instance that was not ready at the step first served, and the exposure window that
    follows: REACTION_S + (ready - decision), the whole phase's rest if it never served, REACTION_S alone
    if nothing was decided."""
    k = step_phase(plan)
    begin, end = run.t0 + k * plan.phase_s, run.t0 + (k + 1) * plan.phase_s
    before = [p for p in run.polls if p.at < begin]
    during = [p for p in run.polls if begin <= p.at < end]
    desired0 = before[-1].desired if before and before[-1].desired is not None else plan.min_replicas
    decided = next((p.at for p in during if p.desired is not None and p.desired > desired0), None)
    was_ready = {iid for iid, s in (before[-1].states.items() if before else ()) if s == "ready"}
    first_ready: dict[str, float] = {}
    for p in during:
        for iid, state in p.states.items():
            if state == "ready" and iid not in was_ready:
                first_ready.setdefault(iid, p.at)
    ready = max(first_ready.values()) if first_ready else None
    start_s = None if decided is None else (ready if ready is not None else end) - decided
    window = REACTION_S + (start_s or 0.0)
    return {
        "step_phase": k + 1,
        "decided_s": None if decided is None else round(decided - begin, 2),
        "new_ready_s": None if ready is None else round(ready - begin, 2),
        "start_s": None if start_s is None else round(start_s, 2),
        "started_in_phase": ready is not None,
        "window_s": round(window, 2),
        "exposure": round(exposure(plan, window), 5),
    }


def failures(run: Run, plan: Plan, window_s: float) -> dict[str, Any]:
    """Every failed request, and those lost: all but the refusals of never-served requests in the step
    phase's first `window_s` (module docstring)."""
    k = step_phase(plan)
    begin = run.t0 + k * plan.phase_s

    def inside(r: Request) -> bool:
        return r.phase == k and r.start - begin < window_s

    failed = [r for r in run.requests if r.status != 200]
    lost = [r for r in failed if not (inside(r) and error_kind(r) in REFUSALS)]
    return {
        "failed_kinds": autoscale._counts(error_kind(r) for r in failed),
        "failed_in_window": sum(1 for r in failed if inside(r)),
        "lost": len(lost),
        "lost_first": [
            {"s": round(r.start - run.t0, 3), "kind": error_kind(r), "instance": r.instance, "error": r.error}
            for r in lost
        ][:10],
    }


def vllm_figures(run: Run, plan: Plan) -> dict[str, Any]:
    """What autoscale.figures gives, with the scale-up's timing and the failed requests' accounting: in the
    sie mode over its own exposure window, in the fixed modes over none (they never wait for a start)."""
    out = figures(run, plan)
    if run.mode == "sie":
        out["scale_up"] = scale_up(run, plan)
        out["failures"] = failures(run, plan, out["scale_up"]["window_s"])
    else:
        out["failures"] = failures(run, plan, 0.0)
    return out


def judged(results: dict[str, dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def check(target: str, value: Any, limit: Any, holds: bool) -> None:
        checks.append({"target": target, "value": value, "limit": limit, "holds": bool(holds)})

    sie, top = results.get("sie"), results.get("fixed-max")
    if sie is None:
        return checks
    up = sie.get("scale_up") or {}
    if top is not None:
        a, b = sie.get("sla_attainment"), top.get("sla_attainment")
        share = up.get("exposure")
        limit = None if b is None or share is None else round(b - SLA_POINT - share / 2, 5)
        check(
            "SIE's SLA attainment >= fixed-max's minus 1 point minus half the share of requests offered while "
            f"its scale-up was coming (the 2x phase's first {REACTION_S:g} s + the vLLM start it measured: "
            f"{up.get('window_s')} s, {share} of all; 200 within sla.p99_latency_ms, all requests)",
            a,
            limit,
            a is not None and limit is not None and a >= limit,
        )
        s, m = sie.get("instance_seconds"), top.get("instance_seconds")
        frac = 1 - (1 - ideal_fraction(plan)) / 2
        limit = None if not m else round(frac * m, 1)
        check(
            f"SIE's instance-seconds (ready instances integrated over the phases) <= {frac:.3f} x fixed-max's "
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
    lost = (sie.get("failures") or {}).get("lost")
    check(
        "SIE mode: no request lost: failed requests other than refusals of never-served requests (429/503 "
        "queue_full, queue_timeout, overloaded, ...) while its scale-up was coming == 0",
        lost,
        0,
        lost == 0,
    )
    return checks


# ---- the run -------------------------------------------------------------------------------------


def report_plan(plan: VllmPlan) -> dict[str, Any]:
    return {k: v for k, v in asdict(plan).items() if k not in SIM_ONLY}


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan = QUICK if args.quick else VllmPlan()
    if args.phase_s:
        plan = replace(plan, phase_s=args.phase_s)  # the window stays: it is the engine's start, not the phase's
    modes = args.modes.split(",") if args.modes else list(QUICK_MODES if args.quick else FULL_MODES)
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
        plan = replace(plan, model_path=str(bench_model(work, plan)))
        if args.rate_1x is not None:
            plan = replace(plan, capacity_rps=args.rate_1x)
            probes["given_rate_1x"] = args.rate_1x
        elif modes[0] != "fixed-max":
            plan = probe_stack(plan, probes)
        for mode in modes:
            try:
                run, machine, driven = run_mode_with(plan, mode, prober(mode, plan, probes))
            except Exception as exc:  # noqa: BLE001 - a mode that could not run is reported, the others still run
                errors[mode] = repr(exc)[:2000]
                print(f"[{mode}] failed to run: {exc!r}"[:2000], flush=True)
                measured = (probes.get("fleet_at_target") or {}).get("rps")
                if not plan.capacity_rps and measured:
                    plan = replace(plan, capacity_rps=round(measured / plan.max_replicas, 2))  # probed, not loaded
                if not plan.capacity_rps:
                    break  # no capacity figure: no other mode can run its load
                continue
            assert isinstance(driven, VllmPlan)
            plan = driven
            r = vllm_figures(run, plan)
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
            "modes": modes,
            "plan": report_plan(plan),
            "rate_1x_rps": plan.rate_1x,
            "target_concurrency": plan.target,
            "capacity": "measured: the fixed-max stack's completions per second with round(target_concurrency) "
            f"closed-loop callers per instance through Envoy and the sidecars ({plan.probe_warmup_s:g} s "
            f"warm-up, then {plan.probe_s:g} s counted), over max_replicas: one instance's share of a full fleet",
            "probes": probes,
            "reaction_s": REACTION_S,
            "ideal_instance_seconds_fraction": round(ideal_fraction(plan), 4),
            "stacks": "one fresh `sie up` stack per mode, one after another (xds_server, Envoy, node host, "
            "sidecars, vLLM servers started by the node host)",
            "workers": f"vLLM {engines.vllm_version} (CPU build), a random-weight Qwen2 (hidden {plan.hidden_size}, "
            f"{plan.layers} layers, MLP {plan.intermediate_size}), each server bound to one core",
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
