"""Record batches as the broker sends them, read without aiokafka's record decoding.

aiokafka decodes every header name as UTF-8 while it fetches, and Kafka's wire format lets a header name
be any bytes (other clients write what they are given). A record aiokafka cannot decode stops its
fetch: getmany raises, and since aiokafka decodes a whole batch from its start, seeking past the record
does not help while the batch holds anything after it. The connector then reads that partition's bytes
itself (salvage.py, `Salvager`) and this module parses them: a record with a header name that is not
UTF-8 is returned with its offset, key and value, flagged; a batch that cannot be parsed at all
(bad CRC, a length that runs past its end, an unknown codec) is returned as one unit with its offsets.

Pure: bytes in, values out. Magic 2 (Kafka 0.11 and later) only: an older batch has no headers, so
aiokafka never fails on one for a header, and it is returned unread (`legacy`).

Layout of a batch (KIP-98): base offset (int64), length (int32), leader epoch (int32), magic (int8), CRC-32C
(uint32) of everything after it, attributes (int16), last offset delta (int32), first and max timestamp
(int64 each), producer id (int64), producer epoch (int16), base sequence (int32), record count (int32),
then the records, compressed as the attributes say. A record: its length, attributes (int8), timestamp
delta, offset delta, key, value and headers, every length and delta a zigzag varint.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from aiokafka import codec
from aiokafka.record.util import calc_crc32c

from sidecar.kafka.records import SourceMessage

_HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = _HEADER.size  # 61
_LOG_OVERHEAD = 12  # base offset and length: the part of a batch its length does not count
_MAGIC_END = 17  # base offset, length, leader epoch (or a legacy CRC) and magic: where every format agrees
_CRC_FROM = 21  # the CRC covers the batch from its attributes on
_TIMESTAMP_LOG_APPEND = 0x08
_TRANSACTIONAL = 0x10
_CONTROL = 0x20
_DECODERS = {
    1: ("gzip", codec.has_gzip, codec.gzip_decode),
    2: ("snappy", codec.has_snappy, codec.snappy_decode),
    3: ("lz4", codec.has_lz4, codec.lz4_decode),
    4: ("zstd", codec.has_zstd, codec.zstd_decode),
}


class RawRecord(NamedTuple):
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[bytes, bytes | None], ...]  # names as bytes: not every producer writes UTF-8

    def undecodable_header(self) -> bytes | None:
        """The first header name that is not UTF-8 (aiokafka cannot return this record), or None."""
        for name, _value in self.headers:
            try:
                name.decode("utf-8")
            except UnicodeDecodeError:
                return name
        return None


class RawBatch(NamedTuple):
    base_offset: int
    next_offset: int  # the offset after its last one (the last may have been compacted away)
    records: tuple[RawRecord, ...]  # empty for a control batch, a legacy one, and one that cannot be read
    control: bool = False  # a transaction marker: no records a consumer sees
    legacy: bool = False  # magic 0 or 1: not read here
    problem: str | None = None  # why the batch cannot be read; None when it can


class BatchError(ValueError):
    """A batch's bytes are not what its header says."""


def read_batches(data: bytes) -> list[RawBatch]:
    """The batches in `data` (a fetch response's records for one partition), in order. A batch cut off at
    the end (a broker fills a fetch up to its byte limit) is left out: the next fetch starts with it."""
    view = memoryview(data)
    batches = []
    pos = 0
    while pos + _MAGIC_END <= len(view):
        base_offset, length, _epoch, magic = struct.unpack_from(">qiib", view, pos)
        end = pos + _LOG_OVERHEAD + length
        if length < 0 or end > len(view):
            break  # cut off, or a length nothing after it can be placed by
        if magic < 2:  # the offset field of a legacy entry is its (last inner) message's offset
            batches.append(RawBatch(base_offset, base_offset + 1, (), legacy=True))
        elif magic > 2 or end - pos < HEADER_SIZE:
            batches.append(RawBatch(base_offset, base_offset + 1, (), problem=f"magic {magic}, {length} bytes"))
        else:
            batches.append(_read_batch(view[pos:end]))
        pos = end
    return batches


class Rescue(NamedTuple):
    """What the connector takes from a partition aiokafka cannot read on, in place of its fetch."""

    messages: list[SourceMessage]  # in offset order, from the partition's position on
    undecodable: dict[int, str]  # offset -> why it cannot be read: these go to the dead-letter topic as they are
    resume_at: int  # where the consumer reads on from


