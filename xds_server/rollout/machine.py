"""The rollout state machine (DESIGN §11). Pure: a state and observations in, the next state out.

    start ──► PROGRESSING ──(every step held with its gates met)──► SUCCEEDED   (the new build is stable)
                 │  ▲                 a breached gate, auto_rollback ──► ROLLED_BACK (share 0, new drained)
           pause │  │ resume          a breached gate, no auto_rollback ──► PAUSED
                 ▼  │                 a deadline passed (below), the same as a breach
               PAUSED                 abort (by hand) ──► ABORTED (as a rollback)

A step is first *prepared* (the new build's instances for its share start, and must be ready) and then
*live* (its share is in the routes; its hold runs from then). The share that is live is the only share
Envoy carries: a prepared step does not move traffic. While any share is live, every gate is judged on
each observation, and a breach acts at once; a step advances only after its hold with every gate met.

A share in the routes needs its instances ready. Envoy answers the requests it sends to a cluster with no
ready host with its own 503: no sidecar counts them, so no gate sees them. So, paused or not, a share
whose new instances are all gone (crashed, their node lost) is taken out of the routes at once
(`withdrawn`) and comes back when they are ready again; while the new build is short of what its share
needs, the step does not advance, and the hold counts only the time it had them. Deadlines of the
policy end a rollout that cannot go on (as a breach does: rolled back, or paused without auto_rollback):
progress_deadline_s of a step being prepared without the ready instances it needs to go live (a build
that never becomes ready: it crash-loops, its model path is wrong, no node has memory for it), the same
of a share in the routes short of them, and starved_deadline_s of a share that gets no answer from the
new build while the old build's traffic says it should. Each counts only time under watch: a pause is a
person's to end, so a resume starts the deadlines again, and the time the control plane was down is no
one's wait, so after a restart each counts from when it watches again (`watched_since`).

Room (max_unavailable). Where the nodes have no memory for the new build's instances beside the old
build's (or max_surge leaves none), old instances stop first, one at a time (`yielded`): each only where
it stops a running instance, only once the one before has stopped, and only while the ready instances
that serve (the old build's, and the new build's once a share of it is in the routes) stay at least
replicas - max_unavailable without it, as Kubernetes' RollingUpdate keeps them. The room an old instance
gave up is not given back while the rollout runs (the new build's instances hold it), and the old build
keeps its last instance until the rollout ends, for its share or a rollback to go to. So on nodes with
room for only the replicas a step whose share needs every replica goes live one short (sie.spec.
rollout_needed: max_unavailable covers it), and the last new instance starts in the old build's last
instance's room when the new build is promoted.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal

from sie.errors import InputError
from sie.spec import SLA, RolloutPolicy, rollout_needed, rollout_sizes, share_instances
from xds_server.rollout.gates import GateResult, TrackStats, judge
from xds_server.rollout.record import Event, Phase, RolloutRecordError, RolloutState

__all__ = [
    "Action",
    "Event",
    "Phase",
    "RolloutConflict",
    "RolloutRecordError",
    "RolloutState",
    "act",
    "advance",
    "replica_counts",
    "start",
]

Action = Literal["pause", "resume", "abort"]


class RolloutConflict(InputError):
    """A by-hand action the rollout's phase does not allow (resume a finished rollout, say): 409."""

    def __init__(self, message: str):
        super().__init__("rollout_conflict", message, status=409)


def start(
    model_id: str,
    *,
    from_generation: int,
    from_version: str,
    to_version: str,
    policy: RolloutPolicy,
    replicas: int,
    now: float,
) -> RolloutState:
    state = RolloutState(
        model_id=model_id,
        from_generation=from_generation,
        generation=from_generation + 1,
        from_version=from_version,
        to_version=to_version,
        policy=policy,
        replicas=max(1, replicas),
        started_at=now,
    )
    return state.with_event(
        now,
        "started",
        f"{from_version} -> {to_version}: steps {'/'.join(map(str, policy.steps))}%, hold {policy.hold_s:g} s each",
    )


