"""The unified Prometheus schema (sie/metric_names.py), exported at GET /-/metrics.

One private registry per sidecar. Every series carries the same four labels (model_id, service_type,
priority_level, version); inference_requests_total adds `code`. The label children are bound once
here, so the data path pays a lock and an add per observation, nothing more.

Gauges are not pushed from the hot path: a collector reads the live counts at scrape time, and the
KV-cache gauge is left out entirely while the figure is unknown (absent, not zero).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sie import metric_names as M

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


Live = Callable[[], tuple[int, int, float | None, float | None]]  # in flight, queued, KV use, cache hit rate


class _LiveGauges(Collector):
    def __init__(self, labels: dict[str, str], read: Live):
        self._names = list(labels)
        self._values = list(labels.values())
        self._read = read

    def collect(self) -> Iterator[Metric]:
        in_flight, queued, kv, hits = self._read()
        for name, doc, value in (
            (M.IN_FLIGHT, "Requests at the worker now.", in_flight),
            (M.QUEUED, "Requests waiting for admission now.", queued),
            (M.KV_CACHE_USAGE, "KV-cache use reported by the worker, 0..1.", kv),
            (M.CACHE_HIT_RATE, "Prompt tokens the worker found in its prefix cache, 0..1.", hits),
        ):
            if value is None:
                continue
            family = GaugeMetricFamily(name, doc, labels=self._names)
            family.add_metric(self._values, value)
            yield family


class Metrics:
    def __init__(self, labels: dict[str, str], live: Live):
        if tuple(labels) != M.LABELS:
            raise ValueError(f"metric labels must be exactly {M.LABELS}, got {tuple(labels)}")
        self.registry = CollectorRegistry(auto_describe=True)
        names = list(M.LABELS)
        values = list(labels.values())
        self._latency = Histogram(
            M.LATENCY,
            "End-to-end latency at the sidecar (queue wait included) of requests that reached the worker.",
            names,
            buckets=M.LATENCY_BUCKETS_S,
            registry=self.registry,
        ).labels(*values)
        self._queue_time = Histogram(
            M.QUEUE_TIME,
            "Time requests waited for admission (0 when admitted at once).",
            names,
            buckets=M.LATENCY_BUCKETS_S,
            registry=self.registry,
        ).labels(*values)
        self._requests = Counter(
            M.REQUESTS,
            "Requests answered, by HTTP status (499: the client went away first).",
            [*names, "code"],
            registry=self.registry,
        )
        self._invalid = Counter(
            M.INVALID_SCHEMA,
            "Requests refused with 400 for breaking the model's input_schema.",
            names,
            registry=self.registry,
        ).labels(*values)
        self._evictions = Counter(
            M.EVICTIONS,
            "Times this instance was evicted (slept to free GPU memory).",
            names,
            registry=self.registry,
        ).labels(*values)
        self.registry.register(_LiveGauges(labels, live))
        self._values = values
        # One bound child per status code, made on first use; a handful of codes ever occur.
        self._by_code: dict[int, Counter] = {}

    def answered(self, code: int) -> None:
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self._requests.labels(*self._values, str(code))
        child.inc()

    def served(self, latency_s: float, queue_s: float) -> None:
        self._latency.observe(latency_s)
        self._queue_time.observe(queue_s)

    def invalid_schema(self) -> None:
        self._invalid.inc()

    def evicted(self) -> None:
        self._evictions.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def metric_labels(model_id: str, service_type: str, priority_level: str, version: str) -> dict[str, str]:
    return {"model_id": model_id, "service_type": service_type, "priority_level": priority_level, "version": version}
