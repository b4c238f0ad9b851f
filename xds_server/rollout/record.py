"""A rollout's state as the machine keeps it, and its recorded form (to_json, read back by from_json).

The record comes back from the state directory (xds_server/state.py) or a ModelService's status.build
(k8s_source.py), written by an earlier control plane, edited by hand, or cut short. from_json takes only
what the machine itself could have written: a step in range, a share its position allows, known phase
names, fields of their types. Anything else is a RolloutRecordError (a ValueError) naming the field,
and the caller leaves the stable build serving.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sie.errors import SIEError
from sie.spec import RolloutPolicy
from xds_server.rollout.gates import GateResult, TrackStats

__all__ = ["Event", "Phase", "RolloutRecordError", "RolloutState", "position_share"]

MAX_EVENTS = 64

T = TypeVar("T")


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


class RolloutRecordError(SIEError, ValueError):
    """A recorded rollout that is not a state the machine could have written. `field` names what is wrong."""

    def __init__(self, field: str, why: str):
        self.field = field  # "" for the record as a whole
        self.why = why
        super().__init__(f"the recorded rollout's {field} {why}" if field else f"the recorded rollout {why}")

    def within(self, outer: str) -> RolloutRecordError:
        """The same error, its field named from the enclosing one (`share` and `new`: `share.new`)."""
        return RolloutRecordError(f"{outer}{'' if self.field.startswith('[') else '.'}{self.field}", self.why)


@dataclass(frozen=True)
class Event:
    at: float  # wall-clock seconds
    what: str
    share: int
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "what": self.what, "share": self.share, "detail": self.detail}


def position_share(steps: list[int], step: int, live: bool) -> int:
    """The new build's share in the routes at this position: the step's own once it is live, the step
    before's while it is prepared (0 before the first)."""
    if live:
        return steps[step]
    return steps[step - 1] if step > 0 else 0


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
    # The share taken out of the routes because no instance of the new build is ready; it returns when
    # they are, and the fleet stays sized for it meanwhile (0: nothing withdrawn; `share` is then 0).
    withdrawn: int = 0
    # Since when (wall clock) the new build has had fewer ready instances than the share in the routes,
    # or the one withdrawn, needs; None while it has them.
    unready_since: float | None = None
    # Since when the share in the routes has had no answer from the new build although the old build's
    # traffic says it should have had min_requests; None otherwise.
    starved_since: float | None = None
    # Since when (wall clock) the step being prepared has waited for the ready instances it needs to go
    # live; policy.progress_deadline_s counts from it. Set only while a step is prepared and the rollout
    # is active; None before the rollout's first observation, which starts it (as it does for a record
    # written before the progress deadline existed).
    preparing_since: float | None = None
    reason: str = "starting the new version's instances"
    gates: tuple[GateResult, ...] = ()
    failed_gate: GateResult | None = None
    new_stats: TrackStats = TrackStats()
    old_stats: TrackStats = TrackStats()
    reference: TrackStats | None = None  # the old build's last figures with enough samples
    # Old instances stopped early to make room for new ones (max_unavailable): the old build runs this many
    # fewer than sie.spec.rollout_sizes plans at the position; carried from step to step (machine._moved),
    # since the new build's instances hold their room until the rollout ends.
    yielded: int = 0
    finished_at: float | None = None
    events: tuple[Event, ...] = field(default=())

    @property
    def steps(self) -> list[int]:
        return self.policy.steps

    @property
    def routable_share(self) -> int:
        """The new build's share once its instances are ready: the one in the routes, or the one withdrawn."""
        return self.share or self.withdrawn

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
            "withdrawn": self.withdrawn,
            "unready_since": self.unready_since,
            "starved_since": self.starved_since,
            "preparing_since": self.preparing_since,
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
    def from_json(cls, doc: Any) -> RolloutState:
        """The recorded form (to_json) read back; figures are re-observed, so only the machine's own
        state is restored. RolloutRecordError (a ValueError) naming the field for what the machine could
        not have written."""
        if not isinstance(doc, dict):
            raise RolloutRecordError("", f"is {_kind(doc)}, not a JSON object")
        policy = _parsed(doc, "policy", RolloutPolicy.model_validate)
        steps = policy.steps
        step = _integer(doc, "step", 1, len(steps)) - 1  # recorded from 1
        phase = _parsed(doc, "phase", _phase)
        live = _parsed(doc, "live", _boolean)
        share = _parsed(doc, "share", lambda shares: _integer(_object(shares), "new", 0, 100))
        withdrawn = _integer(doc, "withdrawn", 0, 100, default=0)
        step_since = _optional_number(doc, "step_since")
        preparing_since = _optional_number(doc, "preparing_since")
        _check_position(phase, steps, step, live, share, withdrawn)
        if live and step_since is None:
            raise RolloutRecordError("step_since", "is missing, and the step is live: its hold has no start")
        if preparing_since is not None and (live or not phase.active):
            where = "a live step" if live else f"a {phase.value} rollout"
            raise RolloutRecordError("preparing_since", f"is set at {where}: only a step being prepared waits")
        replicas = _integer(doc, "replicas", 1)
        return cls(
            model_id=_text(doc, "model"),
            from_generation=_integer(doc, "from_generation", 0),
            generation=_integer(doc, "generation", 1),
            from_version=_text(doc, "from_version"),
            to_version=_text(doc, "to_version"),
            policy=policy,
            replicas=replicas,
            started_at=_number(doc, "started_at"),
            phase=phase,
            step=step,
            live=live,
            step_since=step_since,
            share=share,
            withdrawn=withdrawn,
            unready_since=_optional_number(doc, "unready_since"),
            starved_since=_optional_number(doc, "starved_since"),
            preparing_since=preparing_since,
            reason=_text(doc, "reason", ""),
            failed_gate=_parsed(doc, "failed_gate", _gate) if doc.get("failed_gate") is not None else None,
            reference=_parsed(doc, "reference", _stats) if doc.get("reference") is not None else None,
            # Old instances stopped for room, never given back while the rollout runs, never the last (and
            # none without max_unavailable). A record from before they were kept across steps (at most
            # max_unavailable, 0 at a live step) means the same at its position.
            yielded=_integer(doc, "yielded", 0, _most_yielded(policy, replicas), default=0),
            finished_at=_optional_number(doc, "finished_at"),
            events=_parsed(doc, "events", _events) if doc.get("events") is not None else (),
        )