def replica_counts(state: RolloutState) -> tuple[int, int]:
    """(instances of the old build, instances of the new build) the fleet should run now
    (sie.spec.rollout_sizes: what the live share and the step being prepared need, within max_surge,
    less what the old build yielded). A withdrawn share counts as live: the fleet keeps its shape for when
    it comes back."""
    n = state.replicas
    if state.phase is Phase.SUCCEEDED:
        return 0, n
    if not state.phase.active:
        return n, 0
    old, new, _ = _sizes(state)
    return old, new


def advance(
    state: RolloutState,
    new: TrackStats,
    old: TrackStats,
    sla: SLA,
    now: float,
    *,
    waiting_for_memory: str = "",
    watched_since: float | None = None,
) -> RolloutState:
    """The next state after one observation: the new and old builds' figures, and why a new instance
    waits if the node hosts say it waits for memory. `watched_since`: since when this control plane has
    watched (its first observation since it started); no deadline counts time before it."""
    gates = state.policy.gates
    reference = old if old.requests >= gates.min_requests else state.reference
    verdicts = tuple(judge(new, reference or old, gates, sla))
    state = replace(state, gates=verdicts, new_stats=new, old_stats=old, reference=reference)
    if not state.phase.active:
        return state
    watched = -math.inf if watched_since is None else watched_since

    if state.phase is Phase.PROGRESSING and state.share > 0:
        breached = next((g for g in verdicts if g.holds is False), None)
        if breached is not None:
            return _breach(state, breached, now)
    followed = _follow_readiness(state, new, now)
    if followed.events is not state.events or followed.phase is Phase.PAUSED:
        return followed  # a share withdrawn or restored: the routes change now, the step on the next observation
    state = followed
    state = _watch_answers(state, new, old, now)
    if not state.live and state.preparing_since is None:
        # The rollout's first observation, or the first of a record written before the progress deadline
        # existed: the step's wait is counted from now on.
        state = replace(state, preparing_since=now)
    stalled = _past_deadline(state, new, old, now, waiting_for_memory, watched)
    if stalled is not None:
        return stalled

    step_share = state.steps[state.step]
    if not state.live:
        old_count, planned, need = _sizes(state)
        if new.ready >= need:
            wanted = share_instances(state.replicas, step_share)
            short = (
                f" on {need} of its {wanted} instances: the last starts in the room of the old version's last "
                "instance once the rollout succeeds"
                if need < wanted
                else ""
            )
            return state.with_event(
                now,
                f"step {state.step + 1}/{len(state.steps)}",
                f"{step_share}% of traffic to {state.to_version}{short}",
                **_moved(state, live=True, share=step_share, withdrawn=0),
                unready_since=None,
                starved_since=None,
                preparing_since=None,
                step_since=now,
            )
        if waiting_for_memory or planned < need:
            blocker = _yield_blocker(state, new, old, old_count, need)
            if not blocker:
                kept = min(old_count, old.ready) - 1
                why = f"no memory to surge ({waiting_for_memory})" if waiting_for_memory else "max_surge is reached"
                return state.with_event(
                    now,
                    "yielded",
                    f"{why}; stopping one old instance first (the old version keeps {kept})",
                    yielded=state.yielded + old_count - kept,
                )
            why = _blocked(state, waiting_for_memory, planned, need, blocker)
        else:
            why = f"waiting for {need - new.ready} new instance(s) to be ready ({new.ready}/{need})"
        return replace(state, reason=why + _short_note(state, new, now, watched) + _preparing_note(state, now, watched))

    assert state.step_since is not None
    if state.unready_since is not None:
        return replace(
            state,
            reason=f"holding {step_share}%: the step waits for its instances" + _short_note(state, new, now, watched),
        )
    held = now - state.step_since
    if held < state.policy.hold_s:
        return replace(state, reason=f"holding {step_share}%: {held:.0f}/{state.policy.hold_s:g} s")
    unjudged = [g for g in verdicts if g.holds is None]
    if unjudged:
        return replace(state, reason=f"holding {step_share}%: waiting for samples ({unjudged[0].detail})")
    if state.step + 1 == len(state.steps):
        return state.with_event(
            now,
            "succeeded",
            f"{state.to_version} serves 100%; the old version drains",
            phase=Phase.SUCCEEDED,
            finished_at=now,
        )
    return replace(
        state,
        **_moved(state, step=state.step + 1, live=False),
        step_since=None,
        preparing_since=now,
        reason="preparing the next step",
    )


