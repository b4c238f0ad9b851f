"""Snapshots: per-resource and per-type versions, consistency, and the per-node cache."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from xds_server.ingress import IngressConfig
from xds_server.policy.decisions import EndpointDecision, ModelDecision
from xds_server.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, ModelInputs, Resource, ResourceCache
from xds_server.snapshots import InconsistentSnapshot, Snapshot, SnapshotCache, check_consistency


def svc(name: str):
    return parse_model_service({"spec": {"model": {"name": name}, "backend": {"type": "sim"}}})


def inputs(weights: dict[str, int]) -> dict[str, ModelInputs]:
    return {
        m: ModelInputs(svc(m), ModelDecision(m, {f"{m}-0": EndpointDecision("127.0.0.1:9000", w)}))
        for m, w in weights.items()
    }


def test_one_models_endpoint_change_bumps_only_its_cla_and_the_eds_type_version():
    cache = ResourceCache()
    before = Snapshot.build(cache.build(inputs({"a": 100, "b": 100}), IngressConfig()))
    after = Snapshot.build(cache.build(inputs({"a": 100, "b": 50}), IngressConfig()))
    changed = {
        (t, n) for t in before.resources for n in before.get(t) if before.get(t)[n].version != after.get(t)[n].version
    }
    assert changed == {(ENDPOINT, "model.b")}
    assert [t for t in before.versions if before.version(t) != after.version(t)] == [ENDPOINT]


def test_equal_content_gives_equal_versions_across_builders():
    # A restarted control plane rebuilds the same snapshot from the same registry: Envoy sees no change.
    one = Snapshot.build(ResourceCache().build(inputs({"a": 100}), IngressConfig()))
    two = Snapshot.build(ResourceCache().build(inputs({"a": 100}), IngressConfig()))
    assert one.versions == two.versions


def test_an_inconsistent_set_is_refused_with_the_reason():
    resources = ResourceCache().build(inputs({"a": 100}), IngressConfig())
    del resources[ENDPOINT]["model.a"]
    with pytest.raises(InconsistentSnapshot, match="Cluster 'model.a' references missing ClusterLoadAssignment"):
        Snapshot.build(resources)


@pytest.mark.parametrize(
    ("remove", "problem"),
    [
        ((CLUSTER, "model.a"), "has no cluster"),
        ((ROUTE, "ingress_routes"), "Listener 'ingress' references missing RouteConfiguration"),
    ],
)
def test_consistency_problems(remove, problem):
    resources = ResourceCache().build(inputs({"a": 100}), IngressConfig())
    del resources[remove[0]][remove[1]]
    assert any(problem in p for p in check_consistency(resources))


def test_with_resource_replaces_one_resource_unchecked():
    snap = Snapshot.build(ResourceCache().build(inputs({"a": 100}), IngressConfig()))
    bad = Resource("model.a", CLUSTER, "bad", snap.get(CLUSTER)["model.a"].packed)
    forced = snap.with_resource(bad)
    assert forced.get(CLUSTER)["model.a"].version == "bad"
    assert forced.version(CLUSTER) != snap.version(CLUSTER) and forced.version(LISTENER) == snap.version(LISTENER)


def test_cache_serves_the_node_snapshot_else_the_default_and_tells_watchers():
    cache, calls = SnapshotCache(), []
    unsubscribe = cache.subscribe(lambda: calls.append(1))
    assert cache.get("envoy-1") is None
    default = Snapshot.build(ResourceCache().build(inputs({"a": 100}), IngressConfig()))
    special = Snapshot.build(ResourceCache().build(inputs({"b": 100}), IngressConfig()))
    cache.set_snapshot(default)
    cache.set_snapshot(special, node_id="envoy-2")
    assert cache.get("envoy-1") is default and cache.get("envoy-2") is special and cache.get(None) is default
    assert len(calls) == 2
    unsubscribe()
    cache.clear_node("envoy-2")
    assert cache.get("envoy-2") is default and len(calls) == 2
