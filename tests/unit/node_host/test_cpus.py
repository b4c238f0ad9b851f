"""The tiers' CPU cores (node_host.cpus): which cores an instance gets for its spec's tier, the checks a
--tier-cpus value must pass on this machine, and the thread-pool sizes a pinned child is given."""

from __future__ import annotations

import pytest

from node_host.cpus import THREAD_ENV, CpuPlan, CpuShare, thread_env
from sie.cpu_lists import parse_tier_cpus
from sie.spec import Priority

FOUR = frozenset({0, 1, 2, 3})


@pytest.mark.parametrize(
    ("allowed", "tiers", "tier", "cpus"),
    [
        # No tier cores configured: nothing is pinned, whatever the spec says.
        (FOUR, "", None, None),
        (FOUR, "", "gold", None),
        # A tier with cores gets exactly those; everyone else the shared pool (allowed less every tier's).
        (FOUR, "gold=0", "gold", {0}),
        (FOUR, "gold=0", None, {1, 2, 3}),
        (FOUR, "gold=0", "silver", {1, 2, 3}),  # a tier without cores of its own is in the shared pool
        (FOUR, "gold=0-1;silver=2", "silver", {2}),
        (FOUR, "gold=0-1;silver=2", "gold", {0, 1}),
        (FOUR, "gold=0-1;silver=2", None, {3}),
        (frozenset({0, 1}), "gold=0", None, {1}),  # the 2-core machine of bench.tiers
        (frozenset({2, 5, 7}), "gold=5", None, {2, 7}),  # an affinity that is not 0..n-1
    ],
)
def test_cpus_for_a_tier(allowed, tiers, tier, cpus):
    plan = CpuPlan.build(allowed, parse_tier_cpus(tiers))
    assert plan.cpus_for(tier) == (None if cpus is None else frozenset(cpus))


@pytest.mark.parametrize(
    ("allowed", "tiers", "match"),
    [
        (frozenset({0, 1}), "gold=2", "tier 'gold' asks for CPU 2, not among the CPUs this node host may use \\(0-1"),
        (frozenset({0, 1}), "gold=0-1", "leaving none for the shared pool"),
        (FOUR, "gold=0-1;silver=2-3", "leaving none for the shared pool"),
        (FOUR, "gold=0-1;silver=1-2", "CPU 1 is given to both tier 'gold' and tier 'silver'"),
    ],
)
def test_a_plan_that_does_not_fit_the_machine_names_the_field_and_why(allowed, tiers, match):
    with pytest.raises(ValueError, match="^tier_cpus: .*" + match):
        CpuPlan.build(allowed, parse_tier_cpus(tiers))


def test_the_plan_describes_itself():
    plan = CpuPlan.build(FOUR, parse_tier_cpus("gold=0;silver=2"))
    assert plan.isolating and plan.shared == {1, 3}
    assert plan.describe() == {"gold": "0", "silver": "2", "shared": "1,3"}
    assert CpuPlan.none().describe() == {} and not CpuPlan.none().isolating and CpuPlan.none().cpus_for("x") is None


@pytest.mark.parametrize(
    ("tiers", "background_shared", "tier", "priority", "share"),
    [
        ("", True, None, Priority.P2, None),  # no tier cores: nothing changes
        ("gold=0", True, "gold", Priority.P0, CpuShare(frozenset({0}))),
        # The shared pool's P1 and P2 instances run in the background (SCHED_IDLE)...
        ("gold=0", True, None, Priority.P1, CpuShare(frozenset({1, 2, 3}), background=True)),
        ("gold=0", True, "silver", Priority.P2, CpuShare(frozenset({1, 2, 3}), background=True)),
        # ...a P0 there keeps the ordinary policy, as does everyone with shared_pool_sched normal.
        ("gold=0", True, None, Priority.P0, CpuShare(frozenset({1, 2, 3}))),
        ("gold=0", False, None, Priority.P2, CpuShare(frozenset({1, 2, 3}))),
        # A tier's own instances are never in the background, whatever their priority.
        ("gold=0;silver=1", True, "silver", Priority.P2, CpuShare(frozenset({1}))),
    ],
)
def test_share_for_a_tier_and_priority(tiers, background_shared, tier, priority, share):
    plan = CpuPlan.build(FOUR, parse_tier_cpus(tiers), background_shared)
    assert plan.share_for(tier, priority) == share


def test_a_share_describes_itself():
    assert CpuShare(frozenset({2, 3}), background=True).describe() == "2-3 (background)"
    assert CpuShare(frozenset({0})).describe() == "0"


@pytest.mark.parametrize(
    ("cpus", "environ", "env"),
    [
        (None, {}, {}),  # unpinned: its libraries size their pools as they always did
        (frozenset({0}), {}, {name: "1" for name in THREAD_ENV}),
        (frozenset({1, 2, 3}), {}, {name: "3" for name in THREAD_ENV}),
        # The operator's own setting (the node host's environment, which children inherit) is kept.
        (frozenset({0}), {"OMP_NUM_THREADS": "4"}, {"MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}),
    ],
)
def test_thread_env(cpus, environ, env):
    assert thread_env(cpus, environ) == env


def test_share_of_counts_background_only_with_the_autogroup_lowered(monkeypatch):
    import os

    from node_host import cpus

    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(cpus.os, "sched_getscheduler", lambda pid: os.SCHED_IDLE)
    # 19: lowered; None: no autogroups (SCHED_IDLE alone decides); 0: the group was not lowered.
    for group, background in ((19, True), (None, True), (0, False)):
        monkeypatch.setattr(cpus, "autogroup_nice", lambda pid, g=group: g)
        assert cpus.share_of(4242) == cpus.CpuShare(frozenset({1}), background)
    monkeypatch.setattr(cpus.os, "sched_getscheduler", lambda pid: os.SCHED_OTHER)
    monkeypatch.setattr(cpus, "autogroup_nice", lambda pid: 19)
    assert cpus.share_of(4242) == cpus.CpuShare(frozenset({1}), False)
