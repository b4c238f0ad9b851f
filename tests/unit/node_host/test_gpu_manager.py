"""GPUManager: what an instance asks of the GPUs, and admission into the running node's ledger."""

from __future__ import annotations

import pytest

from node_host.gpu_manager import DEFAULT_SMALL_MODEL_MB, Evict, GPUManager, OffGPU, Placed, Refuse, Wait, gpu_need
from node_host.ledger import EntryState, Watermarks
from node_host.memory_estimate import EstimateError
from sie.spec_loader import parse_model_service
from sie.wire import GPUInfo

GIB = 1024.0
FACTS = {"python": "3.11.7", "torch": "2.13.0", "cuda": "12.4"}
QWEN2_0_5B = {  # the public config.json of Qwen2-0.5B
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "intermediate_size": 4864,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def svc(name="m", *, backend="sim", priority="P2", mb=None, gpus=None, path=None, tier=None, requires=(), tp=1):
    resources = {}
    if mb is not None:
        resources["min_gpu_memory_mb"] = mb
    if gpus is not None:
        resources["gpus"] = gpus
    spec = {
        "model": {"name": name, "priority_level": priority, **({"path": path} if path else {})},
        "backend": {"type": backend, "requires": list(requires), "config": {"tp_size": tp}},
        "resources": resources,
        "scheduling": {"tier": tier} if tier else {},
    }
    return parse_model_service({"metadata": {"name": name}, "spec": spec}, "test")


def gpu(index=0, gib=80.0, used=0.0):
    return GPUInfo(
        index=index, name=f"virtual GPU ({gib:g} GiB, simulated)", total_mb=gib * GIB, used_mb=used, virtual=True
    )


def configs(mapping):
    return lambda path: mapping.get(path)


@pytest.mark.parametrize(
    "service, expect",
    [
        (svc(backend="sklearn"), (False, 0.0, "")),  # a scorer: off-GPU
        (svc(backend="torch"), (False, 0.0, "")),  # the CPU torch demo: no GPU asked for
        (svc(backend="sim"), (False, 0.0, "")),
        (svc(backend="sim", mb=30720), (True, 30720.0, "spec")),
        (svc(backend="torch", gpus=1), (True, DEFAULT_SMALL_MODEL_MB, "default")),  # no size, no config.json
        (svc(backend="sglang", mb=20480, tp=2), (True, 10240.0, "spec")),  # per GPU
    ],
)
def test_gpu_need(service, expect):
    need = gpu_need(service, configs({}))
    assert (need.on_gpu, need.per_gpu_mb, need.source) == expect


def test_gpu_need_from_config_json():
    need = gpu_need(svc(backend="sglang", path="/models/qwen"), configs({"/models/qwen": QWEN2_0_5B}))
    assert need.on_gpu and need.source == "config"
    assert 1000 < need.per_gpu_mb < 4 * GIB  # ~0.9 GiB of weights + the default KV budget + overheads


def test_sglang_without_a_size_is_refused_with_the_fix():
    with pytest.raises(EstimateError, match="min_gpu_memory_mb"):
        gpu_need(svc(backend="sglang", path="/nowhere"), configs({}))
    manager = GPUManager([gpu()], facts=FACTS, read_config=configs({}))
    decision = manager.admit("s-0", svc(backend="sglang", path="/nowhere"), 0.0)
    assert isinstance(decision, Refuse) and "min_gpu_memory_mb" in decision.reason


def test_off_gpu_instances_hold_nothing_but_requirements_still_apply():
    manager = GPUManager([gpu()], facts=FACTS)
    assert isinstance(manager.admit("a-0", svc(backend="sklearn"), 0.0), OffGPU)
    assert manager.gpu_of("a-0") is None and not manager.holds("a-0")
    refused = manager.admit("b-0", svc(backend="sklearn", requires=["sglang>=0.5"]), 0.0)
    assert isinstance(refused, Refuse) and "sglang" in refused.reason


def test_a_p0_only_tier_refuses_p1_off_the_gpus_too():
    """Its CPU cores (--tier-cpus) are the tier's as much as its GPUs: P0 alone there."""
    manager = GPUManager([], facts=FACTS, p0_only_tiers=["gold"])
    refused = manager.admit("s-0", svc("s", backend="sklearn", priority="P1", tier="gold"), 0.0)
    assert isinstance(refused, Refuse) and refused.status == 409 and "reserved for P0" in refused.reason
    assert isinstance(manager.admit("s-1", svc("s", backend="sklearn", priority="P0", tier="gold"), 0.0), OffGPU)
    assert isinstance(manager.admit("s-2", svc("s", backend="sklearn", priority="P1", tier="silver"), 0.0), OffGPU)


def test_a_node_without_gpus_refuses_gpu_models_and_points_at_virtual_gpus():
    decision = GPUManager([], facts=FACTS).admit("a-0", svc(mb=1024), 0.0)
    assert isinstance(decision, Refuse) and "--virtual-gpus" in decision.reason


def test_one_load_at_a_time_per_gpu():
    manager = GPUManager([gpu()], facts=FACTS)
    first = manager.admit("p2-0", svc("p2", mb=28672), 0.0)
    assert first == Placed((0,), 28672.0) and manager.state_of("p2-0") is EntryState.LOADING
    second = manager.admit("p2-1", svc("p2", mb=28672), 0.0)
    assert isinstance(second, Wait) and not second.short_of_memory and "p2-0" in second.reason
    manager.loaded("p2-0")
    assert manager.admit("p2-1", svc("p2", mb=28672), 0.0) == Placed((0,), 28672.0)


def full_gpu() -> GPUManager:
    manager = GPUManager([gpu()], facts=FACTS)
    for iid in ("p2-0", "p2-1"):
        assert isinstance(manager.admit(iid, svc("p2", mb=28672), 0.0), Placed)
        manager.loaded(iid)
    return manager


def test_a_p0_that_would_cross_the_high_watermark_needs_a_victim_and_reserves_nothing_yet():
    manager = full_gpu()
    decision = manager.admit("p0-0", svc("p0", priority="P0", mb=30720), 0.0)
    assert isinstance(decision, Evict) and len(decision.victims) == 1 and decision.victims[0].startswith("p2-")
    assert not manager.holds("p0-0")
    freed = manager.sleep(decision.victims[0])
    assert freed == 28672.0
    assert manager.admit("p0-0", svc("p0", priority="P0", mb=30720), 0.0) == Placed((0,), 30720.0)
    assert manager.ledger.gpus[0].level_mb == 58 * GIB


def test_a_p2_never_evicts_a_busy_p0_and_the_wait_says_what_is_missing():
    manager = GPUManager([gpu()], facts=FACTS)
    manager.admit("p0-0", svc("p0", priority="P0", mb=60 * 1024), 0.0)
    manager.loaded("p0-0")
    manager.observe("p0-0", demand=3)
    decision = manager.admit("p2-0", svc("p2", mb=28672), 0.0)
    assert isinstance(decision, Wait) and decision.short_of_memory
    assert "missing" in decision.reason and "p0-0" in decision.reason


def test_tier_exclusivity_and_size_are_refusals_not_waits():
    manager = GPUManager([gpu(0), gpu(1)], facts=FACTS, tiers={0: "gold"}, p0_only_tiers=["gold"])
    refused = manager.admit("p2-0", svc("p2", mb=1024, tier="gold"), 0.0)
    assert isinstance(refused, Refuse) and refused.status == 409 and "reserved for P0" in refused.reason
    assert manager.admit("p0-0", svc("p0", priority="P0", mb=1024, tier="gold"), 0.0) == Placed((0,), 1024.0)
    assert manager.admit("p2-1", svc("p2", mb=1024), 0.0) == Placed((1,), 1024.0)  # no tier: outside gold
    too_big = manager.admit("big-0", svc("big", mb=75 * 1024), 0.0)
    assert isinstance(too_big, Refuse) and "tp_size" in too_big.reason


def test_wake_candidates_only_under_the_low_watermark():
    manager = full_gpu()
    manager.sleep("p2-0")
    manager.admit("p0-0", svc("p0", priority="P0", mb=30720), 0.0)
    manager.loaded("p0-0")
    assert manager.wake_candidates() == ()  # 58 GiB held + 28 would be 86 > 60
    manager.release("p0-0")
    assert manager.wake_candidates() == ("p2-0",)  # 28 + 28 = 56 <= 60
    assert manager.begin_wake("p2-0") is None and manager.state_of("p2-0") is EntryState.LOADING
    manager.abort_wake("p2-0")
    assert manager.state_of("p2-0") is EntryState.SLEEPING and manager.held_mb("p2-0") == 0.0


def test_measured_growth_above_the_high_watermark_asks_for_relief():
    manager = GPUManager([gpu()], facts=FACTS, watermarks=Watermarks(high=0.9, low=0.75))
    for iid, priority in (("p0-0", "P0"), ("p2-0", "P2")):
        manager.admit(iid, svc(iid[:2], priority=priority, mb=30 * 1024), 0.0)
        manager.loaded(iid)
    assert manager.relief() is None
    manager.observe("p0-0", measured_mb={0: 50 * 1024})  # KV grew: 50 + 30 = 80 > 72 GiB
    relief = manager.relief()
    assert relief is not None and relief.instance_ids == ("p2-0",)


def test_views_label_virtual_gpus_and_report_the_ledger_level_as_use():
    manager = full_gpu()
    (info,) = manager.gpu_infos()
    assert info.virtual and info.used_mb == 56 * GIB
    view = manager.to_json()["gpus"][0]
    assert view["virtual"] is True and "simulated" in view["name"] and view["level_mb"] == 56 * GIB
    assert view["high_mb"] == 72 * GIB and view["low_mb"] == 60 * GIB
    row = view["instances"][0]
    assert (
        row["estimate_source"] == "spec" and row["measured"] == "not measured: virtual GPU" and row["state"] == "loaded"
    )


def test_engine_sizing_is_the_reserved_budget_and_what_the_others_leave_free():
    manager = full_gpu()
    manager.sleep("p2-0")
    assert isinstance(manager.admit("s-0", svc("s", backend="sglang", priority="P0", mb=20 * 1024), 0.0), Placed)
    # 80 GiB less the 28 GiB the other P2 still holds (the sleeper holds nothing).
    assert manager.engine_sizing("s-0") == {"budget_mb": 20 * GIB, "free_mb": 52 * GIB, "total_mb": 80 * GIB, "gpus": 1}
    assert manager.engine_sizing("nobody") == {}


# ---- what the heartbeat tells the control plane's placement ------------------------------------------


def test_heartbeat_gpus_carry_the_ledgers_tier_level_and_high_watermark():
    manager = GPUManager([gpu(0), gpu(1)], facts=FACTS, tiers={1: "gold"}, watermarks=Watermarks(high=0.9, low=0.7))
    assert isinstance(manager.admit("m-0", svc(mb=10_240), 0.0), Placed)
    infos = {g.index: g for g in manager.gpu_infos()}
    total = 80 * 1024
    assert (infos[0].tier, infos[1].tier) == ("", "gold")
    assert infos[0].high_mb == pytest.approx(0.9 * total)
    placed_on = 0 if infos[0].reserved_mb else 1
    assert infos[placed_on].reserved_mb == pytest.approx(10_240)
    assert manager.reserved_mb("m-0") == pytest.approx(10_240)
    assert manager.reserved_mb("nobody") is None


def test_real_gpus_keep_nvmls_reading_and_gain_the_ledgers_figures():
    manager = GPUManager([gpu(0)], facts=FACTS)
    nvml = [GPUInfo(index=0, name="H100", total_mb=81_559.0, used_mb=1_234.0, utilization=0.5)]
    (info,) = manager.gpu_infos(nvml)
    assert (info.used_mb, info.utilization, info.total_mb) == (1_234.0, 0.5, 81_559.0)
    assert info.reserved_mb == 0.0 and info.high_mb is not None


def test_heartbeat_gpus_carry_what_sleeping_instances_still_hold():
    manager = full_gpu()
    assert manager.gpu_infos()[0].sleeping_mb == 0.0  # both awake
    manager.sleep("p2-0", residue_mb=512.0)  # a CUDA context the released worker keeps
    (info,) = manager.gpu_infos()
    assert info.sleeping_mb == 512.0 and info.reserved_mb == 28 * GIB + 512.0  # part of the level
    manager.sleep("p2-1")  # an engine that releases everything
    assert manager.gpu_infos()[0].sleeping_mb == 512.0
