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
for a batch (the connector works on whole fetched batches). A batch's messages are one run of the
ledger, so a step finds it by bisection and changes it as a slice of the stages string.

Stages of one message:   WORKING --finish--> READY --take_sendable--> SENT --ack--> ACKED
                         WORKING --finish(produce=False)--> ACKED     (nothing to write, e.g. no dead-letter topic)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from enum import Enum
from operator import lt
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


# The ledger keeps a stage as one letter, all of a partition's in one string beside its offsets: a step
# then finds, checks and changes a batch's run of stages with string operations instead of a Python loop
# over every message in work (at 10,000 messages/s the loops were ~5 us a message of the connector's CPU).
_CODE = {Stage.WORKING: "W", Stage.READY: "R", Stage.SENT: "S", Stage.ACKED: "A"}
_STAGE = {code: stage for stage, code in _CODE.items()}


class LedgerError(SIEError, ValueError):
    """A step that breaks the ledger's invariants: a bug in the caller, never a broker condition."""


@dataclass(frozen=True)
class PartitionLedger:
    """Messages of one partition from the last committed offset on, in fetch order.

    The acknowledged prefix is folded into `done_through` as soon as it forms, so `offsets` holds only
    the messages still in work (at most the connector's in-flight window) and every step is cheap.
    `stages` has one letter per offset (W, R, S, A: see Stage); `entries` pairs them up.

    Invariants: offsets strictly increase; the first stage is never ACKED; a message is SENT only if
    every one before it is SENT or ACKED; committed <= done_through.
    """

    offsets: tuple[int, ...] = ()
    stages: str = ""
    done_through: int | None = None  # offset + 1 of the last message of the acknowledged prefix
    committed: int | None = None  # the next offset to read, as committed to the group (Kafka's convention)
    done_count: int = 0  # messages folded into done_through so far: the connector's "committed" counter

    @property
    def entries(self) -> tuple[tuple[int, Stage], ...]:
        """(offset, stage) of each message in work, in offset order."""
        return tuple((offset, _STAGE[code]) for offset, code in zip(self.offsets, self.stages))

    @property
    def last_offset(self) -> int | None:
        if self.offsets:
            return self.offsets[-1]
        return None if self.done_through is None else self.done_through - 1

    def stage(self, offset: int) -> Stage | None:
        index = bisect_left(self.offsets, offset)
        if index < len(self.offsets) and self.offsets[index] == offset:
            return _STAGE[self.stages[index]]
        if self.done_through is not None and offset < self.done_through:
            return Stage.ACKED
        return None


def receive(ledger: PartitionLedger, offset: int) -> PartitionLedger:
    """A message was fetched and is now being worked on."""
    return receive_many(ledger, (offset,))


def receive_many(ledger: PartitionLedger, offsets: Sequence[int]) -> PartitionLedger:
    """Messages fetched together (in offset order) are now being worked on: `receive` for each, in one step."""
    if not offsets:
        return ledger
    last = ledger.last_offset
    if (last is not None and offsets[0] <= last) or not all(map(lt, offsets, offsets[1:])):
        previous = last
        for offset in offsets:
            if previous is not None and offset <= previous:
                raise LedgerError(
                    f"offset {offset} arrived after offset {previous}: a partition's offsets must increase"
                )
            previous = offset
    if ledger.committed is not None and offsets[0] < ledger.committed:
        raise LedgerError(f"offset {offsets[0]} is below the committed offset {ledger.committed}")
    return replace(ledger, offsets=ledger.offsets + tuple(offsets), stages=ledger.stages + "W" * len(offsets))


def finish(ledger: PartitionLedger, offset: int, produce: bool = True) -> PartitionLedger:
    """The message's output record is ready (`produce=True`), or it has none and counts as done."""
    return finish_many(ledger, {offset: produce})


