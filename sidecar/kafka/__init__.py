"""The Kafka connector of a model with `kafka_input` (issue 6): its sidecar reads the model's topic,
scores each request on the local worker, writes the result to the output topic in source order, and
commits only what the broker acknowledged (at-least-once; results carry their source for dedup).

What the rest of the sidecar uses:

    connector_for(spec, instance_id, ...)  the instance's connector, wired to the sidecar's own parts
                                           (admission Gate, keep-alive pool, metrics registry), not
                                           started; None when the model has no kafka_input
    follow_lifecycle(connector, status)    consume exactly while the instance serves (a supervised task)
    KafkaConnector                         start / drain / pause / resume / close, and status()
    ConnectorSettings                      what it consumes and how it paces the group protocol

`python -m sidecar.kafka` runs the same connector as a process of its own beside a worker
(standalone.py). Modules, each importing only those listed above it:

    settings.py    ConnectorSettings (plain values)
    records.py     requests and results as values: decoding, result and dead-letter records, headers,
                   what replaces a record too large or refused (pure)
    pipeline.py    per-partition ledger: what may be produced next, what may be committed (pure)
    batches.py     record batches read without aiokafka's decoding, for records it cannot decode (pure)
    metrics.py     the inference_kafka_* series
    handler.py     one request: validate, take a worker slot, call the worker, retry, dead-letter
    salvage.py     Salvager: what a session does with a record aiokafka cannot decode; a partition's
                   bytes fetched undecoded, and where a partition had been read from
    sending.py     Sender: a session's results to the producer in order, the broker's answers to the
                   ledgers; a record too large or refused is replaced there
    commits.py     Committer: a session's commits of what is acknowledged, and the lag behind them
    session.py     GroupSession: one membership of the consumer group, from join to leave (fetch, score,
                   release in order, hand partitions over); owns a Sender, a Committer and a Salvager
    connector.py   KafkaConnector: supervises sessions and follows the instance's life
    adapters.py    connector_for and follow_lifecycle: the connector made from the sidecar's parts
    standalone.py  the composition root of `python -m sidecar.kafka`

aiokafka is the optional `kafka` extra and only batches.py, salvage.py, sending.py, commits.py,
session.py and connector.py import it (none of them loaded by this file), so importing this package
does not need it: `KafkaConnector` is loaded from connector.py when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sidecar.kafka.adapters import connector_for, follow_lifecycle
from sidecar.kafka.settings import ConnectorSettings

if TYPE_CHECKING:
    from sidecar.kafka.connector import KafkaConnector

__all__ = ["ConnectorSettings", "KafkaConnector", "connector_for", "follow_lifecycle"]


def __getattr__(name: str) -> Any:
    if name == "KafkaConnector":  # needs aiokafka: loaded on first use, not with the package
        from sidecar.kafka.connector import KafkaConnector

        return KafkaConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
