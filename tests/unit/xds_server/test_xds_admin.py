"""The admin API, in process (aiohttp test client): models CRUD, telemetry intake, heartbeats, status, and who
may call each route."""

from __future__ import annotations

import time

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from sie.auth import Identity, Signer, TokenAuthenticator
from sie.errors import SpecError
from sie.wire import InstanceReport
from sie_testing import error_shape
from xds_server.admin import AdminContext, make_app
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop, PendingChanges
from xds_server.credentials import TokenIssuer
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics
from xds_server.policy.decisions import MAX_WEIGHT, EqualWeights
from xds_server.prometheus_sd import node_targets
from xds_server.registry import Registry
from xds_server.snapshots import SnapshotCache

SPEC = {
    "kind": "ModelService",
    "spec": {"model": {"name": "scorer", "service_type": "scoring"}, "backend": {"type": "sim"}},
}


def record(**over):
    base = {
        "instance_id": "scorer-0",
        "model_id": "scorer",
        "version": "0.0.0",
        "address": "127.0.0.1:9000",
        "node": "n1",
        "state": "ready",
        "seq": 1,
        "timestamp": time.time(),
        "reporter": "r1",
    }
    return base | over


class World:
    def __init__(self, client: TestClient, registry: Registry, control: ControlLoop, signer: Signer):
        self.client, self.registry, self.control, self.signer = client, registry, control, signer
        self.admin = self.auth(Identity.admin())

    def auth(self, who: Identity) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.signer.issue(who)}"}

    def sidecar(self, iid="scorer-0", model="scorer", node="n1") -> dict[str, str]:
        return self.auth(Identity.for_sidecar(iid, model, node))

    def node(self, name="n1") -> dict[str, str]:
        return self.auth(Identity.for_node(name))

    async def post_record(self, **over):
        rec = record(**over)
        return await self.client.post(
            "/v1/telemetry", json=rec, headers=self.sidecar(rec["instance_id"], rec["model_id"], rec["node"])
        )

    async def beat(self, node="n1", instances=()):
        hb = {"node": node, "address": "http://127.0.0.1:1", "instances": list(instances)}
        return await self.client.post("/v1/nodes/heartbeat", json=hb, headers=self.node(node))


def report(iid="scorer-0", address="127.0.0.1:9000", spec=None, cpus="") -> dict:
    rep = InstanceReport(
        iid,
        "scorer",
        "0.0.0",
        "ready",
        spec or SPEC,
        sidecar_address=address,
        control_address="127.0.0.1:9100",
        cpus=cpus,
    )
    return {**rep.__dict__, "state": "ready"}


@pytest.fixture
async def world():
    signer = Signer.generate()
    metrics, cache = ControlPlaneMetrics(), SnapshotCache()
    changes = PendingChanges(time.monotonic)
    registry = Registry(clock=time.monotonic, changes=changes, tokens=TokenIssuer(signer))
    control = ControlLoop(
        registry, EqualWeights(), cache, metrics, IngressConfig(), time.monotonic, time.time, changes=changes
    )
    ads = AdsServer(cache, metrics, time.monotonic)
    app = make_app(
        AdminContext(
            registry, control, metrics, ads, time.monotonic, time.time, TokenAuthenticator(signer.verifier()), "equal"
        )
    )
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield World(client, registry, control, signer)
    finally:
        await client.close()


