"""What the Kafka connector reads and writes, as plain values: decoding requests, building result and
dead-letter records, and the headers that let consumers downstream deduplicate.

Pure: no client objects, no clock. The connector turns aiokafka's ConsumerRecord into a `SourceMessage`
and hands `OutRecord`s to the producer.

Every record the connector writes carries where it came from:

    sie-source-topic      the request's topic
    sie-source-partition  its partition (decimal)
    sie-source-offset     its offset (decimal)
    sie-model-id          the model that answered
    sie-instance-id       the instance whose sidecar answered

Delivery is at-least-once, so a consumer of the output topic that must not count a result twice keys
on (source topic, partition, offset): a repeat carries the same three values. Dead-letter records add
`sie-error` (why the request was refused) and carry the request's original bytes, untouched, so the
sender can fix and resend it.

Keys: a result keeps its request's key, so results of one key stay in order on one output partition;
a request without a key gives its result the key `p<source partition>`, and the connector writes it to
the output partition with the source partition's number (modulo the output topic's partition count),
which keeps the results of one source partition in one output partition, in source order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

from sie import strict_json
from sie.errors import InputError

HEADER_SOURCE_TOPIC = "sie-source-topic"
HEADER_SOURCE_PARTITION = "sie-source-partition"
HEADER_SOURCE_OFFSET = "sie-source-offset"
HEADER_MODEL = "sie-model-id"
HEADER_INSTANCE = "sie-instance-id"
HEADER_ERROR = "sie-error"

_OURS = frozenset(
    (
        HEADER_SOURCE_TOPIC,
        HEADER_SOURCE_PARTITION,
        HEADER_SOURCE_OFFSET,
        HEADER_MODEL,
        HEADER_INSTANCE,
        HEADER_ERROR,
    )
)

Headers = tuple[tuple[str, bytes], ...]


class SourceMessage(NamedTuple):
    """One request read from the input topic. (A NamedTuple, not a frozen dataclass: the connector
    makes one per message at thousands a second, and a frozen dataclass's __init__ costs a setattr
    call per field.)"""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None  # the record's timestamp (producer's CreateTime, or the broker's LogAppendTime)
    key: bytes | None
    value: bytes | None
    headers: Headers = ()


class OutRecord(NamedTuple):
    """One record to produce: a result, or a refused request for the dead-letter topic."""

    topic: str
    key: bytes | None
    value: bytes
    headers: Headers


@dataclass(frozen=True)
class SourceRef:
    """Where a result came from: the identity a downstream consumer deduplicates on."""

    topic: str
    partition: int
    offset: int


def decode_json_object(value: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
    """(body, None) for a JSON object, or (None, why not). Requests to a model are JSON objects."""
    if value is None:
        return None, "the message has no value (a tombstone); expected a JSON object"
    try:
        body = strict_json.loads(value, what="the value")
    except InputError as exc:
        return None, str(exc)
    if not isinstance(body, dict):
        return None, f"the value is JSON {type(body).__name__}; expected a JSON object"
    return body, None


def result_record(
    message: SourceMessage, result: bytes, output_topic: str, model_id: str, instance_id: str
) -> OutRecord:
    return OutRecord(
        topic=output_topic,
        key=_result_key(message),
        value=result,
        headers=_passed_through(message.headers) + _provenance(message, model_id, instance_id),
    )


def dead_letter_record(
    message: SourceMessage, reason: str, dead_letter_topic: str, model_id: str, instance_id: str
) -> OutRecord:
    return OutRecord(
        topic=dead_letter_topic,
        key=message.key,
        value=message.value if message.value is not None else b"",
        headers=_passed_through(message.headers)
        + _provenance(message, model_id, instance_id)
        + ((HEADER_ERROR, reason.encode("utf-8", errors="replace")),),
    )


def source_of(headers: Headers | list[tuple[str, bytes]]) -> SourceRef | None:
    """The source a written record names in its headers, or None if it names none (not ours)."""
    found = {key: value for key, value in headers if key in _OURS}
    try:
        return SourceRef(
            topic=found[HEADER_SOURCE_TOPIC].decode(),
            partition=int(found[HEADER_SOURCE_PARTITION]),
            offset=int(found[HEADER_SOURCE_OFFSET]),
        )
    except (KeyError, ValueError):
        return None


def header(headers: Headers | list[tuple[str, bytes]], name: str) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("utf-8", errors="replace")
    return None


def end_to_end_seconds(timestamp_ms: int | None, now_s: float) -> float | None:
    """Seconds from the request's timestamp to `now_s` (wall clock); None if there is no timestamp.

    Clocks of producer and sidecar hosts differ, so a small negative figure is clamped to 0.
    """
    if timestamp_ms is None or timestamp_ms < 0:
        return None
    return max(0.0, now_s - timestamp_ms / 1000.0)


def _result_key(message: SourceMessage) -> bytes:
    return message.key if message.key is not None else f"p{message.partition}".encode()


@functools.lru_cache(maxsize=1024)
def _fixed(topic: str, partition: int, model_id: str, instance_id: str) -> tuple[Headers, Headers]:
    # Everything but the offset repeats on every record of a partition: encode it once. (The
    # connector writes thousands of records a second; per-record encoding showed in its profile.)
    return (
        ((HEADER_SOURCE_TOPIC, topic.encode()), (HEADER_SOURCE_PARTITION, str(partition).encode())),
        ((HEADER_MODEL, model_id.encode()), (HEADER_INSTANCE, instance_id.encode())),
    )


def _provenance(message: SourceMessage, model_id: str, instance_id: str) -> Headers:
    source, ours = _fixed(message.topic, message.partition, model_id, instance_id)
    return source + ((HEADER_SOURCE_OFFSET, str(message.offset).encode()),) + ours


def _passed_through(headers: Headers) -> Headers:
    # The request's own headers (trace ids, tenant tags) travel with the result; stale provenance
    # headers from an earlier hop are replaced by ours, so there is exactly one of each.
    if not headers:
        return ()
    return tuple([pair for pair in headers if pair[0] not in _OURS])