def _most_yielded(policy: RolloutPolicy, replicas: int) -> int:
    """The most old instances a rollout of `replicas` stops for room (machine: never the old build's last)."""
    return 0 if policy.max_unavailable == 0 else replicas - 1


def _check_position(phase: Phase, steps: list[int], step: int, live: bool, share: int, withdrawn: int) -> None:
    """The shares the machine leaves at a position: while the rollout is active, the position's share in
    the routes (or withdrawn from them, with 0 routed); 100 once it succeeded, live at the last step; 0
    once it ended otherwise."""
    where = f"step {step + 1} ({'live' if live else 'prepared'}) of a {phase.value} rollout"
    if phase is Phase.SUCCEEDED and (not live or step != len(steps) - 1):
        raise RolloutRecordError("step", f"is {where}: a succeeded rollout ends live at step {len(steps)}")
    if phase is Phase.SUCCEEDED:
        routed, may_withdraw = 100, 0
    elif not phase.active:
        routed, may_withdraw = 0, 0
    else:
        may_withdraw = position_share(steps, step, live)
        routed = 0 if withdrawn else may_withdraw
    if withdrawn not in (0, may_withdraw):
        raise RolloutRecordError("withdrawn", f"is {withdrawn}%; at {where} it is 0 or {may_withdraw}")
    if share != routed:
        withdrawn_note = f" with {withdrawn}% withdrawn" if withdrawn else ""
        raise RolloutRecordError("share.new", f"is {share}%; at {where}{withdrawn_note} it is {routed}")


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _parsed(doc: dict[str, Any], key: str, parse: Callable[[Any], T]) -> T:
    """doc[key] through `parse`; an error it raises becomes a RolloutRecordError naming the field."""
    if doc.get(key) is None:
        raise RolloutRecordError(key, "is missing")
    try:
        return parse(doc[key])
    except RolloutRecordError as exc:
        raise exc.within(key) from exc
    except (TypeError, ValueError, KeyError) as exc:
        raise RolloutRecordError(key, f"is unreadable: {exc}") from exc


def _integer(doc: dict[str, Any], key: str, low: int, high: int | None = None, *, default: int | None = None) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RolloutRecordError(key, f"is {_kind(value)}, not an integer")
    if value < low or (high is not None and value > high):
        raise RolloutRecordError(key, f"is {value}, not {f'at least {low}' if high is None else f'in {low}..{high}'}")
    return value


def _number(doc: dict[str, Any], key: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RolloutRecordError(key, f"is {_kind(value)}, not a number")
    if not math.isfinite(value):
        raise RolloutRecordError(key, f"is {value}, not a finite number")
    return float(value)


def _optional_number(doc: dict[str, Any], key: str) -> float | None:
    return None if doc.get(key) is None else _number(doc, key)


def _text(doc: dict[str, Any], key: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise RolloutRecordError(key, f"is {_kind(value)}, not a string")
    return value


def _phase(value: Any) -> Phase:
    if not isinstance(value, str) or value not in {p.value for p in Phase}:
        raise ValueError(f"{value!r}, not one of {', '.join(Phase)}")
    return Phase(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_kind(value)}, not true or false")
    return value


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{_kind(value)}, not a JSON object")
    return value


def _gate(value: Any) -> GateResult:
    doc = _object(value)
    holds = doc.get("holds")
    return GateResult(
        _text(doc, "name"),
        None if holds is None else _parsed(doc, "holds", _boolean),
        _optional_number(doc, "value"),
        _optional_number(doc, "limit"),
        _text(doc, "detail", ""),
    )


def _stats(value: Any) -> TrackStats:
    doc = _object(value)
    return TrackStats(
        requests=_integer(doc, "requests", 0, default=0),
        p99_ms=_optional_number(doc, "p99_ms"),
        error_rate=_optional_number(doc, "error_rate"),
        queue_time_ms=_optional_number(doc, "queue_time_ms"),
        ready=_integer(doc, "ready", 0, default=0),
        draining=_integer(doc, "draining", 0, default=0),
    )


def _events(value: Any) -> tuple[Event, ...]:
    if not isinstance(value, list):
        raise TypeError(f"{_kind(value)}, not a list")
    out = []
    for i, item in enumerate(value):
        try:
            doc = _object(item)
            out.append(
                Event(_number(doc, "at"), _text(doc, "what"), _integer(doc, "share", 0, 100), _text(doc, "detail", ""))
            )
        except RolloutRecordError as exc:
            raise exc.within(f"[{i}]") from exc
        except TypeError as exc:
            raise RolloutRecordError(f"[{i}]", f"is unreadable: {exc}") from exc
    return tuple(out)
