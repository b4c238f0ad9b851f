"""One fetch's records over several partitions make one task (one worker call); a revocation that finds
such a batch stuck fails the session instead of leaving a kept partition's messages in work for ever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry

from sidecar.kafka import pipeline
from sidecar.kafka.metrics import KafkaMetrics, MetricLabels
from sidecar.kafka.records import OutRecord
from sidecar.kafka.session import GroupSession
from sidecar.kafka.settings import ConnectorSettings
from sie.spec import KafkaInput, Priority

A, B = TopicPartition("requests", 0), TopicPartition("requests", 1)


class Handler:
    """handle_batch records each call; it answers at once, or never while `hold` is set."""

    def __init__(self, hold: bool = False):
        self.calls: list[list[tuple[int, int]]] = []
        self.hold = hold

    async def handle_batch(self, messages: Any, stop: asyncio.Event) -> list[OutRecord | None]:
        self.calls.append([(m.partition, m.offset) for m in messages])
        if self.hold:
            await asyncio.Event().wait()
        return [OutRecord("results", None, b"{}", ()) for _ in messages]


class Consumer:
    def __init__(self) -> None:
        self.commits: list[dict[TopicPartition, int]] = []

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)

    def highwater(self, tp: TopicPartition) -> int | None:
        return None


def record(tp: TopicPartition, offset: int) -> Any:
    return SimpleNamespace(
        topic=tp.topic, partition=tp.partition, offset=offset, timestamp=0, key=None, value=b"{}", headers=()
    )


def session(handler: Handler, max_batch: int = 256) -> GroupSession:
    kafka = KafkaInput(
        bootstrap_servers=["127.0.0.1:9"], topic="requests", group_id="g", output_topic="results", max_batch=max_batch
    )
    settings = ConnectorSettings(
        kafka=kafka, model_id="m", instance_id="i", priority=Priority.P1, drain_timeout_s=0.05, commit_interval_s=0
    )
    metrics = KafkaMetrics(CollectorRegistry(), MetricLabels("m", "scoring", "P1", "1", "requests"))
    return GroupSession(settings, Consumer(), None, handler, metrics, asyncio.Event())  # type: ignore[arg-type]


def test_one_fetch_over_two_partitions_is_one_worker_call_in_order():
    async def go():
        handler = Handler()
        s = session(handler)
        for tp in (A, B):
            s._ledgers[tp] = pipeline.PartitionLedger()
        for batch in pipeline.pack([(A, [record(A, 0), record(A, 1)]), (B, [record(B, 5)])], 256):
            s._accept(batch)
        await asyncio.gather(*{t for tasks in s._tasks.values() for t in tasks})
        return handler.calls, s

    calls, s = asyncio.run(go())
    assert calls == [[(0, 0), (0, 1), (1, 5)]]
    assert s._sender._send_queue.qsize() == 2, "each partition's results go to the send loop on their own, in order"


def revoke_a_with_a_stuck_batch(batch: list[tuple[TopicPartition, list[Any]]]) -> tuple[GroupSession, asyncio.Task]:
    """A session holding A and B starts `batch`, whose worker call never answers, then loses A: the
    drain bound passes. Returns the session and the batch's task."""

    async def go():
        s = session(Handler(hold=True))
        for tp in (A, B):
            s._ledgers[tp] = pipeline.PartitionLedger()
        s._accept(batch)
        await asyncio.sleep(0)
        task = next(iter(s._tasks[A]))
        await s.on_partitions_revoked([A])
        await asyncio.sleep(0)
        return s, task

    return asyncio.run(go())


def test_a_stuck_batch_spanning_a_kept_partition_fails_the_session_on_revocation():
    s, task = revoke_a_with_a_stuck_batch([(A, [record(A, 0)]), (B, [record(B, 0)])])
    assert task.cancelled()
    assert isinstance(s._failure, TimeoutError), "B's message would otherwise stay in work for ever"
    assert A not in s._ledgers and B in s._ledgers


def test_a_stuck_batch_of_the_revoked_partition_alone_is_cancelled_and_the_session_goes_on():
    s, task = revoke_a_with_a_stuck_batch([(A, [record(A, 0)])])
    assert task.cancelled() and s._failure is None


def test_a_delivery_from_before_a_revocation_leaves_the_partition_s_new_ledger_alone():
    """A producer ack that arrives after its partition was revoked (drain bound passed) and assigned
    again must not ack the new ledger's offsets nor drive the unacknowledged count below zero."""

    async def go():
        s = session(Handler())
        s._ledgers[A] = pipeline.PartitionLedger()
        s._accept([(A, [record(A, 0), record(A, 1)])])
        await asyncio.gather(*s._tasks[A])
        tp, generation, ready, alone = s._sender._send_queue.get_nowait()  # what the send loop would hand the producer
        part = [(tp, offset, rec, msg, generation, alone) for offset, rec, msg in ready]
        await s.on_partitions_revoked([A])  # the drain bound passes: the results were never acknowledged
        await s.on_partitions_assigned([A])
        s._accept([(A, [record(A, 0), record(A, 1)])])  # the same offsets, fetched again
        late: asyncio.Future = asyncio.get_running_loop().create_future()
        late.set_result(None)
        s._sender._delivered(part, late)
        return s

    s = asyncio.run(go())
    assert s._failure is None
    assert s._sender.unacked(A) >= 0
    assert pipeline.unfinished(s._ledgers[A]) == 2, "the new generation's offsets are still its own to finish"
