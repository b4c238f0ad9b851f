"""KafkaMetrics.observe_end_to_end: a batch of latencies lands in the histogram exactly as one `observe`
per value would put it (same buckets, count and sum in the exposition)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from sidecar.kafka.metrics import KafkaMetrics, MetricLabels
from sie.metric_names import LATENCY_BUCKETS_S

LABELS = ("m", "scoring", "P0", "1", "requests")


def _metrics() -> tuple[CollectorRegistry, KafkaMetrics]:
    registry = CollectorRegistry()
    return registry, KafkaMetrics(registry, MetricLabels(*LABELS))


def _buckets(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if "end_to_end_latency_seconds" in line and "_created" not in line]


# Values on the bucket bounds themselves, between them, and past the last one.
LATENCIES = st.lists(st.sampled_from(list(LATENCY_BUCKETS_S)) | st.floats(min_value=0.0, max_value=120.0), max_size=60)


@settings(max_examples=200, deadline=None)
@given(st.lists(LATENCIES, max_size=5))
def test_a_batch_observation_is_the_same_as_one_per_value(batches):
    one_by_one, by_value = _metrics()
    batched, by_batch = _metrics()
    for batch in batches:
        for latency in batch:
            by_value.end_to_end.observe(latency)
        by_batch.observe_end_to_end(batch)
    counts = [line for line in _buckets(one_by_one) if "_sum" not in line]
    assert counts == [line for line in _buckets(batched) if "_sum" not in line]
    total = sum(sum(batch) for batch in batches)
    for registry in (one_by_one, batched):
        (line,) = [line for line in _buckets(registry) if "_sum{" in line]
        assert abs(float(line.rsplit(" ", 1)[1]) - total) <= 1e-9 * max(1.0, total)


def test_a_histogram_without_the_internals_is_observed_value_by_value(monkeypatch):
    registry, metrics = _metrics()
    seen: list[float] = []

    class Plain:
        def observe(self, value: float) -> None:
            seen.append(value)

    monkeypatch.setattr(metrics, "end_to_end", Plain())
    metrics.observe_end_to_end([0.1, 0.2])
    assert seen == [0.1, 0.2]
