"""The sim engine's timing model (SimCore, pure) and its asyncio shell (SimEngine) on a fake clock."""

from __future__ import annotations

import asyncio
import random

import pytest

from node_host.backends.sim.core import SimCore, SimParams, SimResult
from node_host.backends.sim.engine import SimEngine, SimEngineStopped
from sie.errors import SpecError

# Round numbers so expected times can be written by hand: a forward pass costs 10 ms, each prompt token
# 0.1 ms of prefill, each running request 1 ms of decode.
P = SimParams(
    prefill_ms_per_token=0.1,
    decode_base_ms=10.0,
    decode_ms_per_request=1.0,
    max_running_requests=8,
    kv_tokens=10_000,
    admit_reserve_ratio=0.0,
)


def _run(core: SimCore, arrivals: list[tuple[float, int, int]], until: float = 1e9) -> dict[int, SimResult]:
    """Feed (time, prompt_tokens, max_new_tokens) arrivals in order; run until idle; results by rid."""
    results: dict[int, SimResult] = {}
    for at, prompt, new in arrivals:
        results.update({r.rid: r for r in core.advance(at)})
        core.submit(prompt, new, at)
    while core.busy_until is not None and core.busy_until <= until:
        results.update({r.rid: r for r in core.advance(core.busy_until)})
    results.update({r.rid: r for r in core.advance(until)})
    return results


@pytest.mark.parametrize(
    "case, params, arrivals, expected",
    [
        # prefill 10 + 100*0.1 = 20 ms gives the first token; 3 decode steps of 10 + 1*1 = 11 ms each.
        ("one request", P, [(0.0, 100, 4)], {0: (0.020, 0.053, 0.0)}),
        # One token only: done when the prefill ends.
        ("single token", P, [(0.0, 100, 1)], {0: (0.020, 0.020, 0.0)}),
        # Slowdown multiplies every cost.
        ("slowdown 3x", SimParams(**{**P.to_json(), "slowdown": 3.0}), [(0.0, 100, 4)], {0: (0.060, 0.159, 0.0)}),
        # The second arrives during the first's prefill: it waits for that iteration, then is prefilled
        # alone (20 ms, prefill has priority; the first does not decode meanwhile), then both decode
        # together at 10 + 2*1 = 12 ms per step and finish at the same step, at 64 ms.
        (
            "batching",
            P,
            [(0.0, 100, 3), (0.005, 100, 3)],
            {0: (0.020, 0.064, 0.0), 1: (0.035, 0.059, 0.015)},
        ),
    ],
)
def test_timing(case, params, arrivals, expected):
    results = _run(SimCore(params), arrivals)
    for rid, (ttft, e2e, queue) in expected.items():
        got = results[rid]
        assert got.ttft_s == pytest.approx(ttft), case
        assert got.e2e_latency_s == pytest.approx(e2e), case
        assert got.queue_time_s == pytest.approx(queue), case
        assert got.finish_reason == "length" and got.error is None


@pytest.mark.parametrize(
    "case, changes, blocked_until",
    [
        # max_running_requests 1: the second waits until the first finishes (20 + 11 = 31 ms).
        ("max running", {"max_running_requests": 1}, 0.031),
        # KV room for one request only (needs 100 + 1 at admission, 102 to finish): the second waits.
        ("kv full", {"kv_tokens": 150}, 0.031),
        # Reserve: 0.5 of the first's 9 remaining tokens (5) plus the second's 101 + 5 do not fit 210.
        ("kv reserve", {"kv_tokens": 210, "admit_reserve_ratio": 0.5, "max_running_requests": 8}, None),
    ],
)
def test_queueing(case, changes, blocked_until):
    new = 2 if blocked_until is not None else 10
    params = P.changed(changes)
    results = _run(SimCore(params), [(0.0, 100, new), (0.0, 100, new)])
    first, second = results[0], results[1]
    if blocked_until is None:
        assert second.queue_time_s == pytest.approx(first.e2e_latency_s), case
    else:
        assert second.queue_time_s == pytest.approx(blocked_until), case
    assert second.retractions == 0, case


def test_queue_reported_in_loads():
    core = SimCore(P.changed({"max_running_requests": 2}))
    for _ in range(5):
        core.submit(10, 50, 0.0)
    core.advance(0.0)
    loads = core.loads()
    assert (loads.running, loads.waiting) == (1, 4)  # the first started alone at t=0
    core.advance(core.busy_until)
    loads = core.loads()
    assert (loads.running, loads.waiting) == (2, 3)
    # The second's prefill is under way: two prompts and their first tokens; no decode slot yet.
    assert loads.used_tokens == 2 * 11
    assert loads.max_total_tokens == 10_000
    assert loads.token_usage == pytest.approx(22 / 10_000)


