"""The autoscaler's loop against a real Registry: demand from telemetry, the count into the placement."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.xds_server.test_rollout_registry import Changes, Clock, hb, rec, report, svc
from xds_server.autoscale.driver import Autoscaler
from xds_server.placement import Track
from xds_server.registry import Registry

SCALED = svc("1", replicas=1, sla={"max_replicas": 4}, resources={"max_concurrent_requests": 10})


def registry() -> tuple[Registry, Clock]:
    clock = Clock(100.0)
    reg = Registry(clock=clock, wall_clock=Clock(5000.0), changes=Changes())
    reg.put_model(SCALED, "api")
    reg.heartbeat(hb(report("m-0", SCALED)))
    reg.mark_synced()
    return reg, clock


def busy(iid: str, load: int, seq: int, port: int = 9000) -> object:
    """A record of `load` requests: in flight up to the spec's 10 slots, the rest queued."""
    return dataclasses.replace(rec(iid, seq=seq, port=port), in_flight=min(load, 10), queued=max(0, load - 10))


def test_demand_in_telemetry_raises_the_count_and_the_placement_follows():
    reg, clock = registry()
    scaler = Autoscaler(reg)
    reg.record_telemetry(busy("m-0", 20, 1))  # 20 in flight, target 7 per instance: a burst, so a doubling
    scaler.tick()
    entry = reg.models["m"]
    assert entry.replicas == 2 and entry.tracks() == [Track(0, 3, awake=2)]  # one more asleep: the warm pool
    assert entry.scale_decision is not None and entry.scale_decision["reason"].startswith("up: demand 20.0")
    reply = reg.heartbeat(hb(report("m-0", SCALED)))
    assert sorted((a.instance_id, a.awake) for a in reply.assignments) == [
        ("m-0", True),
        ("m-1", True),
        ("m-2", False),
    ]


def test_no_demand_holds_for_the_window_then_falls_to_the_floor_dropping_the_highest_ids():
    reg, clock = registry()
    scaler = Autoscaler(reg)
    reg.record_telemetry(busy("m-0", 20, 1))
    scaler.tick()
    for seq, iid in enumerate(("m-0", "m-1", "m-2"), start=2):
        reg.heartbeat(hb(report("m-0", SCALED), report("m-1", SCALED, port=9001), report("m-2", SCALED, port=9002)))
        reg.record_telemetry(dataclasses.replace(rec(iid, seq=seq, port=9000 + int(iid[-1])), in_flight=0))
    clock.now += 30
    scaler.tick()
    assert reg.models["m"].replicas == 2, "within the 60 s window nothing falls"
    clock.now += 31
    for seq, iid in enumerate(("m-0", "m-1", "m-2"), start=10):
        reg.record_telemetry(dataclasses.replace(rec(iid, seq=seq, port=9000 + int(iid[-1])), in_flight=0))
    scaler.tick()
    assert reg.models["m"].replicas == 1
    reply = reg.heartbeat(hb(report("m-0", SCALED), report("m-1", SCALED, port=9001), report("m-2", SCALED, port=9002)))
    assert [(a.instance_id, a.awake) for a in reply.assignments] == [("m-0", True), ("m-1", False)], (
        "m-1 drains and sleeps (the warm pool of 1), m-2 is dropped: its node drains and stops it"
    )


def test_a_model_with_fixed_replicas_is_left_alone():
    reg, _ = registry()
    fixed = svc("1", replicas=2)
    reg.put_model(fixed, "api")
    scaler = Autoscaler(reg)
    reg.record_telemetry(busy("m-0", 50, 1))
    scaler.tick()
    assert reg.models["m"].scale is None and reg.models["m"].replicas == 2


def test_only_an_instance_held_back_for_memory_stops_the_count_rising_and_the_reason_names_it():
    from sie.telemetry import InstanceState

    reg, clock = registry()
    scaler = Autoscaler(reg)
    asleep = report("m-1", SCALED, port=9001, state=InstanceState.SLEEPING, detail="asleep: no GPU memory held")
    reg.heartbeat(hb(report("m-0", SCALED), asleep))
    reg.record_telemetry(busy("m-0", 20, 1))
    scaler.tick()
    assert reg.models["m"].replicas == 2, "a sleeping warm-pool instance is not a memory wait"
    # m-1 serves (the step up is done); m-2, wanted next, waits for memory on its node.
    short = report("m-2", SCALED, port=9002, state=InstanceState.FAILED, detail="pending: not enough GPU memory")
    serving = [report(f"m-{n}", SCALED, port=9000 + n) for n in range(2)]
    reg.heartbeat(hb(*serving, short))
    clock.now += 3.0
    for seq in (2, 3):  # two looks: when all three serve, and after the step's settle (policy rule 3)
        for n in range(2):
            reg.record_telemetry(busy(f"m-{n}", 11, seq, port=9000 + n))
        scaler.tick()
        clock.now += 1.5
    entry = reg.models["m"]
    assert entry.replicas == 2 and entry.scale_decision is not None
    assert "only 0 more fit on the nodes (m-2 on n1: pending: not enough GPU memory)" in entry.scale_decision["reason"]


