"""One membership of the model's consumer group, from join to leave: fetch, score, produce in order,
commit what is acknowledged, and hand partitions over cleanly on a rebalance or a drain.

`KafkaConnector` (connector.py) starts one `GroupSession` per membership and a new one after a
failure; everything here lives and dies with the session. Per partition it keeps a `PartitionLedger`
(pipeline.py) and the records waiting to be produced in order.

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
- Results of one partition are handed to the producer in offset order, by one send loop; the producer
  keeps one batch in flight per output partition, so they are written in that order.
- At most `max_in_flight` messages (over all partitions) are between fetch and acknowledgement.
- On revocation the session stops taking messages of those partitions, waits (bounded) for the ones
  it has, commits them and only then lets the rebalance go on, so the next owner starts where this
  one finished: nothing lost, nothing repeated. A message that cannot finish within the bound is not
  committed, so it is repeated by the next owner rather than lost. The group waits that long for the
  member (ConnectorSettings.rebalance_timeout_ms).

Bad input fails its message, never the session (DESIGN.md section 10: a bad input loses nothing and stops
nothing; a failed session would meet the same input again from the committed offset, for ever):
- A record aiokafka cannot decode (a header name that is not UTF-8) makes getmany raise. `_salvage`
  reads the partition's bytes itself (salvage.py, batches.py), takes its records in order through the
  bad one's batch, dead-letters the bad one ("undecodable record: ...") and seeks past it.
- A record over `max_record_bytes` is replaced before it is sent, and a record the broker refuses for
  good (too large, invalid) after (`_refused`): a result by a dead-letter record, a dead-letter record by a
  stub (records.Outgoing). Only a batch of several refused whole is sent again record by record, after
  what the producer already queued for that output partition: the one case where results can land out of
  source order (the commit still follows the acknowledgements).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    CorruptRecordException,
    IllegalStateError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    UnknownError,
)
from aiokafka.partitioner import DefaultPartitioner

from sidecar.kafka import batches as raw_batches
from sidecar.kafka import pipeline, salvage
from sidecar.kafka.handler import Abandoned, MessageHandler
from sidecar.kafka.records import Outgoing, OutRecord, SourceMessage, encoded_size, end_to_end_seconds
from sidecar.kafka.settings import ConnectorSettings
from sie.tasks import wait_event

if TYPE_CHECKING:
    from sidecar.kafka.metrics import KafkaMetrics

log = logging.getLogger("sie.sidecar.kafka")

# A record on its way to the producer: its source partition and offset, the record, the request, the
# partition's generation in this session (each revocation starts a new one; see _delivered), and whether
# it goes in a producer batch of its own (sent again after the broker refused a batch; see _refused).
Item = tuple[TopicPartition, int, OutRecord, SourceMessage, int, bool]
RawFetch = Callable[[Any, dict[TopicPartition, int], int], Awaitable[dict[TopicPartition, bytes]]]

# Errors with which a broker refuses a produced batch for what is in it, for good: the same bytes would
# be refused again, so they are that batch's messages' failure, not the session's (_refused). aiokafka
# 0.14 has no class for INVALID_RECORD (87): it arrives as UnknownError, like an unknown server error,
# and both are taken as a refusal (a batch of several is first sent again a record at a time).
_REFUSED = (MessageSizeTooLargeError, RecordListTooLargeError, CorruptRecordException, UnknownError)
# What getmany raises when aiokafka cannot decode a fetched record (see batches.py and _salvage).
_UNDECODABLE = (UnicodeDecodeError, CorruptRecordException)
# Salvages in a row that find no undecodable record before the session gives up and fails as before.
_SALVAGE_MISSES = 3
# aiokafka's max_partition_fetch_bytes unless the overrides set another: the raw read covers what the
# failed fetch did.
_PARTITION_FETCH_BYTES = 1_048_576


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
        fetch_raw: RawFetch = salvage.fetch_raw,
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
        self._send_queue: asyncio.Queue[
            tuple[TopicPartition, int, list[tuple[int, OutRecord, SourceMessage]], bool]
        ] = asyncio.Queue()
        self._generation: dict[TopicPartition, int] = defaultdict(int)
        self._partitions: dict[str, list[int]] = {}  # output topic -> its partitions, read once per session
        self._partition_of: dict[tuple[str, bytes], int] = {}
        self._writer_queues: dict[tuple[str, int], asyncio.Queue[list[Item]]] = {}
        self._writers: list[asyncio.Task] = []  # one per output partition written to, made on first use
        # The connector's producer partitions with aiokafka's default (murmur2 of the key, as Kafka's
        # Java client does) unless the overrides name another; batches must land where send() would.
        self._partitioner = settings.client_overrides.get("partitioner") or DefaultPartitioner()
        self._progress = asyncio.Event()
        self._commit_wanted = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._failure: BaseException | None = None
        self._fetch_raw = fetch_raw
        self._outgoing = Outgoing(
            output_topic=settings.kafka.output_topic,
            dead_letter_topic=settings.kafka.dead_letter_topic,
            model_id=settings.model_id,
            instance_id=settings.instance_id,
            max_bytes=settings.max_record_bytes,
        )

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
            await self._cancel(*[t for tasks in self._tasks.values() for t in tasks], *loops, *self._writers)
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
                if await self._salvage(free, exc):
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
            self._update_lag(batches)

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
                    record = self._too_large(record, message)
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
        ready = [(offset, *outbox.pop(offset)) for offset in offsets]
        self._unacked[tp] += len(ready)
        self._send_queue.put_nowait((tp, self._generation[tp], ready, False))

    # -- records aiokafka cannot decode ----------------------------------------------------------

    async def _salvage(self, room: int, error: BaseException) -> bool:
        """getmany raised `error` decoding a fetched record (batches.py says why it can happen and why
        seeking past it is not enough). Read the partitions' bytes from where this session has read them
        to, take the records of the one that holds the bad record (up to `room`) through the end of its
        batch, dead-letter the bad one and go on after it. Returns whether it found one.

        Every other partition is sought back to where it has been read to: getmany may have moved it
        past records of the same call before it failed, and those records were never returned.
        Partitions being handed over are paused: the next owner reads them from the committed offset."""
        consumer = self._consumer
        reset = self._settings.kafka.auto_offset_reset
        positions: dict[TopicPartition, int] = {}
        for tp, ledger in list(self._ledgers.items()):
            if tp in self._closing:
                _quietly(consumer.pause, tp)
                continue
            last = ledger.last_offset
            positions[tp] = last + 1 if last is not None else await salvage.start_position(consumer, tp, reset)
        max_bytes = int(self._settings.client_overrides.get("max_partition_fetch_bytes", _PARTITION_FETCH_BYTES))
        try:
            raw = await self._fetch_raw(consumer, positions, max_bytes)
        except KafkaError as exc:
            log.warning("reading %s undecoded failed: %r", _names(list(positions)), exc)
            raw = {}
        found = False
        for tp, position in positions.items():
            if tp not in self._ledgers or tp in self._closing:
                continue  # revoked or being handed over while this read: not this session's to take
            plan = None
            if not found and tp in raw:
                plan = raw_batches.rescue(tp.topic, tp.partition, position, raw_batches.read_batches(raw[tp]), room)
            if plan is None:
                _quietly(consumer.seek, tp, position)
                continue
            found = True
            log.warning(
                "%s/%s: the Kafka client cannot decode %s (%r); taking %d records up to offset %d undecoded",
                tp.topic,
                tp.partition,
                ", ".join(f"offset {o}: {why}" for o, why in plan.undecodable.items()) or "a record further on",
                error,
                len(plan.messages),
                plan.resume_at,
            )
            self._take(tp, plan)
            _quietly(consumer.seek, tp, plan.resume_at)
        return found

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

    def _too_large(self, record: OutRecord, message: SourceMessage) -> OutRecord | None:
        replacement = self._outgoing.fit(record, message)
        self._metrics.unwritable.inc()
        log.warning(
            "%s/%s@%s: its %s is %d bytes, over max_record_bytes (%d); %s",
            message.topic,
            message.partition,
            message.offset,
            "result" if record.topic == self._outgoing.output_topic else "dead-letter record",
            encoded_size(record),
            self._outgoing.max_bytes,
            "skipped (no dead_letter_topic)"
            if replacement is None
            else f"writing a smaller one to {replacement.topic}",
        )
        return replacement

    async def _send_loop(self) -> None:
        # One loop routes the released records, in the order take_sendable released them, to one
        # writer per output partition; each writer puts what it has into producer batches, in that
        # order. The producer keeps one batch in flight per partition and `send_batch` waits while the
        # partition's next batch is still queued there, so a writer per partition keeps one busy
        # partition from holding up the others.
        while True:
            released = [await self._send_queue.get()]
            while not self._send_queue.empty():
                released.append(self._send_queue.get_nowait())
            # Items go to their writer a list at a time (one queue operation per writer per wake-up,
            # not one per record: at 10,000 records a second the per-record put and get showed).
            routed: dict[tuple[str, int], list[Item]] = {}
            for tp, generation, ready, alone in released:
                for offset, record, message in ready:
                    if record.topic not in self._partitions:
                        self._partitions[record.topic] = sorted(await self._producer.partitions_for(record.topic))
                    target = (record.topic, self._output_partition(record, message))
                    items = routed.get(target)
                    if items is None:
                        items = routed[target] = []
                    items.append((tp, offset, record, message, generation, alone))
            for target, items in routed.items():
                queue = self._writer_queues.get(target)
                if queue is None:
                    queue = self._writer_queues[target] = asyncio.Queue[list[Item]]()
                    writer = asyncio.create_task(
                        self._write(target[0], target[1], queue), name=f"kafka-write:{target[0]}/{target[1]}"
                    )
                    writer.add_done_callback(self._loop_ended)
                    self._writers.append(writer)
                queue.put_nowait(items)

    async def _write(self, topic: str, partition: int, queue: asyncio.Queue[list[Item]]) -> None:
        while True:
            items = await queue.get()
            while not queue.empty():
                items += queue.get_nowait()
            batch = self._producer.create_batch()
            part: list[Item] = []
            for item in items:
                record = item[2]
                headers = list(record.headers)
                if item[5] and part:  # a record sent again goes alone
                    await self._send_batch(batch, topic, partition, part)
                    batch, part = self._producer.create_batch(), []
                if batch.append(key=record.key, value=record.value, timestamp=None, headers=headers) is None:
                    await self._send_batch(batch, topic, partition, part)  # full: this record starts the next
                    batch, part = self._producer.create_batch(), []
                    batch.append(key=record.key, value=record.value, timestamp=None, headers=headers)
                part.append(item)
                if item[5]:
                    await self._send_batch(batch, topic, partition, part)
                    batch, part = self._producer.create_batch(), []
            if part:
                await self._send_batch(batch, topic, partition, part)

    async def _send_batch(self, batch: Any, topic: str, partition: int, part: list[Item]) -> None:
        delivery = await self._producer.send_batch(batch, topic, partition=partition)
        delivery.add_done_callback(partial(self._delivered, part))

    def _output_partition(self, record: OutRecord, message: SourceMessage) -> int:
        """Where a record goes. A request's own key decides, through the producer's partitioner, as
        `producer.send` would (one key's results stay together, in order). A request without a key
        gets the output partition with its source partition's number (modulo the output topic's
        count): one source partition's results stay in one output partition, in source order, and they
        spread as the requests did (hashing the few keys `p0`, `p1`, ... can put most of them on one
        partition: murmur2 puts p1, p2 and p3 of a 4-partition topic all on partition 2)."""
        partitions = self._partitions[record.topic]
        if message.key is None and record.topic == self._settings.kafka.output_topic:
            return partitions[message.partition % len(partitions)]
        if record.key is None:
            return int(self._partitioner(None, partitions, partitions))
        cache_key = (record.topic, record.key)
        partition = self._partition_of.get(cache_key)
        if partition is None:
            if len(self._partition_of) > 100_000:  # keys are the requests' own: bound what they can grow
                self._partition_of.clear()
            partition = self._partition_of[cache_key] = int(self._partitioner(record.key, partitions, partitions))
        return partition

    def _delivered(self, part: list[Item], delivery: asyncio.Future) -> None:
        # Records of a partition revoked since they were sent are another generation's: the partition's
        # ledger and counts were dropped with the revocation (and may have begun anew if it came back),
        # and the next owner repeats those messages from the committed offset. What is left belongs to
        # partitions whose ledger is the one these records were received into.
        part = [item for item in part if item[4] == self._generation[item[0]]]
        if not part:
            return
        by_partition: dict[TopicPartition, list[int]] = {}
        for tp, offset, _record, _message, _generation, _alone in part:
            by_partition.setdefault(tp, []).append(offset)
        for tp, offsets in by_partition.items():
            self._unacked[tp] -= len(offsets)
        self._progress.set()
        if delivery.cancelled():
            return  # the session is closing; the messages stay uncommitted and are redelivered
        error = delivery.exception()
        if isinstance(error, _REFUSED):
            self._refused(part, error)
            return
        if error is not None:
            names = ", ".join(f"{tp.topic}/{tp.partition}@{o[0]}..{o[-1]}" for tp, o in by_partition.items())
            self._fail(error, f"producing the results of {names} failed")
            return
        for tp, offsets in by_partition.items():
            self._ledgers[tp] = pipeline.ack_many(self._ledgers[tp], offsets)
        now = self._clock()
        output_topic = self._settings.kafka.output_topic
        produced = dead = 0
        latencies = []
        for _tp, _offset, record, message, _generation, _alone in part:
            if record.topic == output_topic:
                produced += 1
                latency = end_to_end_seconds(message.timestamp_ms, now)
                if latency is not None:
                    latencies.append(latency)
            else:
                dead += 1
        if latencies:
            self._metrics.observe_end_to_end(latencies)
        if produced:
            self._metrics.produced.inc(produced)
        if dead:
            self._metrics.dead_lettered.inc(dead)
        self._commit_wanted.set()

    def _refused(self, part: list[Item], error: BaseException) -> None:
        """The broker refused a batch for what is in it (_REFUSED). A batch of several is sent again a record
        at a time, to find which; a record refused alone is its message's failure: it is replaced
        (records.Outgoing: a result by a dead-letter record, a dead-letter record by a stub) and the
        replacement sent, or, with nothing left to send, the message counts as done (logged, counted) so
        the partition goes on.

        Order: the records sent again go after what the producer already had queued for that output
        partition (one batch at most), so only here can results of one source partition land out of
        order; what is committed still follows the acknowledgements (pipeline.commit_point)."""
        if len(part) > 1:
            log.warning(
                "the broker refused a batch of %d records (%r); sending them again one at a time", len(part), error
            )
            again = part
        else:
            tp, offset, record, message, generation, _alone = part[0]
            self._metrics.unwritable.inc()
            replacement = self._outgoing.replace(record, message, repr(error))
            where = f"{message.topic}/{message.partition}@{message.offset}"
            if replacement is None:
                log.error(
                    "the broker refused the record for %s (%r) and there is no smaller one to write: skipped",
                    where,
                    error,
                )
                self._ledgers[tp] = pipeline.ack_many(self._ledgers[tp], [offset])
                self._commit_wanted.set()
                return
            log.warning(
                "the broker refused the record for %s (%r); writing a smaller one to %s",
                where,
                error,
                replacement.topic,
            )
            again = [(tp, offset, replacement, message, generation, True)]
        for tp, offset, record, message, generation, _alone in again:
            self._unacked[tp] += 1
            self._send_queue.put_nowait((tp, generation, [(offset, record, message)], True))

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
            self._unacked.pop(tp, None)
            self._generation[tp] += 1  # what is still on its way for it is now stale (_delivered)
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


def _quietly(call: Callable[..., Any], *args: Any) -> None:
    """pause/seek on a partition that a rebalance took away meanwhile: nothing to do for it here."""
    try:
        call(*args)
    except IllegalStateError:
        pass


def _names(tps: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(tps))
