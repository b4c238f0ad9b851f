"""The Kafka connector's settings: what it consumes (the model's `kafka_input`), who it is, and how it
paces the group protocol, fetches, drains, commits and restarts. Plain values, no client objects, so
every module of the connector can read them without importing aiokafka.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sie.spec import KafkaInput, ModelService, Priority

_SMALLEST_RECORD_LIMIT = 4096  # a stub: provenance headers and a reason of at most 1,000 characters


@dataclass(frozen=True)
class ConnectorSettings:
    """What one instance's connector consumes and who it is (from the spec, not flags), and how it paces
    the group protocol, fetches, drains, commits and restarts. The sidecar sets only drain_timeout_s (its
    own); `python -m sidecar.kafka` has a flag for each tunable (sie.settings_flags), help from the
    docstrings below."""

    kafka: KafkaInput = field(metadata={"cli": False})
    model_id: str = field(metadata={"cli": False})
    instance_id: str = field(metadata={"cli": False})
    priority: Priority = field(metadata={"cli": False})
    session_timeout_ms: int = 10_000
    """Milliseconds the group waits for a heartbeat before it removes this member (Kafka's default,
    10,000; tests use 2,000, as group joins on Tansu take about half the session timeout)."""
    heartbeat_interval_ms: int = 3_000
    """Milliseconds between heartbeats to the group coordinator (Kafka's default, 3,000; under
    session_timeout_ms, and best at most a third of it)."""
    fetch_wait_ms: int = 100
    """Longest the fetch loop waits for records (milliseconds), so a drain is noticed within this."""
    broker_fetch_wait_ms: int = 10
    """Longest the broker holds a fetch that has no data yet (milliseconds). Kafka answers as soon as data
    arrives; Tansu 0.6 looks again after half the time left, and again, so a record that comes during the
    wait waits up to half of it more (measured with librdkafka, one record at a time: median 3.0 ms, at
    most 7 ms at 10 ms; 63 and 103 ms at 200). A small value is what keeps end-to-end latency low there;
    the cost is about 100 empty fetches a second when idle."""
    drain_timeout_s: float = 30.0
    """Bound on finishing in-flight work when partitions are handed over (seconds)."""
    rebalance_margin_s: float = 10.0
    """Seconds the group waits for this member in a rebalance beyond drain_timeout_s (default 10): time to
    hear of the rebalance (a heartbeat interval), to commit after the drain, and to send JoinGroup. See
    `rebalance_timeout_ms`."""
    max_poll_interval_ms: int = 300_000
    """Longest the consumer may go without fetching before it leaves the group (Kafka's default, 5
    minutes; the fetch loop stops fetching while its window is full). Raised to the rebalance timeout
    when that is longer, as Kafka's Java client ties the two together."""
    max_record_bytes: int = 1_048_588
    """Largest record the connector writes, counted as a record batch holding it alone (bytes; default
    1,048,588, Kafka's default message.max.bytes, which a broker compares with a whole batch, its 61-byte
    header and the record's framing included). A result over it is replaced by a dead-letter record saying
    so, and a dead-letter record over it (it copies the request and adds headers) by a stub without the
    request's bytes. Set it to the output and dead-letter topics' max.message.bytes when they are lower
    (the spec's kafka_input.max_record_bytes, which this setting overrides when given)."""
    commit_interval_s: float = 0.1
    """Least time between commits (seconds; 0: one as soon as results are acknowledged, one on the wire at
    a time). At 10,000 messages/s on Tansu, 0 sent about one commit per produced batch, each a broker
    request; in one pair of `bench.kafka --quick` runs end-to-end p99 went from 256 ms (0) to 114 ms
    (0.1). The price: after a crash, up to this much more work is repeated (never lost: commits still
    follow the acknowledgements)."""
    restart_backoff_s: float = 1.0
    """Pause before rejoining the group after a failed session (seconds)."""
    client_overrides: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})
    """Passed to both aiokafka clients as keyword arguments (tests only)."""

    def __post_init__(self) -> None:
        for name in ("session_timeout_ms", "heartbeat_interval_ms", "fetch_wait_ms", "max_poll_interval_ms"):
            if not 0 < getattr(self, name) <= 3_600_000:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be in 1..3,600,000 ms")
        if not 0 <= self.broker_fetch_wait_ms <= 60_000:
            raise ValueError(f"broker_fetch_wait_ms is {self.broker_fetch_wait_ms}; it must be in 0..60,000 ms")
        if self.heartbeat_interval_ms >= self.session_timeout_ms:  # Kafka's own rule (a third is its advice)
            raise ValueError(
                f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be under session_timeout_ms "
                f"({self.session_timeout_ms}), or the group removes the member between two heartbeats"
            )
        for name in ("drain_timeout_s", "rebalance_margin_s", "commit_interval_s", "restart_backoff_s"):
            if not 0 <= getattr(self, name) <= 3_600:
                raise ValueError(f"{name} is {getattr(self, name)}; it must be in 0..3,600 s")
        if self.max_record_bytes < _SMALLEST_RECORD_LIMIT:
            raise ValueError(
                f"max_record_bytes is {self.max_record_bytes}; it must be at least {_SMALLEST_RECORD_LIMIT}, "
                "room for the stub that stands in for a request too large to copy"
            )
        batch_size = self.client_overrides.get("max_batch_size")
        if batch_size is not None and batch_size > self.max_record_bytes:
            raise ValueError(
                f"client_overrides max_batch_size ({batch_size}) is over max_record_bytes ({self.max_record_bytes}): "
                "a batch of records that each fit could still be refused whole"
            )

    @property
    def rebalance_timeout_ms(self) -> int:
        """How long the group waits for this member to rejoin in a rebalance. Revocation waits up to
        drain_timeout_s for the work in hand and then commits it (session.py), all before the member
        rejoins; a member that takes longer is removed, its partitions' work is repeated elsewhere, and
        its commit fails. aiokafka's default is the session timeout (10 s), under the drain bound."""
        return int((self.drain_timeout_s + self.rebalance_margin_s) * 1000)

    @property
    def poll_interval_ms(self) -> int:
        """max_poll_interval_ms, at least the rebalance timeout."""
        return max(self.max_poll_interval_ms, self.rebalance_timeout_ms)

    @classmethod
    def from_spec(cls, service: ModelService, instance_id: str, **overrides: Any) -> ConnectorSettings:
        kafka = service.spec.kafka_input
        if kafka is None:
            raise ValueError(f"model {service.model_id!r} has no kafka_input block; nothing to consume")
        if kafka.max_record_bytes is not None:  # the topics' bound, from the spec; a given setting wins
            overrides = {"max_record_bytes": kafka.max_record_bytes, **overrides}
        return cls(
            kafka=kafka,
            model_id=service.model_id,
            instance_id=instance_id,
            priority=service.spec.model.priority_level,
            **overrides,
        )
