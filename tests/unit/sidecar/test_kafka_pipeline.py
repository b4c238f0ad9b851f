"""The per-partition ledger: results leave in offset order, and only the acknowledged prefix is committed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.kafka import pipeline
from sidecar.kafka.pipeline import (
    LedgerError,
    PartitionLedger,
    Stage,
    ack,
    ack_many,
    commit_point,
    committed,
    finish,
    finish_many,
    lag,
    receive,
    receive_many,
    settled,
    take_sendable,
    unfinished,
)


def ledger_with(*offsets: int) -> PartitionLedger:
    ledger = PartitionLedger()
    for offset in offsets:
        ledger = receive(ledger, offset)
    return ledger


def run(steps: list[tuple[str, int]], offsets=(10, 11, 12, 13)) -> tuple[PartitionLedger, list[int]]:
    """Apply steps ("finish" / "skip" / "ack"), releasing sendable offsets after each; returns what was sent."""
    ledger = ledger_with(*offsets)
    sent: list[int] = []
    for step, offset in steps:
        if step == "finish":
            ledger = finish(ledger, offset)
        elif step == "skip":
            ledger = finish(ledger, offset, produce=False)
        elif step == "ack":
            ledger = ack(ledger, offset)
        ledger, released = take_sendable(ledger)
        sent.extend(released)
    return ledger, sent


@pytest.mark.parametrize(
    "steps, sent, point",
    [
        # In order: each result is sent as it finishes, and commits follow the acks.
        ([("finish", 10), ("ack", 10)], [10], 11),
        # A later message finishing first waits for the earlier one: output keeps source order.
        ([("finish", 12), ("finish", 11)], [], None),
        ([("finish", 12), ("finish", 10)], [10], None),
        ([("finish", 11), ("finish", 10)], [10, 11], None),
        # Acks out of order: the commit stops at the first unacknowledged offset.
        ([("finish", 10), ("finish", 11), ("ack", 11)], [10, 11], None),
        ([("finish", 10), ("finish", 11), ("ack", 11), ("ack", 10)], [10, 11], 12),
        # A message with nothing to write (no dead-letter topic) counts as done in its place.
        ([("skip", 10)], [], 11),
        ([("finish", 10), ("skip", 11), ("finish", 12)], [10, 12], None),
        ([("finish", 10), ("skip", 11), ("finish", 12), ("ack", 12)], [10, 12], None),
        ([("finish", 10), ("skip", 11), ("finish", 12), ("ack", 12), ("ack", 10)], [10, 12], 13),
        # A skipped message behind a working one releases nothing and commits nothing.
        ([("skip", 11)], [], None),
    ],
)
def test_sending_and_committing_follow_offset_order(steps, sent, point):
    ledger, released = run(steps)
    assert released == sent
    assert commit_point(ledger) == point


def test_offsets_with_gaps_commit_the_offset_after_the_last_done_message():
    ledger, _ = run([("finish", 3), ("finish", 7), ("ack", 3), ("ack", 7)], offsets=(3, 7, 20))
    assert commit_point(ledger) == 8  # not 4: the ledger follows the offsets it was given
    ledger = committed(ledger, 8)
    assert commit_point(ledger) is None
    assert unfinished(ledger) == 1 and not settled(ledger)


def test_a_commit_is_offered_once_and_settles_the_partition():
    ledger, _ = run([("finish", 10), ("ack", 10)], offsets=(10,))
    assert ledger.done_count == 1 and not settled(ledger)
    ledger = committed(ledger, commit_point(ledger))
    assert commit_point(ledger) is None and settled(ledger) and ledger.committed == 11


def test_the_ledger_only_keeps_messages_still_in_work():
    ledger = ledger_with(*range(100))
    for offset in range(100):
        ledger = finish(ledger, offset)
        ledger, _ = take_sendable(ledger)
        ledger = ack(ledger, offset)
    assert ledger.entries == () and ledger.done_through == 100 and ledger.done_count == 100
    assert ledger.stage(5) is Stage.ACKED and ledger.stage(100) is None


@pytest.mark.parametrize(
    "bad_step, message",
    [
        (lambda led: receive(led, 11), "must increase"),
        (lambda led: receive(led, 9), "must increase"),
        (lambda led: finish(led, 99), "not in work"),
        (lambda led: ack(led, 10), "expected sent"),
        (lambda led: committed(led, 11), "could be lost"),
        (lambda led: finish(finish(led, 10), 10), "expected working"),
    ],
)
def test_steps_that_would_break_the_invariants_are_refused(bad_step, message):
    with pytest.raises(LedgerError, match=message):
        bad_step(ledger_with(10, 11))


def test_commits_never_go_backwards_and_receive_refuses_committed_offsets():
    ledger, _ = run([("finish", 10), ("ack", 10), ("finish", 11), ("ack", 11)], offsets=(10, 11))
    ledger = committed(ledger, 12)
    with pytest.raises(LedgerError, match="backwards"):
        committed(ledger, 11)
    with pytest.raises(LedgerError, match="must increase"):
        receive(ledger, 11)


@pytest.mark.parametrize(
    "highwater, position, expected",
    [(None, 5, None), (10, None, None), (10, 4, 6), (10, 10, 0), (3, 5, 0)],
)
def test_lag(highwater, position, expected):
    assert lag(highwater, position) == expected


# -- batch steps: the same ledger as the single steps, in one pass ---------------------------------------


@given(
    gaps=st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=30),
    produce=st.lists(st.booleans(), min_size=30, max_size=30),
    finish_order=st.randoms(use_true_random=False),
    batch_cut=st.integers(min_value=1, max_value=8),
)
def test_batch_steps_equal_the_single_steps(gaps, produce, finish_order, batch_cut):
    offsets, at = [], 100
    for gap in gaps:
        at += gap
        offsets.append(at)
    single = PartitionLedger()
    for offset in offsets:
        single = receive(single, offset)
    batched = receive_many(PartitionLedger(), offsets)
    assert batched == single
    # Finish in a random order, in groups of `batch_cut`; release and acknowledge what may go after each.
    order = list(offsets)
    finish_order.shuffle(order)
    for start in range(0, len(order), batch_cut):
        group = order[start : start + batch_cut]
        for offset in group:
            single = finish(single, offset, produce=produce[offsets.index(offset)])
        batched = finish_many(batched, {o: produce[offsets.index(o)] for o in group})
        assert batched == single
        single, sent_single = take_sendable(single)
        batched, sent_batched = take_sendable(batched)
        assert sent_single == sent_batched
        for offset in sent_single:
            single = ack(single, offset)
        batched = ack_many(batched, sent_batched)
        assert batched == single
    assert not batched.entries and commit_point(batched) == offsets[-1] + 1


@pytest.mark.parametrize(
    "step, message",
    [
        (lambda ledger: receive_many(ledger, [13, 12]), "must increase"),
        (lambda ledger: receive_many(ledger, [11]), "must increase"),
        (lambda ledger: finish_many(ledger, {10: True, 99: True}), r"\[99\] are not in work"),
        (lambda ledger: ack_many(ledger, [10]), "is working, expected sent"),
    ],
)
def test_batch_steps_refuse_what_single_steps_refuse(step, message):
    with pytest.raises(LedgerError, match=message):
        step(ledger_with(10, 11))


@given(
    st.lists(st.tuples(st.integers(0, 7), st.integers(0, 40)), max_size=8),
    st.integers(1, 50),
)
def test_pack_keeps_every_record_once_in_order_within_the_limit(sizes, limit):
    groups = [(key, [(key, i) for i in range(n)]) for key, n in sizes]
    batches = pipeline.pack(groups, limit)
    assert all(1 <= sum(len(items) for _key, items in batch) <= limit for batch in batches)
    assert all(items for batch in batches for _key, items in batch), "no empty piece"
    flat = [item for batch in batches for _key, items in batch for item in items]
    assert flat == [item for _key, items in groups for item in items], "all once, in the given order"
    # A partition is split only where a batch is full: every batch but the last is full.
    assert all(sum(len(items) for _key, items in batch) == limit for batch in batches[:-1])


def test_pack_puts_several_partitions_in_one_batch_and_refuses_a_zero_limit():
    assert pipeline.pack([("a", [1, 2]), ("b", [3])], 256) == [[("a", [1, 2]), ("b", [3])]]
    assert pipeline.pack([("a", [1, 2, 3])], 2) == [[("a", [1, 2])], [("a", [3])]]
    with pytest.raises(ValueError):
        pipeline.pack([("a", [1])], 0)


# -- the ledger against a plain model: a list of [offset, stage] walked in full at every step ------------


class Model:
    """What the ledger means, written the slow, obvious way."""

    def __init__(self) -> None:
        self.entries: list[list] = []
        self.done_through: int | None = None
        self.done_count = 0

    def move(self, offsets, source: Stage, target_of) -> None:
        for entry in self.entries:
            if entry[0] in offsets:
                assert entry[1] is source
                entry[1] = target_of(entry[0])
        while self.entries and self.entries[0][1] is Stage.ACKED:
            offset, _ = self.entries.pop(0)
            self.done_through, self.done_count = offset + 1, self.done_count + 1

    def take_sendable(self) -> tuple[int, ...]:
        sent = []
        for entry in self.entries:
            if entry[1] is Stage.WORKING:
                break
            if entry[1] is Stage.READY:
                entry[1] = Stage.SENT
                sent.append(entry[0])
        return tuple(sent)


@given(st.data())
def test_the_ledger_moves_as_the_plain_model_does(data):
    ledger, model, next_offset = PartitionLedger(), Model(), 0
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        step = data.draw(st.sampled_from(["receive", "finish", "send", "ack"]))
        in_stage = {s: [o for o, st_ in model.entries if st_ is s] for s in Stage}
        if step == "receive":
            fresh = []
            for _gap in range(data.draw(st.integers(1, 6))):
                next_offset += data.draw(st.integers(1, 3))
                fresh.append(next_offset)
            ledger = receive_many(ledger, fresh)
            model.entries += [[o, Stage.WORKING] for o in fresh]
        elif step == "finish" and in_stage[Stage.WORKING]:
            # A run of the ledger (as the connector finishes a fetched batch), or any subset of it.
            working = in_stage[Stage.WORKING]
            if data.draw(st.booleans(), label="a run"):
                start = data.draw(st.integers(0, len(working) - 1))
                chosen = working[start : start + data.draw(st.integers(1, len(working) - start))]
            else:
                chosen = data.draw(st.lists(st.sampled_from(working), min_size=1, unique=True))
            produce = {o: data.draw(st.booleans()) for o in chosen}
            ledger = finish_many(ledger, produce)
            model.move(
                set(chosen), Stage.WORKING, lambda o, produce=produce: Stage.READY if produce[o] else Stage.ACKED
            )
        elif step == "send":
            ledger, sent = take_sendable(ledger)
            assert sent == model.take_sendable()
        elif step == "ack" and in_stage[Stage.SENT]:
            chosen = data.draw(st.lists(st.sampled_from(in_stage[Stage.SENT]), min_size=1, unique=True))
            ledger = ack_many(ledger, chosen)
            model.move(set(chosen), Stage.SENT, lambda o: Stage.ACKED)
        assert ledger.entries == tuple((o, s) for o, s in model.entries)
        assert (ledger.done_through, ledger.done_count) == (model.done_through, model.done_count)
        assert unfinished(ledger) == len(model.entries)
        for offset, stage in model.entries:
            assert ledger.stage(offset) is stage