async def test_healthz_is_open_and_503_until_the_sync_is_over(world):
    assert (await world.client.get("/healthz")).status == 503
    world.registry.mark_synced()
    assert (await world.client.get("/healthz")).status == 200


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/models"),
        ("GET", "/v1/models/scorer"),
        ("PUT", "/v1/models/scorer"),
        ("DELETE", "/v1/models/scorer"),
        ("GET", "/v1/endpoints"),
        ("POST", "/v1/telemetry"),
        ("POST", "/v1/nodes/heartbeat"),
        ("GET", "/v1/nodes"),
        ("GET", "/v1/status"),
        ("GET", "/v1/prometheus/targets"),
        ("GET", "/v1/picker/endpoints"),
        ("GET", "/metrics"),
        ("GET", "/no/such/route"),
    ],
)
async def test_every_route_but_healthz_needs_a_valid_credential(world, method, path):
    for headers in (
        {},
        {"Authorization": "Bearer nonsense"},
        {"Authorization": "Basic YWRtaW46YWRtaW4="},
        {"Authorization": f"Bearer {Signer.generate().issue(Identity.admin())}"},
    ):  # another key's admin
        resp = await world.client.request(method, path, json=SPEC, headers=headers)
        body = await resp.json()
        assert resp.status == 401, (headers, body)
        assert body["error"]["type"] == "unauthenticated" and body["error"]["message"]
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "who, method, path",
    [
        (Identity.reader(), "POST", "/v1/models"),
        (Identity.reader(), "DELETE", "/v1/models/scorer"),
        (Identity.for_node("n1"), "PUT", "/v1/models/scorer"),
        (Identity.for_sidecar("scorer-0", "scorer", "n1"), "GET", "/v1/status"),
        (Identity.for_node("n1"), "POST", "/v1/telemetry"),
        (Identity.admin(), "POST", "/v1/telemetry"),
        (Identity.for_sidecar("scorer-0", "scorer", "n1"), "POST", "/v1/nodes/heartbeat"),
        (Identity.envoy(), "GET", "/v1/endpoints"),
        (Identity.for_sidecar("scorer-0", "scorer", "n1"), "GET", "/v1/picker/endpoints"),
        (Identity.for_node("n1"), "GET", "/v1/picker/endpoints"),
    ],
)
async def test_an_identity_may_do_only_what_its_role_allows(world, who, method, path):
    resp = await world.client.request(method, path, json=SPEC, headers=world.auth(who))
    body = await resp.json()
    assert resp.status == 403 and body["error"]["type"] == "forbidden" and who.subject in body["error"]["message"]
    assert world.registry.models == {} and world.registry.telemetry == {} and world.registry.nodes == {}


async def test_model_crud(world):
    client, admin = world.client, world.admin
    resp = await client.post("/v1/models", json=SPEC, headers=admin)
    assert resp.status == 201 and (await resp.json())["spec"]["model"]["name"] == "scorer"
    resp = await client.post("/v1/models", json=SPEC, headers=admin)
    assert resp.status == 409 and "PUT /v1/models/scorer" in (await resp.json())["error"]["message"]
    listed = (await (await client.get("/v1/models", headers=world.auth(Identity.reader()))).json())["models"]
    assert [m["metadata"]["name"] for m in listed] == ["scorer"]
    assert listed[0]["status"]["desired_instances"] == 1 and listed[0]["status"]["source"] == "api"
    changed = yaml.safe_dump({**SPEC, "spec": {**SPEC["spec"], "replicas": 1}})
    resp = await client.put("/v1/models/scorer", data=changed, headers={"content-type": "application/yaml", **admin})
    assert resp.status == 200
    assert (await client.get("/v1/models/scorer", headers=admin)).status == 200
    assert (await client.delete("/v1/models/scorer", headers=admin)).status == 200
    assert (await client.get("/v1/models/scorer", headers=admin)).status == 404
    assert (await client.delete("/v1/models/scorer", headers=admin)).status == 404


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"spec": {"model": {"name": "Bad_Name"}, "backend": {"type": "sim"}}}, "spec.model.name"),
        ({"spec": {"model": {"name": "ok"}, "backend": {"type": "nope"}}}, "spec.backend.type"),
        ({"spec": {"model": {"name": "ok"}, "backend": {"type": "sim"}, "replcas": 2}}, "spec.replcas"),
        (
            {"spec": {"model": {"name": "ok"}, "backend": {"type": "sim"}, "sla": {"max_replicas": 1e9}}},
            "spec.sla.max_replicas",
        ),
        (
            {"spec": {"model": {"name": "ok"}, "backend": {"type": "sim", "config": {"trust_remote_code": True}}}},
            "spec.backend.config.trust_remote_code",
        ),
        ({"spec": {"model": {"name": "ok", "path": "/m/x.joblib"}, "backend": {"type": "sklearn"}}}, "spec.model.path"),
        # An embedded engine's settings are part of the spec: refused here, not by a worker that exits.
        (
            {
                "spec": {
                    "model": {"name": "ok", "path": "m/x.skops"},
                    "backend": {"type": "sklearn", "config": {"demo": "yes"}},
                }
            },
            "spec.backend.config.demo",
        ),
        (
            {
                "spec": {
                    "model": {"name": "ok", "path": "m/x"},
                    "backend": {"type": "torch", "config": {"device": "tpu"}},
                }
            },
            "spec.backend.config.device",
        ),
        (
            {
                "spec": {
                    "model": {"name": "ok"},
                    "backend": {"type": "sim"},
                    "routing": {"inference_paths": ["/-/drain"]},
                }
            },
            "spec.routing.inference_paths",
        ),
    ],
)
async def test_a_bad_spec_is_400_naming_the_field(world, body, path):
    resp = await world.client.post("/v1/models", json=body, headers=world.admin)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_spec" and path in [p["path"] for p in error["problems"]]
    assert world.registry.models == {}


