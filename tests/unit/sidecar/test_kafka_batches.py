"""Reading record batches without aiokafka's decoding (batches.py), and what the connector takes from a
partition aiokafka cannot read on (`rescue`)."""

from __future__ import annotations

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kafka.batches import RawBatch, RawRecord, read_batches, rescue

PLACEHOLDER = "\x01\x02"  # a header name patched into bytes that are not UTF-8 (b"\xff\xfe")


def batch(
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]],
    base_offset: int = 0,
    compression: int = 0,
    timestamp: int = 1_000,
) -> bytes:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=compression,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 24,
    )
    for delta, (key, value, headers) in enumerate(records):
        builder.append(delta, timestamp + delta, key, value, headers)
    data = bytearray(builder.build())
    data[0:8] = base_offset.to_bytes(8, "big", signed=True)
    if any(name == PLACEHOLDER for _key, _value, headers in records for name, _ in headers):
        data = data.replace(b"\x04" + PLACEHOLDER.encode(), b"\x04\xff\xfe")  # its length (2) and the name
    return _recrc(data)


def _recrc(data: bytearray) -> bytes:
    data[17:21] = calc_crc32c(bytes(data[21:])).to_bytes(4, "big")
    return bytes(data)


def aiokafka_reads(data: bytes) -> list[tuple[int, int, bytes | None, bytes | None, list[tuple[str, bytes | None]]]]:
    records = MemoryRecords(data)
    out = []
    while records.has_next():
        for record in records.next_batch():
            out.append((record.offset, record.timestamp, record.key, record.value, list(record.headers)))
    return out


names = st.text(max_size=12)
header_lists = st.lists(st.tuples(names, st.one_of(st.none(), st.binary(max_size=70))), max_size=4)
records_st = st.lists(
    st.tuples(
        st.one_of(st.none(), st.binary(max_size=70)), st.one_of(st.none(), st.binary(max_size=300)), header_lists
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(records_st, min_size=1, max_size=4), st.sampled_from([0, 1]), st.integers(0, 60))
def test_what_aiokafka_can_read_reads_the_same_here_and_a_cut_off_batch_is_left_out(groups, compression, cut):
    data, offset = b"", 5
    for records in groups:
        data += batch(records, base_offset=offset, compression=compression)
        offset += len(records) + 3  # gaps between batches, as compaction leaves
    tail = batch([(b"k", b"v" * 80, [])], base_offset=offset)
    mine = read_batches(data + tail[: len(tail) - 1 - cut])
    assert [
        (r.offset, r.timestamp_ms, r.key, r.value, [(n.decode(), v) for n, v in r.headers])
        for b in mine
        for r in b.records
    ] == (aiokafka_reads(data))
    assert all(b.problem is None and not b.legacy for b in mine) and len(mine) == len(groups)


def test_a_header_name_that_is_not_utf8_stops_aiokafka_and_is_flagged_here():
    data = batch([(b"a", b"1", [("ok", b"")]), (b"b", b"2", [(PLACEHOLDER, b"x")]), (b"c", b"3", [])], base_offset=7)
    with pytest.raises(UnicodeDecodeError):
        aiokafka_reads(data)
    [read] = read_batches(data)
    assert [r.offset for r in read.records] == [7, 8, 9] and read.next_offset == 10
    assert [r.undecodable_header() for r in read.records] == [None, b"\xff\xfe", None]
    assert read.records[1].value == b"2" and read.records[1].headers == ((b"\xff\xfe", b"x"),)


def test_batches_that_cannot_be_read_are_returned_whole_with_their_offsets():
    good = bytearray(batch([(b"a", b"1", []), (b"b", b"2", [])], base_offset=3))
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 0xFF
    control = bytearray(good)
    control[22] |= 0x20  # attributes: a transaction marker
    legacy = LegacyRecordBatchBuilder(magic=1, compression_type=0, batch_size=1 << 20)
    legacy.append(0, timestamp=1, key=b"k", value=b"v")
    unknown_codec = bytearray(good)
    unknown_codec[22] |= 0x07
    read = read_batches(bytes(bad_crc) + _recrc(control) + bytes(legacy.build()) + _recrc(unknown_codec) + bytes(good))
    assert [(b.base_offset, b.next_offset, len(b.records)) for b in read] == [
        (3, 5, 0),
        (3, 5, 0),
        (0, 1, 0),
        (3, 5, 0),
        (3, 5, 2),
    ]
    assert "CRC" in read[0].problem and read[1].control and read[1].problem is None and read[2].legacy
    assert "codec 7" in read[3].problem and read[4].problem is None


def raw(offset: int, bad: bool = False) -> RawRecord:
    return RawRecord(offset, 1_000 + offset, b"k", b'{"i": %d}' % offset, ((b"\xff", b"") if bad else (b"h", b"v"),))


def rb(*records: RawRecord, next_offset: int | None = None, **kw) -> RawBatch:
    first = records[0].offset if records else kw.pop("base")
    return RawBatch(first, next_offset or records[-1].offset + 1, records, **kw)


@pytest.mark.parametrize(
    "batches, position, room, taken, bad, resume",
    [
        # The bad record's batch is taken whole, with the batches before it; later ones are aiokafka's.
        ([rb(raw(0), raw(1)), rb(raw(2), raw(3, True), raw(4)), rb(raw(5))], 0, 10, [0, 1, 2, 3, 4], [3], 5),
        # From the position on; records below it were taken before.
        ([rb(raw(2), raw(3, True), raw(4))], 3, 10, [3, 4], [3], 5),
        # The bad record already taken (below the position): the rest of its batch still comes this way.
        ([rb(raw(2), raw(3, True), raw(4), raw(5)), rb(raw(6))], 5, 10, [5], [], 6),
        # At most `room`; the rest on the next failure.
        ([rb(raw(0), raw(1), raw(2, True), raw(3))], 0, 2, [0, 1], [], 2),
        # A compacted tail and a control batch are stepped over.
        ([rb(raw(0, True), raw(1), next_offset=4), rb(base=4, next_offset=5, control=True)], 0, 10, [0, 1], [0], 4),
        # A batch that cannot be read is one message at its first offset from the position.
        ([rb(raw(0)), rb(base=1, next_offset=9, problem="its CRC does not match its contents")], 0, 10, [0, 1], [1], 9),
        ([rb(base=1, next_offset=9, problem="x")], 4, 10, [4], [4], 9),
    ],
)
def test_rescue_takes_everything_through_the_bad_batch_in_order(batches, position, room, taken, bad, resume):
    plan = rescue("requests", 2, position, batches, room)
    assert plan is not None
    assert [m.offset for m in plan.messages] == taken
    assert sorted(plan.undecodable) == bad and plan.resume_at == resume
    assert all(m.topic == "requests" and m.partition == 2 for m in plan.messages)
    for m in plan.messages:
        if m.offset in plan.undecodable:
            assert m.headers == ()
        elif m.value is not None:
            assert (
                m.value == b'{"i": %d}' % m.offset
                and m.headers == (("h", b"v"),)
                and m.timestamp_ms == 1_000 + m.offset
            )


def test_rescue_finds_nothing_where_aiokafka_can_read_everything():
    assert rescue("requests", 0, 0, [rb(raw(0), raw(1)), rb(raw(2))], 10) is None
    assert rescue("requests", 0, 0, [], 10) is None


def test_why_an_undecodable_record_is_refused_names_the_header():
    plan = rescue("requests", 0, 0, [rb(raw(0, True))], 10)
    assert plan is not None and plan.undecodable == {0: "header name b'\\xff' is not UTF-8"}
