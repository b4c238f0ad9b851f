"""Rollouts where the nodes have little or no room beside the old build (xds_server.rollout.machine with
max_unavailable): the machine against one simulated node of a fixed number of instance slots, following
its counts as the placement and a node host would. Each rollout must succeed, and at every tick the ready
instances of both builds stay at least replicas - max_unavailable (what max_unavailable promises, as in
Kubernetes' RollingUpdate), no share is routed to a build with no ready instance, and the node never
holds more instances than its slots. Pure: the clock is the loop's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import pytest

from sie.spec import SLA, RolloutPolicy, rollout_problem
from xds_server.rollout.gates import TrackStats
from xds_server.rollout.machine import Phase, RolloutState, advance, replica_counts, start

SLA_ = SLA(p99_latency_ms=1000.0, max_queue_time_ms=1000.0)
DRAIN_S, LOAD_S = 25, 60
MEMORY = "m.g1-0 on n1: pending: waiting for GPU memory: 0/20480 MB"
# Placement keeps the instances closest to serving (xds_server.placement._keep): ready, then loading,
# then those waiting for memory.
KEEP_ORDER = ("ready", "loading", "waiting")


@dataclass
class Instance:
    build: str  # "old" or "new"
    phase: str  # waiting (placed, no memory for it yet), loading, ready, draining
    until: int = 0  # when loading or draining ends


@dataclass
class Node:
    """One node with `slots` instances' worth of memory. A freed slot goes to a waiting instance of the new
    build first, or of the old build first (`new_first`): a node host admits in its own order."""

    slots: int
    new_first: bool
    instances: list[Instance]

    def follow(self, counts: tuple[int, int], now: int) -> None:
        """The placement's counts: the instances closest to serving stay; one with memory that is dropped
        drains (a ready one) or stops (a loading one), one still waiting is simply not started."""
        for build, want in zip(("old", "new"), counts, strict=True):
            running = sorted(
                (i for i in self.instances if i.build == build and i.phase != "draining"),
                key=lambda i: KEEP_ORDER.index(i.phase),
            )
            for inst in running[want:]:
                if inst.phase == "ready":
                    inst.phase, inst.until = "draining", now + DRAIN_S
                else:
                    self.instances.remove(inst)
            self.instances += [Instance(build, "waiting") for _ in range(want - len(running))]

    def tick(self, now: int) -> None:
        for inst in list(self.instances):
            if inst.phase == "draining" and now >= inst.until:
                self.instances.remove(inst)
            elif inst.phase == "loading" and now >= inst.until:
                inst.phase = "ready"
        waiting = sorted(
            (i for i in self.instances if i.phase == "waiting"), key=lambda i: (i.build == "new") != self.new_first
        )
        for inst in waiting[: self.slots - self.used()]:
            inst.phase, inst.until = "loading", now + LOAD_S

    def used(self) -> int:
        return sum(1 for i in self.instances if i.phase != "waiting")

    def count(self, build: str, phase: str) -> int:
        return sum(1 for i in self.instances if i.build == build and i.phase == phase)


def figures(build: str, node: Node, share: int) -> TrackStats:
    """A build's figures: answers when it has ready instances and a share of the traffic."""
    ready, draining = node.count(build, "ready"), node.count(build, "draining")
    if not (ready and share):
        return TrackStats(ready=ready, draining=draining)
    return TrackStats(requests=500, p99_ms=10.0, error_rate=0.0, queue_time_ms=1.0, ready=ready, draining=draining)