def _sizes(state: RolloutState) -> tuple[int, int, int]:
    """(old, new, needed) at the rollout's position (sie.spec.rollout_sizes)."""
    policy = state.policy
    return rollout_sizes(
        state.replicas,
        state.steps[state.step],
        state.routable_share,
        policy.max_surge,
        policy.max_unavailable,
        state.yielded,
    )


def _moved(state: RolloutState, **position: Any) -> dict[str, Any]:
    """The changes that move the rollout to `position` (step, live, share, withdrawn), with the `yielded`
    that keeps the old build's count from rising there. What it yielded is not given back while the
    rollout runs: the new build's instances hold that room, so an old instance started again could only
    wait for memory, and the next yield would stop it instead of one that runs, freeing nothing."""
    kept = _sizes(state)[0]
    there = _sizes(replace(state, **position, yielded=0))[0]
    return {**position, "yielded": max(0, there - kept)}


def _yield_blocker(state: RolloutState, new: TrackStats, old: TrackStats, old_count: int, need: int) -> str:
    """Why no old instance may stop now to make room for the new build's ("" when one may).

    One stops only where that stops a running instance: the count falls to what runs less one (the
    placement keeps ready instances first, so one ready instance stops, with any that is not ready and
    holds nothing). Only once the one before is gone (until then its memory is not free, and the node
    hosts still report the wait). Never the old build's last (sie.spec.rollout_sizes). And only while the
    ready instances that serve stay at least replicas - max_unavailable without it: the old build's, and
    the new build's once a share of it is in the routes (before that they serve nothing)."""
    policy = state.policy
    if policy.max_unavailable == 0:
        return "max_unavailable is 0: no old instance stops before new ones are ready"
    if old.draining or old.ready > old_count:
        running = old.ready + old.draining
        return f"an old instance is stopping to make room (the old version runs {running}, keeps {old_count})"
    if old_count <= 1:
        return (
            f"the old version is down to its last instance, which stays until the rollout succeeds (its "
            f"{100 - state.share}% share, or a rollback, needs it): the step's {need} new instance(s) need room "
            "beside it"
        )
    if old.ready <= 1:
        return f"{old.ready} of the old version's {old_count} instances are ready: its last ready one stays"
    serving = old.ready + (new.ready if state.share > 0 else 0)
    if serving - 1 < state.replicas - policy.max_unavailable:
        idle = ""
        if state.share == 0 and new.ready:
            idle = (
                f"; the new version's {new.ready} ready instance(s) serve nothing until step "
                f"{state.steps[state.step]}% has its {need}"
            )
        return (
            f"max_unavailable ({policy.max_unavailable}) is used up: {serving} of the {state.replicas} replicas "
            f"serve, and another old instance stops only once a new one is ready{idle}"
        )
    return ""


def _blocked(state: RolloutState, waiting_for_memory: str, planned: int, need: int, blocker: str) -> str:
    """Why a step being prepared waits where its new instances have no room: the policy's own limit
    first, where that is what holds it, then what the node hosts or max_surge say."""
    if waiting_for_memory:
        lack = f"waiting for memory for the new version: {waiting_for_memory}"
    else:
        lack = f"max_surge allows {planned} of the {need} new instances this step needs; waiting"
    if not blocker:
        return lack
    # With max_unavailable 0 the policy stops nothing early by design: the nodes' room is what is short.
    return f"{lack}; {blocker}" if state.policy.max_unavailable == 0 else f"{blocker}; {lack}"


