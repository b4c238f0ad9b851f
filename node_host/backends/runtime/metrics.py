"""A worker's /metrics: SGLang's metric names (sie/metric_names.py SGLANG_*), label model_name.

Gauges are read from the engine at scrape time (no stale values between scrapes, and a scorer simply has
no token gauges: absent is not zero). Histograms and the generation throughput are fed by the app as
requests run. The registry is private to the worker, so nothing else in the process leaks into it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_host.backends.protocol import Loads
from sie import metric_names as names

# SGLang's own buckets are wider at the top for long generations; these cover 1 ms .. 60 s.
_BUCKETS = names.LATENCY_BUCKETS_S
THROUGHPUT_WINDOW_S = 5.0


class _Throughput:
    """Generated tokens per second over a sliding window, for sglang:gen_throughput."""

    def __init__(self, clock: Callable[[], float], window_s: float = THROUGHPUT_WINDOW_S):
        self._clock = clock
        self._window = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._start = clock()

    def add(self, tokens: int) -> None:
        if tokens > 0:
            self._events.append((self._clock(), tokens))

    def rate(self) -> float:
        now = self._clock()
        while self._events and self._events[0][0] < now - self._window:
            self._events.popleft()
        # Before a whole window has passed, divide by the time actually observed.
        span = min(self._window, max(now - self._start, 1e-3))
        return sum(n for _, n in self._events) / span


class _LoadsCollector(Collector):
    def __init__(self, model_name: str, loads: Callable[[], Loads], throughput: _Throughput | None):
        self._model = model_name
        self._loads = loads
        self._throughput = throughput

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def collect(self) -> Iterator[Metric]:
        loads = self._loads()
        yield self._gauge(names.SGLANG_RUNNING, "Requests running in the engine.", loads.running)
        yield self._gauge(names.SGLANG_QUEUE, "Requests waiting for admission.", loads.waiting)
        if loads.used_tokens is not None:
            yield self._gauge(names.SGLANG_USED_TOKENS, "KV-cache tokens in use.", loads.used_tokens)
        if loads.max_total_tokens is not None:
            yield self._gauge(names.SGLANG_MAX_TOTAL_TOKENS, "KV-cache token budget.", loads.max_total_tokens)
        if loads.token_usage is not None:
            yield self._gauge(names.SGLANG_TOKEN_USAGE, "KV-cache use, 0..1.", loads.token_usage)
        if loads.cache_hit_rate is not None:
            yield self._gauge(
                names.SGLANG_CACHE_HIT_RATE, "Prompt tokens found in the prefix cache, 0..1.", loads.cache_hit_rate
            )
        if self._throughput is not None:
            yield self._gauge(names.SGLANG_GEN_THROUGHPUT, "Generated tokens per second.", self._throughput.rate())


class WorkerMetrics:
    """The metrics of one worker. `observe_*` are called by the app; `render()` answers /metrics."""

    def __init__(
        self,
        model_name: str,
        loads: Callable[[], Loads],
        *,
        generative: bool,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registry = CollectorRegistry(auto_describe=False)
        self._model = model_name
        self._throughput = _Throughput(clock) if generative else None
        self.registry.register(_LoadsCollector(model_name, loads, self._throughput))
        self._e2e = Histogram(
            names.SGLANG_E2E_LATENCY,
            "End-to-end request latency in the worker.",
            ["model_name"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._ttft = Histogram(
            names.SGLANG_TTFT, "Time to first token.", ["model_name"], buckets=_BUCKETS, registry=self.registry
        )
        # Created with the first batch, so a generative worker's /metrics has no empty batch series.
        self._batch_rows: Histogram | None = None
        self._batch_requests: Histogram | None = None
        self._queue = Histogram(
            names.SGLANG_QUEUE_TIME,
            "Time from arrival to admission.",
            ["model_name"],
            buckets=_BUCKETS,
            registry=self.registry,
        )

    def observe_batch(self, rows: int, requests: int) -> None:
        """One engine call of a scorer's micro-batcher: its rows and how many requests they came from."""
        if self._batch_rows is None or self._batch_requests is None:
            self._batch_rows = Histogram(
                names.WORKER_BATCH_SIZE,
                "Rows in one engine call (scorer micro-batching).",
                ["model_name"],
                buckets=names.BATCH_BUCKETS,
                registry=self.registry,
            )
            self._batch_requests = Histogram(
                names.WORKER_BATCH_REQUESTS,
                "Requests that shared one engine call (scorer micro-batching).",
                ["model_name"],
                buckets=names.BATCH_BUCKETS,
                registry=self.registry,
            )
        self._batch_rows.labels(self._model).observe(rows)
        self._batch_requests.labels(self._model).observe(requests)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.labels(self._model).observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.labels(self._model).observe(seconds)

    def observe_queue(self, seconds: float) -> None:
        self._queue.labels(self._model).observe(seconds)

    def add_tokens(self, tokens: int) -> None:
        if self._throughput is not None:
            self._throughput.add(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