def test_a_scale_down_keeps_the_ready_instance_not_the_lowest_id():
    """m-0 fails to load on n1 while m-1 serves on n2: going down to one drops m-0 and keeps m-1."""
    from sie.telemetry import InstanceState

    alone = svc("1", replicas=1, sla={"max_replicas": 4}, autoscale={"warm_pool": 0})
    reg = Registry(clock=Clock(100.0), wall_clock=Clock(5000.0), changes=Changes())
    reg.put_model(alone, "api")
    reg.heartbeat(hb(node="n1"))
    reg.heartbeat(hb(node="n2"))
    reg.mark_synced()
    reg.set_scale("m", 2)
    failed = hb(report("m-0", alone, state=InstanceState.FAILED, detail="worker exited 1"), node="n1")
    serving = hb(report("m-1", alone, port=9001), node="n2")
    reg.heartbeat(failed)
    reg.heartbeat(serving)
    assert dict(reg.placement.by_instance) == {"m-0": "n1", "m-1": "n2"}
    reg.set_scale("m", 1)
    assert [(a.instance_id, a.awake) for a in reg.heartbeat(serving).assignments] == [("m-1", True)]
    assert reg.heartbeat(failed).assignments == [], "the failed one goes: its node host stops it"


def _sample(reg, *records) -> float:
    """The demand the autoscaler reads from these records at its next look (policy.decide's sample)."""
    seen: list = []
    scaler = Autoscaler(reg, on_decision=lambda model, state: seen.append(state))
    for r in records:
        assert reg.record_telemetry(r)
    scaler.tick()
    return seen[-1].loads[-1][1]


def _asleep(iid: str, port: int, queued: int, node: str = "n1", in_flight: int = 0) -> object:
    from sie.telemetry import InstanceState

    r = rec(iid, state=InstanceState.SLEEPING, seq=1, port=port)
    return dataclasses.replace(r, node=node, queued=queued, in_flight=in_flight)


@pytest.mark.parametrize(
    ("iid", "node", "expected"),
    [
        pytest.param("m-1", "n1", 50, id="a placed holder counts what its sidecar can hold: 10 + 4 x 10"),
        pytest.param("m-19", "n1", 0, id="an instance placed nowhere says nothing"),
        pytest.param("m-2", "n1", 0, id="an instance the count no longer places says nothing"),
        pytest.param("m-1", "n9", 0, id="the placed instance's id from another node says nothing"),
    ],
)
def test_held_requests_count_only_from_placed_holders_and_only_what_a_sidecar_holds(iid, node, expected):
    from sie.telemetry import InstanceState

    reg, _ = registry()  # m-0 serves on n1; m-1, the warm pool's, sleeps there; n1 still runs m-2
    asleep = [report(i, SCALED, port=9000 + int(i[2:]), state=InstanceState.SLEEPING) for i in ("m-1", "m-2")]
    reg.heartbeat(hb(report("m-0", SCALED), *asleep))
    assert reg.placement.by_instance == {"m-0": "n1", "m-1": "n1"}
    held = _asleep(iid, 9000 + int(iid[2:]), queued=10_000_000, node=node, in_flight=10_000_000)
    assert _sample(reg, busy("m-0", 0, 1), held) == expected


@pytest.mark.parametrize("swept", [False, True], ids=["before the sweep notices", "once it is re-placed"])
def test_a_holder_on_a_lost_node_says_nothing(swept):
    from sie.telemetry import InstanceState

    reg, clock = registry()
    reg.heartbeat(hb(report("m-0", SCALED), report("m-1", SCALED, port=9001, state=InstanceState.SLEEPING)))
    assert _sample(reg, busy("m-0", 0, 1), _asleep("m-1", 9001, queued=3)) == 3
    clock.now += 31.0  # past the heartbeat timeout; the sidecar still reports
    if swept:
        reg.sweep()
    later = dataclasses.replace(_asleep("m-1", 9001, queued=10_000_000), seq=2)
    assert _sample(reg, busy("m-0", 0, 2), later) == 0


def test_a_holder_its_node_registered_no_address_for_says_nothing():
    from sie.telemetry import InstanceState

    reg, _ = registry()
    unlisted = dataclasses.replace(report("m-1", SCALED, state=InstanceState.SLEEPING), sidecar_address=None)
    reg.heartbeat(hb(report("m-0", SCALED), unlisted))
    assert reg.placement.holds("m-1", "n1")
    assert _sample(reg, busy("m-0", 0, 1), _asleep("m-1", 9001, queued=5)) == 0


def test_a_ready_instance_counts_at_most_what_its_sidecar_admits():
    reg, _ = registry()
    flood = dataclasses.replace(rec("m-0", seq=1), in_flight=10_000_000, queued=10_000_000)
    assert _sample(reg, flood) == 10 + 40


def test_the_queue_bound_is_the_sidecars():
    from sidecar.settings import QUEUE_PER_SLOT
    from xds_server.autoscale import driver

    assert driver.QUEUE_PER_SLOT == QUEUE_PER_SLOT


def test_with_a_warm_pool_the_ready_instance_serves_not_the_lowest_id():
    from sie.telemetry import InstanceState

    pooled = svc("1", replicas=1, sla={"max_replicas": 4}, autoscale={"warm_pool": 1})
    reg = Registry(clock=Clock(100.0), wall_clock=Clock(5000.0), changes=Changes())
    reg.put_model(pooled, "api")
    reg.heartbeat(hb(node="n1"))
    reg.heartbeat(hb(node="n2"))
    reg.mark_synced()
    reg.set_scale("m", 2)
    n1 = hb(
        report("m-0", pooled, state=InstanceState.FAILED),
        report("m-2", pooled, port=9002, state=InstanceState.SLEEPING),
        node="n1",
    )
    n2 = hb(report("m-1", pooled, port=9001), node="n2")
    reg.heartbeat(n1)
    reg.heartbeat(n2)
    reg.set_scale("m", 1)
    assert [(a.instance_id, a.awake) for a in reg.heartbeat(n2).assignments] == [("m-1", True)]
