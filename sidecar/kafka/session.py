"""One membership of the model's consumer group, from join to leave: fetch, score, produce in order,
commit what is acknowledged, and hand partitions over cleanly on a rebalance or a drain.

`KafkaConnector` (connector.py) starts one `GroupSession` per membership and a new one after a
failure; everything here lives and dies with the session. Per partition it keeps a `PartitionLedger`
(pipeline.py) and the records waiting to be produced in order.

Flow of one message:

    fetch loop ──receive──▶ message task (decode, validate, admission slot, worker) ──finish──▶
    take_sendable ──▶ send queue ──▶ send loop (producer.send, in order) ──ack callback──▶
    ledger ack ──▶ commit loop (consumer.commit of each partition's commit point)

Invariants:
- An offset is committed only after its result (or dead-letter record) is acknowledged by the broker,
  and only with every earlier offset of its partition (pipeline.commit_point).
- Results of one partition are handed to the producer in offset order, by one send loop.
- At most `max_in_flight` messages (over all partitions) are between fetch and acknowledgement.
- On revocation the session stops taking messages of those partitions, waits (bounded) for the ones
  it has, commits them and only then lets the rebalance go on, so the next owner starts where this
  one finished: nothing lost, nothing repeated. A message that cannot finish within the bound is not
  committed, so it is repeated by the next owner rather than lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from sidecar.kafka import pipeline
from sidecar.kafka.handler import Abandoned, MessageHandler
from sidecar.kafka.records import OutRecord, SourceMessage, end_to_end_seconds
from sidecar.kafka.settings import ConnectorSettings
from sie.tasks import wait_event

if TYPE_CHECKING:
    from sidecar.kafka.metrics import KafkaMetrics

log = logging.getLogger("sie.sidecar.kafka")


class GroupSession(ConsumerRebalanceListener):
    def __init__(
        self,
        settings: ConnectorSettings,
        consumer: Any,
        producer: Any,
        handler: MessageHandler,
        metrics: KafkaMetrics,
        stop: asyncio.Event,
        clock: Callable[[], float] = time.time,
    ):
        self._settings = settings
        self._consumer = consumer
        self._producer = producer
        self._handler = handler
        self._metrics = metrics
        self._stop = stop
        self._clock = clock
        self._ledgers: dict[TopicPartition, pipeline.PartitionLedger] = {}
        self._outbox: dict[TopicPartition, dict[int, tuple[OutRecord, SourceMessage]]] = defaultdict(dict)
        self._tasks: dict[TopicPartition, set[asyncio.Task]] = defaultdict(set)
        self._unacked: dict[TopicPartition, int] = defaultdict(int)
        self._committed_count: dict[TopicPartition, int] = defaultdict(int)
        self._closing: set[TopicPartition] = set()
        self._send_queue: asyncio.Queue[tuple[TopicPartition, int, OutRecord, SourceMessage]] = asyncio.Queue()
        self._progress = asyncio.Event()
        self._commit_wanted = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._failure: BaseException | None = None

    # -- what the connector reads -------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(pipeline.unfinished(ledger) for ledger in self._ledgers.values())

    def status(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "partitions": {
                f"{tp.topic}/{tp.partition}": {
                    "committed": ledger.committed,
                    "done_through": ledger.done_through,
                    "in_work": pipeline.unfinished(ledger),
                    "closing": tp in self._closing,
                }
                for tp, ledger in sorted(self._ledgers.items())
            },
        }

    # -- the session ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Join, consume until `stop` is set, finish and commit what was taken, leave. Raises on failure."""
        name = self._settings.model_id
        loops: list[asyncio.Task] = []
        try:
            self._consumer.subscribe([self._settings.kafka.topic], listener=self)
            await self._consumer.start()
            loops = [
                asyncio.create_task(self._send_loop(), name=f"kafka-send:{name}"),
                asyncio.create_task(self._commit_loop(), name=f"kafka-commit:{name}"),
            ]
            for loop in loops:
                loop.add_done_callback(self._loop_ended)
            await self._fetch_loop()
            if self._failure is None:
                await self._finish_all()
        finally:
            await self._cancel(*[t for tasks in self._tasks.values() for t in tasks], *loops)
            # Leaving the group (in stop) is what hands the partitions to the other instances at once,
            # instead of after the session timeout.
            await self._consumer.stop()
        if self._failure is not None:
            raise self._failure

    async def _fetch_loop(self) -> None:
        window = self._settings.kafka.max_in_flight
        wait_ms = self._settings.fetch_wait_ms
        while not self._stop.is_set() and self._failure is None:
            free = window - self.in_flight
            if free <= 0:
                await self._wait_for(lambda: self.in_flight < window or self._stop.is_set(), wait_ms / 1000)
                continue
            batches = await self._consumer.getmany(timeout_ms=wait_ms, max_records=free)
            for tp, records in batches.items():
                if tp in self._closing:
                    continue  # being handed over: its next owner reads these from the committed offset
                for record in records:
                    self._accept(tp, record)
            self._update_lag(batches)

    def _accept(self, tp: TopicPartition, record: Any) -> None:
        message = SourceMessage(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=record.timestamp,
            key=record.key,
            value=record.value,
            headers=tuple(record.headers or ()),
        )
        self._ledgers[tp] = pipeline.receive(self._ledgers.get(tp, pipeline.PartitionLedger()), message.offset)
        self._metrics.consumed.inc()
        task = asyncio.create_task(
            self._process(tp, message), name=f"kafka-message:{tp.topic}/{tp.partition}@{message.offset}"
        )
        self._tasks[tp].add(task)
        task.add_done_callback(partial(self._message_ended, tp))

    async def _process(self, tp: TopicPartition, message: SourceMessage) -> None:
        try:
            record = await self._handler.handle(message, self._stop)
        except Abandoned:
            return  # stays WORKING: never committed here, so the group redelivers it
        if record is None:
            self._ledgers[tp] = pipeline.finish(self._ledgers[tp], message.offset, produce=False)
            self._commit_wanted.set()
        else:
            self._ledgers[tp] = pipeline.finish(self._ledgers[tp], message.offset)
            self._outbox[tp][message.offset] = (record, message)
        self._queue_sendable(tp)

    def _queue_sendable(self, tp: TopicPartition) -> None:
        self._ledgers[tp], offsets = pipeline.take_sendable(self._ledgers[tp])
        for offset in offsets:
            record, message = self._outbox[tp].pop(offset)
            self._unacked[tp] += 1
            self._send_queue.put_nowait((tp, offset, record, message))

    async def _send_loop(self) -> None:
        # One loop, so records reach the producer exactly in the order take_sendable released them.
        while True:
            tp, offset, record, message = await self._send_queue.get()
            delivery = await self._producer.send(
                record.topic, record.value, key=record.key, headers=list(record.headers)
            )
            delivery.add_done_callback(partial(self._delivered, tp, offset, record, message))

    def _delivered(
        self, tp: TopicPartition, offset: int, record: OutRecord, message: SourceMessage, delivery: asyncio.Future
    ) -> None:
        self._unacked[tp] -= 1
        self._progress.set()
        if delivery.cancelled():
            return  # the session is closing; the message stays uncommitted and is redelivered
        error = delivery.exception()
        if error is not None:
            self._fail(error, f"producing the result of {tp.topic}/{tp.partition}@{offset} failed")
            return
        if tp not in self._ledgers:
            return  # revoked after the drain bound: not committed here, repeated by the next owner
        self._ledgers[tp] = pipeline.ack(self._ledgers[tp], offset)
        if record.topic == self._settings.kafka.output_topic:
            self._metrics.produced.inc()
            latency = end_to_end_seconds(message.timestamp_ms, self._clock())
            if latency is not None:
                self._metrics.end_to_end.observe(latency)
        else:
            self._metrics.dead_lettered.inc()
        self._commit_wanted.set()

    async def _commit_loop(self) -> None:
        # Commits coalesce: while one is on the wire (or during commit_interval_s after it), further
        # acknowledgements pile up for the next. Hand-overs and drains commit on their own, at once.
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            await self._commit(list(self._ledgers))
            if self._settings.commit_interval_s > 0:
                await asyncio.sleep(self._settings.commit_interval_s)

    async def _commit(self, tps: list[TopicPartition]) -> None:
        async with self._commit_lock:
            points = {}
            for tp in tps:
                ledger = self._ledgers.get(tp)
                if ledger is None:
                    continue
                point = pipeline.commit_point(ledger)
                if point is not None:
                    points[tp] = (point, ledger.done_count)
            if not points:
                return
            try:
                await self._consumer.commit({tp: point for tp, (point, _count) in points.items()})
            except (CommitFailedError, IllegalStateError) as exc:
                # The group is rebalancing; the revocation handler commits what is done before handing over.
                log.info("commit of %s deferred: %s", sorted(f"{tp.topic}/{tp.partition}" for tp in points), exc)
                return
            except KafkaError as exc:
                log.warning("commit failed, will retry with the next one: %s", exc)
                return
            for tp, (point, count) in points.items():
                if tp in self._ledgers:
                    self._ledgers[tp] = pipeline.committed(self._ledgers[tp], point)
                self._metrics.committed.inc(count - self._committed_count[tp])
                self._committed_count[tp] = count
            self._update_lag({tp: () for tp in points})

    # -- handing partitions over ----------------------------------------------------------------

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        mine = [tp for tp in revoked if tp in self._ledgers]
        if not mine:
            return
        self._closing.update(mine)
        settled = await self._wait_for(lambda: all(self._idle(tp) for tp in mine), self._settings.drain_timeout_s)
        if not settled:
            log.warning(
                "partitions %s revoked with messages unfinished after %.1f s; they are not committed and "
                "will be processed again by the next owner",
                _names(mine),
                self._settings.drain_timeout_s,
            )
        await self._commit(mine)
        await self._cancel(*[task for tp in mine for task in self._tasks.pop(tp, ())])
        for tp in mine:
            self._ledgers.pop(tp, None)
            self._outbox.pop(tp, None)
            self._unacked.pop(tp, None)
            self._committed_count.pop(tp, None)
            self._metrics.forget_partition(tp.partition)
        self._closing.difference_update(mine)
        log.info("handed over %s", _names(mine))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:
            self._ledgers.setdefault(tp, pipeline.PartitionLedger())
        log.info("assigned %s", _names(assigned))

    async def _finish_all(self) -> None:
        tps = list(self._ledgers)
        self._closing.update(tps)
        settled = await self._wait_for(lambda: all(self._idle(tp) for tp in tps), self._settings.drain_timeout_s)
        if not settled:
            log.warning(
                "drain bound of %.1f s passed with %d messages unfinished; they are not committed and will "
                "be processed by another instance",
                self._settings.drain_timeout_s,
                self.in_flight,
            )
        await self._commit(tps)

    def _idle(self, tp: TopicPartition) -> bool:
        return not self._tasks.get(tp) and self._unacked.get(tp, 0) == 0

    # -- plumbing -------------------------------------------------------------------------------

    async def _wait_for(self, condition: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self._failure is not None:
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._progress.clear()
            await wait_event(self._progress, remaining)  # not asyncio.wait_for: see wait_event
        return True

    def _message_ended(self, tp: TopicPartition, task: asyncio.Task) -> None:
        self._tasks[tp].discard(task)
        self._progress.set()
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._fail(error, f"processing {task.get_name()} failed")

    def _loop_ended(self, task: asyncio.Task) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._fail(error, f"{task.get_name()} died")

    def _fail(self, exc: BaseException, what: str) -> None:
        if self._failure is None:
            log.error("%s: %r; the session leaves the group without committing past it", what, exc)
            self._failure = exc
        self._progress.set()

    def _update_lag(self, batches: dict[TopicPartition, Any]) -> None:
        for tp in batches:
            ledger = self._ledgers.get(tp)
            if ledger is None:
                continue
            value = pipeline.lag(self._consumer.highwater(tp), ledger.committed)
            if value is not None:
                self._metrics.set_lag(tp.partition, value)

    @staticmethod
    async def _cancel(*tasks: asyncio.Task) -> None:
        for task in tasks:
            task.cancel()
        # Their own failures were reported by their done callbacks; only cancellation is expected here.
        await asyncio.gather(*tasks, return_exceptions=True)


def _names(tps: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(tps))
