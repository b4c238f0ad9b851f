"""The Kafka connector's metrics, in the unified schema (sie/metric_names.py): the same four labels as
every sidecar metric (model_id, service_type, priority_level, version) plus `topic` (the input topic),
and `partition` for the per-partition lag.

    inference_kafka_consumed_total             requests read from the input topic
    inference_kafka_produced_total             results acknowledged by the broker on the output topic
    inference_kafka_committed_total            requests whose offsets the group has committed
    inference_kafka_invalid_total              requests refused before the worker (not JSON, schema)
    inference_kafka_dead_lettered_total        records acknowledged on the dead-letter topic
    inference_kafka_failed_total               requests the worker refused (4xx, or 5xx after retries)
    inference_kafka_undecodable_total          records the Kafka client could not decode (a header name that
                                               is not UTF-8): dead-lettered without reaching the worker
    inference_kafka_unwritable_total           records that could not be written as built (over
                                               max_record_bytes, or refused by the broker): replaced by a
                                               dead-letter record or a stub, or skipped when even that fails
    inference_kafka_lag{partition}             offsets in the partition not yet committed by the group
    inference_kafka_end_to_end_latency_seconds request timestamp to result acknowledged

Invalid requests are also counted in the unified `inference_invalid_schema_total`: the sidecar hands in
its own counter's `invalid_schema` method, so one PromQL line counts bad input from HTTP and Kafka alike;
without one (the standalone connector) the counter is registered here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sie.metric_names import INVALID_SCHEMA, LABELS, LATENCY_BUCKETS_S

CONSUMED = "inference_kafka_consumed_total"
PRODUCED = "inference_kafka_produced_total"
COMMITTED = "inference_kafka_committed_total"
INVALID = "inference_kafka_invalid_total"
DEAD_LETTERED = "inference_kafka_dead_lettered_total"
FAILED = "inference_kafka_failed_total"
UNDECODABLE = "inference_kafka_undecodable_total"
UNWRITABLE = "inference_kafka_unwritable_total"
LAG = "inference_kafka_lag"
END_TO_END = "inference_kafka_end_to_end_latency_seconds"

_LABELS = (*LABELS, "topic")


@dataclass(frozen=True)
class MetricLabels:
    model_id: str
    service_type: str
    priority_level: str
    version: str
    topic: str

    def values(self) -> tuple[str, ...]:
        return (self.model_id, self.service_type, self.priority_level, self.version, self.topic)


class KafkaMetrics:
    """The connector's series in `registry` (the sidecar's own, so one scrape shows both)."""

    def __init__(
        self, registry: CollectorRegistry, labels: MetricLabels, on_invalid_schema: Callable[[], None] | None = None
    ):
        values = labels.values()

        def counter(name: str, doc: str) -> Any:
            # prometheus_client appends _total itself and refuses a name that already ends in it.
            return Counter(name.removesuffix("_total"), doc, _LABELS, registry=registry).labels(*values)

        self.consumed = counter(CONSUMED, "Requests read from the input topic.")
        self.produced = counter(PRODUCED, "Results acknowledged by the broker on the output topic.")
        self.committed = counter(COMMITTED, "Requests whose offsets the consumer group has committed.")
        self.invalid = counter(
            INVALID, "Requests refused before the worker: not a JSON object, or against the input schema."
        )
        self.dead_lettered = counter(DEAD_LETTERED, "Records acknowledged on the dead-letter topic.")
        self.failed = counter(FAILED, "Requests the worker refused (4xx, or 5xx after retries).")
        self.undecodable = counter(
            UNDECODABLE, "Records the Kafka client could not decode (a header name that is not UTF-8), dead-lettered."
        )
        self.unwritable = counter(
            UNWRITABLE,
            "Records not written as built (over max_record_bytes, or refused by the broker): replaced or skipped.",
        )
        self.end_to_end = Histogram(
            END_TO_END,
            "Request timestamp to result acknowledged on the output topic.",
            _LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        ).labels(*values)
        self._lag = Gauge(
            LAG, "Offsets in the partition not yet committed by the group.", (*_LABELS, "partition"), registry=registry
        )
        self._values = values
        if on_invalid_schema is None:
            on_invalid_schema = (
                Counter(
                    INVALID_SCHEMA.removesuffix("_total"),
                    "Requests refused for breaking the input schema.",
                    LABELS,
                    registry=registry,
                )
                .labels(*values[:4])
                .inc
            )
        self._on_invalid_schema = on_invalid_schema

    def observe_end_to_end(self, latencies_s: Sequence[float]) -> None:
        """Observe a batch's end-to-end latencies at once. The connector acknowledges thousands of results
        a second, and prometheus_client's `observe` takes two locks and walks the buckets per value;
        here each bucket and the sum move once per batch. It reaches into the histogram child's
        `_upper_bounds`, `_buckets` and `_sum` (prometheus_client 0.20-0.26); without them it observes
        value by value. The exposition is the same either way (tests/unit/sidecar/test_kafka_metrics.py)."""
        child = self.end_to_end
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        total = getattr(child, "_sum", None)
        if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
            for latency in latencies_s:
                child.observe(latency)
            return
        for index, count in Tally(bisect_left(bounds, latency) for latency in latencies_s).items():
            buckets[index].inc(count)  # bisect_left: the first bound >= the value, as observe picks it
        total.inc(sum(latencies_s))

    def count_invalid(self) -> None:
        self.invalid.inc()
        self._on_invalid_schema()

    def set_lag(self, partition: int, lag: int) -> None:
        self._lag.labels(*self._values, str(partition)).set(lag)

    def forget_partition(self, partition: int) -> None:
        """A revoked partition's lag is the new owner's to report; a stale figure here would double it."""
        try:
            self._lag.remove(*self._values, str(partition))
        except KeyError:
            pass
