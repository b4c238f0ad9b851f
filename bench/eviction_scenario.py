"""The eviction scenario of bench/eviction, against a running stack (also driven by
tests/integration/test_eviction.py, which asserts on what it observes).

    P2 load (open loop, through Envoy) ──────────────────────────────────────────────────────────▶
          │ warmup  │ long request pinned on each P2 instance
                    │ P0 model added (the pressure event)
                    │      ... victim drains / is killed / nothing (per node-host mode)
                    │      P0 answers ──▶ P0 burst (open loop) ──▶ P0 model deleted ──▶ victim back in Envoy

While it runs, `Watch` polls Envoy's /clusters (every 50 ms) and xds_server's /v1/status (every 100 ms)
and keeps every change; afterwards the node host's /v1/events give the ledger's own timeline and the P2
sidecars' /-/metrics the eviction count. `figures` turns it all into the result of one mode.

Classification of a P2 answer: 200 is served; 503/429 carrying `x-sie-retryable: true` or Retry-After
is a retryable refusal (the client was told to retry; nothing was lost); anything else, transport
errors included, is a lost request.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.stats import Sample, summarize
from xds_server.envoy_process import admin_request_async

P0 = {
    "metadata": {"name": "chat-p0"},
    "spec": {
        "model": {"name": "chat-p0", "version": "0.1.0", "priority_level": "P0"},
        "backend": {"type": "sim"},
        "resources": {"min_gpu_memory_mb": 30720, "max_concurrent_requests": 16},
        "sla": {"p99_latency_ms": 1000, "max_queue_time_ms": 1000},
    },
}


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
    envoy_admin: Path  # Envoy's admin interface: a Unix socket (sie.standalone.envoy_admin_socket)
    admin: str
    node: str
    token: str = ""  # an admin token: the admin API, the node host's API and the sidecars' control listeners

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


@dataclass(frozen=True)
class Answer:
    at: float  # wall clock of the scheduled send
    latency_s: float
    status: int  # 0: transport error
    retryable: bool  # x-sie-retryable: true or Retry-After on the answer
    instance: str = ""
    error: str = ""  # the start of a non-200 body, or the transport error


def chat(model: str, tokens: int, i: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"request {i} about memory pressure"}],
        "max_tokens": tokens,
    }


async def call(session: aiohttp.ClientSession, url: str, body: dict[str, Any], at: float) -> Answer:
    status, retryable, instance, error = 0, False, "", ""
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            payload = await resp.read()
            status, instance = resp.status, resp.headers.get("x-sie-instance", "")
            retryable = resp.headers.get("x-sie-retryable") == "true" or "Retry-After" in resp.headers
            if status != 200:
                error = payload[:200].decode(errors="replace")
    except (TimeoutError, aiohttp.ClientError) as exc:
        error = repr(exc)[:200]
    return Answer(at, time.time() - at, status, retryable, instance, error)


async def open_loop(
    session: aiohttp.ClientSession, url: str, model: str, tokens: int, rate: float, stop: asyncio.Event, seed: int
) -> list[Answer]:
    """Poisson arrivals at `rate` until `stop` is set; every request sent is awaited and returned."""
    rng, start = random.Random(seed), time.time()
    sent: list[asyncio.Task[Answer]] = []
    next_at = 0.0
    while not stop.is_set():
        next_at += rng.expovariate(rate)
        delay = start + next_at - time.time()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except TimeoutError:
                pass
        sent.append(
            asyncio.create_task(
                call(session, url, chat(model, tokens, len(sent)), start + next_at), name=f"load-{model}-{len(sent)}"
            )
        )
    return list(await asyncio.gather(*sent))


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=3), headers=headers) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def envoy_json(admin_socket: Path, path: str) -> Any:
    """A JSON page of Envoy's admin interface, through its Unix socket; None when it does not answer one."""
    try:
        status, body = await admin_request_async(admin_socket, path, timeout=3)
        return json.loads(body) if status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
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
            clusters = await envoy_json(self._urls.envoy_admin, "/clusters?format=json")
            if clusters is not None:
                self._envoy(clusters)
            if tick % 2 == 0:
                status = await get_json(self._session, self._urls.admin + "/v1/status", self._urls.headers)
                if status is not None:
                    self._status(status)
            tick += 1
            await asyncio.sleep(0.05)

    def _envoy(self, body: dict[str, Any]) -> None:
        now: dict[str, dict[str, str]] = {}
        for cluster in body.get("cluster_statuses", []):
            if not cluster.get("name", "").startswith("model."):
                continue  # Envoy's own (ADS, the admin socket behind its stats port): not a model's hosts
            model = cluster["name"].removeprefix("model.")
            hosts = now.setdefault(model, {})
            for host in cluster.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                hosts[f"{sock['address']}:{sock['port_value']}"] = host["health_status"].get("eds_health_status", "?")
        for model in set(now) | set(self.envoy):
            before, after = self.envoy.get(model, {}), now.get(model, {})
            for addr in set(before) | set(after):
                if before.get(addr) != after.get(addr):
                    self.changes.append(
                        {
                            "at": time.time(),
                            "source": "envoy",
                            "model": model,
                            "address": addr,
                            "health": after.get(addr, "gone"),
                        }
                    )
        self.envoy = now

    def _status(self, body: dict[str, Any]) -> None:
        for m in body.get("models", []):
            for inst in m.get("instances", []):
                iid, state = inst["instance_id"], inst.get("state", "?")
                self.details[iid] = inst.get("detail") or ""
                if self.states.get(iid) != state:
                    self.changes.append(
                        {
                            "at": time.time(),
                            "source": "status",
                            "instance_id": iid,
                            "state": state,
                            "detail": self.details[iid],
                        }
                    )
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


