"""Input that cannot be written or read as it is fails its message, never the session: records over
max_record_bytes, records the broker refuses for good, and records aiokafka cannot decode (sending.py's
`_refused`, salvage.py's `Salvager`). The broker and the consumer are fakes;
tests/integration/test_kafka_connector.py runs the same against a real broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, UnknownError
from prometheus_client import CollectorRegistry

from sidecar.kafka import pipeline
from sidecar.kafka.metrics import KafkaMetrics, MetricLabels
from sidecar.kafka.records import HEADER_ERROR, OutRecord, SourceMessage, dead_letter_record, header, result_record
from sidecar.kafka.session import GroupSession
from sidecar.kafka.settings import ConnectorSettings
from sie.spec import KafkaInput, Priority
from tests.unit.sidecar.test_kafka_batches import PLACEHOLDER, batch

A, B = TopicPartition("requests", 0), TopicPartition("requests", 1)
LIMIT = 8192  # the session's max_record_bytes here


class Handler:
    """Answers each message with what `answer` makes of it."""

    def __init__(self, answer: Callable[[SourceMessage], OutRecord | None]):
        self.answer = answer

    async def handle_batch(self, messages: Any, stop: asyncio.Event) -> list[OutRecord | None]:
        return [self.answer(m) for m in messages]


def result(m: SourceMessage, value: bytes = b"{}") -> OutRecord:
    return result_record(m, value, "results", "m", "i")


def dead(m: SourceMessage, reason: str = "invalid") -> OutRecord:
    return dead_letter_record(m, reason, "dead", "m", "i")


class Batch:
    def __init__(self) -> None:
        self.records: list[OutRecord] = []

    def append(self, *, key: bytes | None, value: bytes, timestamp: None, headers: list) -> object | None:
        if len(self.records) >= 8:
            return None  # full
        self.records.append(OutRecord("", key, value, tuple(headers)))
        return object()


class Producer:
    """Acknowledges a batch, or fails it with what `refuse(topic, records)` returns, as aiokafka's
    sender does when the broker answers with an error that is not retriable."""

    def __init__(self, refuse: Callable[[str, list[OutRecord]], BaseException | None]):
        self.refuse = refuse
        self.written: list[tuple[str, OutRecord]] = []
        self.refused: list[tuple[str, int]] = []

    def create_batch(self) -> Batch:
        return Batch()

    async def partitions_for(self, topic: str) -> set[int]:
        return {0, 1}

    async def send_batch(self, batch: Batch, topic: str, *, partition: int) -> asyncio.Future:
        delivery = asyncio.get_running_loop().create_future()
        error = self.refuse(topic, batch.records)
        if error is None:
            self.written += [(topic, r) for r in batch.records]
            delivery.set_result(None)
        else:
            self.refused.append((topic, len(batch.records)))
            delivery.set_exception(error)
        return delivery


def too_large_over(limit: int) -> Callable[[str, list[OutRecord]], BaseException | None]:
    def refuse(topic: str, records: list[OutRecord]) -> BaseException | None:
        size = sum(len(r.value) + sum(len(v or b"") for _, v in r.headers) for r in records)
        return MessageSizeTooLargeError() if size > limit else None

    return refuse


class Consumer:
    """What the session calls on its consumer outside getmany, recorded."""

    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.paused: list[TopicPartition] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)

    def highwater(self, tp: TopicPartition) -> int | None:
        return None

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    def pause(self, tp: TopicPartition) -> None:
        self.paused.append(tp)

    async def committed(self, tp: TopicPartition) -> int | None:
        return 100


def record(tp: TopicPartition, offset: int, value: bytes = b'{"text": "x"}') -> Any:
    return SimpleNamespace(
        topic=tp.topic, partition=tp.partition, offset=offset, timestamp=0, key=b"k", value=value, headers=()
    )


def session(handler: Handler, producer: Producer | None, dead_letter: str | None = "dead", **kw: Any) -> GroupSession:
    kafka = KafkaInput(
        bootstrap_servers=["127.0.0.1:9"],
        topic="requests",
        group_id="g",
        output_topic="results",
        dead_letter_topic=dead_letter,
        max_batch=8,
    )
    settings = ConnectorSettings(
        kafka=kafka,
        model_id="m",
        instance_id="i",
        priority=Priority.P1,
        drain_timeout_s=0.05,
        commit_interval_s=0,
        max_record_bytes=LIMIT,
    )
    metrics = KafkaMetrics(CollectorRegistry(), MetricLabels("m", "scoring", "P1", "1", "requests"))
    s = GroupSession(settings, Consumer(), producer, handler, metrics, asyncio.Event(), **kw)  # type: ignore[arg-type]
    for tp in (A, B):
        s._ledgers[tp] = pipeline.PartitionLedger()
    return s


async def settle(s: GroupSession) -> None:
    """Run the send and commit loops until every message is committed (or the session failed)."""
    loops = [asyncio.create_task(s._sender.run()), asyncio.create_task(s._committer.run())]
    for loop in loops:
        loop.add_done_callback(s._loop_ended)
    try:
        async with asyncio.timeout(5):
            while s._failure is None and not all(pipeline.settled(ledger) for ledger in s._ledgers.values()):
                await asyncio.sleep(0.001)
    finally:
        await s._cancel(*loops, *s._sender.writers)


def counted(s: GroupSession, name: str) -> float:
    return getattr(s._metrics, name)._value.get()


def committed(s: GroupSession) -> dict[int, int | None]:
    return {tp.partition: ledger.committed for tp, ledger in s._ledgers.items()}


async def test_a_result_over_max_record_bytes_is_dead_lettered_before_it_is_sent():
    producer = Producer(lambda topic, records: None)
    s = session(Handler(lambda m: result(m, b"x" * (LIMIT + 1) if m.offset == 1 else b"{}")), producer)
    s._accept([(A, [record(A, 0), record(A, 1), record(A, 2)])])
    await settle(s)
    assert s._failure is None and committed(s)[0] == 3
    written = {header(r.headers, "sie-source-offset"): (topic, r) for topic, r in producer.written}
    assert sorted((offset, topic) for offset, (topic, _r) in written.items()) == [
        ("0", "results"),
        ("1", "dead"),
        ("2", "results"),
    ]
    assert "max_record_bytes" in header(written["1"][1].headers, HEADER_ERROR)
    assert counted(s, "unwritable") == 1 and producer.refused == []


async def test_a_dead_letter_record_the_broker_refuses_as_too_large_becomes_a_stub():
    # Under max_record_bytes, over what this broker takes (a topic with a lower max.message.bytes).
    producer = Producer(too_large_over(2000))
    s = session(Handler(lambda m: dead(m) if m.offset == 1 else result(m)), producer)
    s._accept([(A, [record(A, 0), record(A, 1, b"y" * 4000)])])
    await settle(s)
    assert s._failure is None and committed(s)[0] == 2
    stub = [r for topic, r in producer.written if topic == "dead"]
    assert len(stub) == 1 and stub[0].value == b"" and stub[0].key is None
    assert "MessageSizeTooLargeError" in header(stub[0].headers, HEADER_ERROR)
    assert counted(s, "unwritable") == 1 and counted(s, "dead_lettered") == 1 and counted(s, "produced") == 1


async def test_a_refused_batch_of_several_is_sent_again_one_by_one_and_only_the_bad_one_fails():
    def refuse(topic: str, records: list[OutRecord]) -> BaseException | None:
        # INVALID_RECORD for any batch holding the bad result; aiokafka reports it as UnknownError.
        return UnknownError() if any(r.value == b"bad" for r in records) else None

    producer = Producer(refuse)
    s = session(Handler(lambda m: result(m, b"bad" if m.offset == 2 else b"{}")), producer)
    s._accept([(A, [record(A, o) for o in range(5)]), (B, [record(B, 0)])])
    await settle(s)
    assert s._failure is None and committed(s) == {0: 5, 1: 1}
    results = sorted(int(header(r.headers, "sie-source-offset")) for t, r in producer.written if t == "results")
    assert results == [0, 0, 1, 3, 4]  # A's 0, 1, 3, 4 and B's 0
    [dead_letter] = [r for t, r in producer.written if t == "dead"]
    assert header(dead_letter.headers, "sie-source-offset") == "2"
    assert "the broker refused the result: UnknownError" in header(dead_letter.headers, HEADER_ERROR)
    assert counted(s, "unwritable") == 1


async def test_when_even_the_stub_is_refused_the_message_is_skipped_and_the_partition_goes_on():
    producer = Producer(lambda topic, records: MessageSizeTooLargeError() if topic == "dead" else None)
    s = session(Handler(lambda m: dead(m) if m.offset == 0 else result(m)), producer)
    s._accept([(A, [record(A, 0), record(A, 1)])])
    await settle(s)
    assert s._failure is None and committed(s)[0] == 2
    assert [t for t, _ in producer.written] == ["results"] and counted(s, "unwritable") == 2


async def test_an_error_that_is_not_about_the_records_still_fails_the_session():
    producer = Producer(lambda topic, records: KafkaTimeoutError())
    s = session(Handler(result), producer)
    s._accept([(A, [record(A, 0)])])
    await settle(s)
    assert isinstance(s._failure, KafkaTimeoutError) and committed(s)[0] is None


async def test_an_undecodable_record_is_dead_lettered_in_order_and_every_partition_is_read_on_from_where_it_was():
    fetched: list[dict[TopicPartition, int]] = []
    poisoned = batch([(b"k", b'{"n": 5}', []), (b"k", b'{"n": 6}', [(PLACEHOLDER, b"")]), (b"k", b'{"n": 7}', [])], 5)

    async def fetch_raw(consumer: Any, positions: dict[TopicPartition, int], max_bytes: int) -> dict:
        fetched.append(dict(positions))
        return {A: poisoned, B: batch([(b"k", b"{}", [])], 0)}

    producer = Producer(lambda topic, records: None)
    s = session(Handler(result), producer, fetch_raw=fetch_raw)
    s._accept([(A, [record(A, o) for o in range(5)])])  # A was read up to 4; nothing of B yet
    assert await s._salvager.salvage(10, UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    await settle(s)
    assert fetched == [{A: 5, B: 100}]  # B from its committed offset (the fake's 100)
    assert s._consumer.seeks == [(A, 8), (B, 100)]
    assert s._failure is None and committed(s)[0] == 8
    written = [(t, header(r.headers, "sie-source-offset")) for t, r in producer.written]
    assert sorted(written) == sorted([("results", str(o)) for o in (0, 1, 2, 3, 4, 5, 7)] + [("dead", "6")])
    [dead_letter] = [r for t, r in producer.written if t == "dead"]
    assert header(dead_letter.headers, HEADER_ERROR).startswith("undecodable record: header name")
    assert dead_letter.value == b'{"n": 6}'
    assert counted(s, "undecodable") == 1 and counted(s, "consumed") == 8


async def test_a_salvage_that_finds_nothing_only_puts_the_partitions_back_and_pauses_those_handed_over():
    async def fetch_raw(consumer: Any, positions: dict[TopicPartition, int], max_bytes: int) -> dict:
        return {tp: batch([(b"k", b"{}", [])], offset) for tp, offset in positions.items()}

    s = session(Handler(result), Producer(lambda topic, records: None), fetch_raw=fetch_raw)
    s._accept([(A, [record(A, 0)])])
    s._closing.add(B)
    assert not await s._salvager.salvage(10, UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    assert s._consumer.seeks == [(A, 1)] and s._consumer.paused == [B]
    await settle(s)
