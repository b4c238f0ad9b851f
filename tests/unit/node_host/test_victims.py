import pytest

from node_host.ledger import Entry, EntryState, GPULedger, Refusal
from node_host.victims import Eviction, choose_victims, may_evict
from sie.spec import Priority

P0, P1, P2 = Priority.P0, Priority.P1, Priority.P2
LOADED, LOADING, SLEEPING = EntryState.LOADED, EntryState.LOADING, EntryState.SLEEPING


def e(name, mb, priority, *, demand=0, wake=1.0, used=0.0, state=LOADED, residue=0.0):
    return Entry(
        instance_id=name,
        model_id=name,
        priority=priority,
        estimate_mb=mb,
        state=state,
        demand=demand,
        wake_cost_s=wake,
        last_used=used,
        residue_mb=residue,
    )


def gpu(*entries):
    return GPULedger(index=3, total_mb=80_000, entries=tuple(entries))


# (entries on the GPU, MiB needed, requester priority, expected victims in order; None = refused)
ROWS = [
    # priority first: P2 goes before P1 whatever else is true of them
    ([e("p1", 100, P1), e("p2", 100, P2)], 50, P0, ["p2"]),
    ([e("p1", 100, P1, used=0), e("p2", 100, P2, used=99, demand=5, wake=9)], 50, P0, ["p2"]),
    # then no demand before busy
    ([e("busy", 100, P2, demand=1), e("idle", 100, P2, demand=0)], 50, P1, ["idle"]),
    ([e("busy", 100, P2, demand=1, wake=0.1), e("idle", 100, P2, wake=30)], 50, P1, ["idle"]),
    # then cheapest to bring back
    ([e("slow", 100, P2, wake=30), e("fast", 100, P2, wake=0.5)], 50, P1, ["fast"]),
    ([e("slow", 100, P2, wake=30, used=0), e("fast", 100, P2, wake=0.5, used=99)], 50, P1, ["fast"]),
    # then least recently used
    ([e("recent", 100, P2, used=50), e("old", 100, P2, used=10)], 50, P1, ["old"]),
    # ties broken by id, so the choice is deterministic
    ([e("b", 100, P2), e("a", 100, P2)], 50, P1, ["a"]),
    # stop once enough is freed, in order
    ([e("a", 100, P2), e("b", 100, P2, used=1), e("c", 100, P2, used=2)], 150, P1, ["a", "b"]),
    ([e("a", 100, P2), e("b", 100, P2, used=1)], 100, P1, ["a"]),  # exactly enough is enough
    ([e("big", 500, P2, used=5), e("small", 10, P2, used=1)], 100, P1, ["small", "big"]),  # order, not best fit
    # nothing needed, nobody goes
    ([e("a", 100, P2)], 0, P1, []),
    ([e("a", 100, P2)], -5, P1, []),
    # P0 never makes way for lower priorities
    ([e("p0", 1000, P0)], 10, P1, None),
    ([e("p0", 1000, P0)], 10, P2, None),
    ([e("p0", 1000, P0), e("p2", 5, P2)], 10, P1, None),  # p2 is not enough and p0 may not help
    # an idle P0 makes way for a P0 with work; a busy one does not
    ([e("p0", 1000, P0)], 10, P0, ["p0"]),
    ([e("p0", 1000, P0, demand=2)], 10, P0, None),
    # equal priority: idle peers only
    ([e("peer", 100, P1)], 50, P1, ["peer"]),
    ([e("peer", 100, P1, demand=1)], 50, P1, None),
    ([e("peer", 100, P1, demand=1), e("idle", 100, P1)], 50, P1, ["idle"]),
    # higher priority than the requester: only when idle, after every lower or equal candidate, never P0
    ([e("p1", 100, P1, demand=1)], 50, P2, None),
    ([e("p1", 100, P1)], 50, P2, ["p1"]),  # an idle P1 makes way for a P2 with traffic
    ([e("p1", 100, P1), e("p2", 100, P2)], 150, P2, ["p2", "p1"]),
    ([e("p1", 100, P1), e("p2", 100, P2)], 100, P2, ["p2"]),  # the peer first; the P1 stays
    ([e("p1", 100, P1, demand=2), e("p2", 100, P2)], 150, P2, None),  # a busy P1 never goes for a P2
    ([e("p0", 100, P0), e("p1", 100, P1)], 150, P2, None),  # an idle P0 never goes for a P2
    ([e("p0", 100, P0), e("p1", 100, P1)], 100, P2, ["p1"]),
    # lower priority goes even when busy, after the idle ones of that priority
    ([e("p2busy", 100, P2, demand=9), e("p1idle", 100, P1)], 150, P1, ["p2busy", "p1idle"]),
    ([e("p2busy", 100, P2, demand=9), e("p2idle", 100, P2)], 150, P0, ["p2idle", "p2busy"]),
    # loading and sleeping instances free nothing and are never chosen
    ([e("loading", 100, P2, state=LOADING)], 50, P0, None),
    ([e("asleep", 100, P2, state=SLEEPING)], 50, P0, None),
    ([e("asleep", 100, P2, state=SLEEPING), e("awake", 100, P2, used=9)], 50, P0, ["awake"]),
    # a victim frees what it holds less the residue it keeps asleep
    ([e("a", 100, P2, residue=60), e("b", 100, P2, used=1)], 50, P1, ["a", "b"]),
    ([e("a", 100, P2, residue=50)], 50, P1, ["a"]),
    # a full mix: P2 idle cheap, P2 idle dear, P2 busy, P1 idle, P1 busy, P0 idle
    (
        [
            e("p0", 100, P0),
            e("p1busy", 100, P1, demand=4),
            e("p1idle", 100, P1, used=3),
            e("p2busy", 100, P2, demand=1, wake=0.1),
            e("p2dear", 100, P2, wake=40),
            e("p2cheap", 100, P2, wake=2),
        ],
        450,
        P0,
        ["p2cheap", "p2dear", "p2busy", "p1idle", "p1busy"],
    ),
    (
        [e("p0", 100, P0), e("p1busy", 100, P1, demand=4), e("p1idle", 100, P1), e("p2", 100, P2)],
        250,
        P1,
        None,  # p2 and p1idle free 200; p1busy (busy peer) and p0 (P0 for a P1) stay
    ),
    (
        [
            e("p0idle", 100, P0),
            e("p0busy", 100, P0, demand=1),
            e("p1idle", 100, P1, used=9),
            e("p2busy", 100, P2, demand=3),
        ],
        300,
        P2,
        None,  # for a P2: only p1idle may go (p2busy is a busy peer, P0 never for a P2)
    ),
]