def rollout(replicas: int, slots: int, new_first: bool = True, **policy: Any) -> tuple[RolloutState, int, int]:
    """The rollout run to its end, and on after a success until the new build has all its instances:
    (its last state, the tick it ended at, the fewest ready instances seen). Asserts the invariants at
    every tick."""
    doc = {"hold_s": 30.0, "gates": {"min_requests": 20}} | policy
    rules = RolloutPolicy.model_validate(doc)
    assert rollout_problem(rules, replicas) is None
    state = start("m", from_generation=0, from_version="1", to_version="2", policy=rules, replicas=replicas, now=0.0)
    node = Node(slots, new_first, [Instance("old", "ready") for _ in range(replicas)])
    fewest = replicas
    for now in range(5000):
        node.follow(replica_counts(state), now)
        node.tick(now)
        ready_old, ready_new = node.count("old", "ready"), node.count("new", "ready")
        where = f"t={now}: {ready_old} old + {ready_new} new ready, {state.reason}"
        assert node.used() <= slots, where
        assert ready_old + ready_new >= replicas - rules.max_unavailable, where
        fewest = min(fewest, ready_old + ready_new)
        # The routes as they are while the fleet moved: the share the last observation left.
        assert state.share == 0 or ready_new > 0, where
        assert state.share == 100 or not state.phase.active or ready_old > 0, where
        if state.phase is Phase.SUCCEEDED and ready_new == replicas and not node.count("old", "draining"):
            return state, now, fewest
        if not state.phase.active and state.phase is not Phase.SUCCEEDED:
            return state, now, fewest
        waiting = MEMORY if node.count("new", "waiting") else ""
        state = advance(
            state,
            figures("new", node, state.share),
            figures("old", node, 100 - state.share),
            SLA_,
            float(now),
            waiting_for_memory=waiting,
        )
    raise AssertionError(f"still {state.phase.value} at t=5000: {state.reason}")


# (replicas, instance slots on the node, policy); each run with either build first to a freed slot
FITS = {
    "4 on 4, max_unavailable 1": (4, 4, {"max_unavailable": 1}),
    "4 on 4, max_unavailable 1, max_surge 1": (4, 4, {"max_unavailable": 1, "max_surge": 1}),
    "4 on 4, max_unavailable 2, max_surge 1": (4, 4, {"max_unavailable": 2, "max_surge": 1}),
    "4 on 4, max_unavailable 1, no surge": (4, 4, {"max_unavailable": 1, "max_surge": 0}),
    "4 on 4, max_unavailable 1, steps of 25%": (4, 4, {"max_unavailable": 1, "steps": [25, 50, 75, 100]}),
    "4 on 4, max_unavailable 3": (4, 4, {"max_unavailable": 3}),
    "4 on 5, max_unavailable 1": (4, 5, {"max_unavailable": 1}),
    "4 on 5, max_unavailable 1, max_surge 1": (4, 5, {"max_unavailable": 1, "max_surge": 1}),
    "2 on 2, max_unavailable 1, steps 50/100": (2, 2, {"max_unavailable": 1, "steps": [50, 100]}),
    "2 on 2, max_unavailable 1, max_surge 1, steps 50/100": (
        2,
        2,
        {"max_unavailable": 1, "max_surge": 1, "steps": [50, 100]},
    ),
    "2 on 2, max_unavailable 1": (2, 2, {"max_unavailable": 1}),
    # 60% needs both replicas: it goes live one short beside the old build's last instance, as 100% does.
    "2 on 2, max_unavailable 1, steps 60/100": (2, 2, {"max_unavailable": 1, "steps": [60, 100]}),
    "2 on 3, max_unavailable 1": (2, 3, {"max_unavailable": 1}),
    "3 on 3, max_unavailable 1": (3, 3, {"max_unavailable": 1}),
    "3 on 4, max_unavailable 1, steps 50/100": (3, 4, {"max_unavailable": 1, "steps": [50, 100]}),
    "8 on 8, max_unavailable 1": (8, 8, {"max_unavailable": 1}),
    "8 on 8, max_unavailable 2, steps 25/50/100": (8, 8, {"max_unavailable": 2, "steps": [25, 50, 100]}),
    "8 on 9, max_unavailable 1": (8, 9, {"max_unavailable": 1}),
    # Room to surge: nothing stops early, the old build keeps all its instances until the end.
    "4 on 8, room to surge": (4, 8, {}),
    "4 on 6, max_surge 2, room for it": (4, 6, {"max_surge": 2}),
}


