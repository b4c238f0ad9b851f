"""bench.kafka's result reader, on a real broker: each request's latency runs from the send time in its
header to the fetch that brought its result, the first copy of a repeated result is the one that counts,
and a result without the bench's headers stops the wait with an error that says so."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from bench.kafka import PARTITIONS, PATHS, ResultReader
from sie_testing.tansu import TansuBroker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@asynccontextmanager
async def reader_and_producer(tmp_path: Path) -> AsyncIterator[tuple[ResultReader, AIOKafkaProducer]]:
    """A started reader watching SIE's results on a fresh broker, and a producer to write those results."""
    async with TansuBroker.started(tmp_path) as broker:
        for _requests, results in PATHS.values():
            await broker.create_topic(results, partitions=PARTITIONS)
        reader = ResultReader(broker.bootstrap)
        reader.start()
        reader.watch("sie")
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
        await producer.start()
        try:
            yield reader, producer
        finally:
            await producer.stop()
            reader.stop()


def headers(sent_s: float, key: str) -> list[tuple[str, bytes]]:
    return [("bench-sent-us", str(int(sent_s * 1e6)).encode()), ("bench-id", key.encode())]


async def test_each_result_counts_once_from_its_scheduled_send(tmp_path):
    async with reader_and_producer(tmp_path) as (reader, producer):
        fetched_before = reader.fetched
        scheduled = time.time() - 2.0  # two seconds ago: every latency is at least that
        keys = [f"t-{i}" for i in range(40)]
        for i, key in enumerate(keys):
            await producer.send_and_wait("results", b"{}", headers=headers(scheduled, key), partition=i % 4)
        # Repeats (at-least-once) of the first five, "sent" a minute earlier: they must not count. Each
        # goes where its original went, as a repeated result does (same key, same output partition):
        # across partitions the reader may fetch a repeat before its original, which no pipeline makes.
        for i, key in enumerate(keys[:5]):
            await producer.send_and_wait("results", b"{}", headers=headers(scheduled - 60, key), partition=i % 4)
        await reader.wait_for([k.encode() for k in keys], fetched_before, timeout_s=30)
        latencies = [reader.latency[k.encode()] for k in keys]
        assert all(2.0 <= x < 30 for x in latencies), latencies
        assert all(k.encode() in reader.written for k in keys)


async def test_a_result_without_the_bench_headers_stops_the_wait(tmp_path):
    async with reader_and_producer(tmp_path) as (reader, producer):
        fetched_before = reader.fetched
        await producer.send_and_wait("results", b"{}", headers=headers(time.time(), "ok-0"), partition=0)
        await producer.send_and_wait("results", b"{}", partition=1)
        with pytest.raises(RuntimeError, match="lacks the bench's two headers"):
            await reader.wait_for([b"ok-0", b"never-sent"], fetched_before, timeout_s=30)
