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
