"""Decoding requests and building result / dead-letter records with their provenance headers."""

from __future__ import annotations

import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.kafka.records import (
    HEADER_ERROR,
    HEADER_INSTANCE,
    HEADER_MODEL,
    Outgoing,
    OutRecord,
    SourceMessage,
    SourceRef,
    dead_letter_record,
    decode_json_object,
    encoded_size,
    end_to_end_seconds,
    header,
    result_record,
    source_of,
)


def message(**overrides) -> SourceMessage:
    fields = dict(
        topic="requests",
        partition=3,
        offset=41,
        timestamp_ms=1_000_000,
        key=b"user-7",
        value=b'{"text": "hi"}',
        headers=(("trace-id", b"abc"),),
    )
    return SourceMessage(**{**fields, **overrides})


@pytest.mark.parametrize(
    "value, body, reason",
    [
        (b'{"text": "hi"}', {"text": "hi"}, None),
        (b"{}", {}, None),
        (None, None, "tombstone"),
        (b"", None, "not valid JSON"),
        (b"not json", None, "not valid JSON"),
        (b"\xff\xfe", None, "not valid UTF-8"),
        (b'{"text": "\\ud800"}', None, "lone UTF-16 surrogate"),
        (b'{"a": 1, "a": 2}', None, "appears twice"),
        (b'{"a": ' + b"[" * 80 + b"]" * 80 + b"}", None, "nested deeper"),
        (b"[1, 2]", None, "JSON list; expected a JSON object"),
        (b'"text"', None, "JSON str; expected a JSON object"),
        (b"null", None, "JSON NoneType; expected a JSON object"),
    ],
)
def test_decode_json_object(value, body, reason):
    got_body, got_reason = decode_json_object(value)
    assert got_body == body
    if reason is None:
        assert got_reason is None
    else:
        assert reason in got_reason


def test_a_result_names_its_source_model_and_instance_and_keeps_key_and_headers():
    record = result_record(message(), b'{"score": 0.9}', "results", "scorer", "scorer-a")
    assert record.topic == "results" and record.key == b"user-7" and record.value == b'{"score": 0.9}'
    assert source_of(record.headers) == SourceRef("requests", 3, 41)
    assert header(record.headers, HEADER_MODEL) == "scorer"
    assert header(record.headers, HEADER_INSTANCE) == "scorer-a"
    assert header(record.headers, "trace-id") == "abc"


def test_a_result_of_an_unkeyed_request_is_keyed_by_its_source_partition():
    assert result_record(message(key=None), b"{}", "results", "m", "i").key == b"p3"


def test_provenance_from_an_earlier_hop_is_replaced_not_duplicated():
    upstream = message(headers=(("sie-source-offset", b"999"), ("sie-error", b"old"), ("x", b"1")))
    record = result_record(upstream, b"{}", "results", "m", "i")
    names = [name for name, _ in record.headers]
    assert names.count("sie-source-offset") == 1 and "sie-error" not in names
    assert source_of(record.headers).offset == 41


def test_a_dead_letter_carries_the_request_unchanged_and_the_reason():
    record = dead_letter_record(message(value=b"not json"), "the value is not JSON", "dead", "scorer", "a")
    assert record.topic == "dead" and record.value == b"not json" and record.key == b"user-7"
    assert header(record.headers, HEADER_ERROR) == "the value is not JSON"
    assert source_of(record.headers) == SourceRef("requests", 3, 41)
    assert dead_letter_record(message(value=None), "tombstone", "dead", "m", "i").value == b""


@pytest.mark.parametrize(
    "headers",
    [
        (),
        (("sie-source-topic", b"t"),),
        (("sie-source-topic", b"t"), ("sie-source-partition", b"x"), ("sie-source-offset", b"1")),
    ],
)
def test_records_without_complete_provenance_have_no_source(headers):
    assert source_of(headers) is None


@pytest.mark.parametrize(
    "timestamp_ms, now_s, expected",
    [(1_000_000, 1_000.25, 0.25), (None, 5.0, None), (-1, 5.0, None), (2_000_000, 1_999.0, 0.0)],
)
def test_end_to_end_seconds(timestamp_ms, now_s, expected):
    assert end_to_end_seconds(timestamp_ms, now_s) == (pytest.approx(expected) if expected is not None else None)


def lone_batch_size(record: OutRecord) -> int:
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1,
    )
    builder.append(0, None, record.key, record.value, list(record.headers))
    return len(builder.build())


