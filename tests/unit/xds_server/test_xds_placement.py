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


def node(
    name: str, *reported: tuple[str, str], live: bool = True, ready: tuple[str, ...] = (), cannot: dict | None = None
) -> NodeView:
    return NodeView(name, live, frozenset(reported), ready=frozenset(ready), unplaceable=cannot or {})


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


# ---- node loss, homes, rebalance, new before old, instances a node cannot run (rules 2, 4-6) -----------

A0 = ("a-0", "a")


def test_a_lost_nodes_instance_goes_elsewhere_and_remembers_its_home():
    nodes = {"n1": node("n1", A0, live=False, ready=("a-0",)), "n2": node("n2")}
    got = place({"a": svc("a")}, nodes, {"a-0": "n1"})
    assert got.by_instance == {"a-0": "n2"} and got.homes == {"a-0": "n1"}
    assert "in place of its copy on n1, a lost node" in got.reasons["a-0"]
    assert got.for_node("n1") == [] and not got.leaving  # nothing is handed over from a lost node


@pytest.mark.parametrize(
    ("rebalance", "home_reports", "expected", "leaving", "homes"),
    [
        # The home came back still running its copy (it was cut off, not dead).
        ("none", True, "n2", {}, {}),
        ("return", True, "n1", {}, {}),
        # The home came back empty (restarted): "return" starts it there while n2 serves it.
        ("none", False, "n2", {}, {}),
        ("return", False, "n1", {"a-0": "n2"}, {}),
    ],
)
def test_a_returning_home_and_the_rebalance_policy(rebalance, home_reports, expected, leaving, homes):
    home = node("n1", A0, ready=("a-0",)) if home_reports else node("n1")
    nodes = {"n1": home, "n2": node("n2", A0, ready=("a-0",))}
    got = place({"a": svc("a")}, nodes, {"a-0": "n2"}, homes={"a-0": "n1"}, rebalance=rebalance)
    assert got.by_instance == {"a-0": expected}
    assert dict(got.leaving) == leaving and dict(got.homes) == homes
    if leaving:
        assert got.for_node("n2") == ["a-0"] and got.holds("a-0", "n2") and got.holds("a-0", "n1")
        assert "n2 serves it until then" in got.reasons["a-0"]


def test_return_waits_while_the_home_has_no_room():
    from xds_server.node_fit import GpuView, NodeTraits

    full = NodeTraits(gpus=(GpuView(0, "", 1_000.0),))
    roomy = NodeTraits(gpus=(GpuView(0, "", 50_000.0),))
    big = parse_model_service(
        {"spec": {"model": {"name": "a"}, "backend": {"type": "sim"}, "resources": {"min_gpu_memory_mb": 10_000}}}
    )
    nodes = {
        "n1": NodeView("n1", True, frozenset(), full),
        "n2": NodeView("n2", True, frozenset({A0}), roomy, ready=frozenset({"a-0"})),
    }
    got = place({"a": big}, nodes, {"a-0": "n2"}, homes={"a-0": "n1"}, rebalance="return")
    assert got.by_instance == {"a-0": "n2"} and got.homes == {"a-0": "n1"}
    assert "stays off its home n1 (no room there)" in got.reasons["a-0"]


def test_the_home_copy_once_ready_takes_over_and_the_interim_copy_is_dropped():
    nodes = {"n1": node("n1", A0, ready=("a-0",)), "n2": node("n2", A0, ready=("a-0",))}
    got = place({"a": svc("a")}, nodes, {"a-0": "n1"}, rebalance="return")
    assert got.by_instance == {"a-0": "n1"} and not got.leaving and got.for_node("n2") == []


def test_reported_twice_the_other_copy_serves_until_the_chosen_one_is_ready():
    # n1, its home, came back still running it while n2's copy was starting (rebalance none: n2 keeps it).
    nodes = {"n1": node("n1", A0, ready=("a-0",)), "n2": node("n2", A0)}
    got = place({"a": svc("a")}, nodes, {"a-0": "n2"}, homes={"a-0": "n1"})
    assert got.by_instance == {"a-0": "n2"} and got.leaving == {"a-0": "n1"}
    assert got.for_node("n1") == ["a-0"] and "dropped once this one serves" in got.reasons["a-0"]


def test_an_instance_its_node_cannot_run_moves_where_it_fits():
    nodes = {"n1": node("n1", A0, cannot={"a-0": "GPU 0 failed"}), "n2": node("n2")}
    got = place({"a": svc("a")}, nodes, {"a-0": "n1"})
    assert got.by_instance == {"a-0": "n2"}
    assert got.reasons["a-0"].startswith("moved to n2 (GPU 0 failed on n1)")


def test_an_instance_no_other_node_can_take_waits_and_says_why():
    nodes = {"n1": node("n1", A0, cannot={"a-0": "short of memory"}), "n2": node("n2", live=False)}
    got = place({"a": svc("a")}, nodes, {"a-0": "n1"})
    assert got.by_instance == {"a-0": "n1"}
    assert got.reasons["a-0"] == "waiting on n1: short of memory; no other node has room for it"


def test_spread_prefers_a_copy_another_node_already_serves():
    # n2, a-0's home, came back still running it (it was cut off): that copy serves, n1's is dropped.
    nodes = {"n1": node("n1", A0, ("a-1", "a"), ready=("a-0", "a-1")), "n2": node("n2", A0, ready=("a-0",))}
    got = place({"a": svc("a", 2)}, nodes, {"a-0": "n1", "a-1": "n1"}, homes={"a-0": "n2"})
    assert got.by_instance == {"a-0": "n2", "a-1": "n1"} and not got.leaving
    assert got.reasons["a-0"] == "spread: runs on n2 too; the copy on n1 is dropped"


def test_a_node_claiming_an_instance_placed_elsewhere_is_ignored():
    """DESIGN §10: a node speaks only for what it was given. n2 claims a-0, placed on n1: nothing moves."""
    nodes = {"n1": node("n1", A0, ready=("a-0",)), "evil": node("evil", A0, ready=("a-0",))}
    got = place({"a": svc("a")}, nodes, {"a-0": "n1"})
    assert got.by_instance == {"a-0": "n1"} and not got.leaving and got.for_node("evil") == []
    two = {"a": svc("a", 2)}
    nodes = {"n1": node("n1", A0, ("a-1", "a"), ready=("a-0", "a-1")), "evil": node("evil", A0, ready=("a-0",))}
    got = place(two, nodes, {"a-0": "n1", "a-1": "n1"})
    assert got.for_node("evil") == [], "the spread repair does not take a claimed copy either"