def test_retraction_when_decode_outgrows_the_budget():
    # No reserve: both 100-token prompts are admitted (202 of 250), then growth to 250 forces the newest out.
    core = SimCore(P.changed({"kv_tokens": 250}))
    seen_max = 0
    results: dict[int, SimResult] = {}
    core.submit(100, 40, 0.0)
    core.submit(100, 40, 0.0)
    retracted_at_some_point = False
    while core.busy_until is not None:
        results.update({r.rid: r for r in core.advance(core.busy_until)})
        loads = core.loads()
        seen_max = max(seen_max, loads.used_tokens)
        retracted_at_some_point |= loads.waiting == 1 and loads.running == 1
    assert retracted_at_some_point
    assert seen_max <= 250
    assert results[0].retractions == 0
    assert results[1].retractions == 1  # the newest goes back to the queue, as in SGLang
    assert results[1].completion_tokens == 40  # and finishes later with all its tokens
    assert results[1].finished_at > results[0].finished_at


def test_shrinking_the_budget_retracts_at_the_next_decode_step():
    core = SimCore(P)
    for _ in range(3):
        core.submit(100, 100, 0.0)
    while core.loads().running < 3:
        core.advance(core.busy_until)
    assert core.loads().used_tokens > 300
    core.set_params(P.changed({"kv_tokens": 250}))
    core.advance(core.busy_until)
    loads = core.loads()
    # Two requests of ~102 tokens, plus a slot each for this step, fit 250; the third does not.
    assert loads.used_tokens <= 250
    assert (loads.running, loads.waiting) == (2, 1)
    results = _run(core, [])
    assert results[0].retractions == 0  # the oldest is never the victim
    assert results[2].retractions >= 1
    assert [results[rid].completion_tokens for rid in range(3)] == [100, 100, 100]


def test_slowdown_change_applies_from_the_next_iteration():
    core = SimCore(P)
    core.submit(100, 11, 0.0)  # prefill 20 ms, then 10 decode steps of 11 ms
    core.advance(0.020 + 0.011 * 4)  # four steps done; the fifth started at 64 ms
    core.set_params(P.changed({"slowdown": 2.0}))
    (result,) = _run(core, []).values()
    # The fifth step (under way) keeps its 11 ms; the last five take 22 ms each.
    assert result.e2e_latency_s == pytest.approx(0.020 + 0.011 * 5 + 0.022 * 5)


@pytest.mark.parametrize(
    "case, prompt, new, kv, message",
    [
        ("above budget", 200, 100, 250, "needs 300 KV tokens"),
        ("no prompt", 0, 10, 250, "must be >= 1"),
        ("no output", 10, 0, 250, "must be >= 1"),
    ],
)
def test_impossible_requests_are_refused(case, prompt, new, kv, message):
    core = SimCore(P.changed({"kv_tokens": kv}))
    with pytest.raises(SpecError, match=message):
        core.submit(prompt, new, 0.0)
    assert core.loads().waiting == 0, case


def test_request_that_no_longer_fits_after_a_shrink_is_aborted_with_a_reason():
    core = SimCore(P)
    core.submit(10, 5, 0.0)
    core.submit(500, 5, 0.0)
    core.set_params(P.changed({"kv_tokens": 100}))
    results = _run(core, [])
    assert results[0].finish_reason == "length"
    assert results[1].finish_reason == "abort" and "budget is now 100" in results[1].error


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"slowdown": 0}, "slowdown: must be above 0"),
        ({"slowdown": "fast"}, "slowdown: must be a number"),
        ({"kv_tokens": 1.5}, "kv_tokens: must be an integer"),
        ({"kv_tokens": 1}, "kv_tokens: must be 2.."),
        ({"max_running_requests": 0}, "max_running_requests: must be 1.."),
        ({"decode_base_ms": -1}, "decode_base_ms: must be in 0.."),
        # Each has an upper bound: /sim/config takes them at run time, and a slowdown of 1e308 put the
        # scheduler's next iteration at infinity, after which nothing was answered again.
        ({"slowdown": 1e308}, "slowdown: must be above 0 and at most 1000"),
        ({"decode_base_ms": 1e9}, "decode_base_ms: must be in 0..60000"),
        ({"wake_ms": 1e9}, "wake_ms: must be in 0..600000"),
        ({"kv_tokens": 1 << 40}, "kv_tokens: must be 2.."),
        ({"admit_reserve_ratio": 2}, "admit_reserve_ratio: must be in 0..1"),
        ({"turbo": True}, "turbo: unknown sim parameter"),
    ],
)
def test_param_changes_are_validated(changes, problem):
    with pytest.raises(SpecError, match=problem):
        P.changed(changes)


def test_param_changes_apply():
    got = P.changed({"slowdown": 3, "kv_tokens": 4096.0})
    assert (got.slowdown, got.kv_tokens) == (3.0, 4096)
    assert isinstance(got.kv_tokens, int)


