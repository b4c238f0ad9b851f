"""The scorer's micro-batcher: a lone request runs at once, concurrent ones share one engine call,
batches respect the limit and whole requests, and one bad request fails alone."""

from __future__ import annotations

import asyncio

import pytest

from node_host.backends.protocol import BadRequest
from node_host.backends.runtime.batching import BatchLimits, MicroBatcher, take_batch


class Engine:
    """Answers each row with its `x` doubled; refuses a row whose x is negative (naming its index, as
    the real engines do); `gate` holds a call until the test opens it."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gate: asyncio.Event | None = None

    async def infer(self, rows):
        self.calls.append([row["x"] for row in rows])
        if self.gate is not None:
            await self.gate.wait()
        for index, row in enumerate(rows):
            if row["x"] < 0:
                raise BadRequest(f"instances[{index}].x: must not be negative")
        return [{"y": 2 * row["x"]} for row in rows]


async def passes(n: int = 5) -> None:
    """Let the event loop run a few passes (a batch forms and starts within three)."""
    for _ in range(n):
        await asyncio.sleep(0)


def rows(*xs: int) -> list[dict]:
    return [{"x": x} for x in xs]


@pytest.mark.parametrize(
    "sizes, limit, expected",
    [
        ([1, 1, 1], 2, 2),  # whole requests up to the limit
        ([5], 2, 1),  # a request larger than the limit runs alone
        ([1, 5], 4, 1),  # the next one would pass the limit: it waits for the next batch
        ([2, 2, 2], 64, 3),
        ([], 4, 0),
    ],
)
def test_take_batch(sizes, limit, expected):
    assert take_batch(sizes, limit) == expected


async def test_a_lone_request_runs_at_once_and_alone():
    engine = Engine()
    seen: list[tuple[int, int]] = []
    batcher = MicroBatcher(engine.infer, BatchLimits(64, 50.0), observe=lambda r, n: seen.append((r, n)))
    # Even with a long max_delay a lone request does not wait for it: nothing else is arriving.
    out = await asyncio.wait_for(batcher.submit(rows(3)), 0.02)
    assert out == [{"y": 6}] and engine.calls == [[3]] and seen == [(1, 1)]


async def test_requests_that_arrive_together_share_one_engine_call_in_order():
    engine = Engine()
    seen: list[tuple[int, int]] = []
    batcher = MicroBatcher(engine.infer, BatchLimits(64, 1.0), observe=lambda r, n: seen.append((r, n)))
    outs = await asyncio.gather(*(batcher.submit(rows(i)) for i in range(10)))
    assert outs == [[{"y": 2 * i}] for i in range(10)]
    assert engine.calls == [list(range(10))] and seen == [(10, 10)]


async def test_requests_arriving_during_a_batch_form_the_next_one_up_to_the_limit():
    engine = Engine()
    engine.gate = asyncio.Event()
    batcher = MicroBatcher(engine.infer, BatchLimits(4, 0.0))
    first = asyncio.create_task(batcher.submit(rows(0)))
    await passes()
    assert engine.calls == [[0]]  # running, held by the gate
    later = [asyncio.create_task(batcher.submit(rows(i, i))) for i in range(1, 4)]  # 2 rows each
    await passes()
    assert batcher.queued == 3
    engine.gate.set()
    await asyncio.gather(first, *later)
    # 2 + 2 rows fill the limit of 4; the third request (2 rows) runs in a batch of its own.
    assert engine.calls == [[0], [1, 1, 2, 2], [3, 3]]
    assert [t.result() for t in later] == [[{"y": 2 * i}, {"y": 2 * i}] for i in range(1, 4)]


async def test_a_bad_row_fails_only_its_own_request_with_its_own_index():
    engine = Engine()
    batcher = MicroBatcher(engine.infer, BatchLimits(64, 1.0))
    results = await asyncio.gather(
        batcher.submit(rows(1)), batcher.submit(rows(2, -2)), batcher.submit(rows(3)), return_exceptions=True
    )
    assert results[0] == [{"y": 2}] and results[2] == [{"y": 6}]
    assert isinstance(results[1], BadRequest) and "instances[1].x" in str(results[1])
    assert engine.calls[0] == [1, 2, -2, 3]  # tried together first, then each alone


async def test_a_caller_that_went_away_before_its_batch_costs_nothing_and_others_still_run():
    engine = Engine()
    engine.gate = asyncio.Event()
    batcher = MicroBatcher(engine.infer, BatchLimits(64, 0.0))
    first = asyncio.create_task(batcher.submit(rows(0)))
    await passes()
    gone = asyncio.create_task(batcher.submit(rows(9)))
    kept = asyncio.create_task(batcher.submit(rows(1)))
    await passes()
    gone.cancel()
    engine.gate.set()
    assert await first == [{"y": 0}] and await kept == [{"y": 2}]
    assert engine.calls == [[0], [1]]


async def test_batch_size_one_turns_batching_off():
    engine = Engine()
    batcher = MicroBatcher(engine.infer, BatchLimits(1, 5.0))
    await asyncio.gather(*(batcher.submit(rows(i)) for i in range(3)))
    assert engine.calls == [[0], [1], [2]]


async def test_an_engine_that_answers_the_wrong_number_of_rows_fails_the_batch_loudly():
    async def short(batch):
        return [{"y": 0}]

    batcher = MicroBatcher(short, BatchLimits(64, 1.0))
    results = await asyncio.gather(batcher.submit(rows(1)), batcher.submit(rows(2)), return_exceptions=True)
    # 1 output for 2 rows is the engine's bug: every request of the batch fails with it, none gets
    # another's answer.
    assert all(isinstance(r, RuntimeError) and "1 outputs for 2 rows" in str(r) for r in results)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_batch_size"):
        MicroBatcher(Engine().infer, BatchLimits(0, 1.0))