async def evictions_total(session: aiohttp.ClientSession, controls: list[str], headers: dict[str, str]) -> float:
    total = 0.0
    for address in controls:
        try:
            async with session.get(
                f"http://{address}/-/metrics", timeout=aiohttp.ClientTimeout(total=3), headers=headers
            ) as resp:
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError):
            continue
        total += sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("inference_evictions_total{")
        )
    return total


async def run_scenario(urls: Urls, plan: Plan) -> dict[str, Any]:
    """The scenario of the module docstring against a running stack; raw observations and figures."""
    chat_url = urls.envoy + "/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        watch = Watch(session, urls)
        watcher = asyncio.create_task(watch.run(), name="watch")
        stop_p2, stop_p0 = asyncio.Event(), asyncio.Event()
        p2 = asyncio.create_task(
            open_loop(session, chat_url, "chat-p2", plan.p2_tokens, plan.p2_rps, stop_p2, plan.seed), name="p2-load"
        )
        try:
            await asyncio.sleep(plan.warmup_s)
            instances = (await get_json(session, urls.node + "/v1/instances", urls.headers))["instances"]
            p2_sidecars = {i["instance_id"]: i["sidecar_address"] for i in instances if i["model_id"] == "chat-p2"}
            p2_controls = [i["control_address"] for i in instances if i["model_id"] == "chat-p2"]
            long = [
                asyncio.create_task(
                    call(
                        session, f"http://{a}/v1/chat/completions", chat("chat-p2", plan.long_tokens, -1), time.time()
                    ),
                    name=f"long-{a}",
                )
                for a in p2_sidecars.values()
            ]
            await asyncio.sleep(0.3)  # both long requests are in the engines
            added_at = time.time()
            async with session.post(urls.admin + "/v1/models", json=P0, headers=urls.headers) as resp:
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
            async with session.delete(urls.admin + "/v1/models/chat-p0", headers=urls.headers) as resp:
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
        events = (await get_json(session, urls.node + f"/v1/events?since={added_at - 1}", urls.headers))["events"]
        evictions = await evictions_total(session, p2_controls, urls.headers)
    return figures(
        plan,
        added_at,
        serving_at,
        deleted_at,
        back_at,
        p2_answers,
        p0,
        long_answers,
        events,
        watch.changes,
        evictions,
        p0_detail,
        p2_sidecars,
    )


