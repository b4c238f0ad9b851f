"""The recorded form of a rollout read back (xds_server.rollout.record): only what the machine could have
written comes back; anything else is a RolloutRecordError, a ValueError naming the field."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sie.errors import SIEError
from sie.spec import SLA, RolloutPolicy
from xds_server.rollout.gates import TrackStats
from xds_server.rollout.machine import Phase, RolloutRecordError, RolloutState, advance, start
from xds_server.rollout.record import position_share


def begin(**policy: Any) -> RolloutState:
    return start(
        "m",
        from_generation=0,
        from_version="1",
        to_version="2",
        policy=RolloutPolicy.model_validate({"steps": [10, 50, 100], "hold_s": 30.0} | policy),
        replicas=4,
        now=0.0,
    )


def at(step: int, live: bool, share: int | None = None, **more: Any) -> RolloutState:
    state = begin()
    share = position_share(state.steps, step, live) if share is None else share
    return dataclasses.replace(state, step=step, live=live, share=share, step_since=12.5 if live else None, **more)


def recorded(state: RolloutState) -> dict[str, Any]:
    return json.loads(json.dumps(state.to_json()))


GOOD = recorded(at(1, live=True))  # step 2 of 3 (recorded from 1), live at 50%


def with_(path: str, value: Any, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """GOOD (or `doc`) with the dotted `path` set to `value` (a `DELETE` value removes it)."""
    out = copy.deepcopy(GOOD if doc is None else doc)
    *outer, last = path.split(".")
    node = out
    for key in outer:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return out


DELETE = object()

# what is wrong -> (the record, the field the error names)
BAD: dict[str, tuple[Any, str]] = {
    "a list": ([], ""),
    "null": (None, ""),
    "step 0 (recorded from 1; was read as steps[-1], 100%)": (with_("step", 0), "step"),
    "step -1": (with_("step", -1), "step"),
    "step past the last (was an IndexError later)": (with_("step", 9), "step"),
    "step a string": (with_("step", "2"), "step"),
    "step a bool": (with_("step", True), "step"),
    "step missing": (with_("step", DELETE), "step"),
    "share 250": (with_("share.new", 250), "share.new"),
    "share -5": (with_("share.new", -5), "share.new"),
    "share not the live step's": (with_("share.new", 10), "share.new"),
    "share 0 at a live step with nothing withdrawn": (with_("share.new", 0), "share.new"),
    "share a float": (with_("share.new", 50.0), "share.new"),
    "share a list": (with_("share", [50]), "share"),
    "share missing": (with_("share", DELETE), "share"),
    "a prepared step routing its own share": (with_("live", False), "share.new"),
    "an unknown phase": (with_("phase", "rolling"), "phase"),
    "a phase of another type": (with_("phase", 3), "phase"),
    "live not a bool": (with_("live", "yes"), "live"),
    "live with no hold start": (with_("step_since", None), "step_since"),
    "a hold start not a number": (with_("step_since", "noon"), "step_since"),
    "a withdrawn share not the step's": (with_("withdrawn", 10, with_("share.new", 0)), "withdrawn"),
    "a withdrawn share still routed": (with_("withdrawn", 50), "share.new"),
    "a withdrawn share of a finished rollout": (
        with_("withdrawn", 50, recorded(dataclasses.replace(begin(), phase=Phase.ROLLED_BACK))),
        "withdrawn",
    ),
    "a rolled back share left in the routes": (with_("phase", "rolled_back"), "share.new"),
    "a succeeded rollout short of its last step": (with_("phase", "succeeded"), "step"),
    "the policy's steps not rising": (with_("policy.steps", [50, 10, 100]), "policy"),
    "the policy a string": (with_("policy", "fast"), "policy"),
    "replicas 0": (with_("replicas", 0), "replicas"),
    "model a number": (with_("model", 7), "model"),
    "started_at NaN": (with_("started_at", float("nan")), "started_at"),
    "yielded past max_unavailable": (with_("yielded", 1), "yielded"),
    "events a dict": (with_("events", {}), "events"),
    "an event without its time": (with_("events.0.at", DELETE), "events[0].at"),
    "an event that is a string": (with_("events.0", "started"), "events[0]"),
    "a failed gate of another shape": (with_("failed_gate", {"name": "p99", "holds": "no"}), "failed_gate.holds"),
    "a reference with a string count": (with_("reference", {"requests": "many"}), "reference.requests"),
    "a live step still waiting to be prepared": (with_("preparing_since", 30.0), "preparing_since"),
    "a finished rollout still waiting for a step": (
        with_("preparing_since", 30.0, recorded(at(1, live=False, share=0, phase=Phase.ROLLED_BACK))),
        "preparing_since",
    ),
    "a wait that is a string": (with_("preparing_since", "soon", recorded(at(1, live=False))), "preparing_since"),
}


@pytest.mark.parametrize(("doc", "field"), BAD.values(), ids=BAD.keys())
def test_a_record_the_machine_could_not_have_written_is_refused_naming_the_field(doc, field):
    with pytest.raises(RolloutRecordError) as info:
        RolloutState.from_json(doc)
    assert info.value.field == field
    assert isinstance(info.value, ValueError) and isinstance(info.value, SIEError)
    assert str(info.value).startswith(f"the recorded rollout's {field} " if field else "the recorded rollout is ")


GOOD_STATES = {
    "fresh": begin(),
    "first step live": at(0, live=True),
    "second step prepared, the first's share routed": at(1, live=False),
    "second step prepared, waiting since 30 s": at(1, live=False, preparing_since=30.0),
    "paused while the second step is prepared": at(1, live=False, preparing_since=30.0, phase=Phase.PAUSED),
    "second step live": at(1, live=True),
    "withdrawn while live": at(1, live=True, share=0, withdrawn=50, unready_since=40.0),
    "withdrawn while the next is prepared": at(2, live=False, share=0, withdrawn=50, unready_since=40.0),
    "short of answers": at(1, live=True, starved_since=41.0),
    "paused": at(1, live=True, phase=Phase.PAUSED),
    "rolled back": at(1, live=False, share=0, phase=Phase.ROLLED_BACK, finished_at=70.0),
    "aborted before any step": at(0, live=False, phase=Phase.ABORTED, finished_at=70.0),
    "succeeded": at(2, live=True, phase=Phase.SUCCEEDED, finished_at=90.0),
}


@pytest.mark.parametrize("state", GOOD_STATES.values(), ids=GOOD_STATES.keys())
def test_every_state_the_machine_writes_reads_back(state):
    assert RolloutState.from_json(recorded(state)) == state


def test_a_record_from_before_withdrawals_reads_back():
    doc = {k: v for k, v in GOOD.items() if k not in ("withdrawn", "unready_since", "starved_since")}
    assert RolloutState.from_json(doc) == RolloutState.from_json(GOOD)


def test_every_state_of_a_walk_reads_back():
    """Each state advance() leaves, withdrawn and restored included, is one from_json takes."""
    state = begin()
    old = TrackStats(requests=900, p99_ms=10.0, error_rate=0.0, queue_time_ms=1.0, ready=4)
    for now, ready, answers in [
        (0.5, 0, 0),
        (1, 1, 0),
        (2, 1, 200),
        (3, 0, 0),
        (4, 0, 0),
        (5, 1, 200),
        (40, 1, 200),
        (41, 2, 200),
    ]:
        new = TrackStats(requests=answers, p99_ms=10.0, error_rate=0.0, queue_time_ms=1.0, ready=ready)
        state = advance(state, new, old, SLA(p99_latency_ms=1000.0, max_queue_time_ms=1000.0), float(now))
        back = RolloutState.from_json(recorded(state))
        assert back == dataclasses.replace(state, gates=(), new_stats=TrackStats(), old_stats=TrackStats())
    assert [e.what for e in state.events] == ["started", "step 1/3", "withdrawn", "restored", "step 2/3"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(sorted(GOOD)), value=JSON)
def test_any_value_in_any_field_reads_back_or_is_refused_with_a_record_error(key, value):
    doc = with_(key, value)
    try:
        state = RolloutState.from_json(doc)
    except RolloutRecordError:
        return
    # What comes back is a position the machine can act on.
    assert 0 <= state.step < len(state.steps) and 0 <= state.share <= 100
    assert state.share in (0, position_share(state.steps, state.step, state.live))
    state.to_json()