@pytest.mark.parametrize("entries, need, requester, expected", ROWS)
def test_victim_choice(entries, need, requester, expected):
    out = choose_victims(gpu(*entries), need, for_priority=requester)
    if expected is None:
        assert isinstance(out, Refusal), out
        assert out.shortfalls[0].gpu_index == 3 and out.shortfalls[0].missing_mb > 0
        assert f"needs {need:.0f} MiB freed for a {requester.value}" in out.reason
    else:
        assert isinstance(out, Eviction), out
        assert list(out.instance_ids) == expected
        assert out.freed_mb >= need


def test_evicting_everything_allowed_never_touches_busy_peers_or_betters_nor_p0_for_lower():
    entries = [
        e(f"{p.value}-{d}", 100, p, demand=d, used=i)
        for i, (p, d) in enumerate((p, d) for p in Priority for d in (0, 3))
    ]
    for requester in Priority:
        allowed = [
            x
            for x in entries
            if x.priority.rank > requester.rank or (x.demand == 0 and (x.priority is not P0 or requester is P0))
        ]
        out = choose_victims(gpu(*entries), 100 * len(allowed), for_priority=requester)
        assert isinstance(out, Eviction)
        assert set(out.instance_ids) == {x.instance_id for x in allowed}
        assert all(v.demand == 0 for v in out.victims if v.priority.rank <= requester.rank)
        assert all(v.priority is not P0 for v in out.victims) or requester is P0
        ranks = [v.priority.rank for v in out.victims]
        assert ranks == sorted(ranks, reverse=True)  # lowest priority goes first
        assert isinstance(choose_victims(gpu(*entries), 100 * len(allowed) + 1, for_priority=requester), Refusal)


def test_exclude_keeps_named_instances():
    out = choose_victims(gpu(e("me", 100, P2), e("other", 100, P2, used=5)), 50, for_priority=P1, exclude={"me"})
    assert isinstance(out, Eviction) and out.instance_ids == ("other",)


def test_refusal_says_what_is_missing_and_who_was_kept():
    out = choose_victims(gpu(e("p0", 1000, P0), e("p2", 300, P2)), 800, for_priority=P1)
    assert isinstance(out, Refusal)
    assert "frees only 300 MiB (missing 500 MiB)" in out.reason
    assert "eligible: p2 (P2, idle, 300 MiB)" in out.reason
    assert "kept: p0 (P0, idle, 1000 MiB) (busy at equal or higher priority, or P0 for a lower priority" in out.reason


@pytest.mark.parametrize(
    "victim, requester, allowed",
    [
        (e("x", 1, P2), P1, True),
        (e("x", 1, P2, demand=3), P1, True),
        (e("x", 1, P1), P1, True),
        (e("x", 1, P1, demand=1), P1, False),
        (e("x", 1, P0), P1, False),
        (e("x", 1, P0), P2, False),
        (e("x", 1, P1), P2, True),  # idle: makes way for traffic
        (e("x", 1, P1, demand=1), P2, False),
        (e("x", 1, P0), P0, True),
        (e("x", 1, P0, demand=1), P0, False),
        (e("x", 1, P2, state=LOADING), P0, False),
        (e("x", 1, P2, state=SLEEPING), P0, False),
        (e("x", 0, P2), P0, False),  # frees nothing
    ],
)
def test_may_evict(victim, requester, allowed):
    assert may_evict(victim, requester) is allowed
