"""The Kafka connector's settings: what it consumes (the model's `kafka_input`), who it is, and how it
paces the group protocol, fetches, drains, commits and restarts. Plain values, no client objects, so
every module of the connector can read them without importing aiokafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sie.spec import KafkaInput, ModelService, Priority


@dataclass(frozen=True)
class ConnectorSettings:
    kafka: KafkaInput
    model_id: str
    instance_id: str
    priority: Priority
    # Kafka's defaults; tests use 2000 / 500 because group joins on Tansu take about half the session timeout.
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    fetch_wait_ms: int = 100  # longest the fetch loop waits for records, so a drain is noticed within this
    # Longest the broker holds a fetch that has no data yet. Kafka answers as soon as data arrives; Tansu
    # 0.6 looks again after half the time left, and again, so a record that comes during the wait waits
    # up to half of it more (measured with librdkafka, one record at a time: median 3.0 ms, at most 7 ms
    # at 10 ms; 63 and 103 ms at 200). A small value is what keeps end-to-end latency low there; the cost
    # is ~100 empty fetches/s idle.
    broker_fetch_wait_ms: int = 10
    drain_timeout_s: float = 30.0  # bound on finishing in-flight work when partitions are handed over
    # Commits coalesce over this interval (0: one as soon as results are acknowledged, one on the wire at
    # a time). At 10,000 messages/s on Tansu, 0 sent about one commit per produced batch, each a broker
    # request; in one pair of `bench.kafka --quick` runs end-to-end p99 went from 256 ms (0) to 114 ms
    # (0.1). The price: after a crash, up to this much more work is repeated (never lost: commits still
    # follow the acknowledgements).
    commit_interval_s: float = 0.1
    restart_backoff_s: float = 1.0  # pause before rejoining after a failed session
    client_overrides: dict[str, Any] = field(default_factory=dict)  # passed to both aiokafka clients

    @classmethod
    def from_spec(cls, service: ModelService, instance_id: str, **overrides: Any) -> ConnectorSettings:
        kafka = service.spec.kafka_input
        if kafka is None:
            raise ValueError(f"model {service.model_id!r} has no kafka_input block; nothing to consume")
        return cls(
            kafka=kafka,
            model_id=service.model_id,
            instance_id=instance_id,
            priority=service.spec.model.priority_level,
            **overrides,
        )
