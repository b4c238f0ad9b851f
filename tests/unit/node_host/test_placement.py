import pytest

from node_host.ledger import Entry, EntryState, GPULedger, Ledger, Refusal, Watermarks, mark_loaded, reserve, sleep
from node_host.memory_estimate import MemoryEstimate
from node_host.placement import NeedsEviction, Place, PlacementRequest, place, plan_relief, plan_wake
from sie.spec import ModelService, Priority

P0, P1, P2 = Priority.P0, Priority.P1, Priority.P2
FACTS = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.4", "sglang": "0.5.23"}


def e(name, mb, priority=P1, *, demand=0, wake=1.0, used=0.0, state=EntryState.LOADED):
    return Entry(
        instance_id=name,
        model_id=name,
        priority=priority,
        estimate_mb=mb,
        state=state,
        demand=demand,
        wake_cost_s=wake,
        last_used=used,
    )


def book(*gpus, total=1000.0, high=0.9, tiers=None):
    tiers = tiers or {}
    return Ledger(
        gpus=tuple(
            GPULedger(index=i, total_mb=total, entries=tuple(es), tier=tiers.get(i)) for i, es in enumerate(gpus)
        ),
        watermarks=Watermarks(high=high, low=0.5),
    )


def req(mb, priority=P1, *, tp=1, tier=None, requires=(), name="new"):
    return PlacementRequest(
        instance_id=name,
        model_id=name,
        priority=priority,
        per_gpu_mb=mb,
        tp_size=tp,
        tier=tier,
        requires=tuple(requires),
    )


# (GPU contents, request, expected decision: ("place", gpus) | ("evict", gpus, victims) | ("refuse", status))
ROWS = [
    # binpack: the fullest GPU that still fits
    ([[], []], req(100), ("place", (0,))),
    ([[e("a", 500)], []], req(100), ("place", (0,))),
    ([[], [e("a", 500)]], req(100), ("place", (1,))),
    ([[e("a", 300)], [e("b", 600)]], req(200), ("place", (1,))),
    ([[e("a", 300)], [e("b", 600)]], req(301), ("place", (0,))),  # GPU 1 would cross 900
    ([[e("a", 300)], [e("b", 600)], []], req(700), ("place", (2,))),  # only the empty one has room: open it
    ([[e("a", 850)], [e("b", 850)]], req(50), ("place", (0,))),  # a tie goes to the lower index
    ([[e("a", 900)], [e("b", 100)]], req(1), ("place", (1,))),  # exactly at the watermark is full
    # tensor parallel: that many GPUs, fullest first
    ([[e("a", 100)], [e("b", 500)], [e("c", 300)]], req(300, tp=2), ("place", (1, 2))),
    ([[e("a", 100)], [e("b", 700)], []], req(300, tp=2), ("place", (0, 2))),
    ([[], []], req(100, tp=3), ("refuse", 409)),
    # too big for any GPU: no waiting helps
    ([[], []], req(901), ("refuse", 409)),
    # pre-eviction instead of failure: the cheapest GPU to clear
    ([[e("p2", 500, P2)], [e("p1", 500, P1)]], req(600, P1), ("evict", (0,), ("p2",))),
    ([[e("busy", 500, P2, demand=2)], [e("idle", 500, P2)]], req(600, P1), ("evict", (1,), ("idle",))),
    ([[e("dear", 500, P2, wake=60)], [e("cheap", 500, P2, wake=1)]], req(600, P1), ("evict", (1,), ("cheap",))),
    ([[e("x", 250, P2), e("y", 250, P2)], [e("z", 500, P2)]], req(750, P1), ("evict", (1,), ("z",))),  # fewer victims
    ([[e("x", 250, P2), e("y", 250, P2)], [e("z", 500, P2)]], req(600, P1), ("evict", (0,), ("x",))),  # frees least
    ([[e("p0", 800, P0)], [e("p1", 800, P1, demand=1)]], req(200, P1), ("refuse", 503)),  # nothing may make way
    ([[e("p0", 800, P0)]], req(200, P0), ("evict", (0,), ("p0",))),  # an idle P0 makes way for a P0
    ([[e("p1", 500, P1), e("p2", 300, P2)]], req(300, P1), ("evict", (0,), ("p2",))),
    ([[e("p1", 500, P1, demand=1), e("p2", 300, P2, demand=1)]], req(300, P1), ("evict", (0,), ("p2",))),
    ([[e("p1", 500, P1, demand=1), e("p2", 300, P2, demand=1)]], req(300, P2), ("refuse", 503)),
    ([[e("p1", 800, P1)]], req(200, P2), ("evict", (0,), ("p1",))),  # an idle P1 makes way for a P2 with traffic
    ([[e("p1", 800, P1)], [e("p2", 800, P2)]], req(200, P2), ("evict", (1,), ("p2",))),  # the equal one first
    # one load at a time per GPU
    ([[e("l", 100, state=EntryState.LOADING)], []], req(100), ("place", (1,))),
    ([[e("l", 100, state=EntryState.LOADING)]], req(100), ("refuse", 503)),
    # requirements
    ([[]], req(10, requires=["cuda>=12.1", "sglang==0.5.*"]), ("place", (0,))),
    ([[]], req(10, requires=["cuda>=12.6"]), ("refuse", 409)),
    ([[]], req(10, requires=["vllm"]), ("refuse", 409)),
]


