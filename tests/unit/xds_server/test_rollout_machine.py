"""The rollout state machine (xds_server.rollout.machine): steps, holds, gates, rollback, by-hand actions,
the replica counts of both builds, and the recorded form. Pure: every clock value is passed in."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sie.spec import SLA, RolloutPolicy
from xds_server.rollout.gates import GateResult, TrackStats
from xds_server.rollout.machine import (
    Phase,
    RolloutConflict,
    RolloutState,
    act,
    advance,
    replica_counts,
    start,
)

SLA_ = SLA(p99_latency_ms=1000.0, max_queue_time_ms=1000.0)


def begin(replicas: int = 4, now: float = 0.0, **policy) -> RolloutState:
    doc = {"steps": [10, 50, 100], "hold_s": 30.0} | policy
    return start(
        "m",
        from_generation=0,
        from_version="1",
        to_version="2",
        policy=RolloutPolicy.model_validate(doc),
        replicas=replicas,
        now=now,
    )


def stats(ready: int, requests: int = 200, p99: float = 10.0, errors: float = 0.0, queue: float = 1.0) -> TrackStats:
    if requests == 0:
        return TrackStats(ready=ready)
    return TrackStats(requests=requests, p99_ms=p99, error_rate=errors, queue_time_ms=queue, ready=ready)


def at(state: RolloutState, step: int, share: int, live: bool = True, since: float = 0.0, **more) -> RolloutState:
    """A state placed at a step by hand (for counts and single transitions)."""
    return dataclasses.replace(state, step=step, share=share, live=live, step_since=since if live else None, **more)


# ---- a whole rollout ------------------------------------------------------------------------------

# (now, new ready, new requests, old ready, old requests) -> (phase, step, live, share, counts, reason fragment)
WALK = [
    (1.0, 0, 0, 4, 200, Phase.PROGRESSING, 0, False, 0, (4, 1), "waiting for 1 new instance(s) to be ready (0/1)"),
    (2.0, 1, 0, 4, 200, Phase.PROGRESSING, 0, True, 10, (4, 1), "10% of traffic to 2"),
    (10.0, 1, 200, 4, 200, Phase.PROGRESSING, 0, True, 10, (4, 1), "holding 10%: 8/30 s"),
    (32.0, 1, 50, 4, 200, Phase.PROGRESSING, 0, True, 10, (4, 1), "waiting for samples (50/100 answers"),
    (33.0, 1, 200, 4, 200, Phase.PROGRESSING, 1, False, 10, (4, 2), "preparing the next step"),
    (34.0, 1, 200, 4, 200, Phase.PROGRESSING, 1, False, 10, (4, 2), "waiting for 1 new instance(s) to be ready (1/2)"),
    (35.0, 2, 200, 4, 200, Phase.PROGRESSING, 1, True, 50, (4, 2), "50% of traffic to 2"),
    (64.9, 2, 200, 4, 200, Phase.PROGRESSING, 1, True, 50, (4, 2), "holding 50%"),
    (65.0, 2, 200, 4, 200, Phase.PROGRESSING, 2, False, 50, (4, 4), "preparing the next step"),
    (66.0, 4, 200, 4, 200, Phase.PROGRESSING, 2, True, 100, (4, 4), "100% of traffic to 2"),
    # At 100% the old build has no traffic: its last figures with enough answers are the reference.
    (96.0, 4, 400, 1, 0, Phase.SUCCEEDED, 2, True, 100, (0, 4), "2 serves 100%; the old version drains"),
]


def test_a_rollout_walks_its_steps_holding_each_with_its_gates_met_to_success():
    state = begin(replicas=4)
    assert (state.phase, state.step, state.live, state.share) == (Phase.PROGRESSING, 0, False, 0)
    assert [e.what for e in state.events] == ["started"] and replica_counts(state) == (4, 1)
    for now, new_ready, new_req, old_ready, old_req, phase, step, live, share, counts, reason in WALK:
        state = advance(state, stats(new_ready, new_req), stats(old_ready, old_req), SLA_, now)
        got = (state.phase, state.step, state.live, state.share, replica_counts(state))
        assert got == (phase, step, live, share, counts), now
        assert reason in state.reason, (now, state.reason)
    assert state.finished_at == 96.0
    assert [e.what for e in state.events] == ["started", "step 1/3", "step 2/3", "step 3/3", "succeeded"]
    assert [e.share for e in state.events] == [0, 10, 50, 100, 100]


def test_a_step_goes_live_when_its_instances_are_ready_and_its_hold_starts_then():
    state = advance(begin(), stats(1), stats(4), SLA_, 7.0)
    assert (state.live, state.share, state.step_since) == (True, 10, 7.0)
    held = advance(state, stats(1), stats(4), SLA_, 36.9)
    assert (held.step, held.live) == (0, True)  # 29.9 s held of 30
    assert advance(held, stats(1), stats(4), SLA_, 37.0).step == 1


def test_samples_too_few_keep_the_step_holding_past_its_hold():
    state = advance(begin(), stats(1), stats(4), SLA_, 0.0)
    waiting = advance(state, stats(1, requests=99), stats(4), SLA_, 1000.0)
    assert (waiting.step, waiting.live, waiting.share) == (0, True, 10)
    assert {g.name for g in waiting.gates if g.holds is None} == {
        "p99_vs_sla",
        "p99_vs_old",
        "error_rate_vs_old",
        "queue_time_vs_sla",
    }
    assert "waiting for samples" in waiting.reason and "99/100" in waiting.reason


@pytest.mark.parametrize(
    ("replicas", "max_surge"),
    [(1, None), (2, None), (4, None), (4, 2), (2, 1)],
)
def test_a_rollout_with_every_gate_met_reaches_success(replicas, max_surge):
    """The fleet runs what replica_counts asks for and every instance becomes ready: nothing may stall.
    (A policy that would stall, such as max_surge=1 with 4 replicas, is refused with the spec: see
    test_a_rollout_that_could_never_finish_is_refused_with_the_spec.)"""
    state = begin(replicas=replicas, steps=[10, 20, 50, 100], max_surge=max_surge)
    now = 0.0
    for _ in range(40):
        old, new = replica_counts(state)
        assert old + new <= replicas + (max_surge if max_surge is not None else replicas)
        now += 31.0
        state = advance(state, stats(new), stats(old), SLA_, now)
        if state.phase is Phase.SUCCEEDED:
            break
    assert state.phase is Phase.SUCCEEDED, state.reason


# ---- breaches -----------------------------------------------------------------------------------

BREACHES = {
    "p99 over the SLA": (stats(1, p99=1001.0), stats(4, p99=900.0), "p99_vs_sla"),
    "p99 over 1.5x the old + 5 ms": (stats(1, p99=20.1), stats(4, p99=10.0), "p99_vs_old"),
    "error rate over the old + 0.01": (stats(1, errors=0.03), stats(4, errors=0.01), "error_rate_vs_old"),
    "queue over the SLA": (stats(1, queue=1000.5), stats(4), "queue_time_vs_sla"),
}


@pytest.mark.parametrize(("new", "old", "gate"), BREACHES.values(), ids=BREACHES.keys())
def test_a_breach_during_a_hold_rolls_back_at_once(new, old, gate):
    live = advance(begin(), stats(1), stats(4), SLA_, 100.0)
    state = advance(live, new, old, SLA_, 101.0)  # 1 s into a 30 s hold
    assert (state.phase, state.share, state.live, state.finished_at) == (Phase.ROLLED_BACK, 0, False, 101.0)
    assert state.failed_gate is not None and state.failed_gate.name == gate and state.failed_gate.holds is False
    assert state.events[-1].what == "rolled_back" and gate in state.reason and "10%" in state.reason
    assert replica_counts(state) == (4, 0)


@pytest.mark.parametrize(("new", "old", "gate"), BREACHES.values(), ids=BREACHES.keys())
def test_a_breach_without_auto_rollback_pauses_where_it_is(new, old, gate):
    live = advance(begin(auto_rollback=False), stats(1), stats(4), SLA_, 100.0)
    state = advance(live, new, old, SLA_, 101.0)
    assert (state.phase, state.share, state.live, state.finished_at) == (Phase.PAUSED, 10, True, None)
    assert state.failed_gate is not None and state.failed_gate.name == gate
    assert "auto_rollback is off" in state.reason
    assert replica_counts(state) == replica_counts(live)


def test_a_breach_while_the_next_step_is_prepared_still_rolls_back():
    preparing = at(begin(), step=1, share=10, live=False)
    state = advance(preparing, stats(1, p99=5000.0), stats(4), SLA_, 50.0)
    assert (state.phase, state.failed_gate.name) == (Phase.ROLLED_BACK, "p99_vs_sla")


def test_no_gate_acts_before_any_share_is_live_nor_on_too_few_answers():
    bad = stats(0, p99=5000.0, errors=0.9)
    assert advance(begin(), bad, stats(4), SLA_, 1.0).phase is Phase.PROGRESSING  # share 0: no traffic
    live = advance(begin(), stats(1), stats(4), SLA_, 1.0)
    few = stats(1, requests=99, p99=5000.0, errors=0.9)
    state = advance(live, few, stats(4), SLA_, 2.0)
    assert state.phase is Phase.PROGRESSING and state.failed_gate is None


# ---- the reference --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("new_p99", "phase"),
    [(20.0, Phase.SUCCEEDED), (20.5, Phase.ROLLED_BACK)],  # the limit: 10 ms x 1.5 + 5 ms, from the reference
)
def test_at_100_percent_the_old_builds_last_figures_with_enough_answers_are_the_reference(new_p99, phase):
    state = advance(begin(), stats(1), stats(4, p99=10.0), SLA_, 0.0)
    assert state.reference == stats(4, p99=10.0)
    state = at(state, step=2, share=100, since=0.0)
    # The old build keeps one instance and no traffic: too few answers to stand for the old build.
    state = advance(state, stats(4, p99=new_p99), stats(1, requests=0), SLA_, 31.0)
    assert state.phase is phase
    assert state.reference == stats(4, p99=10.0) and state.old_stats == stats(1, requests=0)
    p99_vs_old = next(g for g in state.gates if g.name == "p99_vs_old")
    assert p99_vs_old.limit == pytest.approx(20.0)


def test_the_reference_follows_the_old_build_while_it_has_enough_answers():
    state = advance(begin(), stats(0), stats(4, p99=10.0), SLA_, 0.0)
    state = advance(state, stats(0), stats(4, p99=40.0), SLA_, 1.0)
    assert state.reference == stats(4, p99=40.0)
    state = advance(state, stats(0), stats(4, requests=99, p99=900.0), SLA_, 2.0)
    assert state.reference == stats(4, p99=40.0)


# ---- by hand --------------------------------------------------------------------------------------


def test_pause_freezes_a_step_and_resume_restarts_its_hold():
    live = advance(begin(), stats(1), stats(4), SLA_, 0.0)
    paused = act(live, "pause", 10.0)
    assert (paused.phase, paused.share, paused.events[-1].what) == (Phase.PAUSED, 10, "paused")
    still = advance(paused, stats(1), stats(4), SLA_, 500.0)  # far past the hold: a paused rollout waits
    assert (still.phase, still.step, still.live) == (Phase.PAUSED, 0, True)
    assert still.new_stats == stats(1)  # the figures are still observed
    resumed = act(still, "resume", 600.0)
    assert (resumed.phase, resumed.step_since, resumed.failed_gate) == (Phase.PROGRESSING, 600.0, None)
    assert advance(resumed, stats(1), stats(4), SLA_, 629.0).step == 0  # the hold runs again from 600
    assert advance(resumed, stats(1), stats(4), SLA_, 630.0).step == 1


def test_resume_of_a_step_not_yet_live_has_no_hold_to_restart():
    paused = act(begin(), "pause", 1.0)
    resumed = act(paused, "resume", 2.0)
    assert (resumed.phase, resumed.live, resumed.step_since) == (Phase.PROGRESSING, False, None)


def test_resume_after_a_breach_clears_the_failed_gate():
    live = advance(begin(auto_rollback=False), stats(1), stats(4), SLA_, 0.0)
    paused = advance(live, stats(1, p99=5000.0), stats(4), SLA_, 1.0)
    assert paused.failed_gate is not None
    assert act(paused, "resume", 2.0).failed_gate is None


@pytest.mark.parametrize("phase", [Phase.PROGRESSING, Phase.PAUSED])
def test_abort_gives_the_old_build_all_traffic(phase):
    state = at(begin(), step=1, share=50, phase=phase)
    aborted = act(state, "abort", 77.0)
    assert (aborted.phase, aborted.share, aborted.live, aborted.finished_at) == (Phase.ABORTED, 0, False, 77.0)
    assert aborted.events[-1].what == "aborted" and replica_counts(aborted) == (4, 0)


@pytest.mark.parametrize(
    ("phase", "action"),
    [
        (Phase.PAUSED, "pause"),
        (Phase.SUCCEEDED, "pause"),
        (Phase.ROLLED_BACK, "pause"),
        (Phase.PROGRESSING, "resume"),
        (Phase.ABORTED, "resume"),
        (Phase.SUCCEEDED, "resume"),
        (Phase.SUCCEEDED, "abort"),
        (Phase.ROLLED_BACK, "abort"),
        (Phase.ABORTED, "abort"),
        (Phase.PROGRESSING, "restart"),
    ],
)
def test_an_action_the_phase_does_not_allow_is_a_conflict(phase, action):
    state = dataclasses.replace(begin(), phase=phase)
    with pytest.raises(RolloutConflict) as info:
        act(state, action, 1.0)  # type: ignore[arg-type]
    assert (info.value.kind, info.value.status) == ("rollout_conflict", 409)
    assert (action if action == "restart" else phase.value) in str(info.value)


def test_a_finished_rollout_ignores_observations():
    done = act(begin(), "abort", 1.0)
    after = advance(done, stats(1), stats(4), SLA_, 100.0)
    assert (after.phase, after.share, after.events) == (done.phase, done.share, done.events)


# ---- replica counts -------------------------------------------------------------------------------

# (replicas, step index, share, phase, policy, yielded) -> (old, new); steps 10/50/100
COUNTS = [
    (1, 0, 0, Phase.PROGRESSING, {}, 0, (1, 1)),
    (1, 1, 10, Phase.PROGRESSING, {}, 0, (1, 1)),
    (1, 2, 50, Phase.PROGRESSING, {}, 0, (1, 1)),
    (1, 2, 100, Phase.PROGRESSING, {}, 0, (1, 1)),
    (1, 2, 100, Phase.SUCCEEDED, {}, 0, (0, 1)),
    (2, 0, 0, Phase.PROGRESSING, {}, 0, (2, 1)),
    (2, 1, 10, Phase.PROGRESSING, {}, 0, (2, 1)),
    (2, 2, 50, Phase.PROGRESSING, {}, 0, (2, 2)),  # the default surge keeps the old build whole
    (2, 2, 100, Phase.PROGRESSING, {}, 0, (2, 2)),
    (2, 2, 100, Phase.SUCCEEDED, {}, 0, (0, 2)),
    (4, 0, 0, Phase.PROGRESSING, {}, 0, (4, 1)),
    (4, 1, 10, Phase.PROGRESSING, {}, 0, (4, 2)),
    (4, 2, 50, Phase.PROGRESSING, {}, 0, (4, 4)),
    (4, 2, 100, Phase.PROGRESSING, {}, 0, (4, 4)),
    (4, 2, 100, Phase.SUCCEEDED, {}, 0, (0, 4)),
    (4, 1, 10, Phase.PAUSED, {}, 0, (4, 2)),
    (4, 1, 0, Phase.ROLLED_BACK, {}, 0, (4, 0)),
    (4, 1, 0, Phase.ABORTED, {}, 0, (4, 0)),
    # within max_surge: old + new <= replicas + max_surge
    (4, 0, 0, Phase.PROGRESSING, {"max_surge": 0}, 0, (4, 0)),
    (4, 0, 0, Phase.PROGRESSING, {"max_surge": 1}, 0, (4, 1)),
    (4, 1, 10, Phase.PROGRESSING, {"max_surge": 1}, 0, (4, 1)),
    (4, 2, 50, Phase.PROGRESSING, {"max_surge": 2}, 0, (2, 4)),  # a smaller surge: old shrinks to its share
    (4, 1, 20, Phase.PROGRESSING, {"max_surge": 2}, 0, (4, 2)),
    # yielded to memory: the old build runs that many fewer, never none. How many may stop at once is
    # max_unavailable's, judged on the ready instances observed (test_rollout_surge.py), not on the count.
    (4, 0, 0, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 1}, 1, (3, 1)),
    (4, 0, 0, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 1}, 2, (2, 1)),
    (4, 0, 0, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 2}, 2, (2, 1)),
    (4, 0, 0, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 1}, 3, (1, 1)),
    # the last step beside the old build's last instance: it needs 3 ready new ones (rollout_needed)
    (4, 2, 50, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 1}, 0, (2, 2)),
    (4, 2, 50, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 1}, 1, (1, 3)),
    (4, 2, 100, Phase.PROGRESSING, {"max_surge": 0, "max_unavailable": 1}, 0, (1, 3)),
    (4, 2, 100, Phase.SUCCEEDED, {"max_surge": 0, "max_unavailable": 1}, 0, (0, 4)),
]


@pytest.mark.parametrize(("replicas", "step", "share", "phase", "policy", "yielded", "counts"), COUNTS)
def test_replica_counts(replicas, step, share, phase, policy, yielded, counts):
    state = at(begin(replicas=replicas, **policy), step=step, share=share, phase=phase, yielded=yielded)
    assert replica_counts(state) == counts


@pytest.mark.parametrize("replicas", [0, 1])
def test_a_rollout_sizes_against_at_least_one_replica(replicas):
    assert begin(replicas=replicas).replicas == 1


def test_a_yielded_instance_never_leaves_the_old_build_empty_while_it_serves_and_room_exists():
    """Two replicas, no surge, one old instance yielded to memory to start the first new one. At 50% the
    old build's share needs ceil(2 x 50%) = 1 instance and 1 old + 1 new fit in the 2 replicas, yet the
    yield is still subtracted: the old cluster would be emptied while the routes send it half the traffic
    (the docstring's "at least one until the rollout succeeds, so a rollback always has somewhere to go")."""
    state = begin(replicas=2, steps=[50, 100], max_surge=0, max_unavailable=1)
    state = advance(state, stats(0), stats(2), SLA_, 1.0, waiting_for_memory="m.g1-0 on n1: no memory")
    assert state.yielded == 1 and replica_counts(state) == (1, 1)
    state = advance(state, stats(1), stats(1), SLA_, 2.0)
    assert (state.live, state.share) == (True, 50)
    assert replica_counts(state) == (1, 1)


# ---- memory -------------------------------------------------------------------------------------

MEMORY = "m.g1-0 on n1: waiting for 20480 MB of GPU memory"


# (max_surge, max_unavailable, yielded before, why a new instance waits) -> (yielded after, what the reason
# says when nothing yields); two replicas (with one, the old build's only instance never yields: it serves
# all traffic until the new one is ready)
LAST = "the old version is down to its last instance, which stays until the rollout succeeds"
NOT_ALLOWED = "max_unavailable is 0: no old instance stops before new ones are ready"
YIELDS = {
    "nothing may stop early: it waits": (
        0,
        0,
        0,
        MEMORY,
        0,
        f"waiting for memory for the new version: {MEMORY}; {NOT_ALLOWED}",
    ),
    "no surge: one old instance yields": (0, 1, 0, MEMORY, 1, ""),
    "one already yielded: not the old build's last": (0, 1, 1, MEMORY, 1, f"{LAST} (its 100% share, or a rollback"),
    "the one yield made room: not the last either": (
        0,
        2,
        1,
        MEMORY,
        1,
        f"; waiting for memory for the new version: {MEMORY}",
    ),
    "room to surge, no memory problem: nothing yields": (
        None,
        1,
        0,
        "",
        0,
        "waiting for 1 new instance(s) to be ready",
    ),
    "no surge at all: one old instance yields to make room, as a rolling update would": (0, 1, 0, "", 1, ""),
    "default surge, nothing may stop: it waits": (
        None,
        0,
        0,
        MEMORY,
        0,
        f"waiting for memory for the new version: {MEMORY}; {NOT_ALLOWED}",
    ),
    # The default surge (replicas) plans the new instance, but its node has no memory for it beside the
    # old one: only stopping an old instance lets it start (max_unavailable: "when memory has no room to
    # surge").
    "default surge, one old instance yields": (None, 1, 0, MEMORY, 1, ""),
}


@pytest.mark.parametrize(
    ("max_surge", "max_unavailable", "yielded", "memory", "after", "reason"), YIELDS.values(), ids=YIELDS.keys()
)
def test_waiting_for_memory_yields_an_old_instance_only_when_max_unavailable_allows(
    max_surge, max_unavailable, yielded, memory, after, reason
):
    state = dataclasses.replace(
        begin(replicas=2, max_surge=max_surge, max_unavailable=max_unavailable), yielded=yielded
    )
    state = advance(state, stats(0), stats(2 - yielded), SLA_, 5.0, waiting_for_memory=memory)
    assert state.yielded == after
    assert (state.phase, state.live, state.share) == (Phase.PROGRESSING, False, 0)
    if after > yielded:
        assert state.events[-1].what == "yielded" and memory in state.reason
        assert replica_counts(state) == (1, 1)
    else:
        assert reason in state.reason
        assert state.reason.endswith("; preparing for 0 s, given up at 600 s")
        if memory:
            assert memory in state.reason


def test_a_surge_too_small_for_the_step_says_so():
    state = begin(replicas=4, max_surge=0)
    state = advance(state, stats(0), stats(4), SLA_, 1.0)
    assert "max_surge allows 0 of the 1 new instances" in state.reason


# ---- recorded form --------------------------------------------------------------------------------


def _gate(name: str, holds: bool | None) -> GateResult:
    return GateResult(name, holds, 1500.0, 1000.0, "p99 ms 1500 > 1000")


RECORDED = {
    "fresh": begin(),
    "live, holding": at(begin(), step=1, share=50, since=12.5, reference=stats(4, p99=10.0)),
    "paused by a breach": at(
        begin(auto_rollback=False), step=0, share=10, phase=Phase.PAUSED, failed_gate=_gate("p99_vs_sla", False)
    ),
    "rolled back": dataclasses.replace(
        begin(replicas=2, max_unavailable=1, max_surge=0),
        phase=Phase.ROLLED_BACK,
        failed_gate=_gate("p99_vs_sla", False),
        yielded=1,
        finished_at=99.0,
        reason="gate p99_vs_sla breached",
    ),
    "succeeded": at(begin(), step=2, share=100, since=60.0, phase=Phase.SUCCEEDED, finished_at=90.0),
}


@pytest.mark.parametrize("state", RECORDED.values(), ids=RECORDED.keys())
def test_the_recorded_form_reads_back_as_the_same_machine_state(state):
    observed = dataclasses.replace(
        state,
        gates=(_gate("p99_vs_sla", True),),
        new_stats=stats(2, p99=12.0),
        old_stats=stats(4, p99=11.0),
    )
    doc = json.loads(json.dumps(observed.to_json()))  # what state.py writes, through real JSON
    back = RolloutState.from_json(doc)
    # Figures are observed again after a restart; everything else comes back.
    assert back == dataclasses.replace(observed, gates=(), new_stats=TrackStats(), old_stats=TrackStats())
    assert back.to_json()["events"] == doc["events"]


def test_the_recorded_form_shows_steps_from_one_and_both_shares():
    doc = at(begin(), step=1, share=10, live=False).to_json()
    assert (doc["step"], doc["step_share"], doc["steps"], doc["share"]) == (
        2,
        50,
        [10, 50, 100],
        {"new": 10, "old": 90},
    )
    assert (doc["phase"], doc["from_version"], doc["to_version"], doc["generation"]) == ("progressing", "1", "2", 1)
    assert doc["held_s"] is None and doc["policy"]["hold_s"] == 30.0


def test_a_rollout_that_could_never_finish_is_refused_with_the_spec():
    """max_surge=1 with 4 replicas: the 50% step needs 2 new instances while the old build still holds
    the 4 its 80% needs, 6 > 4 + 1, and no old instance may stop early."""
    from sie.errors import SpecError
    from sie.spec_loader import parse_model_service

    doc = {
        "kind": "ModelService",
        "spec": {
            "model": {"name": "m"},
            "backend": {"type": "sim"},
            "sla": {"min_replicas": 4, "max_replicas": 4},
            "rollout": {"max_surge": 1},
        },
    }
    with pytest.raises(SpecError, match="step 50% needs 2 new instances"):
        parse_model_service(doc, "m.yaml")
    doc["spec"]["rollout"]["max_unavailable"] = 1  # one old instance may stop first: it can finish
    assert parse_model_service(doc, "m.yaml").spec.rollout.max_unavailable == 1
