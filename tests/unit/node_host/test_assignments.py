"""Assignment diffing: what to start and what to stop."""

from __future__ import annotations

import pytest

from node_host.assignments import plan
from sie.wire import Assignment

A = {"v": 1}
B = {"v": 2}


def asg(iid: str, spec: dict) -> Assignment:
    return Assignment(instance_id=iid, model_id="m", spec=spec)


@pytest.mark.parametrize(
    "assigned, running, stopping, start, stop",
    [
        ([], {}, set(), [], []),
        ([asg("i1", A)], {}, set(), ["i1"], []),  # new
        ([asg("i1", A)], {"i1": A}, set(), [], []),  # steady
        ([], {"i1": A, "i2": A}, set(), [], ["i1", "i2"]),  # unassigned
        ([asg("i1", B)], {"i1": A}, set(), [], ["i1"]),  # spec changed: stop now, start later
        ([asg("i1", B)], {}, {"i1"}, [], []),  # still stopping: wait
        ([], {}, {"i1"}, [], []),  # stopping and unassigned: already on its way
        ([asg("i1", A), asg("i1", A)], {}, set(), ["i1"], []),  # duplicates start once
        ([asg("i2", A), asg("i1", A)], {"i3": A}, set(), ["i2", "i1"], ["i3"]),
    ],
)
def test_plan(assigned, running, stopping, start, stop):
    result = plan(assigned, running, stopping)
    assert [a.instance_id for a in result.start] == start
    assert list(result.stop) == stop
    assert result.empty == (not start and not stop)
    assert result.respec == ()


def spec(**changes: object) -> dict:
    base = {
        "kind": "ModelService",
        "spec": {
            "model": {"name": "m", "version": "1"},
            "backend": {"type": "sim"},
            "sla": {"p99_latency_ms": 100, "min_replicas": 1, "max_replicas": 4},
            "replicas": 2,
            "rollout": {"hold_s": 30},
        },
    }
    for dotted, value in changes.items():
        node = base
        *path, last = dotted.split("__")
        for key in path:
            node = node[key]
        node[last] = value
    return base


@pytest.mark.parametrize(
    ("changed", "restarts"),
    [
        ({"spec__replicas": 3}, False),  # scaling restarts no running instance
        ({"spec__sla__min_replicas": 2, "spec__sla__max_replicas": 8}, False),
        ({"spec__rollout": {"hold_s": 5, "steps": [50, 100]}}, False),
        ({"spec__sla__p99_latency_ms": 50}, True),  # the sidecar reads the SLA
        ({"spec__model__version": "2"}, True),
        ({"spec__backend": {"type": "sim", "config": {"slowdown": 2}}}, True),
    ],
)
def test_only_a_change_a_running_instance_reads_restarts_it(changed, restarts):
    old, new = spec(), spec(**changed)
    result = plan([asg("i1", new)], {"i1": old}, set())
    assert list(result.stop) == (["i1"] if restarts else [])
    assert [a.spec for a in result.respec] == ([] if restarts else [new])
    assert result.start == ()