@pytest.mark.parametrize("gpus, request_, expected", ROWS)
def test_place(gpus, request_, expected):
    decision = place(book(*gpus), request_, facts=FACTS)
    kind = expected[0]
    if kind == "place":
        assert decision == Place(expected[1])
    elif kind == "evict":
        assert isinstance(decision, NeedsEviction), decision
        assert (decision.gpu_indices, decision.victims) == (expected[1], expected[2])
    else:
        assert isinstance(decision, Refusal), decision
        assert decision.status == expected[1]
        assert decision.retryable is (expected[1] == 503)


TIERS = {0: "p0-pool", 1: "p0-pool", 2: "batch"}


@pytest.mark.parametrize(
    "request_, expected, fragment",
    [
        (req(10, P0, tier="p0-pool"), Place((0,)), None),
        (req(10, P1, tier="p0-pool"), 409, "tier 'p0-pool' is reserved for P0 models and 'new' (P1) is P1"),
        (req(10, P2, tier="p0-pool"), 409, "set model.priority_level to P0 or choose another scheduling.tier"),
        (req(10, P2, tier="batch"), Place((2,)), None),
        (req(10, P1, tier="gold"), 409, "no GPU in it (its tiers: batch, p0-pool)"),
        (req(10, P1), Place((2,)), None),  # no tier named: anything but P0-only tiers
        (req(10, P0), Place((2,)), None),
        (req(10, P1, tp=2), 409, "needs 2 GPUs (tp_size) but its pool on this node has 1"),
    ],
)
def test_tier_exclusivity(request_, expected, fragment):
    decision = place(book([], [], [], tiers=TIERS), request_, facts=FACTS, p0_only_tiers={"p0-pool"})
    if isinstance(expected, int):
        assert isinstance(decision, Refusal) and decision.status == expected and not decision.retryable
        assert fragment in decision.reason
    else:
        assert decision == expected


def test_node_of_only_p0_tiers_refuses_untiered_models():
    decision = place(book([], tiers={0: "p0-pool"}), req(10, P0), facts=FACTS, p0_only_tiers={"p0-pool"})
    assert isinstance(decision, Refusal) and decision.status == 409 and "P0-only tier" in decision.reason


def test_requirement_refusal_names_every_unmet_constraint():
    decision = place(book([]), req(10, requires=["cuda>=13", "vllm>=0.6"]), facts=FACTS)
    assert isinstance(decision, Refusal)
    assert "node has cuda 12.4" in decision.reason and "does not report vllm" in decision.reason