@pytest.mark.parametrize(
    "body, kind",
    [
        (b"a: &x [1, 2]\nb: *x\n", "invalid_yaml"),  # aliases are refused before anything is expanded
        (b'{"spec": ' * 100 + b"1" + b"}" * 100, "invalid_json"),
        (b"\xff\xfe", "invalid_yaml"),
        (b'{"kind": "ModelService", "kind": "ModelService"}', "invalid_json"),
    ],
)
async def test_a_body_that_cannot_be_read_is_400_naming_why(world, body, kind):
    resp = await world.client.post("/v1/models", data=body, headers=world.admin)
    assert resp.status == 400 and (await resp.json())["error"]["type"] == kind


async def test_put_refuses_a_body_naming_another_model(world):
    resp = await world.client.put("/v1/models/other", json=SPEC, headers=world.admin)
    assert resp.status == 400 and "path names 'other'" in str(await resp.json())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"state": "asleep"}, "state"),
        ({"in_flight": "3"}, "in_flight"),
        ({"in_flight": -1}, "in_flight"),
        ({"kv_cache_usage": 7.0}, "kv_cache_usage"),
        ({"address": "localhost:9000"}, "address"),
        ({"address": "127.0.0.1:\u00b2"}, "address"),
        ({"bogus": 1}, "bogus"),
        ({"seq": 10**30}, ""),  # beyond 64 bits: refused by the JSON reader itself
    ],
)
async def test_a_bad_telemetry_record_is_400_naming_the_field(world, change, field):
    resp = await world.post_record(**change)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert field in [p["path"] for p in error.get("problems", [{"path": ""}])]


@pytest.mark.parametrize(
    "claims",
    [
        {"instance_id": "scorer-1"},
        {"model_id": "chat"},
        {"node": "n2"},
    ],
)
async def test_a_sidecar_reports_only_its_own_instance(world, claims):
    rec = record(**claims)
    resp = await world.client.post("/v1/telemetry", json=rec, headers=world.sidecar())
    assert resp.status == 403 and (await resp.json())["error"]["type"] == "forbidden"
    assert world.registry.telemetry == {}


async def test_telemetry_order_is_per_sidecar_process_and_cannot_lock_the_genuine_one_out(world):
    assert (await (await world.post_record(seq=5)).json()) == {"accepted": True}
    assert (await (await world.post_record(seq=4)).json()) == {"accepted": False}  # reordered within one process
    assert world.registry.telemetry["scorer-0"].record.seq == 5
    # A huge seq and a far-future timestamp from one process...
    assert (await (await world.post_record(seq=2**62, timestamp=9e10)).json()) == {"accepted": True}
    stored = world.registry.telemetry["scorer-0"].record
    assert stored.timestamp <= time.time() + 1  # the control plane's clock judges age, never the record's
    # ...never hold back the next process (a restarted sidecar), which starts over from 1.
    assert (await (await world.post_record(seq=1, reporter="r2")).json()) == {"accepted": True}


