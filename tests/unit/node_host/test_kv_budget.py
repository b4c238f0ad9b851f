"""Admission under the KV-token budget: FIFO, bounded by tokens, rows and prefill per iteration."""

from __future__ import annotations

import pytest

from node_host.backends.torch_engine.kv_budget import BudgetLimits, plan_admission

LIMITS = BudgetLimits(max_total_tokens=100, max_running=3, max_prefill_tokens=50)


@pytest.mark.parametrize(
    "waiting, running, reserved, expect",
    [
        ([], 0, 0, 0),
        ([(10, 20), (10, 20)], 0, 0, 2),  # both fit
        ([(10, 20)] * 5, 0, 0, 3),  # rows cap
        ([(10, 20)] * 5, 2, 10, 1),  # rows cap counts the running ones
        ([(10, 60), (10, 20)], 0, 50, 0),  # head does not fit: FIFO blocks the small one behind it
        ([(10, 50)], 0, 50, 1),  # exactly full is allowed
        ([(40, 45), (20, 25)], 0, 0, 1),  # second prompt would exceed the prefill tokens per iteration
        ([(80, 90)], 0, 0, 1),  # a prompt over max_prefill_tokens still goes when it is first
    ],
)
def test_plan_admission(waiting, running, reserved, expect):
    assert plan_admission(waiting, running, reserved, LIMITS) == expect


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match=">= 1"):
        BudgetLimits(max_total_tokens=0, max_running=1, max_prefill_tokens=1)
