"""Eviction under pressure: a P0 model arrives on a GPU a serving P2 model fills (DESIGN.md section 6).

    python -m bench.eviction [--quick]

The stack is `sie up -f examples/eviction.yaml` (one virtual 80 GiB GPU, `sim` workers: a simulator of
SGLang's timing, not a model): chat-p2 has two 28 GiB instances on the GPU and serves open-loop Poisson
load through Envoy. Then, in one run, once per node-host eviction mode:

  drain  SIE: the P0 model is added (POST /v1/models, 30 GiB); the node host picks a P2 instance as the
         victim, its sidecar drains it (DRAINING in EDS, in-flight requests finish), the worker releases
         its memory (sleeping), and only then the P0 instance starts;
  kill   baseline: the victim's worker is SIGKILLed at once, as an OOM kill would (no drain);
  off    baseline: no pre-eviction; the P0 instance waits for memory that never comes.

In each: a P0 burst (open loop) once P0 answers, then the P0 model is deleted and the victim should wake.
One long request is pinned on each P2 instance just before the P0 model arrives, so a drain always has
work in flight to finish (or, in "kill", to lose).

Figures per mode: P0 errors; P2 requests lost (neither 200 nor a retryable 503/429, transport errors
included); retryable refusals; time from the pressure event (P0 added) to the victim's memory released
in the ledger (node host events), to P0 serving (first 200 through Envoy), and from P0 deleted to the
victim woken. Writes bench/results/eviction.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.stats import Sample, summarize

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CLUSTER = ROOT / "examples" / "eviction.yaml"
MODES = ("drain", "kill", "off")
P0 = {"metadata": {"name": "chat-p0"}, "spec": {
    "model": {"name": "chat-p0", "version": "0.1.0", "priority_level": "P0"},
    "backend": {"type": "sim"},
    "resources": {"min_gpu_memory_mb": 30720, "max_concurrent_requests": 16},
    "sla": {"p99_latency_ms": 1000, "max_queue_time_ms": 1000}}}


@dataclass(frozen=True)
class Plan:
    p2_rps: float = 20.0
    p2_tokens: int = 48
    warmup_s: float = 4.0  # P2 load alone before the P0 model arrives
    long_tokens: int = 300  # the request pinned on each P2 instance at the pressure event (~2 s)
    p0_rps: float = 20.0
    p0_burst_s: float = 8.0
    p0_tokens: int = 16
    serve_timeout_s: float = 20.0  # for P0 to answer, and for the victim to be back in Envoy
    tail_s: float = 2.0  # P2 load after the wake
    seed: int = 1


QUICK = Plan(p2_rps=15.0, warmup_s=2.0, p0_burst_s=3.0, p0_rps=15.0, serve_timeout_s=15.0, tail_s=1.0)


@dataclass(frozen=True)
class Urls:
    envoy: str
    envoy_admin: str
    admin: str
    node: str


@dataclass(frozen=True)
class Answer:
    at: float  # wall clock of the scheduled send
    latency_s: float
    status: int  # 0: transport error
    retryable: bool  # x-sie-retryable: true or Retry-After on the answer
    instance: str = ""
    error: str = ""  # the start of a non-200 body, or the transport error


def chat(model: str, tokens: int, i: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"request {i} about memory pressure"}], "max_tokens": tokens}


async def call(session: aiohttp.ClientSession, url: str, body: dict[str, Any], at: float) -> Answer:
    status, retryable, instance, error = 0, False, "", ""
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            payload = await resp.read()
            status, instance = resp.status, resp.headers.get("x-sie-instance", "")
            retryable = resp.headers.get("x-sie-retryable") == "true" or "Retry-After" in resp.headers
            if status != 200:
                error = payload[:200].decode(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        error = repr(exc)[:200]
    return Answer(at, time.time() - at, status, retryable, instance, error)


async def open_loop(session: aiohttp.ClientSession, url: str, model: str, tokens: int, rate: float,
                    stop: asyncio.Event, seed: int) -> list[Answer]:
    """Poisson arrivals at `rate` until `stop` is set; every request sent is awaited and returned."""
    rng, sent, start = random.Random(seed), [], time.time()
    next_at = 0.0
    while not stop.is_set():
        next_at += rng.expovariate(rate)
        delay = start + next_at - time.time()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except asyncio.TimeoutError:
                pass
        sent.append(asyncio.create_task(call(session, url, chat(model, tokens, len(sent)), start + next_at),
                                        name=f"load-{model}-{len(sent)}"))
    return list(await asyncio.gather(*sent))


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


class Watch:
    """Polls Envoy's /clusters and xds_server's /v1/status; keeps only changes, with wall-clock times."""

    def __init__(self, session: aiohttp.ClientSession, urls: Urls):
        self._session, self._urls = session, urls
        self.envoy: dict[str, dict[str, str]] = {}  # model -> address -> eds health, now
        self.states: dict[str, str] = {}  # instance -> state (/v1/status), now
        self.details: dict[str, str] = {}
        self.changes: list[dict[str, Any]] = []

    async def run(self) -> None:
        tick = 0
        while True:
            clusters = await get_json(self._session, self._urls.envoy_admin + "/clusters?format=json")
            if clusters is not None:
                self._envoy(clusters)
            if tick % 2 == 0:
                status = await get_json(self._session, self._urls.admin + "/v1/status")
                if status is not None:
                    self._status(status)
            tick += 1
            await asyncio.sleep(0.05)

    def _envoy(self, body: dict[str, Any]) -> None:
        now: dict[str, dict[str, str]] = {}
        for cluster in body.get("cluster_statuses", []):
            model = cluster.get("name", "").removeprefix("model.")
            hosts = now.setdefault(model, {})
            for host in cluster.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                hosts[f"{sock['address']}:{sock['port_value']}"] = host["health_status"].get("eds_health_status", "?")
        for model in set(now) | set(self.envoy):
            before, after = self.envoy.get(model, {}), now.get(model, {})
            for addr in set(before) | set(after):
                if before.get(addr) != after.get(addr):
                    self.changes.append({"at": time.time(), "source": "envoy", "model": model, "address": addr,
                                         "health": after.get(addr, "gone")})
        self.envoy = now

    def _status(self, body: dict[str, Any]) -> None:
        for m in body.get("models", []):
            for inst in m.get("instances", []):
                iid, state = inst["instance_id"], inst.get("state", "?")
                self.details[iid] = inst.get("detail") or ""
                if self.states.get(iid) != state:
                    self.changes.append({"at": time.time(), "source": "status", "instance_id": iid, "state": state,
                                         "detail": self.details[iid]})
                    self.states[iid] = state

    def healthy(self, model: str) -> int:
        return sum(1 for h in self.envoy.get(model, {}).values() if h == "HEALTHY")


async def _until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval_s)
    return False


async def evictions_total(session: aiohttp.ClientSession, sidecars: list[str]) -> float:
    total = 0.0
    for address in sidecars:
        try:
            async with session.get(f"http://{address}/-/metrics", timeout=aiohttp.ClientTimeout(total=3)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            continue
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("inference_evictions_total{"))
    return total


async def run_scenario(urls: Urls, plan: Plan) -> dict[str, Any]:
    """The scenario of the module docstring against a running stack; raw observations and figures."""
    chat_url = urls.envoy + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        watch = Watch(session, urls)
        watcher = asyncio.create_task(watch.run(), name="watch")
        stop_p2, stop_p0 = asyncio.Event(), asyncio.Event()
        p2 = asyncio.create_task(open_loop(session, chat_url, "chat-p2", plan.p2_tokens, plan.p2_rps, stop_p2, plan.seed), name="p2-load")
        try:
            await asyncio.sleep(plan.warmup_s)
            instances = (await get_json(session, urls.node + "/v1/instances"))["instances"]
            p2_sidecars = {i["instance_id"]: i["sidecar_address"] for i in instances if i["model_id"] == "chat-p2"}
            long = [asyncio.create_task(call(session, f"http://{a}/v1/chat/completions", chat("chat-p2", plan.long_tokens, -1), time.time()),
                                        name=f"long-{a}") for a in p2_sidecars.values()]
            await asyncio.sleep(0.3)  # both long requests are in the engines
            added_at = time.time()
            async with session.post(urls.admin + "/v1/models", json=P0) as resp:
                assert resp.status == 201, f"adding chat-p0 failed: HTTP {resp.status} {await resp.text()}"

            async def p0_answers() -> bool:
                if watch.states.get("chat-p0-0") == "failed":
                    return True  # refused or waiting for memory: the burst shows what that costs
                return (await call(session, chat_url, chat("chat-p0", 1, -1), time.time())).status == 200

            await _until(p0_answers, plan.serve_timeout_s, 0.1)
            serving_at = time.time() if watch.states.get("chat-p0-0") != "failed" else None
            timer = asyncio.get_running_loop().call_later(plan.p0_burst_s, stop_p0.set)
            p0 = await open_loop(session, chat_url, "chat-p0", plan.p0_tokens, plan.p0_rps, stop_p0, plan.seed + 1)
            timer.cancel()
            long_answers = await asyncio.gather(*long)
            p0_detail = watch.details.get("chat-p0-0", "")
            deleted_at = time.time()
            async with session.delete(urls.admin + "/v1/models/chat-p0") as resp:
                assert resp.status in (200, 204), f"deleting chat-p0 failed: HTTP {resp.status}"

            async def both_back() -> bool:
                return watch.healthy("chat-p2") == 2

            back = await _until(both_back, plan.serve_timeout_s)
            back_at = time.time() if back else None
            await asyncio.sleep(plan.tail_s)
        finally:
            stop_p2.set()
            p2_answers = await p2
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        events = (await get_json(session, urls.node + f"/v1/events?since={added_at - 1}"))["events"]
        evictions = await evictions_total(session, list(p2_sidecars.values()))
    return figures(plan, added_at, serving_at, deleted_at, back_at, p2_answers, p0, long_answers, events, watch.changes,
                   evictions, p0_detail, p2_sidecars)


def figures(plan: Plan, added_at: float, serving_at: float | None, deleted_at: float, back_at: float | None,
            p2: list[Answer], p0: list[Answer], long: list[Answer], events: list[dict], changes: list[dict],
            evictions: float, p0_detail: str, p2_sidecars: dict[str, str]) -> dict[str, Any]:
    def first(kind: str, prefix: str = "") -> dict | None:
        return next((e for e in events if e["kind"] == kind and e["instance_id"].startswith(prefix)), None)

    def since(at: float | None, t0: float = added_at) -> float | None:
        return None if at is None else round(at - t0, 3)

    released, started = first("memory_released"), first("eviction_started")
    victim = started["instance_id"] if started else None
    woken = next((e for e in events if e["kind"] == "woken" and e["instance_id"] == victim), None)
    victim_status = [c for c in changes if c["source"] == "status" and c["instance_id"] == victim and c["at"] >= added_at]
    p2_all = p2 + long
    lost = [a for a in p2_all if a.status != 200 and not (a.status in (429, 503) and a.retryable)]
    refused = [a for a in p2_all if a.status in (429, 503) and a.retryable]
    window = [a for a in p2 if added_at <= a.at <= (released["at"] if released else added_at) + 2.0]
    asleep = [a for a in p2 if released and released["at"] <= a.at <= (woken or {}).get("at", deleted_at) and a.status == 200]
    return {
        "p0": {"requests": len(p0), "errors": sum(1 for a in p0 if a.status != 200),
               "statuses": _counts(p0), "latency": _summary(p0, plan.p0_burst_s), "detail_when_burst_ended": p0_detail},
        "p2": {"requests": len(p2_all), "ok": sum(1 for a in p2_all if a.status == 200), "retryable_refusals": len(refused),
               "lost": len(lost), "lost_statuses": _counts(lost), "statuses": _counts(p2_all),
               "around_eviction": {"requests": len(window), "ok": sum(1 for a in window if a.status == 200)},
               "served_while_victim_slept": _counts_by(asleep),
               "long_requests": [a.status for a in long], "latency": _summary(p2, None),
               "not_ok": [{"s": since(a.at), "status": a.status, "retryable": a.retryable, "instance": a.instance, "error": a.error}
                          for a in p2_all if a.status != 200]},
        "victim": victim,
        "victim_address": p2_sidecars.get(victim or ""),
        "evictions_total": evictions,
        "seconds_from_p0_added": {
            "eviction_started": since(started["at"] if started else None),
            "memory_released": since(released["at"] if released else None),
            "p0_placed": since((first("placed", "chat-p0") or {}).get("at")),
            "p0_loaded": since((first("loaded", "chat-p0") or {}).get("at")),
            "p0_serving": since(serving_at),
        },
        "drain_s": released.get("took_s") if released else None,
        "drained_in_flight": released.get("drained") if released else None,
        "seconds_from_p0_deleted": {"victim_woken": since((woken or {}).get("at"), deleted_at),
                                    "p2_back_in_envoy": since(back_at, deleted_at)},
        "victim_states": [{"s": since(c["at"]), "state": c["state"], "detail": c["detail"]} for c in victim_status],
        "envoy_p2": [{"s": since(c["at"]), "address": c["address"], "health": c["health"]}
                     for c in changes if c["source"] == "envoy" and c["model"] == "chat-p2" and c["at"] >= added_at - 0.5],
        "p2_sidecars": p2_sidecars,
        "events": [{**e, "s": since(e["at"])} for e in events],
    }


def _counts(answers: list[Answer]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        key = f"{a.status}{' retryable' if a.retryable and a.status != 200 else ''}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def _counts_by(answers: list[Answer]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in answers:
        out[a.instance or "?"] = out.get(a.instance or "?", 0) + 1
    return dict(sorted(out.items()))


def _summary(answers: list[Answer], duration_s: float | None) -> dict[str, Any]:
    if not answers:
        return {}
    span = duration_s or max(1e-9, max(a.at for a in answers) - min(a.at for a in answers))
    s = summarize([Sample(a.at, a.latency_s, a.status, a.instance) for a in answers], sla_ms=1000.0, duration_s=span)
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.to_json().items() if k in ("p50_ms", "p99_ms", "ok", "errors")}


# ---- the stack -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_text(mode: str) -> str:
    text = CLUSTER.read_text()
    assert "  virtual_gpus: 1x80GB\n" in text, f"{CLUSTER} changed; update bench/eviction.py"
    return text.replace("  virtual_gpus: 1x80GB\n", f"  virtual_gpus: 1x80GB\n  eviction: \"{mode}\"\n")


def start_stack(workdir: Path, mode: str, timeout_s: float = 180.0) -> tuple[subprocess.Popen, Urls]:
    """`sie up` on free ports with the example cluster in `mode`; returns once every model serves."""
    cluster = workdir / "eviction.yaml"
    cluster.write_text(cluster_text(mode))
    ports = {name: _free_port() for name in ("envoy", "envoy_admin", "admin", "xds")}
    log_path = workdir / "sie-up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sie", "up", "-f", str(cluster), "--envoy-port", str(ports["envoy"]),
             "--envoy-admin-port", str(ports["envoy_admin"]), "--admin-port", str(ports["admin"]),
             "--xds-port", str(ports["xds"]), "--run-dir", str(workdir / "run"), "--timeout", str(timeout_s)],
            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout_s + 30
    while "SIE is up" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.time() > deadline:
            stop_stack(proc)
            raise RuntimeError(f"sie up did not come up (mode {mode}):\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    node = json.loads((workdir / "run" / "node_host.json").read_text())["address"]
    return proc, Urls(f"http://127.0.0.1:{ports['envoy']}", f"http://127.0.0.1:{ports['envoy_admin']}",
                      f"http://127.0.0.1:{ports['admin']}", node)


def stop_stack(proc: subprocess.Popen) -> None:
    """Ctrl-C for `sie up` (it stops its children by pid), then SIGKILL its group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# ---- main ----------------------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("P0 errors / P0 requests", lambda r: f"{r['p0']['errors']} / {r['p0']['requests']}"),
        ("P2 accepted requests lost", lambda r: str(r["p2"]["lost"])),
        ("P2 retryable refusals (503/429)", lambda r: str(r["p2"]["retryable_refusals"])),
        ("P2 requests", lambda r: str(r["p2"]["requests"])),
        ("long in-flight P2 requests", lambda r: " ".join(map(str, r["p2"]["long_requests"]))),
        ("P0 added -> victim memory released (s)", lambda r: _s(r["seconds_from_p0_added"]["memory_released"])),
        ("  of which drain (s)", lambda r: _s(r["drain_s"])),
        ("P0 added -> P0 serving (s)", lambda r: _s(r["seconds_from_p0_added"]["p0_serving"])),
        ("P0 deleted -> victim woken (s)", lambda r: _s(r["seconds_from_p0_deleted"]["victim_woken"])),
        ("P0 deleted -> P2 x2 in Envoy (s)", lambda r: _s(r["seconds_from_p0_deleted"]["p2_back_in_envoy"])),
        ("inference_evictions_total", lambda r: f"{r['evictions_total']:g}"),
        ("P2 p99 ms", lambda r: _s(r["p2"]["latency"].get("p99_ms"))),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{m:>12}" for m in results)]
    for name, cell in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{cell(r):>12}" for r in results.values()))
    return "\n".join(lines)


def _s(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eviction", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases and lower rates")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "eviction.json")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"sie-bench-eviction-{mode}-") as tmp:
            started = time.time()
            proc, urls = start_stack(Path(tmp), mode)
            try:
                print(f"[{mode}] stack up in {time.time() - started:.1f} s; running the scenario", flush=True)
                results[mode] = asyncio.run(run_scenario(urls, replace(plan, seed=plan.seed)))
            finally:
                stop_stack(proc)
    doc = {
        "benchmark": "eviction",
        "setup": {"cluster": str(CLUSTER.relative_to(ROOT)), "plan": asdict(plan), "quick": args.quick,
                  "gpus": "1 virtual GPU of 80 GiB (simulated; no real GPU memory is involved)",
                  "workers": "sim (SGLang timing simulator), not real models",
                  "p0_model": P0, "command": "python -m bench.eviction" + (" --quick" if args.quick else "")},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg": os.getloadavg()},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(results))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
