"""What the connector does with one request, with fake collaborators: validation before the worker,
dead letters with reasons, and which worker failures are retried, bounded or given up."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest
from prometheus_client import CollectorRegistry

from sidecar.kafka.handler import (
    Abandoned,
    MessageHandler,
    RetryPolicy,
    WorkerFailed,
    WorkerRejected,
    WorkerUnavailable,
)
from sidecar.kafka.metrics import KafkaMetrics, MetricLabels
from sidecar.kafka.records import HEADER_ERROR, SourceMessage, header
from sie.errors import RetryableError
from sie.spec import KafkaInput, Priority

KAFKA = KafkaInput(
    bootstrap_servers=["127.0.0.1:9092"],
    topic="requests",
    group_id="g",
    output_topic="results",
    dead_letter_topic="dead",
)


class FakeAdmission:
    def __init__(self, refusals: int = 0):
        self.refusals = refusals
        self.priorities: list[Priority] = []
        self.held = 0

    @asynccontextmanager
    async def slot(self, priority):
        self.priorities.append(priority)
        if self.refusals:
            self.refusals -= 1
            raise RetryableError("queue full")
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1


class FakeWorker:
    """Answers from a script: an exception to raise or bytes to return, one per call; then echoes."""

    def __init__(self, *script):
        self.script = list(script)
        self.calls: list[bytes] = []

    async def __call__(self, raw: bytes) -> bytes:
        self.calls.append(raw)
        step = self.script.pop(0) if self.script else None
        if isinstance(step, Exception):
            raise step
        return step if step is not None else b'{"ok": true}'


class Setup:
    def __init__(
        self,
        worker: FakeWorker,
        admission: FakeAdmission | None = None,
        kafka: KafkaInput = KAFKA,
        validate=lambda body: None if isinstance(body.get("text"), str) else "field 'text' must be a string",
    ):
        self.registry = CollectorRegistry()
        self.metrics = KafkaMetrics(self.registry, MetricLabels("scorer", "scoring", "P2", "1", "requests"))
        self.sleeps: list[float] = []
        self.worker = worker
        self.admission = admission or FakeAdmission()

        async def sleep(seconds: float) -> None:
            self.sleeps.append(seconds)

        self.handler = MessageHandler(
            kafka=kafka,
            model_id="scorer",
            instance_id="a",
            priority=Priority.P2,
            validate=validate,
            call_worker=worker,
            admission=self.admission,
            metrics=self.metrics,
            retry=RetryPolicy(initial_s=0.1, max_s=0.4, server_error_attempts=3),
            sleep=sleep,
        )

    def count(self, name: str) -> float:
        labels = {"model_id": "scorer", "service_type": "scoring", "priority_level": "P2", "version": "1"}
        if name != "inference_invalid_schema_total":  # the unified counter has the unified labels only
            labels["topic"] = "requests"
        return self.registry.get_sample_value(name, labels) or 0.0


def msg(value: bytes | None) -> SourceMessage:
    return SourceMessage("requests", 0, 5, 1000, None, value, ())


async def test_a_valid_request_is_scored_at_the_models_priority_and_becomes_a_result():
    setup = Setup(FakeWorker(b'{"score": 0.5}'))
    record = await setup.handler.handle(msg(b'{"text": "hi"}'), asyncio.Event())
    assert record.topic == "results" and record.value == b'{"score": 0.5}'
    assert setup.worker.calls == [b'{"text": "hi"}']
    assert setup.admission.priorities == [Priority.P2] and setup.admission.held == 0


@pytest.mark.parametrize(
    "value, reason",
    [
        (b"nope", "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"text": 3}', "invalid input: field 'text' must be a string"),
    ],
)
async def test_invalid_requests_are_dead_lettered_with_the_reason_and_never_reach_the_worker(value, reason):
    setup = Setup(FakeWorker())
    record = await setup.handler.handle(msg(value), asyncio.Event())
    assert record.topic == "dead" and record.value == value
    assert reason in header(record.headers, HEADER_ERROR)
    assert setup.worker.calls == [] and setup.admission.priorities == []
    assert setup.count("inference_kafka_invalid_total") == 1
    assert setup.count("inference_invalid_schema_total") == 1


async def test_without_a_dead_letter_topic_an_invalid_request_has_nothing_to_write():
    setup = Setup(FakeWorker(), kafka=KAFKA.model_copy(update={"dead_letter_topic": None}))
    assert await setup.handler.handle(msg(b"nope"), asyncio.Event()) is None
    assert setup.count("inference_kafka_invalid_total") == 1


async def test_a_request_the_worker_rejects_is_dead_lettered_at_once():
    setup = Setup(FakeWorker(WorkerRejected(422, "text too long")))
    record = await setup.handler.handle(msg(b'{"text": "hi"}'), asyncio.Event())
    assert record.topic == "dead" and "422" in header(record.headers, HEADER_ERROR)
    assert len(setup.worker.calls) == 1 and setup.sleeps == []
    assert setup.count("inference_kafka_failed_total") == 1


async def test_worker_failures_are_retried_a_bounded_number_of_times_then_dead_lettered():
    setup = Setup(FakeWorker(WorkerFailed(500, "boom"), WorkerFailed(500, "boom"), WorkerFailed(None, "timeout")))
    record = await setup.handler.handle(msg(b'{"text": "hi"}'), asyncio.Event())
    assert record.topic == "dead" and "timeout" in header(record.headers, HEADER_ERROR)
    assert len(setup.worker.calls) == 3 and setup.sleeps == [0.1, 0.2]


async def test_a_failure_then_success_produces_the_result():
    setup = Setup(FakeWorker(WorkerFailed(500, "boom"), b'{"score": 1}'))
    record = await setup.handler.handle(msg(b'{"text": "hi"}'), asyncio.Event())
    assert record.topic == "results" and record.value == b'{"score": 1}'


async def test_an_unavailable_worker_or_a_full_queue_is_retried_with_backoff_until_it_answers():
    setup = Setup(FakeWorker(*[WorkerUnavailable("503 sleeping")] * 4), FakeAdmission(refusals=2))
    record = await setup.handler.handle(msg(b'{"text": "hi"}'), asyncio.Event())
    assert record.topic == "results"
    assert len(setup.worker.calls) == 5
    assert setup.sleeps == [0.1, 0.2, 0.4, 0.4, 0.4, 0.4], "doubling, capped at max_s"


async def test_a_stopping_session_abandons_a_request_the_worker_cannot_take():
    setup = Setup(FakeWorker(WorkerUnavailable("503")))
    stop = asyncio.Event()
    stop.set()
    with pytest.raises(Abandoned):
        await setup.handler.handle(msg(b'{"text": "hi"}'), stop)
    assert setup.count("inference_kafka_failed_total") == 0


async def test_the_request_bytes_go_to_the_worker_untouched():
    raw = json.dumps({"text": "é", "extra": [1, 2]}, ensure_ascii=False).encode()
    setup = Setup(FakeWorker())
    await setup.handler.handle(msg(raw), asyncio.Event())
    assert setup.worker.calls == [raw]


# -- batches: one worker call for the valid messages, each message ending as `handle` would end it ----


def msgs(*values: bytes) -> list[SourceMessage]:
    return [SourceMessage("requests", 0, 5 + i, 1000, None, v, ()) for i, v in enumerate(values)]


def predictions(*answers: dict) -> bytes:
    return json.dumps({"predictions": list(answers)}).encode()


async def test_a_batch_is_one_worker_call_and_each_message_gets_its_own_result_in_order():
    setup = Setup(FakeWorker(predictions({"score": 0.1}, {"score": 0.2}, {"score": 0.3})))
    records = await setup.handler.handle_batch(
        msgs(b'{"text": "a"}', b'{"text": "b"}', b'{"text": "c"}'), asyncio.Event()
    )
    assert setup.worker.calls == [b'{"instances":[{"text": "a"},{"text": "b"},{"text": "c"}]}']
    assert [r.value for r in records] == [b'{"score":0.1}', b'{"score":0.2}', b'{"score":0.3}']
    assert [header(r.headers, "sie-source-offset") for r in records] == ["5", "6", "7"]
    assert setup.admission.priorities == [Priority.P2], "one admission slot for the one call"


async def test_invalid_messages_of_a_batch_are_dead_lettered_and_the_rest_scored_together():
    setup = Setup(FakeWorker(predictions({"score": 0.1}, {"score": 0.3})))
    records = await setup.handler.handle_batch(msgs(b'{"text": "a"}', b"nope", b'{"text": "c"}'), asyncio.Event())
    assert [r.topic for r in records] == ["results", "dead", "results"]
    assert records[2].value == b'{"score":0.3}'
    assert setup.worker.calls == [b'{"instances":[{"text": "a"},{"text": "c"}]}']
    assert setup.count("inference_kafka_invalid_total") == 1


async def test_a_batch_the_worker_refuses_is_sent_again_one_by_one_so_only_the_bad_one_is_dead_lettered():
    setup = Setup(
        FakeWorker(WorkerRejected(422, "instances[1].text: too long"), b'{"score": 1}', WorkerRejected(422, "x"))
    )
    records = await setup.handler.handle_batch(msgs(b'{"text": "a"}', b'{"text": "bbbb"}'), asyncio.Event())
    assert [r.topic for r in records] == ["results", "dead"]
    assert setup.worker.calls[1:] == [b'{"text": "a"}', b'{"text": "bbbb"}']
    assert setup.count("inference_kafka_failed_total") == 1


@pytest.mark.parametrize(
    "answer",
    [b"not json", b'{"predictions": [{"score": 1}]}', b'{"predictions": "no"}', b"[]"],
)
async def test_a_batched_answer_that_does_not_match_the_batch_falls_back_to_one_call_each(answer):
    setup = Setup(FakeWorker(answer, b'{"score": 1}', b'{"score": 2}'))
    records = await setup.handler.handle_batch(msgs(b'{"text": "a"}', b'{"text": "b"}'), asyncio.Event())
    assert [r.value for r in records] == [b'{"score": 1}', b'{"score": 2}']


async def test_a_batch_of_one_valid_message_is_sent_as_a_single_request():
    setup = Setup(FakeWorker(b'{"score": 0.5}'))
    records = await setup.handler.handle_batch(msgs(b"[]", b'{"text": "b"}'), asyncio.Event())
    assert setup.worker.calls == [b'{"text": "b"}'] and records[1].value == b'{"score": 0.5}'


async def test_a_stopping_session_abandons_the_whole_batch():
    setup = Setup(FakeWorker(WorkerUnavailable("503")))
    stop = asyncio.Event()
    stop.set()
    with pytest.raises(Abandoned):
        await setup.handler.handle_batch(msgs(b'{"text": "a"}', b'{"text": "b"}'), stop)
