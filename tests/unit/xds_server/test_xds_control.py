"""The control loop: nothing before sync, per-model decisions, policy failures, staleness sweeps, debounce."""

from __future__ import annotations

import asyncio

import pytest

from sie.spec_loader import parse_model_service
from sie.telemetry import STALE_AFTER_S, InstanceState, TelemetryRecord
from sie.wire import InstanceReport, NodeHeartbeat
from xds_server.control import ControlLoop, PendingChanges, sanitize
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics
from xds_server.policy.decisions import MAX_WEIGHT, EndpointDecision, EqualWeights, Health, ModelDecision
from xds_server.registry import Registry
from xds_server.resources import CLUSTER, ENDPOINT, ROUTE
from xds_server.snapshots import SnapshotCache, check_consistency


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class SpyPolicy(EqualWeights):
    def __init__(self, fail_for: str | None = None):
        self.calls: list[str] = []
        self.fail_for = fail_for

    def decide(self, model, records, now):
        self.calls.append(model.model_id)
        if model.model_id == self.fail_for:
            raise RuntimeError("policy bug")
        return super().decide(model, records, now)


class FaultyRegistry(Registry):
    """A registry whose EDS view of the models in `broken` raises, as bad data reaching a bug would."""

    broken: set[str] = set()

    def eds_records(self, model_id, now):
        if model_id in self.broken:
            raise ValueError(f"bad data of {model_id}")
        return super().eds_records(model_id, now)


def svc(name: str):
    return parse_model_service({"spec": {"model": {"name": name}, "backend": {"type": "sim"}}})


def rec(iid, model, port, state=InstanceState.READY, seq=1, ts=1000.0):
    return TelemetryRecord(iid, model, "1", f"127.0.0.1:{port}", "n1", state, seq=seq, timestamp=ts)


def report(registry: Registry, record: TelemetryRecord) -> None:
    """The record's node host registers its instance at the record's address; then the record arrives."""
    node = registry.nodes.get(record.node)
    others = [r for r in (node.heartbeat.instances if node else ()) if r.instance_id != record.instance_id]
    spec = registry.models[record.model_id].spec_dict
    registry.heartbeat(
        NodeHeartbeat(
            record.node,
            "http://n1",
            instances=[
                *others,
                InstanceReport(
                    record.instance_id, record.model_id, "1", InstanceState.READY, spec, sidecar_address=record.address
                ),
            ],
        )
    )
    registry.record_telemetry(record)


@pytest.fixture
def world():
    mono, wall = Clock(50.0), Clock(1000.0)
    policy = SpyPolicy()
    cache = SnapshotCache()
    changes = PendingChanges(mono)
    registry = FaultyRegistry(clock=mono, changes=changes, wall_clock=wall)
    control = ControlLoop(
        registry, policy, cache, ControlPlaneMetrics(), IngressConfig(port=0), mono, wall, 0.01, changes=changes
    )
    for m in ("a", "b"):
        registry.add_model(svc(m), "file")
    return registry, control, policy, cache, mono, wall


def test_nothing_is_published_before_the_sync_and_everything_after(world):
    registry, control, policy, cache, *_ = world
    report(registry, rec("a-0", "a", 9000))
    assert control.rebuild() is None and cache.get(None) is None
    registry.mark_synced()
    snap = control.rebuild()
    assert cache.get(None) is snap
    assert set(snap.get(ENDPOINT)) == {"model.a", "model.b"}
    assert sorted(policy.calls) == ["a", "b"]


def test_a_telemetry_change_decides_only_that_model_and_changes_only_its_cla(world):
    registry, control, policy, cache, *_ = world
    registry.mark_synced()
    before = control.rebuild()
    policy.calls.clear()
    report(registry, rec("b-0", "b", 9100))
    after = control.rebuild()
    assert policy.calls == ["b"]
    changed = [n for n in before.get(ENDPOINT) if before.get(ENDPOINT)[n].version != after.get(ENDPOINT)[n].version]
    assert changed == ["model.b"]


def test_an_unchanged_rebuild_publishes_nothing(world):
    registry, control, policy, cache, *_ = world
    registry.mark_synced()
    control.rebuild()
    report(registry, rec("a-0", "a", 9000))
    assert control.rebuild() is not None
    report(registry, rec("a-0", "a", 9000, seq=2, ts=1000.5))  # same decision
    assert control.rebuild() is None


def test_a_failing_policy_falls_back_to_equal_weights_for_that_round(world, caplog):
    registry, control, policy, cache, *_ = world
    policy.fail_for = "a"
    report(registry, rec("a-0", "a", 9000))
    registry.mark_synced()
    control.rebuild()
    assert control.decisions["a"].endpoints["a-0"].weight == MAX_WEIGHT
    assert "weight policy failed for model a" in caplog.text


def test_sanitize_holds_a_decision_to_the_records():
    records = [rec("a-0", "a", 9000, state=InstanceState.DRAINING), rec("a-1", "a", 9001)]
    decision = ModelDecision(
        "a",
        {
            "a-0": EndpointDecision("10.0.0.1:1", 50, Health.HEALTHY),  # draining per its sidecar
            "a-1": EndpointDecision("127.0.0.1:9001", 70, Health.HEALTHY),
            "ghost": EndpointDecision("127.0.0.1:1", 100, Health.HEALTHY),  # not given to the policy
        },
    )
    out = sanitize(decision, records)
    assert set(out.endpoints) == {"a-0", "a-1"}
    assert out.endpoints["a-0"].health is Health.DRAINING and out.endpoints["a-0"].address == "127.0.0.1:9000"
    assert out.endpoints["a-1"].weight == 70