@pytest.mark.parametrize("new_first", [True, False], ids=["new build first", "old build first"])
@pytest.mark.parametrize(("replicas", "slots", "policy"), FITS.values(), ids=FITS.keys())
def test_a_rollout_finishes_on_a_node_without_room_keeping_the_ready_instances_max_unavailable_allows(
    replicas, slots, policy, new_first
):
    """Before, every max_unavailable case on a full node rolled back at progress_deadline_s: a yield was
    given back when its step went live (the old instance it stopped could not start again, the next yield
    lowered the count onto it and freed nothing), and the last step needed replicas + 1 slots."""
    state, _, fewest = rollout(replicas, slots, new_first, **policy)
    assert state.phase is Phase.SUCCEEDED, state.reason
    assert [e.what for e in state.events if e.what in ("rolled_back", "paused", "withdrawn")] == []
    unavailable = policy.get("max_unavailable", 0)
    assert fewest >= replicas - unavailable
    if slots >= 2 * replicas:
        assert fewest == replicas and state.yielded == 0


def test_an_old_instance_stops_only_once_the_one_before_is_gone():
    """Three may be unavailable, but one stopped instance makes the room one new instance needs: while it
    drains (its memory not free yet, the node host still reporting the wait) no second one stops."""
    state, _, fewest = rollout(4, 4, max_unavailable=3, steps=[25, 50, 75, 100])
    assert state.phase is Phase.SUCCEEDED
    assert fewest == 3  # never more than the one stopped instance short


# ---- the machine, step by step ------------------------------------------------------------------


def begin(replicas: int, **policy: Any) -> RolloutState:
    doc = {"steps": [10, 50, 100], "hold_s": 30.0, "gates": {"min_requests": 20}} | policy
    rules = RolloutPolicy.model_validate(doc)
    return start("m", from_generation=0, from_version="1", to_version="2", policy=rules, replicas=replicas, now=0.0)


def stats(ready: int, requests: int = 200, draining: int = 0) -> TrackStats:
    if requests == 0:
        return TrackStats(ready=ready, draining=draining)
    return TrackStats(requests=requests, p99_ms=10.0, error_rate=0.0, queue_time_ms=1.0, ready=ready, draining=draining)


def test_a_yield_stops_a_running_instance_not_one_that_waits():
    """The old build counts four, but only three run (the fourth waits for memory the new build holds).
    Lowering the count by one would drop the one that waits: nothing stops, nothing is freed. The count
    falls to what runs less one instead."""
    state = begin(4, max_unavailable=2)
    state = advance(state, stats(0), stats(3), SLA_, 1.0, waiting_for_memory=MEMORY)
    assert state.events[-1].what == "yielded"
    assert replica_counts(state) == (2, 1)


def test_what_the_old_build_yielded_is_not_given_back_when_the_step_goes_live():
    """Four replicas on four slots: one old instance stops, the new one starts in its room. When the step
    goes live the old build stays at three: a fourth could only wait for memory."""
    state = begin(4, max_unavailable=1)
    state = advance(state, stats(0), stats(4), SLA_, 1.0, waiting_for_memory=MEMORY)
    assert (state.yielded, replica_counts(state)) == (1, (3, 1))
    state = advance(state, stats(1, requests=0), stats(3), SLA_, 90.0)
    assert (state.live, state.share, replica_counts(state)) == (True, 10, (3, 1))
    state = advance(state, stats(1), stats(3), SLA_, 121.0)  # held: the 50% step is prepared
    assert (state.step, state.live, replica_counts(state)) == (1, False, (3, 2))
    state = advance(state, stats(1), stats(3), SLA_, 122.0, waiting_for_memory=MEMORY)
    assert state.events[-1].what == "yielded" and replica_counts(state) == (2, 2)


