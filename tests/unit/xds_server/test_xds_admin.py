"""The admin API, in process (aiohttp test client): models CRUD, telemetry intake, heartbeats, status."""

from __future__ import annotations

import time

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from xds_server.admin import AdminContext, make_app
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop
from xds_server.decisions import MAX_WEIGHT, EqualWeights
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics
from xds_server.registry import Registry
from xds_server.snapshots import SnapshotCache

SPEC = {"kind": "ModelService", "spec": {"model": {"name": "scorer", "service_type": "scoring"},
                                         "backend": {"type": "sklearn"}}}


def record(**over):
    base = {"instance_id": "scorer-0", "model_id": "scorer", "version": "0.0.0", "address": "127.0.0.1:9000",
            "node": "n1", "state": "ready", "seq": 1, "timestamp": time.time()}
    return base | over


@pytest.fixture
async def world():
    holder = {}
    registry = Registry(clock=time.monotonic, on_change=lambda m: holder["c"].notify(m))
    metrics, cache = ControlPlaneMetrics(), SnapshotCache()
    control = ControlLoop(registry, EqualWeights(), cache, metrics, IngressConfig(), time.monotonic, time.time)
    holder["c"] = control
    ads = AdsServer(cache, metrics, time.monotonic)
    app = make_app(AdminContext(registry, control, metrics, ads, time.monotonic, time.time, "equal"))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield client, registry, control
    finally:
        await client.close()


async def test_healthz_is_503_until_the_sync_is_over(world):
    client, registry, control = world
    assert (await client.get("/healthz")).status == 503
    registry.mark_synced()
    assert (await client.get("/healthz")).status == 200


async def test_model_crud(world):
    client, registry, control = world
    resp = await client.post("/v1/models", json=SPEC)
    assert resp.status == 201 and (await resp.json())["spec"]["model"]["name"] == "scorer"
    resp = await client.post("/v1/models", json=SPEC)
    assert resp.status == 409 and "PUT /v1/models/scorer" in (await resp.json())["error"]["message"]
    listed = (await (await client.get("/v1/models")).json())["models"]
    assert [m["metadata"]["name"] for m in listed] == ["scorer"]
    assert listed[0]["status"]["desired_instances"] == 1 and listed[0]["status"]["source"] == "api"
    changed = yaml.safe_dump({**SPEC, "spec": {**SPEC["spec"], "replicas": 1}})
    resp = await client.put("/v1/models/scorer", data=changed, headers={"content-type": "application/yaml"})
    assert resp.status == 200
    assert (await client.get("/v1/models/scorer")).status == 200
    assert (await client.delete("/v1/models/scorer")).status == 200
    assert (await client.get("/v1/models/scorer")).status == 404
    assert (await client.delete("/v1/models/scorer")).status == 404


@pytest.mark.parametrize(("body", "path"), [
    ({"spec": {"model": {"name": "Bad_Name"}, "backend": {"type": "sim"}}}, "spec.model.name"),
    ({"spec": {"model": {"name": "ok"}, "backend": {"type": "nope"}}}, "spec.backend.type"),
    ({"spec": {"model": {"name": "ok"}, "backend": {"type": "sim"}, "replcas": 2}}, "spec.replcas"),
])
async def test_a_bad_spec_is_400_naming_the_field(world, body, path):
    client, *_ = world
    resp = await client.post("/v1/models", json=body)
    assert resp.status == 400
    assert path in [p["path"] for p in (await resp.json())["problems"]]


async def test_put_refuses_a_body_naming_another_model(world):
    client, *_ = world
    resp = await client.put("/v1/models/other", json=SPEC)
    assert resp.status == 400 and "path names 'other'" in str(await resp.json())


@pytest.mark.parametrize(("change", "field"), [
    ({"state": "asleep"}, "state"),
    ({"in_flight": "3"}, "in_flight"),
    ({"address": "localhost:9000"}, "address"),
    ({"bogus": 1}, "bogus"),
])
async def test_a_bad_telemetry_record_is_400_naming_the_field(world, change, field):
    client, *_ = world
    resp = await client.post("/v1/telemetry", json=record(**change))
    assert resp.status == 400
    assert field in [p["path"] for p in (await resp.json())["problems"]]


