"""Per-partition bookkeeping for the Kafka connector: what may be produced next, and what may be committed.

Pure: values in, values out, no I/O, no clock. The connector's group session (`session.py`) owns one
`PartitionLedger` per assigned partition and replaces it after every step.

The choice this module encodes (issue 6, "ordering per partition is kept"):

- Messages of one partition may be *processed* concurrently (up to the connector's `max_in_flight`
  over all partitions), because scoring one message does not depend on another.
- Their results are *produced* strictly in offset order: a finished message waits until every earlier
  message of its partition has been handed to the producer (`take_sendable`). The producer keeps one
  request in flight per partition, so results reach the output topic in source order.
- The committed offset is `offset + 1` of the last message of the longest prefix whose results the
  broker has acknowledged (`commit_point`). A message whose result is not acknowledged is never
  committed, so a crash can repeat results (those after the last commit) but never lose one.

Offsets in a partition are increasing but not necessarily contiguous (compaction, transaction markers),
so the ledger keeps the offsets it was given instead of assuming `offset + 1` follows `offset`.

Messages fetched together move together: `receive_many`, `finish_many` and `ack_many` are the same steps
for a batch, each one pass over the partition's entries (the connector works on whole fetched batches).

Stages of one message:   WORKING --finish--> READY --take_sendable--> SENT --ack--> ACKED
                         WORKING --finish(produce=False)--> ACKED     (nothing to write, e.g. no dead-letter topic)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TypeVar

from sie.errors import SIEError

K = TypeVar("K")
T = TypeVar("T")


def pack(groups: Sequence[tuple[K, Sequence[T]]], limit: int) -> list[list[tuple[K, list[T]]]]:
    """Split what one fetch returned (records per partition) into batches of at most `limit` records
    in all, for one worker call each: partitions in the given order, each partition's records in order
    and contiguous, a partition split across batches only where the limit falls."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    batches: list[list[tuple[K, list[T]]]] = []
    current: list[tuple[K, list[T]]] = []
    room = limit
    for key, items in groups:
        start = 0
        while start < len(items):
            take = list(items[start : start + room])
            current.append((key, take))
            start += len(take)
            room -= len(take)
            if room == 0:
                batches.append(current)
                current, room = [], limit
    if current:
        batches.append(current)
    return batches


class Stage(str, Enum):
    WORKING = "working"  # fetched; being validated / scored
    READY = "ready"  # its output record is built, waiting for earlier offsets to be sent
    SENT = "sent"  # handed to the producer, not yet acknowledged
    ACKED = "acked"  # the broker acknowledged its output (or it had none): may be committed


class LedgerError(SIEError, ValueError):
    """A step that breaks the ledger's invariants: a bug in the caller, never a broker condition."""


@dataclass(frozen=True)
class PartitionLedger:
    """Messages of one partition from the last committed offset on, in fetch order.

    The acknowledged prefix is folded into `done_through` as soon as it forms, so `entries` holds only
    the messages still in work (at most the connector's in-flight window) and every step is cheap.

    Invariants: offsets strictly increase along `entries`; the first entry is never ACKED; an entry is
    SENT only if every entry before it is SENT or ACKED; committed <= done_through.
    """

    entries: tuple[tuple[int, Stage], ...] = ()
    done_through: int | None = None  # offset + 1 of the last message of the acknowledged prefix
    committed: int | None = None  # the next offset to read, as committed to the group (Kafka's convention)
    done_count: int = 0  # messages folded into done_through so far: the connector's "committed" counter

    @property
    def last_offset(self) -> int | None:
        if self.entries:
            return self.entries[-1][0]
        return None if self.done_through is None else self.done_through - 1

    def stage(self, offset: int) -> Stage | None:
        for entry_offset, stage in self.entries:
            if entry_offset == offset:
                return stage
        if self.done_through is not None and offset < self.done_through:
            return Stage.ACKED
        return None


def receive(ledger: PartitionLedger, offset: int) -> PartitionLedger:
    """A message was fetched and is now being worked on."""
    last = ledger.last_offset
    if last is not None and offset <= last:
        raise LedgerError(f"offset {offset} arrived after offset {last}: a partition's offsets must increase")
    if ledger.committed is not None and offset < ledger.committed:
        raise LedgerError(f"offset {offset} is below the committed offset {ledger.committed}")
    return replace(ledger, entries=ledger.entries + ((offset, Stage.WORKING),))


def receive_many(ledger: PartitionLedger, offsets: Sequence[int]) -> PartitionLedger:
    """Messages fetched together (in offset order) are now being worked on: `receive` for each, in one step."""
    if not offsets:
        return ledger
    last = ledger.last_offset
    previous = last
    for offset in offsets:
        if previous is not None and offset <= previous:
            raise LedgerError(f"offset {offset} arrived after offset {previous}: a partition's offsets must increase")
        previous = offset
    if ledger.committed is not None and offsets[0] < ledger.committed:
        raise LedgerError(f"offset {offsets[0]} is below the committed offset {ledger.committed}")
    return replace(ledger, entries=ledger.entries + tuple((offset, Stage.WORKING) for offset in offsets))


