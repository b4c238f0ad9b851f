"""The send path of a group session (session.py): the results it releases go to the producer in source
order, and the broker's acknowledgements advance the partitions' ledgers, which the session commits.

    release (a partition's next results, in offset order) ──▶ send queue ──▶ send loop (everything
    released since its last pass, routed to its output partition) ──▶ one writer per output partition
    (producer batches, in order) ──ack callback per producer batch──▶ _delivered: ack_many, metrics,
    commit wanted

`Sender` is the session's and lives and dies with it. It shares the session's ledgers (acknowledgements
advance them) and keeps, per source partition, how many of its records are on their way (the session
waits for none before it hands a partition over) and a generation that each revocation advances.

Invariants:
- Results of one partition are handed to the producer in offset order, by one send loop; the producer
  keeps one batch in flight per output partition, so they are written in that order.
- An acknowledgement advances a ledger only for records of the partition's current generation: records
  sent before a revocation are the next owner's to repeat, whatever this session holds now.
- A record over `max_record_bytes` is replaced before it is sent (`too_large`), and a record the broker
  refuses for good (too large, invalid) after (`_refused`): a result by a dead-letter record, a
  dead-letter record by a stub (records.Outgoing). Only a batch of several refused whole is sent again
  record by record, after what the producer already queued for that output partition: the one case
  where results can land out of source order (the commit still follows the acknowledgements).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from aiokafka import TopicPartition
from aiokafka.errors import CorruptRecordException, MessageSizeTooLargeError, RecordListTooLargeError, UnknownError

from sidecar.kafka import pipeline
from sidecar.kafka.records import Outgoing, OutRecord, SourceMessage, encoded_size, end_to_end_seconds

if TYPE_CHECKING:
    from sidecar.kafka.metrics import KafkaMetrics

log = logging.getLogger("sie.sidecar.kafka")

# A record on its way to the producer: its source partition and offset, the record, the request, the
# partition's generation in this session (each revocation starts a new one; see _delivered), and whether
# it goes in a producer batch of its own (sent again after the broker refused a batch; see _refused).
Item = tuple[TopicPartition, int, OutRecord, SourceMessage, int, bool]
# What the session releases: a partition's next results in offset order, as (offset, record, request).
Ready = list[tuple[int, OutRecord, SourceMessage]]

# Errors with which a broker refuses a produced batch for what is in it, for good: the same bytes would
# be refused again, so they are that batch's messages' failure, not the session's (_refused). aiokafka
# 0.14 has no class for INVALID_RECORD (87): it arrives as UnknownError, like an unknown server error,
# and both are taken as a refusal (a batch of several is first sent again a record at a time).
_REFUSED = (MessageSizeTooLargeError, RecordListTooLargeError, CorruptRecordException, UnknownError)


class Sender:
    """Writes what its session releases, in order, and reports the broker's answers to the session:
    `ledgers` (the session's own, advanced here), `progress` (set when records stop being on their way),
    `commit_wanted` (set when an acknowledgement moved a ledger), `fail` (an error that is the session's,
    not its messages'), `watch` (the done callback of each writer task)."""

    def __init__(
        self,
        producer: Any,
        outgoing: Outgoing,
        partitioner: Callable[..., Any],
        ledgers: dict[TopicPartition, pipeline.PartitionLedger],
        metrics: KafkaMetrics,
        clock: Callable[[], float],
        *,
        progress: asyncio.Event,
        commit_wanted: asyncio.Event,
        fail: Callable[[BaseException, str], None],
        watch: Callable[[asyncio.Task], None],
    ):
        self._producer = producer
        self._outgoing = outgoing
        self._output_topic = outgoing.output_topic
        self._partitioner = partitioner
        self._ledgers = ledgers
        self._metrics = metrics
        self._clock = clock
        self._progress = progress
        self._commit_wanted = commit_wanted
        self._fail = fail
        self._watch = watch
        self._send_queue: asyncio.Queue[tuple[TopicPartition, int, Ready, bool]] = asyncio.Queue()
        self._unacked: dict[TopicPartition, int] = defaultdict(int)
        self._generation: dict[TopicPartition, int] = defaultdict(int)
        self._partitions: dict[str, list[int]] = {}  # output topic -> its partitions, read once per session
        self._partition_of: dict[tuple[str, bytes], int] = {}
        self._writer_queues: dict[tuple[str, int], asyncio.Queue[list[Item]]] = {}
        self.writers: list[asyncio.Task] = []  # one per output partition written to, made on first use

    # -- what the session calls -----------------------------------------------------------------

    def release(self, tp: TopicPartition, ready: Ready) -> None:
        """Send `ready`, the next results of `tp` in offset order."""
        self._unacked[tp] += len(ready)
        self._send_queue.put_nowait((tp, self._generation[tp], ready, False))

    def unacked(self, tp: TopicPartition) -> int:
        """How many records of `tp` are released and not yet answered by the broker."""
        return self._unacked.get(tp, 0)

    def forget(self, tp: TopicPartition) -> None:
        """`tp` was handed over: what is still on its way for it is now stale (_delivered)."""
        self._unacked.pop(tp, None)
        self._generation[tp] += 1

    def too_large(self, record: OutRecord, message: SourceMessage) -> OutRecord | None:
        """What to write in place of `record`, which is over max_record_bytes (records.Outgoing.fit)."""
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

    async def run(self) -> None:
        """The send loop."""
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
                    writer.add_done_callback(self._watch)
                    self.writers.append(writer)
                queue.put_nowait(items)

    # -- the producer -------------------------------------------------------------------------------

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
        if message.key is None and record.topic == self._output_topic:
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

    # -- the broker's answers -----------------------------------------------------------------------

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
        output_topic = self._output_topic
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