def finish_many(ledger: PartitionLedger, produce: Mapping[int, bool]) -> PartitionLedger:
    """`finish` for several messages in one step: offset -> whether it has an output record to produce."""
    return _move_many(
        ledger, produce.keys(), Stage.WORKING, lambda run: "".join("R" if produce[o] else "A" for o in run)
    )


def take_sendable(ledger: PartitionLedger) -> tuple[PartitionLedger, tuple[int, ...]]:
    """The READY messages that may be sent now, in order, marked SENT.

    A message may be sent once every earlier message has been sent (or needed no output); the first
    WORKING message stops the scan, which is what keeps the output in source order.
    """
    stages = ledger.stages
    end = stages.find("W")
    if end < 0:
        end = len(stages)
    head = stages[:end]
    first = head.find("R")
    if first < 0:
        return ledger, ()
    sendable = tuple(ledger.offsets[i] for i in range(first, end) if head[i] == "R")
    return replace(ledger, stages=head.replace("R", "S") + stages[end:]), sendable


def ack(ledger: PartitionLedger, offset: int) -> PartitionLedger:
    """The broker acknowledged the message's output record."""
    return ack_many(ledger, (offset,))


def ack_many(ledger: PartitionLedger, offsets: Collection[int]) -> PartitionLedger:
    """`ack` for the messages of one produced batch, in one step."""
    return _move_many(ledger, offsets, Stage.SENT, lambda run: "A" * len(run))


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
    return len(ledger.offsets)


def settled(ledger: PartitionLedger) -> bool:
    """Everything received is acknowledged and committed: the partition may be handed over."""
    return not ledger.offsets and ledger.committed == ledger.done_through


def lag(highwater: int | None, position: int | None) -> int | None:
    """Messages in the partition the group has not read yet; None until both ends are known."""
    if highwater is None or position is None:
        return None
    return max(0, highwater - position)


def _move_many(
    ledger: PartitionLedger, moved: Collection[int], source: Stage, targets: Callable[[Sequence[int]], str]
) -> PartitionLedger:
    """Move the messages at `moved` (all in stage `source`) to the stages `targets(run)` gives, one letter
    per offset of `run` (the moved offsets in ledger order). A batch's offsets are usually one run of
    the ledger (fetched together): found by bisection and checked and replaced as slices. Otherwise one
    pass over the ledger."""
    if not moved:
        return ledger
    offsets, stages, code = ledger.offsets, ledger.stages, _CODE[source]
    wanted: Set[int] = moved if isinstance(moved, Set) else frozenset(moved)
    count = len(wanted)
    start = bisect_left(offsets, min(wanted))
    run = offsets[start : start + count]
    if len(run) == count and all(map(wanted.__contains__, run)):
        indexes: Sequence[int] = range(start, start + count)
    else:
        indexes = [index for index, offset in enumerate(offsets) if offset in wanted]
        if len(indexes) != count:
            in_work = set(offsets)
            missing = sorted(offset for offset in wanted if offset not in in_work)
            raise LedgerError(f"offsets {missing[:10]} are not in work")
        run = tuple(offsets[index] for index in indexes)
    for index in indexes:
        if stages[index] != code:
            raise LedgerError(f"offset {offsets[index]} is {_STAGE[stages[index]].value}, expected {source.value}")
    new = targets(run)
    if isinstance(indexes, range):
        stages = stages[:start] + new + stages[start + count :]
    else:
        letters = list(stages)
        for index, letter in zip(indexes, new):
            letters[index] = letter
        stages = "".join(letters)
    return _fold_acked_prefix(replace(ledger, stages=stages))


def _fold_acked_prefix(ledger: PartitionLedger) -> PartitionLedger:
    done = len(ledger.stages) - len(ledger.stages.lstrip("A"))
    if not done:
        return ledger
    return replace(
        ledger,
        offsets=ledger.offsets[done:],
        stages=ledger.stages[done:],
        done_through=ledger.offsets[done - 1] + 1,
        done_count=ledger.done_count + done,
    )
