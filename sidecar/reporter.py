"""Telemetry to the control plane: build a TelemetryRecord (pure) and POST it (shell).

The loop sends every `interval_s`, at once when the state changes, and at once when the recent mean
latency (the fast signal) is `jump_factor` above its baseline and still rising (window.jumped, looked
at every `check_s`): a slowing instance is heard of within about `check_s`, not half an interval later.
It never queues records: each send builds a fresh one from the live figures, so after an outage the
control plane gets the current picture, not a backlog. `seq` grows by one per record built, so the
receiver can drop reordered posts.

A failed send is logged once per outage, and again should its kind change: the control plane away or
failing, or refusing this sidecar's credential (401). A refusal is most likely the token expired: the
node host rewrites the token file with each renewal its heartbeat replies carry (xds_server.credentials),
so the node host is cut off from the control plane; it ends by itself when a fresh token arrives
(TokenSource re-reads the file).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from sidecar.gpu import GpuSample
from sidecar.window import WindowSummary, jumped
from sie.auth import TokenSource
from sie.tasks import wait_event
from sie.telemetry import InstanceState, TelemetryRecord
from sie.worker_loads import EngineLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    """What does not change over the sidecar's life."""

    instance_id: str
    model_id: str
    version: str
    address: str
    node: str
    priority: str
    service_type: str
    gpu_index: int | None
    max_concurrent: int
    simulated: bool


@dataclass(frozen=True)
class Live:
    """The figures of one moment, gathered by the composition root."""

    state: InstanceState
    in_flight: int
    queued: int
    requests_total: int
    window: WindowSummary
    load: EngineLoad | None
    gpu: GpuSample | None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def build_record(identity: Identity, live: Live, timestamp: float, seq: int) -> TelemetryRecord:
    load, gpu, window = live.load, live.gpu, live.window
    return TelemetryRecord(
        instance_id=identity.instance_id,
        model_id=identity.model_id,
        version=identity.version,
        address=identity.address,
        node=identity.node,
        state=live.state,
        priority=identity.priority,
        service_type=identity.service_type,
        gpu_index=identity.gpu_index,
        in_flight=live.in_flight,
        queued=live.queued,
        max_concurrent=identity.max_concurrent,
        queue_time_ms=_ms(window.queue_p99_s),
        kv_cache_usage=load.kv_usage if load else None,
        cache_hit_rate=load.cache_hit_rate if load else None,
        engine_running=load.running if load else None,
        engine_waiting=load.waiting if load else None,
        gpu_utilization=gpu.utilization if gpu else None,
        gpu_memory_used_mb=gpu.memory_used_mb if gpu else None,
        gpu_memory_total_mb=gpu.memory_total_mb if gpu else None,
        latency_p50_ms=_ms(window.latency_p50_s),
        latency_p99_ms=_ms(window.latency_p99_s),
        recent_requests=window.recent_count,
        recent_latency_mean_ms=_ms(window.recent_latency_mean_s),
        recent_latency_std_ms=_ms(window.recent_latency_std_s),
        recent_window_s=window.recent_s,
        recent_running=window.recent_running,
        oldest_running_ms=_ms(window.oldest_running_s),
        latency_max_ms=_ms(window.latency_max_s),
        window_requests=window.count,
        service_p50_ms=_ms(window.service_p50_s),
        service_p99_ms=_ms(window.service_p99_s),
        error_rate=window.error_rate,
        requests_total=live.requests_total,
        simulated=identity.simulated,
        timestamp=timestamp,
        seq=seq,
    )


class Reporter:
    def __init__(
        self,
        identity: Identity,
        live: Callable[[], Live],
        wall_clock: Callable[[], float],
        changed: asyncio.Event,
        interval_s: float,
        session: aiohttp.ClientSession | None = None,
        control_url: str | None = None,
        credential: TokenSource | None = None,
        *,
        check_s: float = 0.05,
        jump_factor: float = 1.3,
        jump_min_count: int = 5,
        jump_step: float = 1.1,
    ):
        self._identity = identity
        self._live = live
        self._wall = wall_clock
        self._changed = changed
        self._interval = interval_s
        self._session = session
        self._url = control_url + "/v1/telemetry" if control_url else None
        self._credential = credential
        self._reporter_id = secrets.token_hex(8)  # this process's records, in `seq` order (sie.telemetry)
        self._timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * interval_s))
        self._check = min(check_s, interval_s)
        self._jump_factor = jump_factor
        self._jump_min_count = jump_min_count
        self._jump_step = jump_step
        self._seq = 0
        self._sent: WindowSummary | None = None  # the window figures of the last record sent
        self.early_sends = 0  # records sent because the recent latency jumped
        self._down_since: float | None = None  # log an outage once, and its end once
        self._down_kind: str | None = None  # "unreachable" or "refused": a change of kind is logged too

    def current(self) -> TelemetryRecord:
        """The record as of now (GET /-/state); takes the next seq, like a send."""
        return self._build()[0]

    def _build(self) -> tuple[TelemetryRecord, Live]:
        self._seq += 1
        live = self._live()
        record = build_record(self._identity, live, self._wall(), self._seq)
        return dataclasses.replace(record, reporter=self._reporter_id), live

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self._interval
        while True:
            changed = await wait_event(self._changed, max(0.0, min(self._check, due - loop.time())))
            if not changed and loop.time() < due:
                if not jumped(
                    self._sent, self._live().window, self._jump_factor, self._jump_min_count, self._jump_step
                ):
                    continue
                self.early_sends += 1
            self._changed.clear()
            await self.send()
            due = loop.time() + self._interval

    async def send(self) -> bool:
        """POST the current record once; False (logged once per outage, and once more should the outage turn
        from unreachable to refused or back) when the control plane is away or refuses it."""
        if self._url is None or self._session is None:
            return False
        record, live = self._build()
        self._sent = live.window
        status = None
        try:
            headers = self._credential.headers() if self._credential is not None else None
            async with self._session.post(
                self._url, json=record.to_json(), timeout=self._timeout, headers=headers
            ) as resp:
                body = await resp.read()
                status = resp.status
                if resp.status >= 300:
                    raise ValueError(f"HTTP {resp.status}: {body[:200]!r}")
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self._failed(status, str(exc) or type(exc).__name__)
            return False
        if self._down_since is not None:
            log.info("telemetry to %s works again after %.1fs", self._url, self._wall() - self._down_since)
            self._down_since = self._down_kind = None
        return True

    def _failed(self, status: int | None, why: str) -> None:
        kind = "refused" if status == 401 else "unreachable"  # "unreachable": away, or any other error
        if self._down_since is None:
            self._down_since = self._wall()
        elif kind == self._down_kind:
            return
        self._down_kind = kind
        if kind == "refused":
            path = self._credential.path if self._credential is not None else None
            log.warning(
                "telemetry to %s refused (%s): this sidecar's token%s has expired or is not valid. Its node "
                "host renews it from every heartbeat reply, so the node host is likely cut off from the "
                "control plane; this clears when a fresh token arrives. Still serving, retrying every %.1fs",
                self._url,
                why,
                f" ({path})" if path is not None else "",
                self._interval,
            )
        else:
            log.warning(
                "telemetry to %s failed (%s); still serving, retrying every %.1fs", self._url, why, self._interval
            )