def _needed(state: RolloutState, share: int) -> int:
    """Ready new instances a share in the routes needs (the count its step went live with; the old build
    never grows back while the rollout runs, so that count never rises)."""
    return rollout_needed(state.replicas, share, _sizes(state)[0], state.policy.max_unavailable)


def _follow_readiness(state: RolloutState, new: TrackStats, now: float) -> RolloutState:
    """Withdraw the share when no new instance is ready, bring it back when all it needs are, and note
    since when the new build has been short of them."""
    share = state.routable_share
    if share == 0:
        return state if state.unready_since is None else replace(state, unready_since=None)
    need = _needed(state, share)
    if new.ready >= need:
        if state.unready_since is None:
            return state
        # The hold counts only the time the step had its instances: the shortfall is added to it.
        since = state.step_since
        if state.live and since is not None:
            since += now - state.unready_since
        if state.withdrawn:
            return state.with_event(
                now,
                "restored",
                f"{new.ready}/{need} new instances ready again: {share}% back to {state.to_version}",
                share=share,
                withdrawn=0,
                unready_since=None,
                step_since=since,
            )
        return replace(state, unready_since=None, step_since=since)
    short_since = now if state.unready_since is None else state.unready_since
    if new.ready == 0 and state.share > 0:
        return state.with_event(
            now,
            "withdrawn",
            f"no instance of {state.to_version} is ready: its {share}% goes to {state.from_version} until {need} are",
            share=0,
            withdrawn=share,
            unready_since=short_since,
            starved_since=None,
        )
    return replace(state, unready_since=short_since)


def _watch_answers(state: RolloutState, new: TrackStats, old: TrackStats, now: float) -> RolloutState:
    """Note since when a share whose instances are ready has had no answer from them although the old
    build's answers say the share should have brought min_requests."""
    share = state.share
    starved = (
        0 < share < 100
        and state.unready_since is None
        and new.requests == 0
        and old.requests * share >= state.policy.gates.min_requests * (100 - share)
    )
    if not starved:
        return state if state.starved_since is None else replace(state, starved_since=None)
    return state if state.starved_since is not None else replace(state, starved_since=now)


def _past_deadline(
    state: RolloutState, new: TrackStats, old: TrackStats, now: float, waiting_for_memory: str, watched: float
) -> RolloutState | None:
    """The rollout given up on, when the new build has been short of ready instances or of answers too long.

    The step being prepared is judged first: its wait began no later than any shortfall of the share in
    the routes (the step before ended its hold with its instances ready), so it is the wait that says most.
    Each wait counts from `watched` at the earliest: the time the control plane was down is no one's."""
    policy = state.policy
    preparing = _watched(state.preparing_since, watched)
    if preparing is not None and now - preparing >= policy.progress_deadline_s:
        step_share = state.steps[state.step]
        old_count, planned, need = _sizes(state)
        if new.ready < need:
            waited = ""
            if waiting_for_memory or planned < need:
                blocker = _yield_blocker(state, new, old, old_count, need)
                waited = f" ({_blocked(state, waiting_for_memory, planned, need, blocker)})"
            return _give_up(
                state,
                f"the new version had {new.ready} of the {need} ready instances step {step_share}% needs for "
                f"{now - preparing:.0f} s{waited}",
                now,
            )
    unready = _watched(state.unready_since, watched)
    if unready is not None and now - unready >= policy.progress_deadline_s:
        need = _needed(state, state.routable_share)
        has = "no ready instance" if new.ready == 0 else f"{new.ready} of the {need} ready instances it needs"
        return _give_up(state, f"the new version has {has} for {now - unready:.0f} s", now)
    starved = _watched(state.starved_since, watched)
    if starved is not None and now - starved >= policy.starved_deadline_s:
        return _give_up(
            state,
            f"no answer from the new version at {state.share}% for {now - starved:.0f} s while the "
            f"old version answered {old.requests}: its traffic does not reach it",
            now,
        )
    return None


