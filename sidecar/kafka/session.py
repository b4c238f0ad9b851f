"""One membership of the model's consumer group, from join to leave: fetch, score, produce in order,
commit what is acknowledged, and hand partitions over cleanly on a rebalance or a drain.

`KafkaConnector` (connector.py) starts one `GroupSession` per membership and a new one after a
failure; everything here lives and dies with the session. Per partition it keeps a `PartitionLedger`
(pipeline.py) and the records waiting to be produced in order. Here: fetching, scoring and releasing
results in order, and the rebalance listener. Its parts, each made by the session and handed what it
needs: `Sender` (sending.py) writes the released results and applies the broker's answers to the
ledgers, `Committer` (commits.py) commits, `Salvager` (salvage.py) takes what aiokafka cannot decode.

Flow of one fetched batch (records that one fetch returned, of one partition or several, at most
`kafka_input.max_batch` of them in all: one worker call carries them, `pipeline.pack`):

    fetch loop ──receive_many──▶ batch task (decode and validate each, an admission slot, ONE worker
    call for the valid ones) ──finish_many──▶ take_sendable ──▶ send queue ──▶ send loop (everything
    released since its last pass, one producer batch per output partition, in order) ──ack callback
    per producer batch──▶ ack_many ──▶ commit loop (consumer.commit of each partition's commit point)

Batching changes how many calls carry the messages, not what happens to each: every message is still
in the ledger on its own, its result is still produced in offset order and committed only once the
broker acknowledged it and every earlier one.

Invariants:
- An offset is committed only after its result (or dead-letter record) is acknowledged by the broker,
  and only with every earlier offset of its partition (pipeline.commit_point).
- Results of one partition are released in offset order (pipeline.take_sendable) and written in that
  order (sending.py).
- At most `max_in_flight` messages (over all partitions) are between fetch and acknowledgement.
- On revocation the session stops taking messages of those partitions, waits (bounded) for the ones
  it has, commits them and only then lets the rebalance go on, so the next owner starts where this
  one finished: nothing lost, nothing repeated. A message that cannot finish within the bound is not
  committed, so it is repeated by the next owner rather than lost. The group waits that long for the
  member (ConnectorSettings.rebalance_timeout_ms).

Bad input fails its message, never the session (DESIGN.md section 10: a bad input loses nothing and stops
nothing; a failed session would meet the same input again from the committed offset, for ever):
- A record aiokafka cannot decode (a header name that is not UTF-8) makes getmany raise. `Salvager`
  reads the partition's bytes itself (salvage.py, batches.py), and `_take` takes its records in order
  through the bad one's batch and dead-letters the bad one ("undecodable record: ..."); it seeks past it.
- A record over `max_record_bytes` is replaced before it is sent, and a record the broker refuses for
  good (too large, invalid) after: a result by a dead-letter record, a dead-letter record by a stub
  (records.Outgoing; sending.py says when results can then land out of source order).
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
from aiokafka.errors import CorruptRecordException
from aiokafka.partitioner import DefaultPartitioner

from sidecar.kafka import batches as raw_batches
from sidecar.kafka import pipeline, salvage
from sidecar.kafka.commits import Committer
from sidecar.kafka.handler import Abandoned, MessageHandler
from sidecar.kafka.records import Outgoing, OutRecord, SourceMessage, encoded_size
from sidecar.kafka.sending import Sender
from sidecar.kafka.settings import ConnectorSettings
from sie.tasks import wait_event

if TYPE_CHECKING:
    from sidecar.kafka.metrics import KafkaMetrics

log = logging.getLogger("sie.sidecar.kafka")

# What getmany raises when aiokafka cannot decode a fetched record (see batches.py and salvage.py).
_UNDECODABLE = (UnicodeDecodeError, CorruptRecordException)
# Salvages in a row that find no undecodable record before the session gives up and fails as before.
_SALVAGE_MISSES = 3


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
        fetch_raw: salvage.RawFetch = salvage.fetch_raw,
    ):
        self._settings = settings
        self._consumer = consumer
        self._handler = handler
        self._metrics = metrics
        self._stop = stop
        self._ledgers: dict[TopicPartition, pipeline.PartitionLedger] = {}
        self._outbox: dict[TopicPartition, dict[int, tuple[OutRecord, SourceMessage]]] = defaultdict(dict)
        self._tasks: dict[TopicPartition, set[asyncio.Task]] = defaultdict(set)
        self._closing: set[TopicPartition] = set()
        self._progress = asyncio.Event()
        self._commit_wanted = asyncio.Event()
        self._failure: BaseException | None = None
        self._outgoing = Outgoing(
            output_topic=settings.kafka.output_topic,
            dead_letter_topic=settings.kafka.dead_letter_topic,
            model_id=settings.model_id,
            instance_id=settings.instance_id,
            max_bytes=settings.max_record_bytes,
        )
        self._committer = Committer(consumer, self._ledgers, metrics, self._commit_wanted, settings.commit_interval_s)
        self._sender = Sender(
            producer,
            self._outgoing,
            # The connector's producer partitions with aiokafka's default (murmur2 of the key, as Kafka's
            # Java client does) unless the overrides name another; batches must land where send() would.
            settings.client_overrides.get("partitioner") or DefaultPartitioner(),
            self._ledgers,
            metrics,
            clock,
            progress=self._progress,
            commit_wanted=self._commit_wanted,
            fail=self._fail,
            watch=self._loop_ended,
        )
        self._salvager = salvage.Salvager(settings, consumer, self._ledgers, self._closing, self._take, fetch_raw)

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
                asyncio.create_task(self._sender.run(), name=f"kafka-send:{name}"),
                asyncio.create_task(self._committer.run(), name=f"kafka-commit:{name}"),
            ]
            for loop in loops:
                loop.add_done_callback(self._loop_ended)
            await self._fetch_loop()
            if self._failure is None:
                await self._finish_all()
        finally:
            await self._cancel(*[t for tasks in self._tasks.values() for t in tasks], *loops, *self._sender.writers)
            # Leaving the group (in stop) is what hands the partitions to the other instances at once,
            # instead of after the session timeout.
            await self._consumer.stop()
        if self._failure is not None:
            raise self._failure

    async def _fetch_loop(self) -> None:
        window = self._settings.kafka.max_in_flight
        batch_size = self._settings.kafka.max_batch
        wait_ms = self._settings.fetch_wait_ms
        misses = 0
        while not self._stop.is_set() and self._failure is None:
            free = window - self.in_flight
            if free <= 0:
                await self._wait_for(lambda: self.in_flight < window or self._stop.is_set(), wait_ms / 1000)
                continue
            try:
                batches = await self._consumer.getmany(timeout_ms=wait_ms, max_records=free)
            except _UNDECODABLE as exc:
                if await self._salvager.salvage(free, exc):
                    misses = 0
                    continue
                misses += 1
                if misses >= _SALVAGE_MISSES:
                    raise
                continue
            misses = 0
            # Being handed over: the next owner reads these from the committed offset.
            taken = [(tp, records) for tp, records in batches.items() if records and tp not in self._closing]
            for batch in pipeline.pack(taken, batch_size):
                self._accept(batch)
            self._committer.update_lag(batches)

    def _accept(self, batch: list[tuple[TopicPartition, list[Any]]]) -> None:
        """Start one task for records of one fetch, of one partition or several: one worker call."""
        self._start(
            [
                (
                    tp,
                    [
                        SourceMessage(
                            topic=record.topic,
                            partition=record.partition,
                            offset=record.offset,
                            timestamp_ms=record.timestamp,
                            key=record.key,
                            value=record.value,
                            headers=tuple(record.headers or ()),
                        )
                        for record in records
                    ],
                )
                for tp, records in batch
            ]
        )

    def _start(self, groups: list[tuple[TopicPartition, list[SourceMessage]]]) -> None:
        for tp, messages in groups:
            ledger = self._ledgers.get(tp, pipeline.PartitionLedger())
            self._ledgers[tp] = pipeline.receive_many(ledger, [m.offset for m in messages])
            self._metrics.consumed.inc(len(messages))
        name = ",".join(f"{tp.topic}/{tp.partition}@{ms[0].offset}-{ms[-1].offset}" for tp, ms in groups)
        task = asyncio.create_task(self._process(groups), name=f"kafka-batch:{name}")
        for tp, _messages in groups:
            self._tasks[tp].add(task)
            task.add_done_callback(partial(self._message_ended, tp))

    async def _process(self, groups: list[tuple[TopicPartition, list[SourceMessage]]]) -> None:
        try:
            records = await self._handler.handle_batch([m for _tp, ms in groups for m in ms], self._stop)
        except Abandoned:
            return  # they stay WORKING: never committed here, so the group redelivers them
        start = 0
        for tp, messages in groups:
            outbox = self._outbox[tp]
            produce: dict[int, bool] = {}
            for message, record in zip(messages, records[start : start + len(messages)]):
                if record is not None and encoded_size(record) > self._outgoing.max_bytes:
                    record = self._sender.too_large(record, message)
                produce[message.offset] = record is not None
                if record is not None:
                    outbox[message.offset] = (record, message)
            start += len(messages)
            self._ledgers[tp] = pipeline.finish_many(self._ledgers[tp], produce)
            if not all(produce.values()):
                self._commit_wanted.set()
            self._queue_sendable(tp)

    def _queue_sendable(self, tp: TopicPartition) -> None:
        self._ledgers[tp], offsets = pipeline.take_sendable(self._ledgers[tp])
        if not offsets:
            return
        outbox = self._outbox[tp]
        self._sender.release(tp, [(offset, *outbox.pop(offset)) for offset in offsets])

    # -- records aiokafka cannot decode ----------------------------------------------------------

    def _take(self, tp: TopicPartition, plan: raw_batches.Rescue) -> None:
        """Start the rescued messages as fetched ones are started; dead-letter the undecodable ones at once."""
        run: list[SourceMessage] = []
        for message in plan.messages:
            why = plan.undecodable.get(message.offset)
            if why is None:
                run.append(message)
                continue
            for batch in pipeline.pack([(tp, run)], self._settings.kafka.max_batch):
                self._start(batch)
            run = []
            self._ledgers[tp] = pipeline.receive_many(self._ledgers[tp], [message.offset])
            self._metrics.consumed.inc()
            self._metrics.undecodable.inc()
            record = self._outgoing.dead_letter(message, f"undecodable record: {why}")
            if record is None:
                log.warning(
                    "skipping %s/%s@%s (no dead_letter_topic is set): %s", tp.topic, tp.partition, message.offset, why
                )
                self._commit_wanted.set()
            else:
                self._outbox[tp][message.offset] = (record, message)
            self._ledgers[tp] = pipeline.finish_many(self._ledgers[tp], {message.offset: record is not None})
            self._queue_sendable(tp)
        for batch in pipeline.pack([(tp, run)], self._settings.kafka.max_batch):
            self._start(batch)

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
        await self._committer.commit(mine)
        stuck = {task for tp in mine for task in self._tasks.pop(tp, ())}
        kept = {task for tp, tasks in self._tasks.items() for task in tasks if tp not in mine}
        if stuck & kept:
            # A batch holds messages of a partition this session keeps: cancelled, they would stay in
            # work there for ever. Leave the group instead; the kept partitions restart from their
            # committed offsets (repeated, never lost). aiokafka's eager rebalance revokes every
            # partition at once, so today this guards a partial revocation (an incremental protocol).
            self._fail(
                TimeoutError(f"a batch with messages of {_names(mine)} did not finish"),
                "a batch spanning kept and revoked partitions did not finish within the drain bound",
            )
        await self._cancel(*stuck)
        for tp in mine:
            self._ledgers.pop(tp, None)
            self._outbox.pop(tp, None)
            self._sender.forget(tp)
            self._committer.forget(tp)
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
        await self._committer.commit(tps)

    def _idle(self, tp: TopicPartition) -> bool:
        return not self._tasks.get(tp) and self._sender.unacked(tp) == 0

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

    @staticmethod
    async def _cancel(*tasks: asyncio.Task) -> None:
        for task in tasks:
            task.cancel()
        # Their own failures were reported by their done callbacks; only cancellation is expected here.
        await asyncio.gather(*tasks, return_exceptions=True)


def _names(tps: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(tps))
