"""Node loss in the registry: the heartbeat timeout marks a node lost, its endpoints leave EDS at once, its
instances are placed on live nodes under the same ids, two reporting copies of one instance never
overwrite each other's telemetry, the rebalance policy decides what a returning node gets back, and an
instance a node cannot run (its GPU failed) moves. Placement's own table tests are test_xds_placement.py."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import GPUInfo, InstanceReport, NodeHeartbeat
from xds_server.registry import Registry

TIMEOUT = 5.0


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def svc(name: str, replicas: int = 1):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": name},
                "backend": {"type": "sim"},
                "sla": {"min_replicas": replicas, "max_replicas": replicas},
            }
        }
    )


def report(iid: str, model: str, node: str, state=InstanceState.READY, unplaceable: str = "") -> InstanceReport:
    port = 9000 + int(iid.rsplit("-", 1)[1]) + (100 if node == "n2" else 0) + (200 if node == "n3" else 0)
    return InstanceReport(
        iid,
        model,
        "1",
        state,
        svc(model).to_dict(),
        sidecar_address=f"127.0.0.1:{port}",
        unplaceable=unplaceable,
    )


def beat(reg: Registry, node: str, *reports: InstanceReport, gpus=()) -> list[str]:
    """A heartbeat from `node`; returns the instance ids of its assignment."""
    reply = reg.heartbeat(NodeHeartbeat(node=node, address=f"http://{node}", instances=list(reports), gpus=list(gpus)))
    return [a.instance_id for a in reply.assignments]


def tel(iid: str, model: str, node: str, seq: int, state=InstanceState.READY, reporter: str = "") -> TelemetryRecord:
    return TelemetryRecord(
        iid, model, "1", "0.0.0.0:1", node, state, seq=seq, timestamp=1.0, reporter=reporter or f"{node}-{iid}"
    )


def eds(reg: Registry, model: str, now: float) -> list[tuple[str, str]]:
    return [(r.instance_id, r.node) for r in reg.eds_records(model, now)]


def lose_n1(reg: Registry, clock: Clock) -> str:
    """n1 stops heartbeating past the timeout while n2 goes on; returns the instance n1 ran."""
    moved = next(i for i, n in reg.placement.by_instance.items() if n == "n1")
    kept = [i for i, n in reg.placement.by_instance.items() if n == "n2"]
    for _ in range(int(TIMEOUT / 0.5) + 2):
        clock.now += 0.5
        beat(reg, "n2", *(report(i, "a", "n2") for i in kept))
        reg.sweep()
    assert reg.nodes["n1"].lost_at is not None and reg.nodes["n2"].lost_at is None
    return moved


@pytest.fixture
def clock():
    return Clock()


def registry(clock, rebalance="none") -> Registry:
    reg = Registry(clock=clock, heartbeat_timeout_s=TIMEOUT, rebalance=rebalance)
    reg.mark_synced()
    return reg


def two_replicas_on_two_nodes(reg: Registry, clock: Clock) -> None:
    beat(reg, "n1")
    beat(reg, "n2")
    reg.add_model(svc("a", replicas=2), "file")
    assert beat(reg, "n1") and beat(reg, "n2")  # placement spreads a-0 and a-1 over n1 and n2
    where = reg.placement.by_instance
    assert sorted(where.values()) == ["n1", "n2"]
    for node in ("n1", "n2"):
        mine = [i for i, n in where.items() if n == node]
        beat(reg, node, *(report(i, "a", node) for i in mine))
        for i in mine:
            reg.record_telemetry(tel(i, "a", node, 1))
    clock.now += 0.1


def test_the_timeout_marks_the_node_lost_and_its_endpoints_leave_eds_at_once(clock):
    reg = registry(clock)
    two_replicas_on_two_nodes(reg, clock)
    on_n1 = [i for i, n in reg.placement.by_instance.items() if n == "n1"]
    on_n2 = [i for i, n in reg.placement.by_instance.items() if n == "n2"]
    assert len(eds(reg, "a", clock())) == 2
    # n2 keeps heartbeating; n1 stops. Its sidecar still reports (cut off, not dead).
    for step in range(int(TIMEOUT / 0.5) + 2):
        clock.now += 0.5
        beat(reg, "n2", *(report(i, "a", "n2") for i in on_n2))
        reg.record_telemetry(tel(on_n1[0], "a", "n1", 2 + step))
        reg.record_telemetry(tel(on_n2[0], "a", "n2", 2 + step))
        reg.sweep()
    lost = [e for e in reg.node_events if e["kind"] == "lost"]
    assert [e["node"] for e in lost] == ["n1"] and "timeout 5 s" in lost[0]["detail"]
    assert reg.nodes["n1"].lost_at is not None
    assert [n for _, n in eds(reg, "a", clock())] == ["n2"], "only the live node's endpoint"
    # ...and the lost instance is placed on the live node, same id, with its home remembered.
    assert reg.placement.by_instance[on_n1[0]] == "n2"
    assert reg.placement.homes == {on_n1[0]: "n1"}
    assert "a lost node" in reg.placement.reasons[on_n1[0]]


def test_the_new_copy_takes_over_and_the_lost_copys_telemetry_never_overwrites_it(clock):
    reg = registry(clock)
    two_replicas_on_two_nodes(reg, clock)
    moved = lose_n1(reg, clock)
    beat(reg, "n2", *(report(i, "a", "n2") for i in reg.placement.by_instance))
    reg.record_telemetry(tel(moved, "a", "n2", 1))
    for seq in range(2, 6):  # the cut-off copy keeps reporting, alternating with the new one
        assert reg.record_telemetry(tel(moved, "a", "n1", seq))
        assert reg.record_telemetry(tel(moved, "a", "n2", seq))
        assert reg.telemetry[moved].record.node == "n2"
        assert sorted(eds(reg, "a", clock())) == sorted(
            [(moved, "n2"), (next(iter(set(reg.placement.by_instance) - {moved})), "n2")]
        )
    assert set(reg.copies[moved]) == {"n1"}


def one_replica_each(reg: Registry, clock: Clock) -> str:
    """Model a (one replica) on n1, model b on n2; n1 is then lost and a-0 moves to n2, where it serves."""
    beat(reg, "n1")
    reg.add_model(svc("a"), "file")
    beat(reg, "n1")
    beat(reg, "n2")
    reg.add_model(svc("b"), "file")
    beat(reg, "n2")
    assert reg.placement.by_instance == {"a-0": "n1", "b-0": "n2"}
    beat(reg, "n1", report("a-0", "a", "n1"))
    reg.record_telemetry(tel("a-0", "a", "n1", 1))
    for _ in range(int(TIMEOUT / 0.5) + 2):
        clock.now += 0.5
        beat(reg, "n2", report("b-0", "b", "n2"))
        reg.sweep()
    assert reg.placement.by_instance["a-0"] == "n2" and reg.placement.homes == {"a-0": "n1"}
    beat(reg, "n2", report("a-0", "a", "n2"), report("b-0", "b", "n2"))
    reg.record_telemetry(tel("a-0", "a", "n2", 1))
    clock.now += 0.1
    return "a-0"


@pytest.mark.parametrize("rebalance, back_on", [("none", "n2"), ("return", "n1")])
def test_a_returning_node_and_the_rebalance_policy(clock, rebalance, back_on):
    reg = registry(clock, rebalance)
    moved = one_replica_each(reg, clock)
    # n1 comes back, still running its copy (it was cut off).
    assigned = beat(reg, "n1", report(moved, "a", "n1"))
    assert [e["kind"] for e in reg.node_events] == ["lost", "back"]
    assert reg.placement.by_instance[moved] == back_on
    assert (moved in assigned) == (back_on == "n1"), "with none the returned node is told to stop its copy"
    assert not reg.placement.leaving, "both copies are ready: the chosen one serves, the other goes at once"
    reg.record_telemetry(tel(moved, "a", "n1", 10))
    assert (moved, back_on) in eds(reg, "a", clock())


def test_return_to_a_restarted_home_keeps_the_interim_copy_until_the_home_copy_serves(clock):
    reg = registry(clock, "return")
    moved = one_replica_each(reg, clock)
    assert moved in beat(reg, "n1"), "the restarted home is given its instance back"
    assert reg.placement.leaving == {moved: "n2"}
    assert moved in beat(reg, "n2", report("a-0", "a", "n2"), report("b-0", "b", "n2"))
    assert (moved, "n2") in eds(reg, "a", clock()), "the interim copy serves while the home copy loads"
    beat(reg, "n1", report(moved, "a", "n1", InstanceState.LOADING))
    reg.record_telemetry(tel(moved, "a", "n1", 1, InstanceState.LOADING))
    assert (moved, "n2") in eds(reg, "a", clock())
    beat(reg, "n1", report(moved, "a", "n1"))
    reg.record_telemetry(tel(moved, "a", "n1", 2))
    assert (moved, "n1") in eds(reg, "a", clock()) and (moved, "n2") not in eds(reg, "a", clock())
    assert moved not in beat(reg, "n2", report("a-0", "a", "n2"), report("b-0", "b", "n2"))
    assert not reg.placement.homes


def test_a_failed_gpus_instance_moves_to_a_node_that_can_run_it(clock):
    reg = registry(clock)
    beat(reg, "n1")
    reg.add_model(svc("a"), "file")
    beat(reg, "n1")
    assert reg.placement.by_instance == {"a-0": "n1"}
    beat(reg, "n2")
    failed = GPUInfo(0, "virtual", 24_576.0, 0.0, virtual=True, failed="failed through the node host's API")
    beat(reg, "n1", report("a-0", "a", "n1", InstanceState.FAILED, unplaceable="GPU 0 failed"), gpus=[failed])
    assert reg.placement.by_instance == {"a-0": "n2"}
    assert reg.placement.reasons["a-0"].startswith("moved to n2 (GPU 0 failed on n1)")
    assert [e["kind"] for e in reg.node_events] == ["gpu_failed"]
    assert "a-0" not in beat(reg, "n1", gpus=[failed])


def test_replicas_all_on_one_node_spread_when_a_second_node_joins_new_before_old(clock):
    reg = registry(clock)
    gpu = GPUInfo(0, "virtual", 24_576.0, 0.0, virtual=True, reserved_mb=0.0, high_mb=22_000.0)
    model = svc("a", replicas=2).to_dict()
    model["spec"]["resources"] = {"min_gpu_memory_mb": 4096}
    beat(reg, "n1", gpus=[gpu])
    reg.add_model(parse_model_service(model), "file")
    beat(reg, "n1", report("a-0", "a", "n1"), report("a-1", "a", "n1"), gpus=[gpu])
    assert reg.placement.for_node("n1") == ["a-0", "a-1"]
    assert "a-1" in beat(reg, "n2", gpus=[gpu]), "the second node gets one replica"
    assert reg.placement.leaving == {"a-1": "n1"} and reg.placement.for_node("n1") == ["a-0", "a-1"]
    assert reg.placement.reasons["a-1"].startswith("spread: moved from n1 to n2")
    beat(reg, "n2", report("a-1", "a", "n2", InstanceState.LOADING), gpus=[gpu])
    assert reg.placement.leaving == {"a-1": "n1"}, "n1 serves it until n2's copy is ready"
    beat(reg, "n2", report("a-1", "a", "n2"), gpus=[gpu])
    assert not reg.placement.leaving
    assert beat(reg, "n1", report("a-0", "a", "n1"), report("a-1", "a", "n1"), gpus=[gpu]) == ["a-0"]