def test_the_last_step_goes_live_beside_the_old_builds_last_instance_and_the_last_new_one_follows_promotion():
    """Two replicas on two slots, steps 50/100: the old build keeps one instance until the rollout ends (a
    rollback needs it), so the second new one has no room. The 100% step goes live on one new instance
    (one short: what max_unavailable 1 allows), holds with its gates judged, and at the end the second
    starts where the old one was."""
    state = begin(2, max_unavailable=1, steps=[50, 100])
    state = advance(state, stats(0), stats(2), SLA_, 1.0, waiting_for_memory=MEMORY)
    state = advance(state, stats(1, requests=0), stats(1), SLA_, 90.0)
    assert (state.live, state.share, replica_counts(state)) == (True, 50, (1, 1))
    state = advance(state, stats(1), stats(1), SLA_, 120.0)  # held: 100% is prepared, nothing can yield
    assert (state.step, state.live, replica_counts(state)) == (1, False, (1, 2))
    state = advance(state, stats(1), stats(1), SLA_, 121.0, waiting_for_memory=MEMORY)
    assert (state.live, state.share, state.unready_since) == (True, 100, None)
    assert "100% of traffic to 2 on 1 of its 2 instances" in state.events[-1].detail
    assert replica_counts(state) == (1, 2)  # the old build's last instance stays for a rollback
    state = advance(state, stats(1), stats(1, requests=0), SLA_, 140.0, waiting_for_memory=MEMORY)
    assert "holding 100%: 19/30 s" in state.reason
    state = advance(state, stats(1), stats(1, requests=0), SLA_, 151.0, waiting_for_memory=MEMORY)
    assert state.phase is Phase.SUCCEEDED and replica_counts(state) == (0, 2)


def test_a_rollback_in_the_last_steps_hold_has_an_old_instance_to_go_to():
    state = begin(2, max_unavailable=1, steps=[50, 100])
    state = advance(state, stats(0), stats(2), SLA_, 1.0, waiting_for_memory=MEMORY)
    state = advance(state, stats(1, requests=0), stats(1), SLA_, 90.0)
    state = advance(state, stats(1), stats(1), SLA_, 120.0)
    state = advance(state, stats(1), stats(1), SLA_, 121.0, waiting_for_memory=MEMORY)
    assert (state.live, state.share) == (True, 100)
    slow = TrackStats(requests=200, p99_ms=5000.0, error_rate=0.0, queue_time_ms=1.0, ready=1)
    state = advance(state, slow, stats(1, requests=0), SLA_, 125.0)
    assert (state.phase, state.share, replica_counts(state)) == (Phase.ROLLED_BACK, 0, (2, 0))
    assert state.old_stats.ready == 1  # its traffic goes to a ready instance; the second restarts


# what holds the step -> (replicas, policy, yielded, new ready, old ready, old draining, the reason's start)
HELD = {
    "max_unavailable used up": (
        4,
        {"max_unavailable": 1},
        1,
        0,
        3,
        0,
        "max_unavailable (1) is used up: 3 of the 4 replicas serve, and another old instance stops only once "
        "a new one is ready; waiting for memory for the new version: ",
    ),
    "the stopped instance still drains": (
        4,
        {"max_unavailable": 2},
        1,
        0,
        3,
        1,
        "an old instance is stopping to make room (the old version runs 4, keeps 3); waiting for memory",
    ),
    "the old build's last instance": (
        1,
        {"max_unavailable": 1},
        0,
        0,
        1,
        0,
        "the old version is down to its last instance, which stays until the rollout succeeds (its 100% share, "
        "or a rollback, needs it): the step's 1 new instance(s) need room beside it; waiting for memory",
    ),
    "a first step needing more than max_unavailable stops": (
        3,
        {"max_unavailable": 1, "steps": [50, 100]},
        1,
        1,
        2,
        0,
        "max_unavailable (1) is used up: 2 of the 3 replicas serve, and another old instance stops only once a "
        "new one is ready; the new version's 1 ready instance(s) serve nothing until step 50% has its 2; waiting",
    ),
    "max_unavailable 0": (
        2,
        {},
        0,
        0,
        2,
        0,
        f"waiting for memory for the new version: {MEMORY}; max_unavailable is 0: no old instance stops before",
    ),
}


@pytest.mark.parametrize(
    ("replicas", "policy", "yielded", "new", "old", "draining", "reason"), HELD.values(), ids=HELD.keys()
)
def test_a_step_held_by_the_policys_own_limits_says_so_before_the_memory_it_waits_for(
    replicas, policy, yielded, new, old, draining, reason
):
    state = dataclasses.replace(begin(replicas, **policy), yielded=yielded)
    held = advance(state, stats(new, requests=0), stats(old, draining=draining), SLA_, 5.0, waiting_for_memory=MEMORY)
    assert held.yielded == yielded and held.events == state.events
    assert held.reason.startswith(reason), held.reason
    # The deadline names the same cause.
    done = advance(held, stats(new, requests=0), stats(old, draining=draining), SLA_, 605.0, waiting_for_memory=MEMORY)
    assert done.phase is Phase.ROLLED_BACK
    assert f"needs for 600 s ({reason}" in done.reason