def test_refusal_under_pressure_names_what_is_missing_per_gpu():
    decision = place(book([e("p0", 800, P0)], [e("p0b", 700, P0)]), req(300, P1), facts=FACTS)
    assert isinstance(decision, Refusal) and decision.retryable
    assert [(s.gpu_index, s.missing_mb) for s in decision.shortfalls] == [(0, 200.0), (1, 100.0)]
    assert "GPU 0 needs 200 MiB freed" in decision.reason and "GPU 1 needs 100 MiB freed" in decision.reason


def test_eviction_then_reserve_round_trip():
    ledger = book([e("idle", 600, P2)])
    decision = place(ledger, req(500, P1), facts=FACTS)
    assert isinstance(decision, NeedsEviction) and decision.victims == ("idle",)
    for victim in decision.victims:
        ledger = sleep(ledger, victim)
    assert place(ledger, req(500, P1), facts=FACTS) == Place((0,))
    ledger = reserve(ledger, decision.gpu_indices, req(500, P1).entry())
    assert isinstance(ledger, Ledger)
    ledger = mark_loaded(ledger, "new", 480.0)
    assert ledger.gpu(0).held_mb == 480


def test_tensor_parallel_eviction_lists_each_victim_once():
    shared = [e("tp-victim", 500, P2)]
    decision = place(book(list(shared), list(shared)), req(600, P1, tp=2), facts=FACTS)
    assert isinstance(decision, NeedsEviction)
    assert decision.gpu_indices == (0, 1) and decision.victims == ("tp-victim",)


@pytest.mark.parametrize(
    "gpu, expected",
    [
        ([e("s", 400, state=EntryState.SLEEPING)], Place((0,))),
        ([e("s", 400, P1, state=EntryState.SLEEPING), e("p2", 600, P2)], ("evict", ("p2",))),
        ([e("s", 400, P1, state=EntryState.SLEEPING), e("p0", 600, P0)], 503),
        ([e("s", 400, state=EntryState.SLEEPING), e("l", 10, state=EntryState.LOADING)], 503),
        ([e("s", 400)], 409),  # awake already
    ],
)
def test_plan_wake(gpu, expected):
    decision = plan_wake(book(gpu), "s")
    if isinstance(expected, int):
        assert isinstance(decision, Refusal) and decision.status == expected
    elif isinstance(expected, tuple):
        assert isinstance(decision, NeedsEviction) and decision.victims == expected[1]
    else:
        assert decision == expected


@pytest.mark.parametrize(
    "entries, victims",
    [
        ([e("grower", 700, P1, demand=3), e("p2", 250, P2)], ("p2",)),  # 950 > 900: 50 must go
        ([e("grower", 700, P2, demand=3), e("p1", 250, P1, demand=1)], None),  # a P2's growth never evicts a busy P1
        ([e("grower", 700, P2, demand=3), e("p1", 250, P1)], ("p1",)),  # an idle one makes way
        ([e("grower", 700, P2, demand=3), e("p0", 250, P0)], None),  # an idle P0 never does, for a P2
        ([e("grower", 500, P1)], ()),  # under the watermark: nothing to do
    ],
)
def test_plan_relief_after_kv_growth(entries, victims):
    out = plan_relief(book(entries), 0, "grower")
    if victims is None:
        assert isinstance(out, Refusal)
    else:
        assert out.instance_ids == victims


def test_request_from_spec():
    service = ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "qwen", "priority_level": "P0"},
                "backend": {"type": "sglang", "config": {"tp_size": 2}, "requires": ["cuda>=12.1"]},
                "scheduling": {"tier": "p0-pool"},
            }
        }
    )
    request = PlacementRequest.from_spec(
        service, "qwen-0", MemoryEstimate(declared_mb=30_000, tp_size=2), wake_cost_s=2.5
    )
    assert request == PlacementRequest("qwen-0", "qwen", P0, 15_000, 2, "p0-pool", ("cuda>=12.1",), 2.5)
    assert request.entry(now=7.0).estimate_mb == 15_000 and request.entry(now=7.0).last_used == 7.0