async def test_heartbeat_and_endpoints_and_status(world):
    client, registry, control = world.client, world.registry, world.control
    await client.post("/v1/models", json=SPEC, headers=world.admin)
    reply = await (await world.beat()).json()
    assert reply == {"authoritative": False, "assignments": [], "node_token": "", "send_specs": []}
    registry.mark_synced()
    reply = await (await world.beat()).json()
    assert reply["authoritative"] and [a["instance_id"] for a in reply["assignments"]] == ["scorer-0"]
    node = world.signer.verifier().verify(reply["node_token"])  # what the node host shows its own sidecars
    assert (node.role.value, node.name) == ("node", "n1") and node.expires_at is not None
    token = reply["assignments"][0]["token"]  # the sidecar's credential, for exactly this instance
    who = world.signer.verifier().verify(token)
    assert (who.role.value, who.name, who.model, who.node) == ("sidecar", "scorer-0", "scorer", "n1")
    await world.beat(instances=[report(cpus="0")])  # its node host pinned it to core 0 (--tier-cpus)
    await client.post("/v1/telemetry", json=record(), headers={"Authorization": f"Bearer {token}"})
    control.rebuild()
    endpoints = (await (await client.get("/v1/endpoints", headers=world.admin)).json())["endpoints"]
    assert endpoints[0]["in_eds"] and endpoints[0]["decision"]["health"] == "HEALTHY"
    status = await (await client.get("/v1/status", headers=world.admin)).json()
    assert status["control_plane"]["ready"] and status["control_plane"]["xds_versions"]
    model = status["models"][0]
    assert (model["model_id"], model["desired_replicas"]) == ("scorer", 1)
    assert model["instances"][0] | {"telemetry_age_s": 0} == model["instances"][0] | {
        "instance_id": "scorer-0",
        "state": "ready",
        "node": "n1",
        "address": "127.0.0.1:9000",
        "in_eds": True,
        "weight": MAX_WEIGHT,
        "health": "HEALTHY",
        "telemetry_age_s": 0,
        "in_flight": 0,
        "queued": 0,
        "cpus": "0",
    }
    nodes = (await (await client.get("/v1/nodes", headers=world.admin)).json())["nodes"]
    assert nodes[0]["live"] and nodes[0]["assigned"] == ["scorer-0"]
    metrics = await (await client.get("/metrics", headers=world.auth(Identity.reader()))).text()
    assert "sie_registry_models" in metrics and "sie_xds_nacks_total" in metrics


async def test_eds_takes_the_address_the_node_registered_never_the_one_telemetry_names(world):
    client, registry, control = world.client, world.registry, world.control
    await client.post("/v1/models", json=SPEC, headers=world.admin)
    registry.mark_synced()
    await world.post_record(address="10.6.6.6:80")  # the sidecar says one thing...
    control.rebuild()
    assert control.decisions["scorer"].endpoints == {}  # ...and no node registered anything: not in EDS
    await world.beat(instances=[report(address="127.0.0.1:9000")])
    await world.post_record(seq=2, address="10.6.6.6:80")
    control.rebuild()
    assert control.decisions["scorer"].endpoints["scorer-0"].address == "127.0.0.1:9000"
    # Another node cannot claim an instance placed on n1.
    await world.beat("n2", instances=[report(address="127.0.0.1:6666")])
    await client.post("/v1/telemetry", json=record(node="n2", seq=3, reporter="x"), headers=world.sidecar(node="n2"))
    control.rebuild()
    assert not any(ep.address == "127.0.0.1:6666" for ep in control.decisions["scorer"].endpoints.values())


async def test_a_registered_address_with_a_unicode_digit_port_stops_nothing(world):
    """'127.0.0.1:²' passes str.isdigit() but not int(): the instance stays out of EDS, and the build,
    the sweep and the views go on (they once raised, for every model and in the fatal sweep task)."""
    client, registry, control = world.client, world.registry, world.control
    await client.post("/v1/models", json=SPEC, headers=world.admin)
    registry.mark_synced()
    token = (await (await world.beat()).json())["assignments"][0]["token"]
    await world.beat(instances=[report(address="127.0.0.1:\u00b2")])
    resp = await client.post("/v1/telemetry", json=record(), headers={"Authorization": f"Bearer {token}"})
    assert resp.status == 200
    assert control.rebuild() is not None and control.snapshot is not None
    assert control.decisions["scorer"].endpoints == {} and not control.resource_errors
    control.sweep()
    for path in ("/v1/status", "/v1/models", "/v1/endpoints"):
        assert (await client.get(path, headers=world.admin)).status == 200, path


async def test_a_node_heartbeats_only_as_itself(world):
    resp = await world.client.post(
        "/v1/nodes/heartbeat", json={"node": "n2", "address": "http://x", "instances": []}, headers=world.node("n1")
    )
    assert resp.status == 403 and "node 'n1'" in (await resp.json())["error"]["message"]
    assert world.registry.nodes == {}