def finish(ledger: PartitionLedger, offset: int, produce: bool = True) -> PartitionLedger:
    """The message's output record is ready (`produce=True`), or it has none and counts as done."""
    return _move(ledger, offset, Stage.WORKING, Stage.READY if produce else Stage.ACKED)


def finish_many(ledger: PartitionLedger, produce: Mapping[int, bool]) -> PartitionLedger:
    """`finish` for several messages in one pass: offset -> whether it has an output record to produce."""
    return _move_many(ledger, {o: (Stage.WORKING, Stage.READY if p else Stage.ACKED) for o, p in produce.items()})


def take_sendable(ledger: PartitionLedger) -> tuple[PartitionLedger, tuple[int, ...]]:
    """The READY messages that may be sent now, in order, marked SENT.

    A message may be sent once every earlier message has been sent (or needed no output); the first
    WORKING message stops the scan, which is what keeps the output in source order.
    """
    sendable: list[int] = []
    entries = list(ledger.entries)
    for index, (offset, stage) in enumerate(entries):
        if stage is Stage.WORKING:
            break
        if stage is Stage.READY:
            entries[index] = (offset, Stage.SENT)
            sendable.append(offset)
    if not sendable:
        return ledger, ()
    return replace(ledger, entries=tuple(entries)), tuple(sendable)


def ack(ledger: PartitionLedger, offset: int) -> PartitionLedger:
    """The broker acknowledged the message's output record."""
    return _move(ledger, offset, Stage.SENT, Stage.ACKED)


def ack_many(ledger: PartitionLedger, offsets: Collection[int]) -> PartitionLedger:
    """`ack` for the messages of one produced batch, in one pass."""
    return _move_many(ledger, {offset: (Stage.SENT, Stage.ACKED) for offset in offsets})


def commit_point(ledger: PartitionLedger) -> int | None:
    """The offset to commit now (last acknowledged offset of the prefix + 1), or None if nothing new."""
    point = ledger.done_through
    if point is None or (ledger.committed is not None and point <= ledger.committed):
        return None
    return point


def committed(ledger: PartitionLedger, next_offset: int) -> PartitionLedger:
    """The group accepted `next_offset` as committed."""
    if ledger.committed is not None and next_offset < ledger.committed:
        raise LedgerError(f"commit went backwards: {next_offset} after {ledger.committed}")
    if ledger.done_through is None or next_offset > ledger.done_through:
        raise LedgerError(
            f"offset {next_offset} committed but only offsets below {ledger.done_through} are acknowledged: "
            "a result could be lost"
        )
    return replace(ledger, committed=next_offset)


def unfinished(ledger: PartitionLedger) -> int:
    """Messages not yet acknowledged: the ones a drain has to wait for."""
    return len(ledger.entries)


def settled(ledger: PartitionLedger) -> bool:
    """Everything received is acknowledged and committed: the partition may be handed over."""
    return not ledger.entries and ledger.committed == ledger.done_through


def lag(highwater: int | None, position: int | None) -> int | None:
    """Messages in the partition the group has not read yet; None until both ends are known."""
    if highwater is None or position is None:
        return None
    return max(0, highwater - position)


def _move(ledger: PartitionLedger, offset: int, source: Stage, target: Stage) -> PartitionLedger:
    entries = list(ledger.entries)
    for index, (entry_offset, stage) in enumerate(entries):
        if entry_offset == offset:
            if stage is not source:
                raise LedgerError(f"offset {offset} is {stage.value}, expected {source.value}")
            entries[index] = (offset, target)
            return _fold_acked_prefix(replace(ledger, entries=tuple(entries)))
    raise LedgerError(f"offset {offset} is not in work (in work: {[o for o, _ in entries]})")


def _move_many(ledger: PartitionLedger, moves: Mapping[int, tuple[Stage, Stage]]) -> PartitionLedger:
    # One pass over the entries for the whole set: a partition with hundreds of messages in work would
    # otherwise pay a pass (and a tuple copy) per message.
    entries = list(ledger.entries)
    found = 0
    for index, (entry_offset, stage) in enumerate(entries):
        move = moves.get(entry_offset)
        if move is None:
            continue
        source, target = move
        if stage is not source:
            raise LedgerError(f"offset {entry_offset} is {stage.value}, expected {source.value}")
        entries[index] = (entry_offset, target)
        found += 1
    if found != len(moves):
        in_work = {offset for offset, _ in entries}
        missing = sorted(offset for offset in moves if offset not in in_work)
        raise LedgerError(f"offsets {missing[:10]} are not in work")
    return _fold_acked_prefix(replace(ledger, entries=tuple(entries)))


def _fold_acked_prefix(ledger: PartitionLedger) -> PartitionLedger:
    done = 0
    for _offset, stage in ledger.entries:
        if stage is not Stage.ACKED:
            break
        done += 1
    if not done:
        return ledger
    return replace(
        ledger,
        entries=ledger.entries[done:],
        done_through=ledger.entries[done - 1][0] + 1,
        done_count=ledger.done_count + done,
    )
