"""What the connector asks of the group protocol and of record sizes (settings.py, connector.py)."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer

from sidecar.kafka.connector import consumer_options, default_consumer
from sidecar.kafka.settings import ConnectorSettings
from sie.spec import KafkaInput, ModelService, Priority

KAFKA = KafkaInput(bootstrap_servers=["127.0.0.1:9"], topic="requests", group_id="g", output_topic="results")


def settings(**overrides) -> ConnectorSettings:
    return ConnectorSettings(kafka=KAFKA, model_id="m", instance_id="i", priority=Priority.P1, **overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"drain_timeout_s": 2.0, "session_timeout_ms": 2000, "heartbeat_interval_ms": 500},
        {"drain_timeout_s": 600.0},
    ],
)
def test_the_group_waits_through_the_drain_a_revocation_may_take(overrides):
    s = settings(**overrides)
    options = consumer_options(s)
    # Revocation waits up to drain_timeout_s and then commits before the member rejoins: the rebalance
    # timeout must cover both, or the member is removed and its partitions' work repeated elsewhere.
    assert options["rebalance_timeout_ms"] >= s.drain_timeout_s * 1000 + 5_000
    assert options["rebalance_timeout_ms"] > s.session_timeout_ms
    assert options["max_poll_interval_ms"] >= max(options["rebalance_timeout_ms"], 300_000)
    assert options["enable_auto_commit"] is False and options["session_timeout_ms"] == s.session_timeout_ms


async def test_the_consumer_is_built_with_those_options():
    s = settings(drain_timeout_s=45.0)
    consumer = default_consumer(s)
    try:
        assert isinstance(consumer, AIOKafkaConsumer)
        assert consumer._rebalance_timeout_ms == consumer_options(s)["rebalance_timeout_ms"] == 55_000
        assert consumer._max_poll_interval_ms == 300_000
    finally:
        await consumer.stop()  # never started: releases its client


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"max_record_bytes": 1000}, "at least 4096"),
        ({"client_overrides": {"max_batch_size": 2_000_000}}, "max_batch_size"),
    ],
)
def test_record_bounds_that_cannot_work_are_refused(overrides, says):
    with pytest.raises(ValueError, match=says):
        settings(**overrides)


def test_the_default_record_bound_is_kafkas_default_message_max_bytes():
    assert settings().max_record_bytes == 1_048_588


def service(**kafka: object) -> ModelService:
    return ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "scorer", "service_type": "scoring"},
                "backend": {"type": "sklearn"},
                "kafka_input": {**KAFKA.model_dump(), **kafka},
            }
        }
    )


def test_the_specs_record_bound_reaches_the_sidecars_connector_and_a_given_setting_wins():
    """The sidecar builds its connector from the spec alone (and its drain bound): a topic whose
    max.message.bytes is under Kafka's default is told to it in kafka_input, the standalone connector's
    --max-record-bytes overriding it."""
    assert ConnectorSettings.from_spec(service(), "i").max_record_bytes == 1_048_588
    assert ConnectorSettings.from_spec(service(max_record_bytes=65_536), "i").max_record_bytes == 65_536
    given = ConnectorSettings.from_spec(service(max_record_bytes=65_536), "i", max_record_bytes=8192)
    assert given.max_record_bytes == 8192


@pytest.mark.parametrize("value", [4095, (64 << 20) + 1, "1MiB"])
def test_a_spec_record_bound_the_connector_cannot_use_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="max_record_bytes"):
        service(max_record_bytes=value)