@pytest.mark.parametrize(
    "body",
    [
        {"address": "x"},
        {"node": "n1", "address": "x", "gpus": [{"index": 0, "name": "g", "total_mb": "lots", "used_mb": 0}]},
        {"node": "n1", "address": "x", "instances": "all of them"},
        {"node": "n1", "address": "x", "instances": [{"instance_id": "a"}]},
        {"node": "n1" * 200, "address": "x"},
    ],
)
async def test_a_malformed_heartbeat_is_400_and_leaves_nothing_behind(world, body):
    resp = await world.client.post("/v1/nodes/heartbeat", json=body, headers=world.node())
    error = (await resp.json())["error"]
    assert resp.status in (400, 403) and error["message"]
    assert world.registry.nodes == {}
    assert (await world.client.get("/v1/status", headers=world.admin)).status == 200  # and status still answers


async def test_prometheus_targets_list_every_sidecar_that_reports(world):
    client = world.client
    reader = world.auth(Identity.reader())
    assert await (await client.get("/v1/prometheus/targets", headers=reader)).json() == []
    await world.beat(instances=[report()])
    await world.post_record(priority="P0", service_type="scoring")
    resp = await client.get("/v1/prometheus/targets", headers=reader)
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.json() == [
        {
            "targets": ["127.0.0.1:9100"],  # the sidecar's control listener, as its node host registered it
            "labels": {
                "__metrics_path__": "/-/metrics",
                "model_id": "scorer",
                "instance_id": "scorer-0",
                "priority_level": "P0",
                "service_type": "scoring",
                "node": "n1",
            },
        },
    ]


async def test_prometheus_targets_with_role_node_list_every_live_node_hosts_api(world):
    client = world.client
    reader = world.auth(Identity.reader())
    assert await (await client.get("/v1/prometheus/targets?role=node", headers=reader)).json() == []
    for node, address in (
        ("n1", "http://127.0.0.1:7001"),
        ("n2", "http://0.0.0.0:7002"),  # a wildcard it listens on: no address to scrape
        ("n3", "http://node-c.example:7003"),  # a name: never resolved, as for sidecars
        ("n4", "https://[::1]:7004"),
        ("n5", "http://127.0.0.1:7005/x"),
    ):
        hb = {"node": node, "address": address, "instances": []}
        assert (await client.post("/v1/nodes/heartbeat", json=hb, headers=world.node(node))).status == 200
    resp = await client.get("/v1/prometheus/targets?role=node", headers=reader)
    assert resp.status == 200 and resp.content_type == "application/json"
    assert await resp.json() == [
        {"targets": ["127.0.0.1:7001"], "labels": {"__metrics_path__": "/metrics", "node": "n1"}},
        {"targets": ["[::1]:7004"], "labels": {"__metrics_path__": "/metrics", "node": "n4", "__scheme__": "https"}},
    ]
    # The sidecars' list is unchanged by node hosts (no sidecar has reported), with or without role=sidecar.
    assert await (await client.get("/v1/prometheus/targets", headers=reader)).json() == []
    assert await (await client.get("/v1/prometheus/targets?role=sidecar", headers=reader)).json() == []
    # A node host whose heartbeats stopped is dropped once its TTL passes (its port may be reused).
    assert [g["labels"]["node"] for g in node_targets(world.registry, time.monotonic() + 9)] == ["n1", "n4"]
    assert node_targets(world.registry, time.monotonic() + 11) == []
    resp = await client.get("/v1/prometheus/targets?role=envoy", headers=reader)
    body = await resp.json()
    assert resp.status == 400 and body["error"]["type"] == "bad_request" and "sidecar, node" in body["error"]["message"]
    error_shape.check(resp.status, body)
    assert (await client.get("/v1/prometheus/targets?role=node", headers=world.node("n1"))).status == 403


async def test_an_unchanged_heartbeat_body_is_not_decoded_again():
    import json

    from xds_server.admin import HeartbeatBodies

    bodies = HeartbeatBodies(most=2)
    body = json.dumps({"node": "n1", "address": "http://x", "instances": [report()]}).encode()
    first = await bodies.decode("n1", body)
    assert await bodies.decode("n1", body) is first  # the same bytes: the same record, no second parse
    changed = body.replace(b"http://x", b"http://y")
    assert (await bodies.decode("n1", changed)).address == "http://y"
    other = await bodies.decode("n2", body)  # another node's claim to be n1 is decoded (the caller refuses it)...
    assert other.node == "n1" and (await bodies.decode("n1", changed)).address == "http://y"  # ...never cached
    with pytest.raises(SpecError):
        await bodies.decode("n1", b'{"node": "n1"}')
