"""The Kafka connector in this process against a real Kafka-protocol broker (Tansu) and a small fake
worker: results, headers, ordering, commits, dead letters, drain and sleep.

Process-level failure tests (SIGKILL, two instances) are in test_kafka_failover.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.record.util import calc_crc32c
from prometheus_client import CollectorRegistry

from sidecar.admission import Gate, Limits
from sidecar.kafka import connector_for
from sidecar.kafka.records import HEADER_ERROR, HEADER_INSTANCE, header, source_of
from sie.spec_loader import parse_model_service
from sie_testing.tansu import FAST_GROUP, FakeWorker, TansuBroker, produce, read_topic

pytestmark = pytest.mark.timeout(60)

PARTITIONS = 4


def model_spec(bootstrap: str, group: str, dead_letter: bool = True, max_in_flight: int = 8) -> Any:
    kafka = {
        "bootstrap_servers": bootstrap,
        "topic": "requests",
        "group_id": group,
        "output_topic": "results",
        "max_in_flight": max_in_flight,
    }
    if dead_letter:
        kafka["dead_letter_topic"] = "dead"
    return parse_model_service(
        {
            "spec": {
                "model": {"name": "scorer", "service_type": "scoring", "priority_level": "P2"},
                "backend": {"type": "sklearn"},
                "resources": {"max_concurrent_requests": 8},
                "input_schema": {"fields": [{"name": "text", "type": "string", "max_length": 50}]},
                "kafka_input": kafka,
            }
        }
    )


class Instance:
    """One connector wired as the sidecar wires it (connector_for), with its own Gate and registry."""

    def __init__(self, spec: Any, worker_url: str, name: str):
        self.spec, self.worker_url, self.name = spec, worker_url, name
        self.registry = CollectorRegistry()

    async def __aenter__(self) -> Instance:
        self.gate = Gate(Limits(8, 32, 5.0), asyncio.get_running_loop())
        self.connector = connector_for(
            self.spec,
            self.name,
            worker_url=self.worker_url,
            worker_key=None,
            gate=self.gate,
            registry=self.registry,
            drain_timeout_s=10.0,
            **FAST_GROUP,
        )
        await self.connector.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.connector.close()
        self.gate.close()

    def metric(self, name: str) -> float:
        return sum(s.value for m in self.registry.collect() for s in m.samples if s.name == name)


async def wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


def texts(n: int) -> list[bytes]:
    return [json.dumps({"text": "x" * (i % 40), "i": i}).encode() for i in range(n)]


async def test_every_request_gets_one_result_in_partition_order_and_offsets_are_committed(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", PARTITIONS)
        sent = await produce(broker.bootstrap, texts(200))
        async with Instance(model_spec(broker.bootstrap, group), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 200)
            results = await read_topic(broker.bootstrap, "results", 200)
            assert inst.metric("inference_kafka_consumed_total") == 200
            assert inst.metric("inference_kafka_produced_total") == 200
            assert inst.metric("inference_kafka_end_to_end_latency_seconds_count") == 200
        committed = await broker.committed(group, "requests", PARTITIONS)
    # The 200 were waiting when the connector joined: fetched many at a time, scored in batched calls,
    # each request exactly once.
    assert sum(worker.batch_sizes) == 200 and max(worker.batch_sizes) > 1
    assert len(worker.batch_sizes) < 200

    sources = [source_of(r.headers) for r in results]
    assert len(results) == 200 and len({(s.partition, s.offset) for s in sources}) == 200
    assert {(s.partition, s.offset) for s in sources} == set(sent)
    per_key: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    for record, source in zip(results, sources):
        request = json.loads(sent[(source.partition, source.offset)])
        assert json.loads(record.value) == {"length": len(request["text"])}
        assert header(record.headers, HEADER_INSTANCE) == "a"
        per_key[record.key].append((source.partition, source.offset))
    # A result keeps its request's key, so one key's results sit in one output partition, in source order.
    for key, seen in per_key.items():
        assert seen == sorted(seen), f"results of key {key!r} out of source order: {seen}"
    ends: dict[int, int] = {}
    for partition, offset in sent:
        ends[partition] = max(ends.get(partition, 0), offset + 1)
    assert committed == {p: ends.get(p, -1) for p in range(PARTITIONS)}  # -1: nothing to commit
    # Results are batched, but each lands where producer.send would have put it: its key's partition.
    partitioner = DefaultPartitioner()
    assert all(r.partition == partitioner(r.key, list(range(PARTITIONS)), list(range(PARTITIONS))) for r in results)


async def test_results_of_requests_without_a_key_stay_with_their_source_partition_in_order(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", PARTITIONS)
        await broker.create_topic("results", PARTITIONS)
        sent = await produce(broker.bootstrap, texts(120), keyed=False)
        async with Instance(model_spec(broker.bootstrap, group), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 120)
            results = await read_topic(broker.bootstrap, "results", 120)
    assert {p for p, _ in sent} == set(range(PARTITIONS)), "the requests were spread over every partition"
    by_output: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for record in results:
        source = source_of(record.headers)
        assert record.key == f"p{source.partition}".encode()
        assert record.partition == source.partition, "one source partition's results in the same-numbered output"
        by_output[record.partition].append((source.partition, source.offset))
    for partition, seen in by_output.items():
        assert seen == sorted(seen), f"output partition {partition} out of source order"
    assert sorted(s for seen in by_output.values() for s in seen) == sorted(sent)


async def test_invalid_requests_go_to_the_dead_letter_topic_with_the_reason_and_never_reach_the_worker(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    bad = [
        b"not json",
        b"[1, 2]",
        json.dumps({"text": 7}).encode(),
        json.dumps({"text": "y" * 51}).encode(),
        json.dumps({"other": "no text"}).encode(),
    ]
    good = texts(20)
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", PARTITIONS)
        sent = await produce(broker.bootstrap, bad + good + [json.dumps({"text": "reject me"}).encode()])
        async with Instance(model_spec(broker.bootstrap, group), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= len(sent))
            dead = await read_topic(broker.bootstrap, "dead", len(bad) + 1)
            results = await read_topic(broker.bootstrap, "results", len(good))
            assert inst.metric("inference_kafka_invalid_total") == len(bad)
            assert inst.metric("inference_invalid_schema_total") == len(bad)
            assert inst.metric("inference_kafka_dead_lettered_total") == len(bad) + 1
            assert inst.metric("inference_kafka_failed_total") == 1

    assert len(results) == len(good)
    # The invalid ones never reached the worker; the refused one did. The batch the refused one was in
    # was sent again one request at a time, so the requests that shared it were scored twice (and
    # produced once: they are committed once, with their partition's order).
    assert {json.dumps(call, sort_keys=True) for call in worker.calls} == {
        json.dumps(json.loads(body), sort_keys=True) for body in good + [json.dumps({"text": "reject me"}).encode()]
    }
    reasons = {}
    for record in dead:
        source = source_of(record.headers)
        assert record.value == sent[(source.partition, source.offset)], "the dead letter carries the request unchanged"
        reasons[record.value] = header(record.headers, HEADER_ERROR)
    assert "not valid JSON" in reasons[b"not json"]
    assert "expected a JSON object" in reasons[b"[1, 2]"]
    assert (
        "'text'" in reasons[json.dumps({"text": 7}).encode()] and "string" in reasons[json.dumps({"text": 7}).encode()]
    )
    assert "max_length" in reasons[json.dumps({"text": "y" * 51}).encode()]
    assert "required" in reasons[json.dumps({"other": "no text"}).encode()]
    assert "422" in reasons[json.dumps({"text": "reject me"}).encode()]


async def test_without_a_dead_letter_topic_invalid_requests_are_counted_and_committed(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", 1)
        await produce(broker.bootstrap, [b"oops"] + texts(3))
        async with Instance(model_spec(broker.bootstrap, group, dead_letter=False), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 4)
            assert inst.metric("inference_kafka_invalid_total") == 1
            assert inst.metric("inference_kafka_produced_total") == 3
        assert await broker.committed(group, "requests", 1) == {0: 4}
    assert len(worker.calls) == 3


async def test_a_worker_that_is_not_ready_yet_is_retried_and_nothing_is_lost(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker(unavailable=5) as worker:
        await broker.create_topic("requests", 1)
        await produce(broker.bootstrap, texts(10))
        async with Instance(model_spec(broker.bootstrap, group, max_in_flight=2), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 10)
        results = await read_topic(broker.bootstrap, "results", 10)
    assert sorted(source_of(r.headers).offset for r in results) == list(range(10))
    assert worker.unavailable == 0


async def test_a_drained_instance_hands_its_partitions_over_without_loss_or_repeats(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", PARTITIONS)
        spec = model_spec(broker.bootstrap, group)
        async with Instance(spec, worker.url, "a") as a, Instance(spec, worker.url, "b") as b:
            await produce(broker.bootstrap, texts(150))
            await wait_until(
                lambda: a.metric("inference_kafka_committed_total") + b.metric("inference_kafka_committed_total") >= 150
            )
            await a.connector.drain()
            assert a.connector.state == "stopped" and a.connector.status()["partitions"] == {}
            sent_later = await produce(broker.bootstrap, texts(150))
            await wait_until(
                lambda: b.metric("inference_kafka_committed_total") + a.metric("inference_kafka_committed_total") >= 300
            )
            assert len(b.connector.status()["partitions"]) == PARTITIONS, "b took every partition"
        results = await read_topic(broker.bootstrap, "results", 300)
        committed = await broker.committed(group, "requests", PARTITIONS)
    sources = [(source_of(r.headers).partition, source_of(r.headers).offset) for r in results]
    assert len(sources) == len(set(sources)) == 300, "each request answered exactly once"
    later_by = {
        header(r.headers, HEADER_INSTANCE)
        for r in results
        if (source_of(r.headers).partition, source_of(r.headers).offset) in sent_later
    }
    assert later_by == {"b"}
    assert sum(committed.values()) == 300


async def test_a_paused_instance_does_not_consume_and_resumes_where_it_left_off(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", 2)
        async with Instance(model_spec(broker.bootstrap, group), worker.url, "a") as inst:
            await produce(broker.bootstrap, texts(20))
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 20)
            await inst.connector.pause()
            await produce(broker.bootstrap, texts(20))
            await asyncio.sleep(1.5)  # long enough for a running consumer to have fetched them
            assert inst.metric("inference_kafka_consumed_total") == 20
            await inst.connector.resume()
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 40)
            # Wake right after sleep: the resume waits for the drain's hand-over, then rejoins.
            draining = asyncio.create_task(inst.connector.pause())
            await asyncio.sleep(0)
            assert inst.connector.state == "draining"
            await inst.connector.resume()
            assert inst.connector.state == "consuming"
            await draining
            await produce(broker.bootstrap, texts(5))
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 45)
        results = await read_topic(broker.bootstrap, "results", 45)
    assert len({(source_of(r.headers).partition, source_of(r.headers).offset) for r in results}) == len(results) == 45


async def produce_batch(bootstrap: str, partition: int, values: list[bytes], poison: int | None = None) -> None:
    """`values` as one producer batch on `partition`; the record at index `poison` gets a header whose
    name is b"\\xff\\xfe", not UTF-8: legal on the wire (Kafka's clients take header names as bytes or
    write them as they are), and aiokafka cannot decode it."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        batch = producer.create_batch()
        for index, value in enumerate(values):
            name = "\x01\x02" if index == poison else "trace"
            batch.append(key=b"k", value=value, timestamp=None, headers=[(name, b"v")])
        data = bytearray(batch._build())  # the built batch, patched in place, its CRC made right again
        if poison is not None:
            at = data.index(b"\x04\x01\x02")  # the name's length (zigzag 2) and the name
            data[at + 1 : at + 3] = b"\xff\xfe"
            data[17:21] = calc_crc32c(bytes(data[21:])).to_bytes(4, "big")
            batch._buffer = data
        await (await producer.send_batch(batch, "requests", partition=partition))
    finally:
        await producer.stop()