def test_the_sweep_notices_staleness_and_the_eds_ttl(world):
    registry, control, policy, cache, mono, wall = world
    report(registry, rec("a-0", "a", 9000))
    registry.mark_synced()
    control.rebuild()
    control.sweep()
    control.rebuild()
    policy.calls.clear()
    control.sweep()
    assert control.rebuild() is None and policy.calls == []  # nothing changed with time yet
    wall.now += STALE_AFTER_S + 0.1
    control.sweep()
    control.rebuild()
    assert policy.calls == ["a"]  # the policy sees the record go stale
    mono.now += 11
    control.sweep()
    snap = control.rebuild()
    assert "a-0" not in control.decisions["a"].endpoints and snap is not None


async def test_a_burst_of_changes_is_published_once(world):
    registry, control, policy, cache, *_ = world
    registry.mark_synced()
    control.rebuild()
    published = []
    cache.subscribe(lambda: published.append(1))
    task = asyncio.create_task(control.run(), name="test-control-loop")
    try:
        for seq in range(1, 6):
            report(registry, rec("a-0", "a", 9000 + seq, seq=seq, ts=1000.0 + seq))
        await asyncio.sleep(0.2)
        assert len(published) == 1
        assert control.decisions["a"].endpoints["a-0"].address == "127.0.0.1:9005"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_one_models_bad_data_keeps_its_last_config_and_stops_nothing_else(world, caplog):
    registry, control, policy, cache, *_ = world
    report(registry, rec("a-0", "a", 9000))
    report(registry, rec("b-0", "b", 9100))
    registry.mark_synced()
    before = control.rebuild()
    registry.broken = {"a"}
    report(registry, rec("a-0", "a", 9001, seq=2, ts=1001.0))
    report(registry, rec("b-0", "b", 9101, seq=2, ts=1001.0))
    after = control.rebuild()
    assert after is not None and cache.get(None) is after
    control.sweep()  # the sweep task is fatal: it must not raise either
    assert control.rebuild() is None  # a is tried again, fails again, and nothing moves
    assert control.decisions["b"].endpoints["b-0"].address == "127.0.0.1:9101"
    # a keeps exactly what Envoy has: its cluster, endpoints and route, as a whole.
    assert after.get(ENDPOINT)["model.a"].version == before.get(ENDPOINT)["model.a"].version
    assert after.get(CLUSTER)["model.a"] is before.get(CLUSTER)["model.a"]
    assert "model.a" in {name for _, name in after.get(ROUTE)["ingress_routes"].refs}
    assert "bad data of a" in control.resource_errors["a"] and "b" not in control.resource_errors
    assert caplog.text.count("model a: its endpoints could not be decided") == 1  # once, not every round
    registry.broken = set()
    report(registry, rec("a-0", "a", 9001, seq=3, ts=1002.0))
    control.rebuild()
    assert control.decisions["a"].endpoints["a-0"].address == "127.0.0.1:9001"
    assert control.resource_errors == {}


def test_a_model_whose_first_build_fails_is_left_out_with_its_route(world):
    registry, control, policy, cache, *_ = world
    registry.broken = {"a"}
    report(registry, rec("b-0", "b", 9100))
    registry.mark_synced()
    snap = control.rebuild()
    assert snap is not None and set(snap.get(CLUSTER)) == {"model.b"}
    assert {name for _, name in snap.get(ROUTE)["ingress_routes"].refs} == {"model.b"}
    assert check_consistency(snap.resources) == []
    registry.broken = set()
    control.notify({"a"})
    assert set(control.rebuild().get(CLUSTER)) == {"model.a", "model.b"}


class FailOnce:
    """Wraps a ResourceCache so its next build raises, as a bug outside any one model would."""

    def __init__(self, inner):
        self.inner, self.armed = inner, True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def build(self, models, ingress):
        if self.armed:
            self.armed = False
            raise RuntimeError("build bug")
        return self.inner.build(models, ingress)


def test_a_failed_build_gives_its_changes_back_for_the_next_build(world, caplog):
    registry, control, policy, cache, mono, _ = world
    registry.mark_synced()
    control.rebuild()
    control._resources = FailOnce(control._resources)
    changed_at = mono.now
    report(registry, rec("a-0", "a", 9000))
    mono.now += 1
    control.changes.wake.clear()  # as the loop does before it builds
    assert control.rebuild() is None and "building the xDS snapshot failed" in caplog.text
    assert not control.changes.wake.is_set()  # no retry every debounce window for a build that fails for good
    assert control.changes.take({"a", "b"}) == ({"a"}, changed_at)


def test_changes_given_back_merge_with_newer_ones_and_keep_the_oldest_time():
    mono = Clock(10.0)
    changes = PendingChanges(mono)
    changes.take(set())
    changes.notify({"a"})
    taken = changes.take({"a", "b"})
    changes.wake.clear()
    mono.now = 12.0
    changes.notify({"b"})
    changes.put_back(*taken)
    assert changes.take({"a", "b"}) == ({"a", "b"}, 10.0)
    changes.put_back(set(), None)
    assert changes.take({"a", "b"}) == (set(), None)
