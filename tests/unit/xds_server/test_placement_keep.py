"""Placement rule 1: which of a build's instances a count keeps, and which of them stay awake, by how close
each is to serving (ready, then present, then failed, then absent; ties by placed-before, then id)."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from xds_server.placement import NodeView, Placement, Track, place


def svc(name: str = "a"):
    return parse_model_service({"spec": {"model": {"name": name}, "backend": {"type": "sim"}}})


def node(
    name: str,
    *reported: str,
    live: bool = True,
    ready: tuple[str, ...] = (),
    failed: tuple[str, ...] = (),
    model: str = "a",
) -> NodeView:
    return NodeView(
        name,
        live,
        frozenset((iid, model) for iid in reported),
        ready=frozenset(ready),
        failed=frozenset(failed),
    )


def run(track: Track, nodes: list[NodeView], previous: dict[str, str], model: str = "a") -> Placement:
    return place({model: svc(model)}, {n.name: n for n in nodes}, previous, {model: [track]})


KEEP = [
    pytest.param(
        Track(0, 1),
        [node("n1", "a-0", failed=("a-0",)), node("n2", "a-1", ready=("a-1",))],
        {"a-0": "n1", "a-1": "n2"},
        {"a-1": "n2"},
        id="down to one: the ready one stays, the failed lower id goes",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", "a-0"), node("n2", "a-1", ready=("a-1",))],
        {"a-0": "n1", "a-1": "n2"},
        {"a-1": "n2"},
        id="down to one: the ready one stays, the loading lower id goes",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", "a-0", failed=("a-0",)), node("n2", "a-1")],
        {"a-0": "n1", "a-1": "n2"},
        {"a-1": "n2"},
        id="none ready: a loading one stays before a failed one",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", live=False), node("n2", "a-1", ready=("a-1",))],
        {"a-0": "n1", "a-1": "n2"},
        {"a-1": "n2"},
        id="the ready one stays, not one re-placed after its node was lost",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", live=False), node("n2")],
        {"a-0": "n1", "a-1": "n2"},
        {"a-1": "n2"},
        id="none ready: one starting on a live node stays before one whose node was lost",
    ),
    pytest.param(
        Track(0, 2),
        [node("n1", "a-0", "a-2", ready=("a-2",)), node("n2", "a-1", "a-3", ready=("a-1", "a-3"))],
        {"a-0": "n1", "a-1": "n2", "a-2": "n1", "a-3": "n2"},
        {"a-1": "n2", "a-2": "n1"},
        id="fewer wanted than ready: the not-ready one goes first, then the highest ready",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", "a-0", ready=("a-0",)), node("n2", "a-1", ready=("a-1",))],
        {"a-0": "n1", "a-1": "n2"},
        {"a-0": "n1"},
        id="all ready: the lowest id stays",
    ),
    pytest.param(
        Track(0, 2),
        [node("n1"), node("n2", "a-1", ready=("a-1",))],
        {"a-1": "n2"},
        {"a-0": "n1", "a-1": "n2"},
        id="up from a gap: the lowest free id is added",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", "a-3", ready=("a-3",)), node("n2", "a-0")],
        {},
        {"a-3": "n1"},
        id="nothing placed yet (a restart): the reported ready instance is adopted under its id",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", "a-0"), node("evil", "a-7", ready=("a-7",))],
        {"a-0": "n1"},
        {"a-0": "n1"},
        id="an id placed nowhere that a node claims is no candidate once the build is placed",
    ),
    pytest.param(
        Track(0, 1),
        [node("n1", "a-0"), node("n2", "a-1", ready=("a-1",)), node("evil", "a-0", ready=("a-0",))],
        {"a-0": "n1", "a-1": "n2"},
        {"a-1": "n2"},
        id="a node cannot make an instance placed elsewhere look ready",
    ),
    pytest.param(
        Track(2, 1),
        [node("n1", "a.g2-0"), node("n2", "a.g2-1", "a-0", ready=("a.g2-1", "a-0"))],
        {"a.g2-0": "n1", "a.g2-1": "n2", "a-0": "n2"},
        {"a.g2-1": "n2"},
        id="a later build's ids: the ready one stays; the other build's instance is not counted",
    ),
]


@pytest.mark.parametrize(("track", "nodes", "previous", "expected"), KEEP)
def test_a_count_keeps_the_instances_closest_to_serving(track, nodes, previous, expected):
    got = run(track, nodes, previous)
    assert dict(got.by_instance) == expected
    again = run(track, nodes, dict(got.by_instance))
    assert again.by_instance == got.by_instance, "the choice holds on the next round: no flapping"


AWAKE = [
    pytest.param(
        Track(0, 2, awake=1),
        [node("n1", "a-0", failed=("a-0",)), node("n2", "a-1", ready=("a-1",))],
        {"a-0", "a-1"},
        {"a-0"},
        id="the ready one serves, the failed lower id sleeps",
    ),
    pytest.param(
        Track(0, 2, awake=1),
        [node("n1", "a-0", "a-1", failed=("a-0",))],
        {"a-0", "a-1"},
        {"a-0"},
        id="none ready: a sleeping one is woken before a failed one",
    ),
    pytest.param(
        Track(0, 2, awake=1),
        [node("n1", "a-0", "a-1", "a-2", failed=("a-0",), ready=("a-2",))],
        {"a-1", "a-2"},
        {"a-1"},
        id="down by one: the failed one goes, the ready one serves, the next sleeps",
    ),
    pytest.param(
        Track(0, 2, awake=1),
        [node("n1", "a-0", "a-1", ready=("a-0", "a-1"))],
        {"a-0", "a-1"},
        {"a-1"},
        id="both ready: the lowest id serves",
    ),
    pytest.param(Track(0, 2, awake=0), [node("n1")], {"a-0", "a-1"}, {"a-0", "a-1"}, id="at zero: all asleep"),
    pytest.param(Track(0, 2), [node("n1")], {"a-0", "a-1"}, set(), id="no warm pool: all awake"),
]


@pytest.mark.parametrize(("track", "nodes", "placed", "asleep"), AWAKE)
def test_the_awake_ones_are_those_closest_to_serving(track, nodes, placed, asleep):
    previous = {iid: n.name for n in nodes for iid, _ in n.reported}
    got = run(track, nodes, previous)
    assert set(got.by_instance) == placed
    assert got.asleep == asleep
    assert {iid for iid in placed if got.awake(iid)} == placed - asleep
    assert run(track, nodes, dict(got.by_instance)).asleep == got.asleep


def test_another_models_ids_with_a_dash_are_not_taken_for_its_own():
    nodes = {"n1": NodeView("n1", True, frozenset({("a-1-0", "a-1")}), ready=frozenset({"a-1-0"}))}
    got = place({"a": svc("a"), "a-1": svc("a-1")}, nodes, {})
    assert dict(got.by_instance) == {"a-0": "n1", "a-1-0": "n1"}
    assert got.model_of["a-0"] == "a" and got.model_of["a-1-0"] == "a-1"
