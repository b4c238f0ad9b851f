"""A share in the routes needs ready instances of the new build (xds_server.rollout.machine): with none
it is withdrawn at once and comes back with them, a step short of them does not advance, and a new build
short of ready instances (for a share in the routes, or for a step being prepared), or of answers it
should have, past its deadline is given up on. Pure: every clock value is passed in."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sie.spec import SLA, RolloutPolicy
from xds_server.rollout.gates import TrackStats
from xds_server.rollout.machine import (
    Phase,
    RolloutState,
    act,
    advance,
    replica_counts,
    start,
)

SLA_ = SLA(p99_latency_ms=1000.0, max_queue_time_ms=1000.0)
# The policy's defaults, which these tests leave alone.
UNREADY_DEADLINE_S = RolloutPolicy().progress_deadline_s
STARVED_DEADLINE_S = RolloutPolicy().starved_deadline_s


def started(replicas: int, now: float, **policy) -> RolloutState:
    """A rollout of steps [50, 100] just started at `now`, not yet observed."""
    doc = {"steps": [50, 100], "hold_s": 30.0, "gates": {"min_requests": 20}} | policy
    return start(
        "m",
        from_generation=0,
        from_version="1",
        to_version="2",
        policy=RolloutPolicy.model_validate(doc),
        replicas=replicas,
        now=now,
    )


def live(replicas: int = 2, now: float = 0.0, **policy) -> RolloutState:
    """A rollout whose first step (50%) went live at `now`."""
    state = started(replicas, now, **policy)
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


# ---- the policy's deadlines -------------------------------------------------------------------------


def test_the_live_deadlines_are_the_policys():
    unready = live(replicas=2, progress_deadline_s=60.0)
    unready = advance(unready, stats(0, requests=0), OLD, SLA_, 10.0)
    assert advance(unready, stats(0, requests=0), OLD, SLA_, 69.9).phase is Phase.PROGRESSING
    given_up = advance(unready, stats(0, requests=0), OLD, SLA_, 70.0)
    assert given_up.phase is Phase.ROLLED_BACK and "no ready instance for 60 s" in given_up.reason
    starved = live(replicas=2, starved_deadline_s=30.0)
    starved = advance(starved, stats(1, 0), OLD, SLA_, 10.0)
    assert advance(starved, stats(1, 0), OLD, SLA_, 39.9).phase is Phase.PROGRESSING
    given_up = advance(starved, stats(1, 0), OLD, SLA_, 40.0)
    assert given_up.phase is Phase.ROLLED_BACK and "no answer from the new version at 50% for 30 s" in given_up.reason


# ---- a step being prepared ----------------------------------------------------------------------------


def preparing(replicas: int = 2, now: float = 0.0, **policy) -> RolloutState:
    """A rollout whose first step (50%) is being prepared, first observed at `now` with nothing ready."""
    state = started(replicas, now, **policy)
    assert state.preparing_since is None  # started, not yet observed
    state = advance(state, stats(0, requests=0), stats(replicas), SLA_, now)
    assert (state.phase, state.live, state.share, state.preparing_since) == (Phase.PROGRESSING, False, 0, now)
    return state


# (policy, new instances ready all along, why they wait) -> the reason the rollout gives; four replicas,
# the 50% step needs two
NEVER_READY = {
    "none ever ready, the default deadline": (
        {},
        0,
        "",
        "the new version had 0 of the 2 ready instances step 50% needs for 600 s",
    ),
    "one of two ready, a deadline of a minute": (
        {"progress_deadline_s": 60.0},
        1,
        "",
        "the new version had 1 of the 2 ready instances step 50% needs for 60 s",
    ),
    "no memory for them": (
        {"progress_deadline_s": 60.0},
        0,
        "m.g1-0 on n1: waiting for 20480 MB of GPU memory",
        "needs for 60 s (waiting for memory for the new version: m.g1-0 on n1: waiting for 20480 MB of GPU memory; "
        "max_unavailable is 0: no old instance stops before new ones are ready)",
    ),
}


@pytest.mark.parametrize("auto_rollback", [True, False], ids=["auto_rollback", "no auto_rollback"])
@pytest.mark.parametrize(("policy", "ready", "memory", "reason"), NEVER_READY.values(), ids=NEVER_READY.keys())
def test_a_step_prepared_whose_instances_are_not_ready_by_the_progress_deadline_gives_the_rollout_up(
    policy, ready, memory, reason, auto_rollback
):
    """Before, this waited for ever at its previous share, saying only that it waited."""
    state = preparing(replicas=4, now=10.0, auto_rollback=auto_rollback, **policy)
    deadline = state.policy.progress_deadline_s
    counts = replica_counts(state)
    for now in (11.0, 10.0 + deadline / 2, 10.0 + deadline - 0.1):
        state = advance(state, stats(ready, requests=0), stats(4), SLA_, now, waiting_for_memory=memory)
        assert (state.phase, state.live, state.share) == (Phase.PROGRESSING, False, 0), now
    assert f"; preparing for {deadline - 0.1:.0f} s, given up at {deadline:g} s" in state.reason
    state = advance(state, stats(ready, requests=0), stats(4), SLA_, 10.0 + deadline, waiting_for_memory=memory)
    assert reason in state.reason and state.failed_gate is None
    if auto_rollback:
        assert (state.phase, state.share, state.live, state.preparing_since) == (Phase.ROLLED_BACK, 0, False, None)
        assert (state.events[-1].what, state.finished_at) == ("rolled_back", 10.0 + deadline)
        assert replica_counts(state) == (4, 0)  # the new build drains
    else:
        assert (state.phase, state.share, state.live) == (Phase.PAUSED, 0, False)
        assert state.events[-1].what == "paused" and "auto_rollback is off" in state.reason
        assert replica_counts(state) == counts  # paused where it is, for a person to look at
    assert advance(state, stats(ready, requests=0), stats(4), SLA_, 86_400.0).phase is state.phase


def test_a_step_prepared_whose_instances_are_ready_in_time_goes_live_and_its_wait_ends():
    state = preparing(replicas=2, now=0.0)
    deadline = state.policy.progress_deadline_s
    state = advance(state, stats(0, requests=0), OLD, SLA_, deadline - 1.0)
    # Ready as the deadline passes: going live wins, the wait was not for nothing.
    state = advance(state, stats(1, requests=0), OLD, SLA_, deadline)
    assert (state.phase, state.live, state.share, state.preparing_since) == (Phase.PROGRESSING, True, 50, None)
    held = advance(state, stats(1), OLD, SLA_, deadline + 30.0)  # the next step's wait starts with its preparing
    assert (held.phase, held.step, held.live, held.preparing_since) == (Phase.PROGRESSING, 1, False, deadline + 30.0)


def test_the_next_steps_wait_counts_from_the_end_of_the_hold_before_it():
    """Live at 50% with its one instance; the 100% step needs two, and the second never comes. The share
    in the routes has what it needs, so only the step being prepared can end this."""
    state = preparing(replicas=2, now=0.0, progress_deadline_s=120.0)
    state = advance(state, stats(1), OLD, SLA_, 5.0)
    assert (state.live, state.share) == (True, 50)
    state = advance(state, stats(1), OLD, SLA_, 35.0)  # the 30 s hold ends: the next step is prepared
    assert (state.step, state.live, state.share, state.preparing_since) == (1, False, 50, 35.0)
    assert advance(state, stats(1), OLD, SLA_, 154.9).phase is Phase.PROGRESSING
    done = advance(state, stats(1), OLD, SLA_, 155.0)
    assert (done.phase, done.share) == (Phase.ROLLED_BACK, 0)
    assert "the new version had 1 of the 2 ready instances step 100% needs for 120 s" in done.reason
    assert replica_counts(done) == (2, 0)


def test_time_paused_by_hand_does_not_count_towards_the_progress_deadline():
    state = preparing(replicas=2, now=0.0, progress_deadline_s=60.0)
    paused = act(advance(state, stats(0, requests=0), OLD, SLA_, 50.0), "pause", 50.0)
    later = advance(paused, stats(0, requests=0), OLD, SLA_, 5000.0)
    assert later.phase is Phase.PAUSED  # a person ends a pause, not the deadline
    resumed = act(later, "resume", 5000.0)
    assert (resumed.phase, resumed.preparing_since) == (Phase.PROGRESSING, 5000.0)
    assert advance(resumed, stats(0, requests=0), OLD, SLA_, 5059.9).phase is Phase.PROGRESSING
    assert advance(resumed, stats(0, requests=0), OLD, SLA_, 5060.0).phase is Phase.ROLLED_BACK


def test_a_resumed_give_up_without_auto_rollback_waits_a_whole_deadline_again():
    state = preparing(replicas=2, now=0.0, progress_deadline_s=60.0, auto_rollback=False)
    paused = advance(state, stats(0, requests=0), OLD, SLA_, 60.0)
    assert paused.phase is Phase.PAUSED
    resumed = act(paused, "resume", 100.0)
    assert advance(resumed, stats(0, requests=0), OLD, SLA_, 159.9).phase is Phase.PROGRESSING
    assert advance(resumed, stats(0, requests=0), OLD, SLA_, 160.0).phase is Phase.PAUSED


def test_a_restart_keeps_the_wait_of_the_step_being_prepared():
    """The control plane records the rollout and reads it back after a restart: the wait goes on from
    when it began, not from the restart."""
    state = preparing(replicas=2, now=0.0, progress_deadline_s=60.0)
    state = advance(state, stats(0, requests=0), OLD, SLA_, 30.0)
    back = RolloutState.from_json(json.loads(json.dumps(state.to_json())))
    assert back.preparing_since == 0.0
    assert advance(back, stats(0, requests=0), OLD, SLA_, 59.9).phase is Phase.PROGRESSING
    assert advance(back, stats(0, requests=0), OLD, SLA_, 60.0).phase is Phase.ROLLED_BACK


def test_a_record_from_before_the_progress_deadline_starts_the_wait_at_its_first_observation():
    state = preparing(replicas=2, now=0.0, progress_deadline_s=60.0)
    doc = json.loads(json.dumps(state.to_json()))
    del doc["preparing_since"]
    del doc["policy"]["progress_deadline_s"], doc["policy"]["starved_deadline_s"]
    back = RolloutState.from_json(doc)
    assert (back.preparing_since, back.policy.progress_deadline_s) == (None, 600.0)
    observed = advance(back, stats(0, requests=0), OLD, SLA_, 1000.0)
    assert (observed.phase, observed.preparing_since) == (Phase.PROGRESSING, 1000.0)
    assert advance(observed, stats(0, requests=0), OLD, SLA_, 1599.9).phase is Phase.PROGRESSING
    assert advance(observed, stats(0, requests=0), OLD, SLA_, 1600.0).phase is Phase.ROLLED_BACK


# ---- control-plane downtime ---------------------------------------------------------------------


def recorded_and_read_back(state: RolloutState) -> RolloutState:
    return RolloutState.from_json(json.loads(json.dumps(state.to_json())))


def test_the_time_the_control_plane_was_down_is_not_the_wait_of_the_step_being_prepared():
    """Recorded while the 100% step was prepared, read back 660 s later: the first observation after the
    restart gave the rollout up at once, the downtime counted as the new build's wait. Its wait counts
    from when the control plane watches again (the driver passes its first observation's time)."""
    state = preparing(replicas=2, now=0.0)
    state = advance(state, stats(1), OLD, SLA_, 1.0)  # 50% live
    state = advance(state, stats(1), OLD, SLA_, 31.0)  # held: 100% prepared, waiting since 31
    assert (state.step, state.live, state.preparing_since) == (1, False, 31.0)
    back = recorded_and_read_back(state)
    restart = 31.0 + 660.0
    first = advance(back, stats(1), OLD, SLA_, restart, watched_since=restart)
    assert first.phase is Phase.PROGRESSING, first.reason
    assert first.reason.endswith("; preparing for 0 s, given up at 600 s")
    assert first.preparing_since == 31.0  # the record keeps when the wait began
    later = advance(first, stats(1), OLD, SLA_, restart + 599.9, watched_since=restart)
    assert later.phase is Phase.PROGRESSING
    done = advance(later, stats(1), OLD, SLA_, restart + 600.0, watched_since=restart)
    assert done.phase is Phase.ROLLED_BACK
    assert "the new version had 1 of the 2 ready instances step 100% needs for 600 s" in done.reason
    # Without the restart's time, the wait is the record's (as before).
    assert advance(back, stats(1), OLD, SLA_, restart).phase is Phase.ROLLED_BACK


def test_the_time_the_control_plane_was_down_is_not_the_wait_of_a_share_short_of_instances():
    state = live(replicas=2, now=0.0)
    short = advance(state, stats(0, requests=0), OLD, SLA_, 10.0)  # withdrawn since 10
    assert (short.withdrawn, short.unready_since) == (50, 10.0)
    back = recorded_and_read_back(short)
    restart = 10.0 + UNREADY_DEADLINE_S + 60.0
    first = advance(back, stats(0, requests=0), OLD, SLA_, restart, watched_since=restart)
    assert (first.phase, first.withdrawn) == (Phase.PROGRESSING, 50), first.reason
    assert "0/1 new instances ready for 0 s" in first.reason
    done = advance(first, stats(0, requests=0), OLD, SLA_, restart + UNREADY_DEADLINE_S, watched_since=restart)
    assert done.phase is Phase.ROLLED_BACK
    assert f"the new version has no ready instance for {UNREADY_DEADLINE_S:.0f} s" in done.reason


def test_the_time_the_control_plane_was_down_is_not_a_share_without_answers():
    state = live(replicas=2, now=0.0)
    starved = advance(state, stats(1, requests=0), stats(2, requests=2000), SLA_, 5.0)
    assert starved.starved_since == 5.0
    restart = 5.0 + STARVED_DEADLINE_S + 60.0
    first = advance(
        recorded_and_read_back(starved),
        stats(1, requests=0),
        stats(2, requests=2000),
        SLA_,
        restart,
        watched_since=restart,
    )
    assert first.phase is Phase.PROGRESSING, first.reason