async def test_a_record_the_kafka_client_cannot_decode_is_dead_lettered_and_its_partition_goes_on(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", 2)
        # Partition 0: a batch of 5 whose third record cannot be decoded (the records after it share its
        # batch, so aiokafka cannot return them either), then a batch of 3; partition 1: 5 plain records.
        await produce_batch(broker.bootstrap, 0, texts(5), poison=2)
        await produce_batch(broker.bootstrap, 0, texts(3))
        await produce_batch(broker.bootstrap, 1, texts(5))
        async with Instance(model_spec(broker.bootstrap, group), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 13)
            dead = await read_topic(broker.bootstrap, "dead", 1)
            results = await read_topic(broker.bootstrap, "results", 12)
            assert inst.connector.sessions_failed == 0
            assert inst.metric("inference_kafka_undecodable_total") == 1
            assert inst.metric("inference_kafka_consumed_total") == 13
        committed = await broker.committed(group, "requests", 2)
    assert committed == {0: 8, 1: 5}
    [letter] = dead
    assert source_of(letter.headers) is not None and (
        source_of(letter.headers).partition,
        source_of(letter.headers).offset,
    ) == (0, 2)
    assert header(letter.headers, HEADER_ERROR) == "undecodable record: header name b'\\xff\\xfe' is not UTF-8"
    assert letter.value == texts(5)[2] and letter.key == b"k"
    sources = [(source_of(r.headers).partition, source_of(r.headers).offset) for r in results]
    assert sorted(sources) == [(0, o) for o in (0, 1, 3, 4, 5, 6, 7)] + [(1, o) for o in range(5)]
    assert [o for p, o in sources if p == 0] == [0, 1, 3, 4, 5, 6, 7], "one key: its results in source order"
    assert all(header(r.headers, "trace") == "v" for r in results)


async def test_a_request_too_large_to_copy_into_a_dead_letter_record_is_named_by_a_stub(tmp_path):
    group = f"g-{uuid.uuid4().hex[:8]}"
    # Invalid (text longer than 50) and just under Kafka's default message.max.bytes: a dead-letter record
    # that copies it and adds headers would be over it, and a broker would refuse it (Tansu has no limit).
    big = json.dumps({"text": "y" * 1_048_400}).encode()
    async with TansuBroker.started(tmp_path) as broker, FakeWorker() as worker:
        await broker.create_topic("requests", 1)
        await produce(broker.bootstrap, [texts(1)[0], big] + texts(3), keyed=False)
        async with Instance(model_spec(broker.bootstrap, group), worker.url, "a") as inst:
            await wait_until(lambda: inst.metric("inference_kafka_committed_total") >= 5)
            dead = await read_topic(broker.bootstrap, "dead", 1)
            assert inst.connector.sessions_failed == 0
            assert inst.metric("inference_kafka_unwritable_total") == 1
            assert inst.metric("inference_kafka_produced_total") == 4
        assert await broker.committed(group, "requests", 1) == {0: 5}
    [stub] = dead
    assert stub.value == b"" and stub.key is None
    assert (source_of(stub.headers).partition, source_of(stub.headers).offset) == (0, 1)
    reason = header(stub.headers, HEADER_ERROR)
    assert "max_length" in reason and "not copied" in reason and "max_record_bytes" in reason