def figures(
    plan: Plan,
    added_at: float,
    serving_at: float | None,
    deleted_at: float,
    back_at: float | None,
    p2: list[Answer],
    p0: list[Answer],
    long: list[Answer],
    events: list[dict],
    changes: list[dict],
    evictions: float,
    p0_detail: str,
    p2_sidecars: dict[str, str],
) -> dict[str, Any]:
    def first(kind: str, prefix: str = "") -> dict | None:
        return next((e for e in events if e["kind"] == kind and e["instance_id"].startswith(prefix)), None)

    def since(at: float | None, t0: float = added_at) -> float | None:
        return None if at is None else round(at - t0, 3)

    released, started = first("memory_released"), first("eviction_started")
    victim = started["instance_id"] if started else None
    woken = next((e for e in events if e["kind"] == "woken" and e["instance_id"] == victim), None)
    victim_status = [
        c for c in changes if c["source"] == "status" and c["instance_id"] == victim and c["at"] >= added_at
    ]
    p2_all = p2 + long
    lost = [a for a in p2_all if a.status != 200 and not (a.status in (429, 503) and a.retryable)]
    refused = [a for a in p2_all if a.status in (429, 503) and a.retryable]
    window = [a for a in p2 if added_at <= a.at <= (released["at"] if released else added_at) + 2.0]
    asleep = [
        a for a in p2 if released and released["at"] <= a.at <= (woken or {}).get("at", deleted_at) and a.status == 200
    ]
    return {
        "p0": {
            "requests": len(p0),
            "errors": sum(1 for a in p0 if a.status != 200),
            "statuses": _counts(p0),
            "latency": _summary(p0, plan.p0_burst_s),
            "detail_when_burst_ended": p0_detail,
        },
        "p2": {
            "requests": len(p2_all),
            "ok": sum(1 for a in p2_all if a.status == 200),
            "retryable_refusals": len(refused),
            "lost": len(lost),
            "lost_statuses": _counts(lost),
            "statuses": _counts(p2_all),
            "around_eviction": {"requests": len(window), "ok": sum(1 for a in window if a.status == 200)},
            "served_while_victim_slept": _counts_by(asleep),
            "long_requests": [a.status for a in long],
            "latency": _summary(p2, None),
            "not_ok": [
                {
                    "s": since(a.at),
                    "status": a.status,
                    "retryable": a.retryable,
                    "instance": a.instance,
                    "error": a.error,
                }
                for a in p2_all
                if a.status != 200
            ],
        },
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
        "seconds_from_p0_deleted": {
            "victim_woken": since((woken or {}).get("at"), deleted_at),
            "p2_back_in_envoy": since(back_at, deleted_at),
        },
        "victim_states": [{"s": since(c["at"]), "state": c["state"], "detail": c["detail"]} for c in victim_status],
        "envoy_p2": [
            {"s": since(c["at"]), "address": c["address"], "health": c["health"]}
            for c in changes
            if c["source"] == "envoy" and c["model"] == "chat-p2" and c["at"] >= added_at - 0.5
        ],
        "p2_sidecars": p2_sidecars,
        "p2_points": [[since(a.at), round(a.latency_s * 1000, 1), a.status] for a in p2],
        "marks": {
            "memory_released": since(released["at"] if released else None),
            "p0_serving": since(serving_at),
            "p0_deleted": since(deleted_at),
            "victim_woken": since((woken or {}).get("at")),
        },
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
    return {
        k: (round(v, 2) if isinstance(v, float) else v)
        for k, v in s.to_json().items()
        if k in ("p50_ms", "p99_ms", "ok", "errors")
    }
