"""bench.reaction's trials: make one event happen, wait until Envoy holds the change, and afterwards split the
time by the control plane's timeline (bench.reaction.plane).

    drain-post     a probe (FakeSidecar in this process) turns `draining`; it posts at once
    drain-sidecar  POST /-/drain to a real sidecar; it reports `draining` at once
    slowdown       POST /sim/config {"slowdown": F} to a real sim worker; its sidecar's latency figures move
                   as slow answers complete, and the weight policy lowers its weight

The time runs from just before the trigger is sent to the arrival of the first admin answer that shows
the change (envoy_admin.py). The split is computed after a phase's trials (`finish`), when the
control plane has logged everything, including the ACKs that arrive after the change is visible.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.reaction.envoy_admin import EnvoyEds, draining, healthy, host, known_host
from bench.reaction.procs import PROBE_MODEL, SIM_MODEL, Plane, SimPair
from sie.telemetry import InstanceState
from sie_testing.control_plane_harness import FakeSidecar
from xds_server.policy.decisions import MAX_WEIGHT

WINDOW_S = 30.0  # the sidecar's default latency window: a slowed instance is clean again after it passes
_HEARD = ("p50", "p99", "recent_n", "recent_mean", "recent_std", "running", "oldest", "max", "window_n")


def breakdown(
    events: list[dict], instance: str, cluster: str, t0: float, seen: float, is_change: Callable[[dict], bool]
) -> dict[str, float | None]:
    """Where the time from `t0` (the trigger) to `seen` (Envoy's admin shows it) went, in ms.

    sidecar_to_intake  trigger -> the record that carried the change is stored by xds_server (the sidecar
                       noticing, its telemetry period, the HTTP post, the admin API's queue)
    intake_to_rebuild  -> the control loop starts the round that decides it (debounce + event-loop queue)
    rebuild_to_push    -> decided, resources built, snapshot published, and the EDS response carrying the
                          model built by the ADS stream (the cache hands the snapshot to the streams at once)
    push_to_seen       -> our admin poll sees it in Envoy (the gRPC write, which waits for the control
                          plane's event loop, Envoy applying it, and up to one poll interval)
    push_to_ack        (not part of the sum) -> the control plane has read Envoy's ACK of that response
    """
    out: dict[str, float | None] = dict.fromkeys(
        ("sidecar_to_intake", "intake_to_rebuild", "rebuild_to_push", "push_to_seen", "push_to_ack")
    )
    decision = next(
        (e for e in events if e["ev"] == "decision" and e["iid"] == instance and e["t"] >= t0 and is_change(e)), None
    )
    if decision is None:
        return out
    rebuild = next((e for e in events if e["ev"] == "rebuild" and e["t1"] == decision["t"]), None)
    if rebuild is None:
        return out
    records = [e for e in events if e["ev"] == "telemetry" and e["iid"] == instance and t0 <= e["t"] <= rebuild["t0"]]
    # A state change is carried by the first record in that state; a weight change by the newest record
    # the rebuild read (the one that tipped the policy).
    changed_state = [e for e in records if e["state"] != "ready"]
    if changed_state:
        records = changed_state[:1]
    # The snapshot is handed to the ADS streams inside the rebuild (SnapshotCache calls them at once), so
    # the push can come before the rebuild's end.
    push = next(
        (e for e in events if e["ev"] == "push" and e["t"] >= rebuild["t0"] and cluster in (e["models"] or [])), None
    )
    ack = next((e for e in events if push and e["ev"] == "ack" and e["nonce"] == push["nonce"]), None)

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) * 1000, 2)

    record_t = records[-1]["t"] if records else None
    out.update(
        sidecar_to_intake=ms(t0, record_t),
        intake_to_rebuild=ms(record_t, rebuild["t0"]),
        rebuild_to_push=ms(rebuild["t0"], push["t"] if push else None),
        push_to_seen=ms(push["t"] if push else None, seen),
        push_to_ack=ms(push["t"] if push else None, ack["t"] if ack else None),
    )
    return out


def heard(events: list[dict], instance: str, t0: float, end: float) -> dict[str, list[dict]]:
    """What the control plane got from the instance around a trial, and what it decided (ms from t0)."""
    return {
        "telemetry": [
            {"at_ms": round((e["t"] - t0) * 1000), **{k: e.get(k) for k in _HEARD}}
            for e in events
            if e["ev"] == "telemetry" and e["iid"] == instance and t0 - 1.0 <= e["t"] <= end
        ],
        "decisions": [
            {"at_ms": round((e["t"] - t0) * 1000), "weight": e["weight"], "health": e["health"]}
            for e in events
            if e["ev"] == "decision" and e["iid"] == instance and t0 <= e["t"] <= end + 1.0
        ],
    }


@dataclass
class _Pending:
    result: dict[str, Any]
    instance: str
    cluster: str
    t0: float
    seen: float | None
    is_change: Callable[[dict], bool]
    keep_heard: bool


def _key(pair: SimPair) -> dict[str, str]:
    return {"Authorization": f"Bearer {pair.worker_key}"}


class Trials:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        envoy_admin: Path,  # Envoy's admin socket
        plane: Plane,
        pairs: list[SimPair],
        probes: list[FakeSidecar],
        slowdown: float,
        timeout_s: float,
        node_headers: dict[str, str],
    ):
        self.session, self.plane, self.pairs, self.probes = session, plane, pairs, probes
        self.node_headers = node_headers  # the sidecars' node host's credential, for their control listeners
        self.slowdown_factor, self.timeout_s = slowdown, timeout_s
        self.sim = EnvoyEds(envoy_admin, SIM_MODEL)
        self.probe = EnvoyEds(envoy_admin, PROBE_MODEL)
        self._slowed_at: dict[str, float] = {}
        self._pending: list[_Pending] = []

    async def _post(self, url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> int:
        async with self.session.post(url, json=body, headers=headers) as resp:
            await resp.read()
            return resp.status

    def _record(
        self,
        event: str,
        instance: str,
        model: str,
        t0: float,
        reading,
        is_change,
        keep_heard: bool = False,
        **extra: Any,
    ) -> dict:
        seen = reading.at if reading is not None else None
        result = {
            "event": event,
            "instance": instance,
            "t0": round(t0, 3),  # CLOCK_MONOTONIC, as the load's failures
            "reaction_ms": round((seen - t0) * 1000, 2) if seen else None,
            **extra,
        }
        self._pending.append(_Pending(result, instance, f"model.{model}", t0, seen, is_change, keep_heard))
        return result

    async def finish(self, settle_s: float = 1.0) -> None:
        """Split the recorded trials' times, once the control plane has logged what followed them."""
        await asyncio.sleep(settle_s)
        events = self.plane.events()
        for p in self._pending:
            p.result["breakdown_ms"] = (
                breakdown(events, p.instance, p.cluster, p.t0, p.seen, p.is_change) if p.seen else {}
            )
            if p.keep_heard:
                p.result.update(heard(events, p.instance, p.t0, p.seen or p.t0 + self.timeout_s))
        self._pending.clear()

    async def drain_post(self, i: int) -> dict:
        probe = self.probes[i % len(self.probes)]
        iid = probe.instance_id
        await self.probe.wait(lambda r: healthy(r, iid), 30)
        t0 = time.monotonic()
        probe.state = InstanceState.DRAINING  # the fake sidecar posts at once
        reading = await self.probe.wait(lambda r: draining(r, iid), self.timeout_s)
        probe.state = InstanceState.READY
        return self._record("drain-post", iid, PROBE_MODEL, t0, reading, lambda e: e["health"] == "DRAINING")

    async def drain_sidecar(self, i: int) -> dict:
        pair = self.pairs[i % len(self.pairs)]
        iid = pair.instance_id
        await self.sim.wait(lambda r: healthy(r, iid), 30)
        t0 = time.monotonic()
        drain = asyncio.create_task(
            self._post(f"http://{pair.control_address}/-/drain?timeout_s=10", headers=self.node_headers),
            name="reaction-drain",
        )
        reading = await self.sim.wait(lambda r: draining(r, iid), self.timeout_s)
        await drain
        await self._post(f"http://{pair.control_address}/-/wake?timeout_s=10", headers=self.node_headers)
        return self._record(
            "drain-sidecar",
            iid,
            SIM_MODEL,
            t0,
            reading,
            lambda e: e["health"] == "DRAINING",
            ejected=known_host(reading, iid).ejected if reading else None,
        )

    async def slowdown(self, i: int) -> dict:
        pair = self.pairs[i % len(self.pairs)]
        iid = pair.instance_id
        # A clean start: no slow answers of an earlier trial left in its window, and its full weight back.
        wait = self._slowed_at.get(iid, -1e9) + WINDOW_S + 1.0 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        before = await self.sim.wait(lambda r: healthy(r, iid) and known_host(r, iid).weight == MAX_WEIGHT, 60)
        base = known_host(before, iid).weight if before else MAX_WEIGHT
        t0 = time.monotonic()
        await self._post(pair.worker_url + "/sim/config", {"slowdown": self.slowdown_factor}, _key(pair))
        reading = await self.sim.wait(lambda r: (h := host(r, iid)) is not None and h.weight < base, self.timeout_s)
        half = (
            await self.sim.wait(lambda r: (h := host(r, iid)) is not None and h.weight <= base // 2, self.timeout_s)
            if reading
            else None
        )
        await self._post(pair.worker_url + "/sim/config", {"slowdown": 1.0}, _key(pair))
        self._slowed_at[iid] = time.monotonic()
        return self._record(
            "slowdown",
            iid,
            SIM_MODEL,
            t0,
            reading,
            lambda e: e["weight"] < base,
            keep_heard=True,
            base_weight=base,
            clean_start=before is not None,
            first_weight=known_host(reading, iid).weight if reading else None,
            half_ms=round((half.at - t0) * 1000, 2) if half else None,
        )

    async def warm_up(self, min_requests: int = 60, timeout_s: float = 90.0) -> None:
        """Until every real instance answered enough requests for the policy to trust its latency."""
        deadline = time.monotonic() + timeout_s
        for pair in self.pairs:
            while True:
                async with self.session.get(
                    f"http://{pair.control_address}/-/state", headers=self.node_headers
                ) as resp:
                    total = (await resp.json())["requests_total"]
                if total >= min_requests:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{pair.instance_id} answered only {total} requests during the warm-up")
                await asyncio.sleep(0.5)


@dataclass
class OpenLoop:
    """Poisson arrivals at `rate_rps` until cancelled; every request's (status, latency) is kept, and
    each failure's details (when it was sent, on CLOCK_MONOTONIC, and the instance that answered)."""

    session: aiohttp.ClientSession
    url: str
    rate_rps: float
    body: dict
    seed: int = 1
    results: list[tuple[int, float]] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)

    async def run(self) -> None:
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task] = set()
        timeout = aiohttp.ClientTimeout(total=30)

        async def one(scheduled: float) -> None:
            status, instance, body = 0, None, b""
            try:
                async with self.session.post(self.url, json=self.body, timeout=timeout) as resp:
                    body = await resp.read()
                    status, instance = resp.status, resp.headers.get("x-sie-instance")
            except (TimeoutError, aiohttp.ClientError) as exc:
                body = repr(exc).encode()
            latency = time.monotonic() - scheduled
            self.results.append((status, latency))
            if status != 200:
                self.failures.append(
                    {
                        "sent": round(scheduled, 3),
                        "status": status,
                        "latency_s": round(latency, 3),
                        "instance": instance,
                        "body": body[:200].decode(errors="replace"),
                    }
                )

        next_at = time.monotonic()
        try:
            while True:
                next_at += rng.expovariate(self.rate_rps)
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                task = asyncio.create_task(one(next_at), name="reaction-load")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
