"""The rollout state machine (DESIGN §11). Pure: a state and observations in, the next state out.

    start ──► PROGRESSING ──(every step held with its gates met)──► SUCCEEDED   (the new build is stable)
                 │  ▲                 a breached gate, auto_rollback ──► ROLLED_BACK (share 0, new drained)
           pause │  │ resume          a breached gate, no auto_rollback ──► PAUSED
                 ▼  │                 abort (by hand) ──► ABORTED (as a rollback)
               PAUSED

A step is first *prepared* (the new build's instances for its share start, and must be ready) and then
*live* (its share is in the routes; its hold runs from then). The share that is live is the only share
Envoy carries: a prepared step does not move traffic. While any share is live, every gate is judged on
each observation, and a breach acts at once; a step advances only after its hold with every gate met.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sie.errors import InputError
from sie.spec import SLA, RolloutPolicy, rollout_sizes
from xds_server.rollout.gates import GateResult, TrackStats, judge

__all__ = [
    "Action",
    "Event",
    "Phase",
    "RolloutConflict",
    "RolloutState",
    "act",
    "advance",
    "replica_counts",
    "start",
]

Action = Literal["pause", "resume", "abort"]
MAX_EVENTS = 64


class Phase(enum.StrEnum):
    PROGRESSING = "progressing"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"

    @property
    def active(self) -> bool:
        """The new build still runs beside the old one and may take traffic."""
        return self in (Phase.PROGRESSING, Phase.PAUSED)


class RolloutConflict(InputError):
    """A by-hand action the rollout's phase does not allow (resume a finished rollout, say): 409."""

    def __init__(self, message: str):
        super().__init__("rollout_conflict", message, status=409)


@dataclass(frozen=True)
class Event:
    at: float  # wall-clock seconds
    what: str
    share: int
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "what": self.what, "share": self.share, "detail": self.detail}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Event:
        return cls(float(doc["at"]), str(doc["what"]), int(doc["share"]), str(doc.get("detail", "")))


