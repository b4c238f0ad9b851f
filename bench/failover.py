"""Failover: steady load through Envoy while a node host dies, a GPU fails and a node is cut off.

    python -m bench.failover [--quick] [--out PATH] [--workdir DIR]

ONE STACK, as on several machines: `sie up --control-plane` (xds_server and a real Envoy) and three node
hosts that joined it with `sie join` (node-a, node-b, node-c: each its own process group, run directory
and two virtual 24 GiB GPUs), `sim` workers (SGLang's timing, simulated). Models: three with two replicas
each, which placement spreads over two nodes (`spread-*`), and one with a single replica (`solo`), each
instance booking 4 GiB of a GPU. Open-loop Poisson load through Envoy on every model the whole run.

In one run, one after another:

  (a) kill     SIGKILL one node host and every process it started (its workers and sidecars): a machine
               gone. Detected when its heartbeat timeout runs out.
  (b) gpu      fail one virtual GPU of another node (POST /v1/gpus/<i>/fail on its node host, as NVML
               reports an Xid or ECC failure): its workers die at once, its instances go to a healthy GPU
               or another node. Detected at the node's next heartbeat.
  (c) cut      SIGSTOP a third node host: its heartbeats stop while its workers and sidecars keep
               running (a node cut off from the control plane). Detected when its timeout runs out;
               SIGCONT afterwards, and the node comes back (rebalance `none`: its copies are dropped).

Between (a) and (b) the killed node joins again (restarted empty), so (c) still has two nodes to move to.

Per scenario: failed requests (any non-200) per model, the time from the fault to detection (the
control plane's node event `lost` or `gpu_failed`), and from detection until every lost instance serves
again elsewhere (ready and in EDS, on another node or GPU), beside the source's 12.3 s (a failed GPU to
a new instance ready).

Targets (issue 14):
  - 0 failed requests for the models with replicas on two nodes (a request in flight on the lost node
    is retried elsewhere by Envoy, as for a lost worker);
  - lost instances serving again elsewhere at most 12.3 s after detection, in every scenario;
  - detection at the configured heartbeat timeout, within one heartbeat (0.5 s), for (a) and (c); for
    (b), within two heartbeats of the fault.

Writes bench/results/failover.json (figures, setup, machine, `judged`) and failover.png (requests per
second, ok and failed, over the run, with each fault and its detection), prints a table and PASS/FAIL
lines. Exits 0 whatever the verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.eviction import stop_stack
from bench.rollout import get_json
from bench.stack import Urls, start_cluster
from sie.processes import descendants
from sie.wire import HEARTBEAT_INTERVAL_S

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
NODES = ("node-a", "node-b", "node-c")
SPREAD = ("spread-1", "spread-2", "spread-3")
SOLO = "solo"
SOURCE_REPLACEMENT_S = 12.3  # the source article: a failed GPU to a new instance ready
GIB = 1024


@dataclass(frozen=True)
class Plan:
    timeout_s: float  # the control plane's heartbeat_timeout_s
    rate_rps: float  # per model
    settle_s: float  # load before the first fault, and after each recovery
    quick: bool

    @classmethod
    def of(cls, quick: bool) -> Plan:
        # The source's default timeout is 30 s; --quick uses 5 s to show the same in a short run.
        return cls(
            timeout_s=5.0 if quick else 30.0,
            rate_rps=8.0 if quick else 10.0,
            settle_s=4.0 if quick else 8.0,
            quick=quick,
        )


def model_service(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "version": "1.0", "service_type": "llm", "priority_level": "P1"},
            "backend": {"type": "sim", "config": {"decode_base_ms": 4.0}},
            "resources": {"min_gpu_memory_mb": 4 * GIB, "max_concurrent_requests": 16},
            "sla": {"min_replicas": replicas, "max_replicas": replicas, "p99_latency_ms": 2000},
        },
    }


def cluster_docs(plan: Plan) -> list[dict[str, Any]]:
    cluster = {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "Cluster",
        "metadata": {"name": "failover"},
        "spec": {
            "host": "127.0.0.1",
            "settings": {"control_plane": {"heartbeat_timeout_s": plan.timeout_s, "rebalance": "none"}},
        },
    }
    return [cluster, *(model_service(m, 2) for m in SPREAD), model_service(SOLO, 1)]


# ---- the stack: a control plane here, node hosts joined to it ---------------------------------------


@dataclass
class NodeProc:
    name: str
    proc: subprocess.Popen
    run_dir: Path

    def api(self) -> str:
        return json.loads((self.run_dir / "node_host.json").read_text())["address"]


def join(work: Path, urls: Urls, name: str) -> NodeProc:
    """`sie join` one node host (its own process group), as on another machine."""
    creds = work / "run" / "credentials"
    if not (creds / f"node-{name}.token").exists():
        minted = subprocess.run(
            [sys.executable, "-m", "sie", "token", "node", name, "--run-dir", str(work / "run")],
            capture_output=True,
            text=True,
            check=False,
        )
        if minted.returncode != 0:
            raise RuntimeError(f"sie token node {name} failed: {minted.stderr}")
    run_dir = work / "nodes" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "node_host.json").unlink(missing_ok=True)
    log = open(work / f"{name}.log", "ab")  # noqa: SIM115 - the child writes it; closed here once started
    proc = subprocess.Popen(
        [sys.executable, "-m", "sie", "join", urls.admin, "--node", name]
        + ["--token-file", str(creds / f"node-{name}.token"), "--trust-file", str(creds / "trust.pem")]
        + ["--run-dir", str(run_dir), "--virtual-gpus", "2x24GB"],
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.time() + 60
    while not (run_dir / "node_host.json").exists():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"node host {name} did not start:\n{(work / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return NodeProc(name, proc, run_dir)


def stop_node(node: NodeProc) -> None:
    """SIGTERM (the node host stops its instances), then SIGKILL whatever is left, by pid."""
    if node.proc.poll() is None:
        os.kill(node.proc.pid, signal.SIGCONT)
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait(timeout=10)
    for pid in descendants(node.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- load and observation ---------------------------------------------------------------------------


@dataclass
class Outcome:
    model: str
    sent_at: float  # wall clock
    status: int  # 0: transport error
    instance: str


@dataclass
class Observer:
    """Polls /v1/status; keeps, per poll, where each instance is, its state and whether it is in EDS."""

    urls: Urls
    polls: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            status = await get_json(session, self.urls.admin + "/v1/status", self.urls.headers)
            if status is not None:
                self.polls.append((time.time(), status))
            await asyncio.sleep(0.2)

    def latest(self) -> dict[str, Any]:
        return self.polls[-1][1] if self.polls else {}


def rows_of(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {i["instance_id"]: i for m in status.get("models", []) for i in m.get("instances", [])}


async def load(
    session: aiohttp.ClientSession, urls: Urls, model: str, rate: float, stop: asyncio.Event, out: list[Outcome]
) -> None:
    rng = random.Random(hash(model) & 0xFFFF)
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
    tasks: list[asyncio.Task] = []

    async def one() -> None:
        at, status, instance = time.time(), 0, ""
        try:
            async with session.post(
                urls.envoy + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                await resp.read()
                status, instance = resp.status, resp.headers.get("x-sie-instance", "")
        except (TimeoutError, aiohttp.ClientError):
            status = 0
        out.append(Outcome(model, at, status, instance))

    while not stop.is_set():
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def wait_for(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting until {what}")


# ---- the scenarios ------------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    fault_at: float = math.nan  # wall clock
    lost: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # instance -> (node, gpu) it ran on
    detected_at: float = math.nan
    served_at: dict[str, float] = field(default_factory=dict)  # instance -> when it served again elsewhere
    until: float = math.nan  # the end of its window (for counting failures)
    note: str = ""


def node_event_at(obs: Observer, node: str, kind: str, after: float) -> float | None:
    events = obs.latest().get("node_events", [])
    return next((e["at"] for e in events if e["node"] == node and e["kind"] == kind and e["at"] >= after), None)


def serving_elsewhere(obs: Observer, sc: Scenario) -> bool:
    """Each lost instance is ready and in EDS somewhere other than where it was lost; notes when."""
    rows = rows_of(obs.latest())
    now = obs.polls[-1][0] if obs.polls else time.time()
    for iid, (node, gpu) in sc.lost.items():
        row = rows.get(iid, {})
        moved = row.get("node") != node or (gpu is not None and row.get("gpu") not in (None, gpu))
        if iid not in sc.served_at and row.get("state") == "ready" and row.get("in_eds") and moved:
            sc.served_at[iid] = now
    return len(sc.served_at) == len(sc.lost)


async def scenario(
    obs: Observer, name: str, node: str, fault: Callable[[], dict[str, tuple[str, int | None]]], event: str, plan: Plan
) -> Scenario:
    sc = Scenario(name)
    sc.fault_at = time.time()
    sc.lost = fault()
    print(f"  ({name}) fault at +0.0 s: {len(sc.lost)} instance(s) lost: {sorted(sc.lost)}", flush=True)
    limit = plan.timeout_s + 60
    sc.detected_at = await wait_for(
        lambda: node_event_at(obs, node, event, sc.fault_at - 1), limit, f"{event} of {node}"
    )
    print(f"  ({name}) detected at +{sc.detected_at - sc.fault_at:.2f} s", flush=True)
    await wait_for(lambda: serving_elsewhere(obs, sc), 90, f"the instances lost in ({name}) to serve elsewhere")
    print(f"  ({name}) serving again {max(sc.served_at.values()) - sc.detected_at:.2f} s after detection", flush=True)
    return sc


def placed_on(obs: Observer, node: str, gpu: int | None = None) -> dict[str, tuple[str, int | None]]:
    rows = rows_of(obs.latest())
    return {
        iid: (node, r.get("gpu"))
        for iid, r in rows.items()
        if r.get("node") == node and r.get("state") == "ready" and (gpu is None or r.get("gpu") == gpu)
    }


async def run(plan: Plan, work: Path) -> dict[str, Any]:
    proc, urls = start_cluster(work, cluster_docs(plan), timeout_s=180.0, name="failover", extra=("--control-plane",))
    nodes: dict[str, NodeProc] = {}
    scenarios: list[Scenario] = []
    outcomes: list[Outcome] = []
    obs = Observer(urls)
    try:
        for name in NODES:
            nodes[name] = await asyncio.to_thread(join, work, urls, name)
        async with aiohttp.ClientSession() as session:
            stop_obs = asyncio.Event()
            watcher = asyncio.create_task(obs.run(session, stop_obs))
            models = [*SPREAD, SOLO]

            def all_ready() -> bool:
                rows = rows_of(obs.latest())
                return len(rows) == 7 and all(r.get("state") == "ready" and r.get("in_eds") for r in rows.values())

            await wait_for(all_ready, 180, "every instance ready on the three nodes")
            where = {iid: r["node"] for iid, r in rows_of(obs.latest()).items()}
            print(f"placement: {json.dumps(where, sort_keys=True)}", flush=True)
            stop_load = asyncio.Event()
            loads = [asyncio.create_task(load(session, urls, m, plan.rate_rps, stop_load, outcomes)) for m in models]
            await asyncio.sleep(plan.settle_s)

            # (a) a node host and everything it started, SIGKILLed. The node with the most instances.
            counts = {n: sum(1 for v in where.values() if v == n) for n in NODES}
            killed = max(NODES, key=lambda n: (counts[n], n))

            def kill() -> dict[str, tuple[str, int | None]]:
                lost = placed_on(obs, killed)
                pids = [nodes[killed].proc.pid, *descendants(nodes[killed].proc.pid)]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return lost

            scenarios.append(await scenario(obs, "kill", killed, kill, "lost", plan))
            scenarios[-1].note = f"SIGKILL {killed} and its workers"
            await asyncio.sleep(plan.settle_s)
            scenarios[-1].until = time.time()
            await asyncio.to_thread(nodes[killed].proc.wait, 10)
            # The machine restarts: the node joins again, empty (off the event loop: the load goes on).
            nodes[killed] = await asyncio.to_thread(join, work, urls, killed)
            await wait_for(
                lambda: any(n["node"] == killed and n["live"] for n in obs.latest().get("nodes", [])), 60, "rejoin"
            )
            await asyncio.sleep(plan.settle_s)

            # (b) a virtual GPU of another node fails: the GPU with the most instances on it.
            others = [n for n in NODES if n != killed]
            rows = rows_of(obs.latest())
            by_gpu: dict[tuple[str, int], int] = {}
            for r in rows.values():
                if r.get("node") in others and r.get("gpu") is not None and r.get("state") == "ready":
                    by_gpu[r["node"], r["gpu"]] = by_gpu.get((r["node"], r["gpu"]), 0) + 1
            gpu_node, gpu_index = max(by_gpu, key=lambda k: (by_gpu[k], k))

            def fail_gpu() -> dict[str, tuple[str, int | None]]:
                lost = placed_on(obs, gpu_node, gpu_index)
                api = nodes[gpu_node].api()
                request = urllib_post(  # one short loopback call: blocking it is fine
                    f"{api}/v1/gpus/{gpu_index}/fail", {"reason": "Xid 79 (bench.failover)"}, urls.token
                )
                print(f"  (gpu) {gpu_node} GPU {gpu_index}: {request}", flush=True)
                return lost

            scenarios.append(await scenario(obs, "gpu", gpu_node, fail_gpu, "gpu_failed", plan))
            scenarios[-1].note = f"{gpu_node} GPU {gpu_index} failed through its node host's API"
            await asyncio.sleep(plan.settle_s)
            scenarios[-1].until = time.time()

            # (c) a third node cut off: its node host stopped, its workers and sidecars running on.
            cut = next(n for n in NODES if n not in (killed, gpu_node))

            def cut_off() -> dict[str, tuple[str, int | None]]:
                lost = placed_on(obs, cut)
                os.kill(nodes[cut].proc.pid, signal.SIGSTOP)
                return lost

            scenarios.append(await scenario(obs, "cut", cut, cut_off, "lost", plan))
            scenarios[-1].note = f"SIGSTOP {cut}'s node host (heartbeats stop, its workers keep running)"
            os.kill(nodes[cut].proc.pid, signal.SIGCONT)
            await wait_for(lambda: node_event_at(obs, cut, "back", scenarios[-1].detected_at), 30, f"{cut} back")
            await asyncio.sleep(plan.settle_s)
            scenarios[-1].until = time.time()

            stop_load.set()
            await asyncio.gather(*loads)
            stop_obs.set()
            await watcher
    finally:
        for node in nodes.values():
            stop_node(node)
        stop_stack(proc)
    return {"scenarios": scenarios, "outcomes": outcomes, "placement": where, "polls": len(obs.polls)}


def urllib_post(url: str, body: dict[str, Any], token: str) -> str:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return f"{resp.status} {resp.read().decode()[:300]}"
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url}: {exc.code} {exc.read().decode()[:300]}") from None


# ---- figures and verdicts -----------------------------------------------------------------------------


def figures(result: dict[str, Any], plan: Plan) -> dict[str, Any]:
    outcomes: list[Outcome] = result["outcomes"]
    start = min((o.sent_at for o in outcomes), default=0.0)
    out: dict[str, Any] = {"scenarios": {}, "requests": {}}
    previous_end = start
    for sc in result["scenarios"]:
        window = [o for o in outcomes if previous_end <= o.sent_at < sc.until]
        previous_end = sc.until
        failed = {m: sum(1 for o in window if o.model == m and o.status != 200) for m in (*SPREAD, SOLO)}
        sent = {m: sum(1 for o in window if o.model == m) for m in (*SPREAD, SOLO)}
        serve_s = max(sc.served_at.values()) - sc.detected_at if sc.served_at else math.nan
        out["scenarios"][sc.name] = {
            "what": sc.note,
            "lost_instances": {iid: {"node": n, "gpu": g} for iid, (n, g) in sorted(sc.lost.items())},
            "detection_s": round(sc.detected_at - sc.fault_at, 3),
            "serving_again_after_detection_s": round(serve_s, 3),
            "serving_again_after_fault_s": round(max(sc.served_at.values()) - sc.fault_at, 3) if sc.served_at else None,
            "each_after_detection_s": {i: round(t - sc.detected_at, 3) for i, t in sorted(sc.served_at.items())},
            "requests": sent,
            "failed": failed,
            "failed_two_node_models": sum(failed[m] for m in SPREAD),
            "source_replacement_s": SOURCE_REPLACEMENT_S,
        }
    for m in (*SPREAD, SOLO):
        mine = [o for o in outcomes if o.model == m]
        out["requests"][m] = {"sent": len(mine), "failed": sum(1 for o in mine if o.status != 200)}
    return out


def judged(fig: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    out = []
    scen = fig["scenarios"]
    failed = sum(s["failed_two_node_models"] for s in scen.values())
    out.append(
        {
            "target": "0 failed requests for the models with replicas on two nodes, over all three scenarios",
            "value": failed,
            "limit": 0,
            "holds": failed == 0,
        }
    )
    for name, s in scen.items():
        value = s["serving_again_after_detection_s"]
        out.append(
            {
                "target": f"({name}) every lost instance serves again elsewhere <= {SOURCE_REPLACEMENT_S} s after detection (the source's figure)",
                "value": value,
                "limit": SOURCE_REPLACEMENT_S,
                "holds": value is not None and not math.isnan(value) and value <= SOURCE_REPLACEMENT_S,
            }
        )
    for name in ("kill", "cut"):
        if name in scen:
            value = scen[name]["detection_s"]
            out.append(
                {
                    "target": f"({name}) detection at the heartbeat timeout ({plan.timeout_s:g} s) within one heartbeat ({HEARTBEAT_INTERVAL_S:g} s)",
                    "value": value,
                    "limit": [plan.timeout_s - HEARTBEAT_INTERVAL_S, plan.timeout_s + HEARTBEAT_INTERVAL_S],
                    "holds": abs(value - plan.timeout_s) <= HEARTBEAT_INTERVAL_S,
                }
            )
    if "gpu" in scen:
        value = scen["gpu"]["detection_s"]
        out.append(
            {
                "target": f"(gpu) detection within two heartbeats ({2 * HEARTBEAT_INTERVAL_S:g} s) of the GPU failing",
                "value": value,
                "limit": 2 * HEARTBEAT_INTERVAL_S,
                "holds": value <= 2 * HEARTBEAT_INTERVAL_S,
            }
        )
    return out


def table(fig: dict[str, Any]) -> str:
    lines = [
        f"{'scenario':<9} {'lost':>4} {'detect s':>9} {'serve s':>8} {'failed 2-node':>14} {'failed solo':>12}  what"
    ]
    for name, s in fig["scenarios"].items():
        lines.append(
            f"{name:<9} {len(s['lost_instances']):>4} {s['detection_s']:>9.2f} {s['serving_again_after_detection_s']:>8.2f} "
            f"{s['failed_two_node_models']:>14} {s['failed'][SOLO]:>12}  {s['what']}"
        )
    lines.append(
        f"(serve s: from detection until every lost instance serves elsewhere; the source: {SOURCE_REPLACEMENT_S} s)"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return
    outcomes: list[Outcome] = result["outcomes"]
    if not outcomes:
        return
    start = min(o.sent_at for o in outcomes)
    end = max(o.sent_at for o in outcomes)
    bins = int(end - start) + 1
    ok, bad = [0] * bins, [0] * bins
    for o in outcomes:
        (ok if o.status == 200 else bad)[int(o.sent_at - start)] += 1
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(range(bins), ok, label="200 per second", color="tab:green")
    ax.bar(range(bins), bad, label="failed per second", color="tab:red")
    for sc in result["scenarios"]:
        ax.axvline(sc.fault_at - start, color="black", linestyle="--")
        ax.axvline(sc.detected_at - start, color="tab:orange", linestyle=":")
        if sc.served_at:
            ax.axvline(max(sc.served_at.values()) - start, color="tab:blue", linestyle="-.")
        ax.text(sc.fault_at - start, max(ok) * 1.02, f"({sc.name})", fontsize=9)
    ax.set_xlabel("seconds (dashed: fault; dotted: detection; dash-dot: every lost instance serving elsewhere)")
    ax.set_ylabel("requests per second")
    ax.set_title("bench.failover: steady load through Envoy, sim workers on 3 node hosts")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 5 s heartbeat timeout instead of the source's 30 s")
    parser.add_argument("--out", type=Path, default=RESULTS / "failover.json")
    parser.add_argument("--workdir", type=Path, default=None, help="run here and keep the stack's logs")
    args = parser.parse_args(argv)
    plan = Plan.of(args.quick)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="sie-bench-failover-") as tmp:
        work = Path(tmp) if args.workdir is None else args.workdir
        work.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(run(plan, work))
    fig = figures(result, plan)
    verdicts = judged(fig, plan)
    doc = {
        "benchmark": "failover",
        "setup": {
            "command": "python -m bench.failover" + (" --quick" if args.quick else ""),
            "heartbeat_timeout_s": plan.timeout_s,
            "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
            "rebalance": "none",
            "stack": "sie up --control-plane (xds_server, Envoy) and 3 node hosts joined with sie join, each 2x24GB virtual GPUs",
            "workers": "sim (SGLang timing simulator), not real models",
            "models": {m: model_service(m, 2 if m in SPREAD else 1)["spec"] for m in (*SPREAD, SOLO)},
            "load": f"open-loop Poisson through Envoy, {plan.rate_rps:g} req/s per model, chat completions of 8 tokens",
            "serving_again": "every lost instance ready and in EDS on another node (or, for a GPU, another GPU), from /v1/status polled every 0.2 s",
            "placement": result["placement"],
            "duration_s": round(time.time() - started, 1),
        },
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count()},
        "results": fig,
        "judged": verdicts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(table(fig))
    for v in verdicts:
        print(f"{'PASS' if v['holds'] else 'FAIL'}  {v['target']}: {v['value']} (limit {v['limit']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
