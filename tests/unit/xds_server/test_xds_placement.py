"""Placement: adoption, pending instances, least-loaded placement, and what is dropped."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from xds_server.placement import NodeView, place


def svc(name: str, replicas: int = 1, priority: str = "P1"):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": name, "priority_level": priority},
                "backend": {"type": "sim"},
                "sla": {"min_replicas": replicas, "max_replicas": max(replicas, 1)},
            }
        }
    )


def node(name: str, *reported: tuple[str, str], live: bool = True) -> NodeView:
    return NodeView(name, live, frozenset(reported))


CASES = [
    pytest.param(
        {"a": 2},
        [node("n1"), node("n2")],
        {},
        {"a-0": "n1", "a-1": "n2"},
        id="new replicas spread over the emptiest nodes",
    ),
    pytest.param(
        {"a": 1},
        [node("n1"), node("n2", ("a-0", "a"))],
        {},
        {"a-0": "n2"},
        id="a reported instance is adopted where it runs",
    ),
    pytest.param(
        {"a": 2},
        [node("n1", ("a-1", "a")), node("n2")],
        {},
        {"a-0": "n2", "a-1": "n1"},
        id="adopted ids are kept, the missing one goes to the emptiest node",
    ),
    pytest.param(
        {"a": 1},
        [node("n1", ("a-0", "a"), ("a-1", "a"), ("gone-0", "gone"))],
        {},
        {"a-0": "n1"},
        id="extras (replicas lowered, model deleted) are dropped",
    ),
    pytest.param(
        {"a": 1},
        [node("n1"), node("n2")],
        {"a-0": "n2"},
        {"a-0": "n2"},
        id="a pending instance stays on the node it was sent to",
    ),
    pytest.param(
        {"a": 1},
        [node("n1"), node("n2", live=False)],
        {"a-0": "n2"},
        {"a-0": "n1"},
        id="an instance of a dead node is placed again on a live one, same id",
    ),
    pytest.param(
        {"a": 1},
        [node("n1", ("a-0", "a")), node("n2", ("a-0", "a"))],
        {"a-0": "n2"},
        {"a-0": "n2"},
        id="reported twice: the node it was placed on keeps it",
    ),
    pytest.param(
        {"a": 1},
        [node("n1", ("a-0", "b"))],
        {},
        {"a-0": "n1"},
        id="an instance id reported under another model is not adopted",
    ),
    pytest.param({"a": 1}, [node("n1", live=False)], {}, {}, id="no live node: nothing placed"),
    pytest.param({"a": 0}, [node("n1", ("a-0", "a"))], {}, {}, id="zero replicas: the running instance is dropped"),
]


@pytest.mark.parametrize(("replicas", "nodes", "previous", "expected"), CASES)
def test_place(replicas, nodes, previous, expected):
    models = {m: svc(m, n) for m, n in replicas.items()}
    placement = place(models, {n.name: n for n in nodes}, previous)
    assert dict(placement.by_instance) == expected
    for iid in expected:
        assert placement.model_of[iid] == iid.rsplit("-", 1)[0]


def test_p0_goes_to_the_emptiest_node_first():
    models = {"low": svc("low", 1, "P2"), "top": svc("top", 1, "P0")}
    nodes = {"n1": node("n1"), "n2": node("n2", ("x-0", "x"))}
    placement = place(models, nodes, {})
    assert placement.by_instance["top-0"] == "n1"
    assert placement.by_instance["low-0"] == "n2"


def test_placement_is_stable_across_rounds():
    models = {"a": svc("a", 3), "b": svc("b", 2)}
    nodes = {n: node(n) for n in ("n1", "n2", "n3")}
    first = place(models, nodes, {})
    second = place(models, nodes, first.by_instance)
    assert second.by_instance == first.by_instance
    assert sorted(first.for_node("n1") + first.for_node("n2") + first.for_node("n3")) == sorted(first.by_instance)


def test_of_model_lists_a_models_placed_instances():
    placement = place({"a": svc("a", 2), "b": svc("b", 1)}, {"n1": node("n1")}, {})
    assert placement.of_model("a") == ["a-0", "a-1"] and placement.of_model("zzz") == []