def rescue(topic: str, partition: int, position: int, batches: list[RawBatch], room: int) -> Rescue | None:
    """The records from `position` on, in order, through the end of the first batch aiokafka cannot read
    (one with a header name that is not UTF-8, or one that cannot be parsed: it is taken as one message
    at its first offset), at most `room` of them. None when `batches` has no such batch: the failure is
    not in what was read.

    Every record up to and including the bad batch is taken here because aiokafka decodes a batch from
    its start, whatever the position: it cannot return the records that share the bad one's batch, and
    the ones before it stay in order by coming the same way. What `room` leaves is read on the next
    failure, from `resume_at`.
    """
    if not any(_unreadable(batch) for batch in batches):
        return None
    messages: list[SourceMessage] = []
    undecodable: dict[int, str] = {}
    resume = position
    for batch in batches:
        if batch.legacy:
            break  # aiokafka reads it: the consumer goes on from there
        if batch.next_offset <= resume:
            continue
        if batch.problem is not None:
            if len(messages) == room:
                break
            offset = max(batch.base_offset, resume)
            messages.append(SourceMessage(topic, partition, offset, None, None, None))
            undecodable[offset] = (
                f"the record batch at offsets {batch.base_offset}..{batch.next_offset - 1} cannot be read: {batch.problem}"
            )
            resume = batch.next_offset
            break
        for record in batch.records:
            if record.offset < resume:
                continue
            if len(messages) == room:
                return Rescue(messages, undecodable, resume)
            name = record.undecodable_header()
            if name is None:
                headers = tuple((key.decode("utf-8"), value) for key, value in record.headers)
            else:
                headers = ()
                undecodable[record.offset] = f"header name {name[:64]!r} is not UTF-8"
            messages.append(
                SourceMessage(topic, partition, record.offset, record.timestamp_ms, record.key, record.value, headers)  # type: ignore[arg-type]
            )
            resume = record.offset + 1
        resume = max(resume, batch.next_offset)  # past a control batch, and a compacted batch's missing tail
        if _unreadable(batch):
            break
    if not messages and resume == position:
        return None
    return Rescue(messages, undecodable, resume)


def _unreadable(batch: RawBatch) -> bool:
    """aiokafka cannot return any record of this batch (it decodes a batch whole, from its start)."""
    return batch.problem is not None or any(record.undecodable_header() is not None for record in batch.records)


def _read_batch(view: memoryview) -> RawBatch:
    (
        base_offset,
        _length,
        _epoch,
        _magic,
        crc,
        attributes,
        last_delta,
        first_ts,
        max_ts,
        _pid,
        _pepoch,
        _seq,
        count,
    ) = _HEADER.unpack_from(view, 0)
    next_offset = base_offset + last_delta + 1
    control = bool(attributes & _CONTROL)
    try:
        if calc_crc32c(bytes(view[_CRC_FROM:])) != crc:
            raise BatchError("its CRC does not match its contents")
        if control:
            return RawBatch(base_offset, next_offset, (), control=True)
        body = _decompress(attributes & 0x07, view[HEADER_SIZE:])
        log_append = attributes & _TIMESTAMP_LOG_APPEND
        records = []
        pos = 0
        for _ in range(count):
            record, pos = _read_record(body, pos, base_offset, first_ts, max_ts if log_append else None)
            records.append(record)
        if pos != len(body):
            raise BatchError(f"{len(body) - pos} bytes follow its {count} records")
    except (BatchError, IndexError, struct.error) as exc:
        return RawBatch(base_offset, next_offset, (), problem=str(exc) or type(exc).__name__)
    except Exception as exc:  # a codec's own error on data that is not what it claims
        return RawBatch(base_offset, next_offset, (), problem=f"it does not decompress: {exc!r}")
    return RawBatch(base_offset, next_offset, tuple(records))


def _decompress(codec_id: int, data: memoryview) -> memoryview:
    if codec_id == 0:
        return data
    found = _DECODERS.get(codec_id)
    if found is None:
        raise BatchError(f"it names unknown compression codec {codec_id}")
    name, available, decode = found
    if not available():
        raise BatchError(f"it is compressed with {name}, which this process cannot decompress")
    return memoryview(decode(bytes(data)))


def _read_record(
    body: memoryview, pos: int, base_offset: int, first_ts: int, log_append_ts: int | None
) -> tuple[RawRecord, int]:
    length, pos = _varint(body, pos)
    end = pos + length
    if length < 0 or end > len(body):
        raise BatchError(f"a record's length ({length}) runs past the batch")
    pos += 1  # attributes: unused by magic 2
    ts_delta, pos = _varint(body, pos)
    offset_delta, pos = _varint(body, pos)
    key, pos = _bytes(body, pos, end)
    value, pos = _bytes(body, pos, end)
    header_count, pos = _varint(body, pos)
    if header_count < 0:
        raise BatchError(f"a record has {header_count} headers")
    headers = []
    for _ in range(header_count):
        name, pos = _bytes(body, pos, end)
        if name is None:
            raise BatchError("a header has no name")
        header_value, pos = _bytes(body, pos, end)
        headers.append((name, header_value))
    if pos != end:
        raise BatchError("a record's fields do not fill its length")
    timestamp = log_append_ts if log_append_ts is not None else first_ts + ts_delta
    return RawRecord(base_offset + offset_delta, timestamp, key, value, tuple(headers)), end


def _bytes(body: memoryview, pos: int, end: int) -> tuple[bytes | None, int]:
    size, pos = _varint(body, pos)
    if size < 0:
        return None, pos
    if pos + size > end:
        raise BatchError(f"a field of {size} bytes runs past its record")
    return bytes(body[pos : pos + size]), pos + size


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    """A zigzag varint (up to 64 bits) at `pos`, and the position after it."""
    shift = result = 0
    while True:
        byte = data[pos]  # IndexError when it runs off the end: the batch is cut short
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise BatchError("a varint is longer than 10 bytes")
