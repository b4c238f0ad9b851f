"""Talking to the worker outside the data path: health probes, load polls, memory release/resume.

`WorkerClient` makes single calls, in the engine's dialect (sie.engines: where its health and load
figures are, how it gives memory back); `WorkerWatch` runs the loops that keep the lifecycle and the
latest load figures current. Both share the process's one ClientSession.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import aiohttp

from sidecar import lifecycle
from sidecar.gpu import GpuReader, GpuSample
from sidecar.lifecycle import Probe
from sidecar.status import Status
from sie.engines import Call, Dialect, MemoryRelease, Sleep
from sie.engines.sie_protocol import SIE
from sie.errors import RetryableError
from sie.tasks import wait_event
from sie.worker_loads import EngineLoad, HitRateWindow, LoadsFormatError, parse_loads

log = logging.getLogger(__name__)

# Load figures older than this are dropped (reported absent) rather than repeated as if current.
LOAD_STALE_S = 2.0
POKE_GAP_S = 0.05


class WorkerCallError(RetryableError):
    """A control call to the worker (release/resume) failed; the message says which and why."""


class WorkerClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        probe_timeout_s: float,
        worker_key: str | None,
        *,
        dialect: Dialect = SIE,
        model_id: str = "",
        on_gpu: bool = False,
        metrics_url: str | None = None,
    ):
        self._session = session
        self._base = base_url
        self.dialect = dialect
        self.sleep_way: Sleep = dialect.sleep(on_gpu)
        self._model = model_id
        # Every worker endpoint but its health (and, for some engines, its metrics) asks for the key.
        self._auth = dialect.key_headers(worker_key)
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._call_timeout = aiohttp.ClientTimeout(total=max(5.0, probe_timeout_s))
        self._health_url = base_url + self._path(dialect.health_path)
        self._metrics_url = metrics_url or base_url + self._path(dialect.metrics_path)
        # False once the load document answered 404 (or the engine has none): use its metrics from then on.
        self._loads_path_works = dialect.loads_path is not None

    def _path(self, path: str) -> str:
        return path.replace("{model}", self._model)

    async def probe(self) -> Probe:
        try:
            async with self._session.get(self._health_url, timeout=self._probe_timeout) as resp:
                await resp.read()
                return Probe.OK if resp.status == 200 else Probe.NOT_READY
        except TimeoutError:
            return Probe.TIMEOUT
        except aiohttp.ClientError:
            return Probe.UNREACHABLE

    async def load(self) -> EngineLoad | None:
        """The worker's own load figures, or None when it does not say (or cannot be reached)."""
        try:
            if self._loads_path_works and self.dialect.loads_path is not None:
                async with self._session.get(
                    self._base + self._path(self.dialect.loads_path), timeout=self._probe_timeout, headers=self._auth
                ) as resp:
                    if resp.status == 200:
                        try:
                            return parse_loads(await resp.json(content_type=None))
                        except (ValueError, LoadsFormatError):
                            pass  # an unknown shape: try the Prometheus gauges below
                    elif resp.status in (404, 405):
                        log.info(
                            "worker has no %s (HTTP %d); reading its metrics", self.dialect.loads_path, resp.status
                        )
                        self._loads_path_works = False
                    else:
                        return None
            async with self._session.get(self._metrics_url, timeout=self._probe_timeout, headers=self._auth) as resp:
                if resp.status != 200:
                    return None
                return self.dialect.parse_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, LoadsFormatError, ValueError):
            return None

    async def release_memory(self) -> None:
        """Give the accelerator memory back as the engine does. An engine that cannot (MemoryRelease.UNLOAD)
        is left as it is: drained and idle, its node host stops the process, which frees everything."""
        if self.sleep_way.release is MemoryRelease.CALL and self.sleep_way.release_call is not None:
            await self._call(self.sleep_way.release_call)

    async def resume_memory(self) -> None:
        """Take the memory back. After an unload the worker is a fresh process that holds it already."""
        if self.sleep_way.release is MemoryRelease.CALL and self.sleep_way.resume_call is not None:
            await self._call(self.sleep_way.resume_call)

    async def _call(self, call: Call) -> None:
        path = self._path(call.path)
        body = None if call.body is None else dict(call.body)
        try:
            async with self._session.post(
                self._base + path, json=body, timeout=self._call_timeout, headers=self._auth
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise WorkerCallError(f"worker POST {path} answered HTTP {resp.status}: {text[:300]}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise WorkerCallError(f"worker POST {path} failed: {exc!r}") from exc


class WorkerWatch:
    """Loops: health every `interval_s` (and at once when poked), load every `interval_s`, GPU too.

    `answered_at()` is when the worker last answered a data-path request. A probe that times out
    while the worker keeps answering real requests means a busy worker, not a dead one (a real
    SGLang's /health generates a token and queues behind the batch), so such a timeout is ignored.
    """

    def __init__(
        self,
        client: WorkerClient,
        status: Status,
        interval_s: float,
        clock: Callable[[], float],
        answered_at: Callable[[], float] = lambda: float("-inf"),
        busy_grace_s: float = 1.5,
    ):
        self._client = client
        self._status = status
        self._interval = interval_s
        self._clock = clock
        self._answered_at = answered_at
        self._busy_grace = busy_grace_s
        self._poke = asyncio.Event()
        self._load: EngineLoad | None = None
        self._load_at = float("-inf")
        self._hit_rate = HitRateWindow()
        self.gpu: GpuSample | None = None

    def poke(self) -> None:
        """Probe now: the data path just failed to reach the worker."""
        self._poke.set()

    @property
    def load(self) -> EngineLoad | None:
        return self._load if self._clock() - self._load_at <= LOAD_STALE_S else None

    async def probe_once(self) -> None:
        probe = await self._client.probe()
        if probe is Probe.TIMEOUT and self._clock() - self._answered_at() <= self._busy_grace:
            log.debug("health probe timed out, but the worker answered a request just now: busy, not failed")
            return
        self._status.apply(lifecycle.on_probe, probe)

    async def run_health(self) -> None:
        while True:
            await self.probe_once()
            if await wait_event(self._poke, self._interval):
                # A burst of data-path failures pokes many times; probe at most every POKE_GAP_S.
                await asyncio.sleep(POKE_GAP_S)
            self._poke.clear()

    async def run_load(self) -> None:
        while True:
            load = await self._client.load()
            if load is not None:
                now = self._clock()
                if load.cache_hit_rate is None and load.prefix_hits is not None and load.prefix_queries is not None:
                    # An engine that counts its prefix-cache hits (vLLM): the rate over the recent window.
                    rate = self._hit_rate.add(now, load.prefix_hits, load.prefix_queries)
                    load = dataclasses.replace(load, cache_hit_rate=rate)
                self._load, self._load_at = load, now
            await asyncio.sleep(self._interval)

    async def run_gpu(self, reader: GpuReader) -> None:
        while True:
            # NVML calls block; keep them off the event loop.
            self.gpu = await asyncio.to_thread(reader.read)
            await asyncio.sleep(self._interval)