lengths = st.sampled_from([0, 1, 63, 64, 127, 128, 8191, 8192, 70_000])


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.none(), lengths),
    lengths,
    st.lists(st.tuples(st.text(max_size=70), st.one_of(st.none(), lengths)), max_size=70),
)
def test_encoded_size_is_the_size_of_the_batch_the_producer_makes_of_the_record_alone(key, value, headers):
    record = OutRecord(
        "t",
        None if key is None else b"k" * key,
        b"v" * value,
        tuple((name, None if size is None else b"h" * size) for name, size in headers),
    )
    assert encoded_size(record) == lone_batch_size(record)


OUT = Outgoing(output_topic="results", dead_letter_topic="dead", model_id="m", instance_id="i", max_bytes=4096)
BIG = b"x" * 5000


def test_a_record_within_the_bound_is_written_as_built():
    record = result_record(message(), b"{}", "results", "m", "i")
    assert OUT.fit(record, message()) is record


def test_a_result_over_the_bound_becomes_a_dead_letter_record_saying_so():
    record = OUT.fit(result_record(message(), BIG, "results", "m", "i"), message())
    assert record.topic == "dead" and record.value == message().value and record.key == b"user-7"
    assert "the result is 5" in header(record.headers, HEADER_ERROR)
    assert "max_record_bytes" in header(record.headers, HEADER_ERROR)
    assert source_of(record.headers) == SourceRef("requests", 3, 41)


@pytest.mark.parametrize(
    "request_, built",
    [
        (message(value=BIG), lambda m: dead_letter_record(m, "invalid input: too long", "dead", "m", "i")),
        # A large request and a large result: its dead-letter record would be too large as well.
        (message(value=BIG), lambda m: result_record(m, BIG, "results", "m", "i")),
        (message(headers=(("trace", BIG),)), lambda m: dead_letter_record(m, "invalid", "dead", "m", "i")),
    ],
)
def test_a_dead_letter_record_over_the_bound_becomes_a_stub_that_names_the_request(request_, built):
    stub = OUT.fit(built(request_), request_)
    assert stub.topic == "dead" and stub.key is None and stub.value == b""
    assert source_of(stub.headers) == SourceRef("requests", 3, 41)
    assert [name for name, _ in stub.headers if name == "trace"] == []
    assert "not copied" in header(stub.headers, HEADER_ERROR) and encoded_size(stub) <= 4096


def test_what_the_broker_refuses_is_replaced_by_something_smaller_until_nothing_is_left():
    result = result_record(message(), b"{}", "results", "m", "i")
    dead = OUT.replace(result, message(), "MessageSizeTooLargeError()")
    assert dead.topic == "dead" and dead.value == message().value
    assert header(dead.headers, HEADER_ERROR) == "the broker refused the result: MessageSizeTooLargeError()"
    stub = OUT.replace(dead, message(), "UnknownError()")
    assert stub.value == b"" and stub.key is None
    assert header(stub.headers, HEADER_ERROR).startswith("the broker refused the result: MessageSizeTooLargeError();")
    assert OUT.replace(stub, message(), "UnknownError()") is None


def test_without_a_dead_letter_topic_there_is_nothing_to_write_instead():
    out = Outgoing(output_topic="results", dead_letter_topic=None, model_id="m", instance_id="i", max_bytes=4096)
    assert out.fit(result_record(message(), BIG, "results", "m", "i"), message()) is None
    assert out.replace(result_record(message(), b"{}", "results", "m", "i"), message(), "refused") is None


def test_a_stub_keeps_a_long_reason_short():
    built = dead_letter_record(message(value=BIG), "r" * 5000, "dead", "m", "i")
    stub = OUT.fit(built, message(value=BIG))
    assert len(header(stub.headers, HEADER_ERROR)) == 1000 and encoded_size(stub) <= 4096


def test_a_stub_reason_of_many_byte_characters_is_cut_by_bytes_and_stays_within_the_smallest_bound():
    """A validator's reason quotes the request's field names: 1,500 emoji are 1,553 characters and 6,053
    bytes, and a stub cut by characters was 4,170 bytes, over the smallest max_record_bytes (4,096)."""
    out = Outgoing(output_topic="results", dead_letter_topic="dead", model_id="m", instance_id="i", max_bytes=4096)
    reason = "invalid input: unknown field " + "\U0001f600" * 1500
    stub = out.fit(dead_letter_record(message(value=BIG), reason, "dead", "m", "i"), message(value=BIG))
    assert stub.value == b"" and encoded_size(stub) <= 4096
    text = dict(stub.headers)[HEADER_ERROR]
    assert len(text) <= 1000 and text.decode().endswith("...") and "\U0001f600" in text.decode()