def _watched(since: float | None, watched: float) -> float | None:
    """Since when a wait counts: from when it began, or from when the control plane watches again if it
    began before (the record of a control plane that was down keeps the start; the downtime is left out)."""
    return None if since is None else max(since, watched)


def _short_note(state: RolloutState, new: TrackStats, now: float, watched: float) -> str:
    """What the shortfall of ready new instances adds to the reason, if there is one."""
    unready = _watched(state.unready_since, watched)
    if unready is None:
        return ""
    share = state.routable_share
    short = f"{new.ready}/{_needed(state, share)} new instances ready for {now - unready:.0f} s"
    withdrawn = f"{share}% withdrawn until they are; " if state.withdrawn else ""
    return f" ({withdrawn}{short}; given up at {state.policy.progress_deadline_s:g} s)"


def _preparing_note(state: RolloutState, now: float, watched: float) -> str:
    """How long the step being prepared has waited, against its deadline."""
    preparing = _watched(state.preparing_since, watched)
    if preparing is None:
        return ""
    return f"; preparing for {now - preparing:.0f} s, given up at {state.policy.progress_deadline_s:g} s"


def _breach(state: RolloutState, gate: GateResult, now: float) -> RolloutState:
    return _give_up(state, f"gate {gate.name} breached at {state.share}%: {gate.detail}", now, gate)


def _give_up(state: RolloutState, detail: str, now: float, gate: GateResult | None = None) -> RolloutState:
    """Roll back, or with auto_rollback off pause where it is (a withdrawn share stays withdrawn)."""
    if state.policy.auto_rollback:
        return state.with_event(
            now,
            "rolled_back",
            detail,
            phase=Phase.ROLLED_BACK,
            share=0,
            live=False,
            withdrawn=0,
            unready_since=None,
            starved_since=None,
            preparing_since=None,
            failed_gate=gate,
            finished_at=now,
        )
    return state.with_event(now, "paused", f"{detail} (auto_rollback is off)", phase=Phase.PAUSED, failed_gate=gate)


def act(state: RolloutState, action: Action, now: float) -> RolloutState:
    """A by-hand action. RolloutConflict when the phase does not allow it."""
    if action == "pause":
        if state.phase is not Phase.PROGRESSING:
            raise RolloutConflict(
                f"the rollout of {state.model_id} is {state.phase.value}; only a progressing one pauses"
            )
        return state.with_event(now, "paused", "paused by hand", phase=Phase.PAUSED)
    if action == "resume":
        if state.phase is not Phase.PAUSED:
            raise RolloutConflict(f"the rollout of {state.model_id} is {state.phase.value}; only a paused one resumes")
        # The hold starts again: what was seen before the pause is not a hold under watch. So do the
        # deadlines: the pause was a person's to end.
        return state.with_event(
            now,
            "resumed",
            "resumed by hand",
            phase=Phase.PROGRESSING,
            failed_gate=None,
            step_since=now if state.live else None,
            preparing_since=None if state.live else now,
            unready_since=None if state.unready_since is None else now,
            starved_since=None,
        )
    if action == "abort":
        if not state.phase.active:
            raise RolloutConflict(f"the rollout of {state.model_id} is {state.phase.value}; nothing to abort")
        return state.with_event(
            now,
            "aborted",
            "aborted by hand: the old version takes all traffic",
            phase=Phase.ABORTED,
            share=0,
            live=False,
            withdrawn=0,
            unready_since=None,
            starved_since=None,
            preparing_since=None,
            finished_at=now,
        )
    raise RolloutConflict(f"unknown rollout action {action!r}")