class FakeClock:
    """Virtual time: sleeping moves the clock, so the engine runs as fast as the CPU allows."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


async def test_engine_returns_results_on_the_fake_clock():
    clock = FakeClock()
    engine = SimEngine(P, clock=clock, sleep=clock.sleep)
    await engine.start()
    try:
        a, b = await asyncio.gather(engine.generate(100, 4), engine.generate(100, 4))
        assert a.e2e_latency_s == pytest.approx(0.020 + 0.020 + 3 * 0.012)
        assert b.queue_time_s == pytest.approx(0.020)
        assert engine.loads().running == 0
        engine.set_params({"slowdown": 2.0})
        c = await engine.generate(100, 4)
        assert c.e2e_latency_s == pytest.approx(2 * 0.053)
    finally:
        await engine.stop()


async def test_engine_stop_fails_pending_requests_with_a_retryable_error():
    clock = FakeClock()

    async def never(_: float) -> None:
        await asyncio.Event().wait()

    engine = SimEngine(P, clock=clock, sleep=never)
    await engine.start()
    pending = asyncio.create_task(engine.generate(10, 10))
    await asyncio.sleep(0)
    assert engine.loads().running == 1
    await engine.stop()
    with pytest.raises(SimEngineStopped):
        await pending
    with pytest.raises(SimEngineStopped, match="not running"):
        await engine.generate(10, 10)


@pytest.mark.parametrize("when", ["waiting", "running mid-step"])
def test_abort_frees_the_requests_tokens(when):
    core = SimCore(P.changed({"max_running_requests": 1}))
    first = core.submit(100, 10, 0.0)
    second = core.submit(50, 10, 0.0)
    core.advance(0.025)  # the first is prefilled and one decode step is under way
    before = core.loads()
    victim = second if when == "waiting" else first
    assert core.abort(victim)
    after = core.loads()
    freed = 0 if when == "waiting" else 100 + 1 + 1  # prompt, first token, and this step's slot
    assert before.used_tokens - after.used_tokens == freed
    assert after.running + after.waiting == 1
    results = _run(core, [])
    assert set(results) == {first, second} - {victim}  # the aborted one never reports
    assert core.loads().used_tokens == 0
    assert not core.abort(victim)


def test_first_tokens_are_reported_once_with_the_queue_time():
    core = SimCore(P.changed({"max_running_requests": 1}))
    a = core.submit(100, 3, 0.0)
    b = core.submit(100, 3, 0.0)
    _run(core, [])
    firsts = {f.rid: f for f in core.take_first_tokens()}
    assert firsts[a].at == pytest.approx(0.020) and firsts[a].queue_time_s == 0.0
    assert firsts[b].queue_time_s == pytest.approx(0.020 + 2 * 0.011)
    assert core.take_first_tokens() == []


async def test_engine_ticket_streams_first_token_then_result_and_cancel_frees():
    clock = FakeClock()
    engine = SimEngine(P, clock=clock, sleep=clock.sleep)
    await engine.start()
    try:
        ticket = engine.submit(100, 4)
        assert await ticket.first_token == 0.0
        assert not ticket.done.done()
        assert (await ticket.done).completion_tokens == 4
        parked = engine.submit(100, 1000)
        await parked.first_token
        assert engine.loads().used_tokens > 0
        engine.cancel(parked)
        assert engine.loads().used_tokens == 0 and parked.done.cancelled()
    finally:
        await engine.stop()


def test_the_queue_moves_on_after_the_only_running_request_is_aborted_by_a_shrink():
    core = SimCore(P.changed({"max_running_requests": 1}))
    big = core.submit(300, 50, 0.0)
    small = core.submit(20, 5, 0.0)
    core.advance(0.040)  # the big one is prefilled and decoding; the small one waits its turn
    core.set_params(core.params.changed({"kv_tokens": 100}))
    results = _run(core, [])
    assert results[big].finish_reason == "abort" and "above the budget of 100" in results[big].error
    assert results[small].finish_reason == "length" and results[small].completion_tokens == 5


def test_a_request_that_ends_before_the_next_submit_is_not_lost():
    # submit() first brings the core up to its `now`. Results of requests that ended on the way must
    # come out of the next advance(); they were once dropped (the outbox list was swapped underneath
    # the extend), which left that request's caller waiting for ever.
    core = SimCore(P)
    first = core.submit(100, 4, 0.0)  # done at 53 ms
    second = core.submit(100, 4, 0.100)  # no advance() in between
    results = {r.rid: r for r in core.advance(0.100)}
    assert set(results) == {first} and results[first].finished_at == pytest.approx(0.053)
    assert set(_run(core, [])) == {second}


def test_every_request_gets_exactly_one_result_however_submits_and_advances_interleave():
    rng = random.Random(7)
    core = SimCore(P.changed({"max_running_requests": 4, "kv_tokens": 2_000}))
    submitted, results, now = [], [], 0.0
    for _ in range(2_000):
        now += rng.expovariate(40.0)
        if rng.random() < 0.5:
            results.extend(core.advance(now))
        submitted.append(core.submit(rng.randint(1, 200), rng.randint(1, 20), now))
    results.extend(_run(core, []).values())
    assert sorted(r.rid for r in results) == sorted(submitted)
