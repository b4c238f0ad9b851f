"""Decoding requests and building result / dead-letter records with their provenance headers."""

from __future__ import annotations

import pytest

from sidecar.kafka.records import (
    HEADER_ERROR,
    HEADER_INSTANCE,
    HEADER_MODEL,
    SourceMessage,
    SourceRef,
    dead_letter_record,
    decode_json_object,
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
