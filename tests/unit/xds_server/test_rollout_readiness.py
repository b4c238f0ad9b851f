"""A share in the routes needs ready instances of the new build (xds_server.rollout.machine): with none
it is withdrawn at once and comes back with them, a step short of them does not advance, and a new build
short of ready instances, or of answers it should have, past its deadline is given up on. Pure: every
clock value is passed in."""

from __future__ import annotations

import dataclasses

import pytest

from sie.spec import SLA, RolloutPolicy
from xds_server.rollout.gates import TrackStats
from xds_server.rollout.machine import (
    STARVED_DEADLINE_S,
    UNREADY_DEADLINE_S,
    Phase,
    RolloutState,
    act,
    advance,
    replica_counts,
    start,
)

SLA_ = SLA(p99_latency_ms=1000.0, max_queue_time_ms=1000.0)


def live(replicas: int = 2, now: float = 0.0, **policy) -> RolloutState:
    """A rollout whose first step (50%) went live at `now`."""
    doc = {"steps": [50, 100], "hold_s": 30.0, "gates": {"min_requests": 20}} | policy
    state = start(
        "m",
        from_generation=0,
        from_version="1",
        to_version="2",
        policy=RolloutPolicy.model_validate(doc),
        replicas=replicas,
        now=now,
    )
    state = advance(state, stats(replicas // 2), stats(replicas), SLA_, now)
    assert (state.live, state.share) == (True, 50)
    return state


def stats(ready: int, requests: int = 200) -> TrackStats:
    if requests == 0:
        return TrackStats(ready=ready)
    return TrackStats(requests=requests, p99_ms=10.0, error_rate=0.0, queue_time_ms=1.0, ready=ready)


OLD = stats(2)


def test_a_live_share_whose_instances_are_all_gone_leaves_the_routes_at_once_and_comes_back_with_them():
    state = live(replicas=2)
    counts = replica_counts(state)
    gone = advance(state, stats(0, requests=0), OLD, SLA_, 5.0)  # the only new instance crashed
    assert (gone.phase, gone.live, gone.share, gone.withdrawn, gone.unready_since) == (
        Phase.PROGRESSING,
        True,
        0,
        50,
        5.0,
    )
    assert gone.events[-1].what == "withdrawn" and gone.events[-1].share == 0
    assert "no instance of 2 is ready: its 50% goes to 1 until 1 are" in gone.reason
    assert replica_counts(gone) == counts  # the fleet keeps its shape: the instance restarts in place
    still = advance(gone, stats(0, requests=0), OLD, SLA_, 60.0)
    assert (still.share, still.withdrawn) == (0, 50)
    assert "50% withdrawn until they are; 0/1 new instances ready for 55 s" in still.reason
    back = advance(still, stats(1, requests=0), OLD, SLA_, 65.0)
    assert (back.phase, back.live, back.share, back.withdrawn, back.unready_since) == (
        Phase.PROGRESSING,
        True,
        50,
        0,
        None,
    )
    assert back.events[-1].what == "restored" and back.events[-1].share == 50
    assert [e.what for e in back.events] == ["started", "step 1/2", "withdrawn", "restored"]


def test_the_hold_counts_only_the_time_the_step_had_its_instances():
    """Live at 0 with a 30 s hold, no instance ready from 10 s to 20 s: the hold ends at 40 s, not 30 s."""
    state = live(replicas=2)
    state = advance(state, stats(1), OLD, SLA_, 9.0)
    state = advance(state, stats(0, requests=0), OLD, SLA_, 10.0)
    state = advance(state, stats(0, requests=0), OLD, SLA_, 31.0)  # the hold would have ended: it waits
    assert (state.step, state.live, state.share) == (0, True, 0)
    assert "the step waits for its instances" in state.reason
    state = advance(state, stats(1), OLD, SLA_, 41.0)  # back after 31 s short
    assert (state.share, state.step_since) == (50, 31.0)
    assert advance(state, stats(1), OLD, SLA_, 60.9).step == 0
    assert advance(state, stats(1), OLD, SLA_, 61.0).step == 1


@pytest.mark.parametrize(
    ("auto_rollback", "phase", "share"),
    [(True, Phase.ROLLED_BACK, 0), (False, Phase.PAUSED, 0)],
)
def test_no_ready_instance_past_the_deadline_gives_the_rollout_up(auto_rollback, phase, share):
    """The reviewer's case: before, this held 50% for ever, waiting for samples that could never come."""
    state = live(replicas=2, auto_rollback=auto_rollback)
    state = advance(state, stats(0, requests=0), OLD, SLA_, 20.0)
    state = advance(state, stats(0, requests=0), OLD, SLA_, 20.0 + UNREADY_DEADLINE_S - 0.1)
    assert state.phase is Phase.PROGRESSING
    state = advance(state, stats(0, requests=0), OLD, SLA_, 20.0 + UNREADY_DEADLINE_S)
    assert (state.phase, state.share) == (phase, share)
    assert f"the new version has no ready instance for {UNREADY_DEADLINE_S:.0f} s" in state.reason
    assert state.failed_gate is None
    if auto_rollback:
        assert (state.live, state.withdrawn, state.finished_at) == (False, 0, 20.0 + UNREADY_DEADLINE_S)
        assert replica_counts(state) == (2, 0)
    else:
        assert state.withdrawn == 50 and "auto_rollback is off" in state.reason
    assert advance(state, stats(0, requests=0), OLD, SLA_, 86_400.0).phase is phase


def test_a_step_short_of_some_instances_keeps_its_share_does_not_advance_and_is_given_up_past_the_deadline():
    """Four replicas at 50% need two new instances; one is left. It serves the share, the gates judge it."""
    state = live(replicas=4)
    short = advance(state, stats(1), stats(4), SLA_, 10.0)
    assert (short.share, short.withdrawn, short.unready_since) == (50, 0, 10.0)
    held = advance(short, stats(1), stats(4), SLA_, 100.0)  # past the 30 s hold, every gate met
    assert (held.step, held.live, held.share) == (0, True, 50)
    assert "1/2 new instances ready for 90 s" in held.reason
    done = advance(held, stats(1), stats(4), SLA_, 10.0 + UNREADY_DEADLINE_S)
    assert done.phase is Phase.ROLLED_BACK
    assert f"the new version has 1 of the 2 ready instances it needs for {UNREADY_DEADLINE_S:.0f} s" in done.reason


def test_a_share_routed_while_the_next_step_is_prepared_is_withdrawn_too():
    state = live(replicas=4, steps=[50, 75, 100], hold_s=0.0)
    state = advance(state, stats(2), stats(4), SLA_, 1.0)
    assert (state.step, state.live, state.share) == (1, False, 50)
    counts = replica_counts(state)
    gone = advance(state, stats(0, requests=0), stats(4), SLA_, 2.0)
    assert (gone.step, gone.live, gone.share, gone.withdrawn) == (1, False, 0, 50)
    assert replica_counts(gone) == counts
    assert "its 50% goes to 1 until 2 are" in gone.reason
    gone = advance(gone, stats(0, requests=0), stats(4), SLA_, 2.5)
    assert "waiting for 3 new instance(s) to be ready (0/3) (50% withdrawn until they are" in gone.reason
    back = advance(gone, stats(2), stats(4), SLA_, 3.0)
    assert (back.step, back.live, back.share, back.withdrawn) == (1, False, 50, 0)
    assert advance(back, stats(3), stats(4), SLA_, 4.0).share == 75


def test_a_paused_rollout_withdraws_and_restores_too_and_resume_restarts_the_deadline():
    paused = act(live(replicas=2), "pause", 1.0)
    gone = advance(paused, stats(0, requests=0), OLD, SLA_, 2.0)
    assert (gone.phase, gone.share, gone.withdrawn) == (Phase.PAUSED, 0, 50)
    later = advance(gone, stats(0, requests=0), OLD, SLA_, 2.0 + 2 * UNREADY_DEADLINE_S)
    assert (later.phase, later.share) == (Phase.PAUSED, 0)  # a person ends a pause, not the deadline
    resumed = act(later, "resume", 5000.0)
    assert resumed.unready_since == 5000.0
    assert advance(resumed, stats(0, requests=0), OLD, SLA_, 5001.0).phase is Phase.PROGRESSING
    assert advance(resumed, stats(1), OLD, SLA_, 5002.0).share == 50


def test_abort_of_a_withdrawn_share_ends_clean():
    gone = advance(live(replicas=2), stats(0, requests=0), OLD, SLA_, 2.0)
    aborted = act(gone, "abort", 3.0)
    assert (aborted.phase, aborted.share, aborted.withdrawn, aborted.unready_since) == (Phase.ABORTED, 0, 0, None)


def test_a_breach_seen_as_the_instances_go_still_rolls_back_on_the_gate():
    state = live(replicas=2)
    crashed = TrackStats(requests=200, p99_ms=10.0, error_rate=0.5, queue_time_ms=1.0, ready=0)
    state = advance(state, crashed, OLD, SLA_, 2.0)
    assert (state.phase, state.failed_gate.name if state.failed_gate else None) == (
        Phase.ROLLED_BACK,
        "error_rate_vs_old",
    )


# (new answers, old answers) at 50%, min_requests 20 -> given up after STARVED_DEADLINE_S
STARVED = {
    "none while the old build answered 200: its traffic does not reach it": (0, 200, True),
    "none while the old build answered the 20 that 50% should have brought": (0, 20, True),
    "none, too little traffic to tell": (0, 19, False),
    "a few answers reach it: it waits for samples": (3, 200, False),
}


@pytest.mark.parametrize(("new_answers", "old_answers", "given_up"), STARVED.values(), ids=STARVED.keys())
def test_a_share_that_gets_no_answer_while_the_old_build_has_traffic_is_given_up(new_answers, old_answers, given_up):
    state = live(replicas=2)
    state = advance(state, stats(1, new_answers), stats(2, old_answers), SLA_, 10.0)
    state = advance(state, stats(1, new_answers), stats(2, old_answers), SLA_, 10.0 + STARVED_DEADLINE_S - 0.1)
    assert state.phase is Phase.PROGRESSING
    state = advance(state, stats(1, new_answers), stats(2, old_answers), SLA_, 10.0 + STARVED_DEADLINE_S)
    assert (state.phase is Phase.ROLLED_BACK) is given_up, state.reason
    if given_up:
        assert f"no answer from the new version at 50% for {STARVED_DEADLINE_S:.0f} s" in state.reason
    else:
        assert advance(state, stats(1, new_answers), stats(2, old_answers), SLA_, 86_400.0).phase is Phase.PROGRESSING


def test_an_answer_resets_the_wait_for_answers():
    state = live(replicas=2)
    state = advance(state, stats(1, 0), OLD, SLA_, 10.0)
    state = advance(state, stats(1, 1), OLD, SLA_, 100.0)
    assert state.starved_since is None
    state = advance(state, stats(1, 0), OLD, SLA_, 101.0)
    assert advance(state, stats(1, 0), OLD, SLA_, 100.0 + STARVED_DEADLINE_S).phase is Phase.PROGRESSING


def test_at_100_percent_no_answer_is_not_starvation_the_old_build_has_no_traffic_to_compare():
    state = dataclasses.replace(live(replicas=2), step=1, share=100)
    state = advance(state, stats(2, 0), stats(2, 0), SLA_, 10.0)
    assert state.starved_since is None
