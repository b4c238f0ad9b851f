"""The ModelService `kafka_input` block: what validates, and what is refused with which field path."""

from __future__ import annotations

import pytest

from sie.errors import SpecError
from sie.spec_loader import parse_model_service

VALID = {"bootstrap_servers": ["127.0.0.1:9092"], "topic": "requests", "group_id": "scorer", "output_topic": "results"}


def service(kafka: dict) -> dict:
    return {
        "spec": {
            "model": {"name": "scorer", "service_type": "scoring"},
            "backend": {"type": "sklearn"},
            "kafka_input": kafka,
        }
    }


def test_defaults():
    kafka = parse_model_service(service(VALID)).spec.kafka_input
    assert kafka.dead_letter_topic is None
    assert kafka.auto_offset_reset == "earliest"
    assert kafka.value_deserializer == "json"
    assert kafka.max_in_flight == 1024
    assert kafka.max_batch == 256


def test_a_model_without_the_block_consumes_nothing():
    doc = service(VALID)
    del doc["spec"]["kafka_input"]
    assert parse_model_service(doc).spec.kafka_input is None


@pytest.mark.parametrize(
    "change, servers",
    [
        ({"bootstrap_servers": "a:9092, b:9093"}, ["a:9092", "b:9093"]),
        ({"bootstrap_servers": "kafka.svc.cluster.local:9092"}, ["kafka.svc.cluster.local:9092"]),
        ({"bootstrap_servers": ["[::1]:9092"]}, ["[::1]:9092"]),
    ],
)
def test_bootstrap_servers_may_be_a_comma_separated_string(change, servers):
    assert parse_model_service(service({**VALID, **change})).spec.kafka_input.bootstrap_servers == servers


@pytest.mark.parametrize(
    "change, path, reason",
    [
        ({"bootstrap_servers": []}, "spec.kafka_input.bootstrap_servers", "at least 1"),
        ({"bootstrap_servers": ""}, "spec.kafka_input.bootstrap_servers", "at least 1"),
        ({"bootstrap_servers": ["localhost"]}, "spec.kafka_input.bootstrap_servers", "is not host:port"),
        ({"bootstrap_servers": ["host:0"]}, "spec.kafka_input.bootstrap_servers", "is not host:port"),
        ({"bootstrap_servers": ["host:70000"]}, "spec.kafka_input.bootstrap_servers", "is not host:port"),
        ({"bootstrap_servers": [":9092"]}, "spec.kafka_input.bootstrap_servers", "is not host:port"),
        ({"bootstrap_servers": ["host:\u0663"]}, "spec.kafka_input.bootstrap_servers", "is not host:port"),
        ({"topic": ""}, "spec.kafka_input.topic", "at least 1"),
        ({"topic": "has space"}, "spec.kafka_input.topic", "pattern"),
        ({"topic": "t" * 250}, "spec.kafka_input.topic", "at most 249"),
        ({"output_topic": "a/b"}, "spec.kafka_input.output_topic", "pattern"),
        ({"dead_letter_topic": "dead letters"}, "spec.kafka_input.dead_letter_topic", "pattern"),
        ({"group_id": ""}, "spec.kafka_input.group_id", "at least 1"),
        ({"auto_offset_reset": "none"}, "spec.kafka_input.auto_offset_reset", "'earliest' or 'latest'"),
        ({"value_deserializer": "avro"}, "spec.kafka_input.value_deserializer", "'json'"),
        ({"max_in_flight": 0}, "spec.kafka_input.max_in_flight", "greater than or equal to 1"),
        ({"max_in_flight": 100_001}, "spec.kafka_input.max_in_flight", "less than or equal to 100000"),
        ({"max_batch": 0}, "spec.kafka_input.max_batch", "greater than or equal to 1"),
        ({"output_topic": "requests"}, "spec.kafka_input", "output_topic must differ from topic"),
        ({"dead_letter_topic": "requests"}, "spec.kafka_input", "dead_letter_topic must differ"),
        ({"dead_letter_topic": "results"}, "spec.kafka_input", "dead_letter_topic must differ"),
        ({"topics": "typo"}, "spec.kafka_input.topics", "unknown field"),
    ],
)
def test_invalid_blocks_are_refused_with_the_field_and_reason(change, path, reason):
    with pytest.raises(SpecError) as caught:
        parse_model_service(service({**VALID, **change}))
    problems = [(p.path, p.reason) for p in caught.value.problems]
    assert any(p == path and reason in r for p, r in problems), problems


@pytest.mark.parametrize("missing", ["bootstrap_servers", "topic", "group_id", "output_topic"])
def test_required_fields(missing):
    kafka = {k: v for k, v in VALID.items() if k != missing}
    with pytest.raises(SpecError) as caught:
        parse_model_service(service(kafka))
    assert [(p.path, p.reason) for p in caught.value.problems] == [(f"spec.kafka_input.{missing}", "Field required")]