async def test_telemetry_older_than_the_stored_record_is_ignored(world):
    client, registry, _ = world
    assert (await (await client.post("/v1/telemetry", json=record(seq=5))).json()) == {"accepted": True}
    now = time.time()
    older = record(seq=4, timestamp=now - 1)
    assert (await (await client.post("/v1/telemetry", json=older)).json()) == {"accepted": False}
    assert registry.telemetry["scorer-0"].record.seq == 5


async def test_heartbeat_and_endpoints_and_status(world):
    client, registry, control = world
    await client.post("/v1/models", json=SPEC)
    hb = {"node": "n1", "address": "http://127.0.0.1:1", "instances": []}
    reply = await (await client.post("/v1/nodes/heartbeat", json=hb)).json()
    assert reply == {"authoritative": False, "assignments": []}
    registry.mark_synced()
    reply = await (await client.post("/v1/nodes/heartbeat", json=hb)).json()
    assert reply["authoritative"] and [a["instance_id"] for a in reply["assignments"]] == ["scorer-0"]
    await client.post("/v1/telemetry", json=record())
    control.rebuild()
    endpoints = (await (await client.get("/v1/endpoints")).json())["endpoints"]
    assert endpoints[0]["in_eds"] and endpoints[0]["decision"]["health"] == "HEALTHY"
    status = await (await client.get("/v1/status")).json()
    assert status["control_plane"]["ready"] and status["control_plane"]["xds_versions"]
    model = status["models"][0]
    assert (model["model_id"], model["desired_replicas"]) == ("scorer", 1)
    assert model["instances"][0] | {"telemetry_age_s": 0} == model["instances"][0] | {
        "instance_id": "scorer-0", "state": "ready", "node": "n1", "address": "127.0.0.1:9000", "in_eds": True,
        "weight": MAX_WEIGHT, "health": "HEALTHY", "telemetry_age_s": 0, "in_flight": 0, "queued": 0}
    nodes = (await (await client.get("/v1/nodes")).json())["nodes"]
    assert nodes[0]["live"] and nodes[0]["assigned"] == ["scorer-0"]
    metrics = await (await client.get("/metrics")).text()
    assert "sie_registry_models" in metrics and "sie_xds_nacks_total" in metrics


async def test_a_malformed_heartbeat_is_400(world):
    client, *_ = world
    resp = await client.post("/v1/nodes/heartbeat", json={"address": "x"})
    assert resp.status == 400 and "NodeHeartbeat" in str(await resp.json())


async def test_prometheus_targets_list_every_sidecar_that_reports(world):
    client, *_ = world
    assert await (await client.get("/v1/prometheus/targets")).json() == []
    await client.post("/v1/telemetry", json=record(priority="P0", service_type="scoring"))
    await client.post("/v1/telemetry", json=record(instance_id="chat-1", model_id="chat", address="127.0.0.1:9001",
                                                   state="draining", node="n2"))
    await client.post("/v1/telemetry", json=record(instance_id="gone-0", model_id="gone", address="127.0.0.1:9002",
                                                   state="stopped"))
    resp = await client.get("/v1/prometheus/targets")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.json() == [
        {"targets": ["127.0.0.1:9001"],
         "labels": {"__metrics_path__": "/-/metrics", "model_id": "chat", "instance_id": "chat-1",
                    "priority_level": "P1", "service_type": "llm", "node": "n2"}},
        {"targets": ["127.0.0.1:9000"],
         "labels": {"__metrics_path__": "/-/metrics", "model_id": "scorer", "instance_id": "scorer-0",
                    "priority_level": "P0", "service_type": "scoring", "node": "n1"}},
    ]


@pytest.mark.parametrize(("state", "age_s", "listed"), [
    ("ready", 0.0, True),
    ("sleeping", 0.0, True),  # still answers /-/metrics; its counters explain the eviction
    ("failed", 9.9, True),
    ("loading", 10.1, False),  # silent past the TTL: its address may belong to another process by now
    ("stopped", 0.0, False),
])
def test_scrape_targets_keep_live_sidecars_only(state, age_s, listed):
    from sie.telemetry import TelemetryRecord
    from xds_server.prometheus_sd import scrape_targets
    from xds_server.registry import InstanceTelemetry

    rec = TelemetryRecord.from_json(record(state=state))
    groups = scrape_targets([InstanceTelemetry(rec, received_at=100.0, first_received_at=90.0)], now=100.0 + age_s,
                            ttl_s=10.0)
    assert [g["targets"] for g in groups] == ([["127.0.0.1:9000"]] if listed else [])