def test_the_fleet_simulation_of_a_policy_that_cannot_make_room_ends_saying_why():
    """Three replicas on three slots and a first step of 50%: it needs two new instances before any of
    them serves, and max_unavailable 1 lets one old instance stop. With a fourth slot it finishes
    (FITS); here it is given up on at the deadline, naming the limit, not memory alone."""
    state, _, fewest = rollout(3, 3, max_unavailable=1, steps=[50, 100])
    assert state.phase is Phase.ROLLED_BACK and fewest >= 2
    assert "max_unavailable (1) is used up" in state.reason


# ---- the spec -------------------------------------------------------------------------------------

# (replicas, policy) -> why it can never finish within its own surge, or None
PROBLEMS = {
    "no surge at all, max_unavailable 1: old instances stop one by one": (
        4,
        {"max_surge": 0, "max_unavailable": 1},
        None,
    ),
    "no surge, nothing may stop": (4, {"max_surge": 0}, "step 10% needs 1 new instances"),
    "no surge, a first step of two instances, one may stop": (
        4,
        {"max_surge": 0, "max_unavailable": 1, "steps": [50, 100]},
        "step 50% needs 2 new instances while 0% is live and the old build keeps 3",
    ),
    "no surge, a first step of two instances, two may stop": (
        4,
        {"max_surge": 0, "max_unavailable": 2, "steps": [50, 100]},
        None,
    ),
    "one replica, no surge: its only instance can never make way": (
        1,
        {"max_surge": 0, "max_unavailable": 1},
        "step 10% needs 1 new instances",
    ),
    "two replicas, no surge, one may stop": (2, {"max_surge": 0, "max_unavailable": 1, "steps": [50, 100]}, None),
}


@pytest.mark.parametrize(("replicas", "policy", "problem"), PROBLEMS.values(), ids=PROBLEMS.keys())
def test_rollout_problem_refuses_only_what_cannot_finish_within_the_policys_own_room(replicas, policy, problem):
    got = rollout_problem(RolloutPolicy.model_validate(policy), replicas)
    if problem is None:
        assert got is None
        # And it does finish, on a node with room for just the replicas.
        slots = replicas + (policy.get("max_surge") or 0)
        state, _, _ = rollout(replicas, slots, **policy)
        assert state.phase is Phase.SUCCEEDED, state.reason
    else:
        assert got is not None and problem in got


# ---- the record ---------------------------------------------------------------------------------


def test_the_room_yielded_over_several_steps_is_recorded_and_read_back():
    state = dataclasses.replace(begin(4, max_unavailable=1), step=2, share=50, yielded=3)
    back = RolloutState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state and replica_counts(back) == (1, 4)


@pytest.mark.parametrize(("policy", "yielded"), [({"max_unavailable": 1}, 4), ({}, 1)], ids=["the last", "none may"])
def test_a_record_that_yielded_what_the_machine_never_stops_is_refused(policy, yielded):
    doc = json.loads(json.dumps(dataclasses.replace(begin(4, **policy), yielded=0).to_json()))
    doc["yielded"] = yielded
    with pytest.raises(ValueError, match="the recorded rollout's yielded"):
        RolloutState.from_json(doc)


def test_a_record_from_before_yields_were_kept_means_what_it_meant():
    """Then `yielded` was at most max_unavailable, for the step being prepared, and 0 once it was live:
    the counts it gave are the counts it gives."""
    prepared = dataclasses.replace(
        begin(4, max_unavailable=1, max_surge=1), step=1, share=10, yielded=1, reference=stats(4)
    )
    doc = json.loads(json.dumps(prepared.to_json()))
    doc["reference"].pop("draining")  # written before draining instances were counted
    assert RolloutState.from_json(doc) == dataclasses.replace(prepared, reference=stats(4))
    assert replica_counts(RolloutState.from_json(doc)) == (3, 2)
    live = dataclasses.replace(prepared, live=True, step_since=5.0, share=50, yielded=0)
    assert replica_counts(RolloutState.from_json(json.loads(json.dumps(live.to_json())))) == (3, 2)