@dataclass(frozen=True)
class RolloutState:
    """One rollout of one model, as recorded (state.py) and shown (admin API, `sie rollout status`)."""

    model_id: str
    from_generation: int
    generation: int
    from_version: str
    to_version: str
    policy: RolloutPolicy
    replicas: int  # the replica count both builds are sized against
    started_at: float
    phase: Phase = Phase.PROGRESSING
    step: int = 0  # index into policy.steps of the step being prepared or held
    live: bool = False  # the step's share is in the routes (its hold runs since step_since)
    step_since: float | None = None
    share: int = 0  # the new build's share of traffic now in the routes, percent
    reason: str = "starting the new version's instances"
    gates: tuple[GateResult, ...] = ()
    failed_gate: GateResult | None = None
    new_stats: TrackStats = TrackStats()
    old_stats: TrackStats = TrackStats()
    reference: TrackStats | None = None  # the old build's last figures with enough samples
    yielded: int = 0  # old instances stopped early to make room for new ones (max_unavailable)
    finished_at: float | None = None
    events: tuple[Event, ...] = field(default=())

    @property
    def steps(self) -> list[int]:
        return self.policy.steps

    def with_event(self, now: float, what: str, detail: str = "", **changes: Any) -> RolloutState:
        state = replace(self, **changes)
        events = (*state.events, Event(now, what, state.share, detail))[-MAX_EVENTS:]
        return replace(state, events=events, reason=detail or what)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "phase": self.phase.value,
            "from_version": self.from_version,
            "to_version": self.to_version,
            "from_generation": self.from_generation,
            "generation": self.generation,
            "steps": list(self.steps),
            "step": self.step + 1,
            "step_share": self.steps[self.step],
            "live": self.live,
            "share": {"new": self.share, "old": 100 - self.share},
            "hold_s": self.policy.hold_s,
            "held_s": None,  # filled by the caller, who has the clock
            "step_since": self.step_since,
            "reason": self.reason,
            "gates": [g.to_json() for g in self.gates],
            "failed_gate": self.failed_gate.to_json() if self.failed_gate else None,
            "figures": {"new": self.new_stats.to_json(), "old": self.old_stats.to_json()},
            "reference": self.reference.to_json() if self.reference else None,
            "replicas": self.replicas,
            "yielded": self.yielded,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "policy": self.policy.model_dump(mode="json"),
            "events": [e.to_json() for e in self.events],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RolloutState:
        """The recorded form (to_json) read back; figures are re-observed, so only the machine's own
        state is restored."""
        failed = doc.get("failed_gate")
        ref = doc.get("reference")
        return cls(
            model_id=str(doc["model"]),
            from_generation=int(doc["from_generation"]),
            generation=int(doc["generation"]),
            from_version=str(doc["from_version"]),
            to_version=str(doc["to_version"]),
            policy=RolloutPolicy.model_validate(doc["policy"]),
            replicas=int(doc["replicas"]),
            started_at=float(doc["started_at"]),
            phase=Phase(doc["phase"]),
            step=int(doc["step"]) - 1,
            live=bool(doc["live"]),
            step_since=None if doc.get("step_since") is None else float(doc["step_since"]),
            share=int(doc["share"]["new"]),
            reason=str(doc.get("reason", "")),
            failed_gate=GateResult(**failed) if failed else None,
            reference=TrackStats(**ref) if ref else None,
            yielded=int(doc.get("yielded", 0)),
            finished_at=None if doc.get("finished_at") is None else float(doc["finished_at"]),
            events=tuple(Event.from_json(e) for e in doc.get("events", ())),
        )


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
    (sie.spec.rollout_sizes: what the live share and the step being prepared need, within max_surge)."""
    n = state.replicas
    if state.phase is Phase.SUCCEEDED:
        return 0, n
    if not state.phase.active:
        return n, 0
    policy = state.policy
    old, new, _ = rollout_sizes(
        n, state.steps[state.step], state.share, policy.max_surge, policy.max_unavailable, state.yielded
    )
    return old, new


def advance(
    state: RolloutState,
    new: TrackStats,
    old: TrackStats,
    sla: SLA,
    now: float,
    *,
    waiting_for_memory: str = "",
) -> RolloutState:
    """The next state after one observation: the new and old builds' figures, and why a new instance
    waits if the node hosts say it waits for memory."""
    gates = state.policy.gates
    reference = old if old.requests >= gates.min_requests else state.reference
    verdicts = tuple(judge(new, reference or old, gates, sla))
    state = replace(state, gates=verdicts, new_stats=new, old_stats=old, reference=reference)
    if state.phase is not Phase.PROGRESSING:
        return state

    if state.share > 0:
        breached = next((g for g in verdicts if g.holds is False), None)
        if breached is not None:
            return _breach(state, breached, now)

    step_share = state.steps[state.step]
    if not state.live:
        policy = state.policy
        old_count, planned, need = rollout_sizes(
            state.replicas, step_share, state.share, policy.max_surge, policy.max_unavailable, state.yielded
        )
        if new.ready >= need:
            # The step goes live; what the old build yielded was for preparing it, and is given back.
            return state.with_event(
                now,
                f"step {state.step + 1}/{len(state.steps)}",
                f"{step_share}% of traffic to {state.to_version}",
                live=True,
                share=step_share,
                step_since=now,
                yielded=0,
            )
        # One at a time: another old instance yields only once the last one has stopped (the node host
        # still reports the wait until its memory is free), and never the last one serving.
        can_yield = state.yielded < policy.max_unavailable and old_count > 1 and old.ready <= old_count
        if (waiting_for_memory or planned < need) and can_yield:
            why = f"no memory to surge ({waiting_for_memory})" if waiting_for_memory else "max_surge is reached"
            return state.with_event(
                now, "yielded", f"{why}; stopping one old instance first", yielded=state.yielded + 1
            )
        if waiting_for_memory:
            return replace(state, reason=f"waiting for memory for the new version: {waiting_for_memory}")
        if planned < need:
            return replace(
                state,
                reason=f"max_surge allows {planned} of the {need} new instances this step needs; waiting",
            )
        return replace(state, reason=f"waiting for {need - new.ready} new instance(s) to be ready ({new.ready}/{need})")

    assert state.step_since is not None
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
    return replace(state, step=state.step + 1, live=False, step_since=None, reason="preparing the next step")


def _breach(state: RolloutState, gate: GateResult, now: float) -> RolloutState:
    detail = f"gate {gate.name} breached at {state.share}%: {gate.detail}"
    if state.policy.auto_rollback:
        return state.with_event(
            now,
            "rolled_back",
            detail,
            phase=Phase.ROLLED_BACK,
            share=0,
            live=False,
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
        # The hold starts again: what was seen before the pause is not a hold under watch.
        return state.with_event(
            now,
            "resumed",
            "resumed by hand",
            phase=Phase.PROGRESSING,
            failed_gate=None,
            step_since=now if state.live else None,
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
            finished_at=now,
        )
    raise RolloutConflict(f"unknown rollout action {action!r}")
