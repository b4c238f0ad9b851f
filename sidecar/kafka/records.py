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

A record the connector cannot write as built (over `max_record_bytes`, or refused by the broker, see
`Outgoing`) is replaced: a result by a dead-letter record saying why, a dead-letter record by a stub
that names the request (the sie-source-* headers) and why, without copying its bytes.

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


# A record batch's header (61 bytes) and a lone record's fixed fields: attributes, and a timestamp and an
# offset delta of 0 (one byte each), as aiokafka's producer writes the first record of a batch.
_BATCH_HEADER = 61
_RECORD_FIXED = 3
# Bytes (UTF-8) of the reason a stub carries: it must stay small whatever it quotes (a validator's reason
# quotes the request's field names, up to 4 bytes a character), so that a stub fits the smallest
# max_record_bytes with its provenance headers (settings._SMALLEST_RECORD_LIMIT).
_REASON_MAX = 1000


def encoded_size(record: OutRecord) -> int:
    """Bytes of a record batch that holds `record` alone, uncompressed (what a broker compares with its
    message.max.bytes): a lone record is the largest batch the connector makes of it. (Written out for
    speed: it runs for every record the connector writes.)"""
    _topic, key, value, headers = record
    n = len(value)
    size = (
        _RECORD_FIXED
        + n
        + (1 if n < 64 else _varint_size(n))
        + (1 if len(headers) < 64 else _varint_size(len(headers)))
    )
    if key is None:
        size += 1
    else:
        n = len(key)
        size += n + (1 if n < 64 else _varint_size(n))
    for name, data in headers:
        n = len(name) if name.isascii() else len(name.encode("utf-8"))
        size += n + (1 if n < 64 else _varint_size(n))
        if data is None:
            size += 1
        else:
            n = len(data)
            size += n + (1 if n < 64 else _varint_size(n))
    return _BATCH_HEADER + (1 if size < 64 else _varint_size(size)) + size


@dataclass(frozen=True)
class Outgoing:
    """What the connector writes in place of a record it cannot write as built: over `max_bytes` (the
    connector's bound, `ConnectorSettings.max_record_bytes`), or refused by the broker for good.

        a result         -> a dead-letter record saying why (the request's bytes, as any dead letter)
        a dead letter    -> a stub: the request's source and why, no key, no value, no headers of its own
        a stub           -> nothing (None): there is nothing smaller to write

    Without a dead-letter topic there is nowhere to write the replacement, so it is None too; the
    connector logs, counts and skips the request (the handler does the same with an invalid one).
    """

    output_topic: str
    dead_letter_topic: str | None
    model_id: str
    instance_id: str
    max_bytes: int

    def dead_letter(self, message: SourceMessage, reason: str) -> OutRecord | None:
        """The request on the dead-letter topic with `reason`, within the bound; None without the topic."""
        if self.dead_letter_topic is None:
            return None
        return self.fit(
            dead_letter_record(message, reason, self.dead_letter_topic, self.model_id, self.instance_id), message
        )

    def fit(self, record: OutRecord, message: SourceMessage) -> OutRecord | None:
        """`record` itself when it is within the bound, else its replacement."""
        size = encoded_size(record)
        if size <= self.max_bytes:
            return record
        over = f"{size} bytes, more than the {self.max_bytes} a record may have (max_record_bytes)"
        if record.topic == self.output_topic:
            return self.dead_letter(message, f"the result is {over}")
        return self._stub(record, message, f"the request is not copied here: with it the record would be {over}")

    def replace(self, record: OutRecord, message: SourceMessage, why: str) -> OutRecord | None:
        """What to write after the broker refused `record` for good (`why`)."""
        if record.topic == self.output_topic:
            return self.dead_letter(message, f"the broker refused the result: {why}")
        if record.key is None and not record.value and not _passed_through(record.headers):
            return None  # a stub already, or as small as one
        return self._stub(
            record, message, f"the request is not copied here: the broker refused the record with it ({why})"
        )

    def _stub(self, record: OutRecord, message: SourceMessage, note: str) -> OutRecord | None:
        if self.dead_letter_topic is None:
            return None
        reason = f"{header(record.headers, HEADER_ERROR) or 'refused'}; {note}".encode()
        if len(reason) > _REASON_MAX:  # cut on a character boundary: the header stays UTF-8
            reason = reason[: _REASON_MAX - 3].decode(errors="ignore").encode() + b"..."
        return OutRecord(
            topic=self.dead_letter_topic,
            key=None,
            value=b"",
            headers=_provenance(message, self.model_id, self.instance_id) + ((HEADER_ERROR, reason),),
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


def _varint_size(value: int) -> int:
    """Bytes of a non-negative `value` as Kafka's zigzag varint."""
    return max(1, ((value << 1).bit_length() + 6) // 7)


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
