"""The autoscaler's loop against a real Registry: demand from telemetry, the count into the placement."""

from __future__ import annotations

import dataclasses

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


def busy(iid: str, in_flight: int, seq: int) -> object:
    return dataclasses.replace(rec(iid, seq=seq), in_flight=in_flight)


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
            reg.record_telemetry(dataclasses.replace(rec(f"m-{n}", seq=seq, port=9000 + n), in_flight=14))
        scaler.tick()
        clock.now += 1.5
    entry = reg.models["m"]
    assert entry.replicas == 2 and entry.scale_decision is not None
    assert "only 0 more fit on the nodes (m-2 on n1: pending: not enough GPU memory)" in entry.scale_decision["reason"]
