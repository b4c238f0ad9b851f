"""xds_server driving a REAL Envoy: routing by body, header and path; the model list and 404s; weights and
health in Envoy's /clusters; draining, failed and refusing instances; a forced NACK; models added and
deleted through the admin API.

One control plane (in this test's event loop) and one Envoy for the whole module; aiohttp upstreams
stand in for sidecars and post telemetry like real ones, a fake node host registers their addresses, and
every caller presents the credential its role needs (the credentials `sie up` would make).
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import aiohttp
import pytest
import pytest_asyncio

from sie.auth import ADMIN_TOKEN, ENVOY_TOKEN, CredentialDir
from sie.telemetry import InstanceState
from sie_testing.control_plane_harness import FakeNodeHost, FakeSidecar
from sie_testing.polling import eventually
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyProcess, admin_socket_in
from xds_server.main import XdsServer
from xds_server.policy.decisions import MAX_WEIGHT, EqualWeights
from xds_server.resources import CLUSTER, Resource
from xds_server.settings import ControlLoopSettings, Settings

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

CLUSTER_FILE = textwrap.dedent("""
    kind: ModelService
    spec:
      model: {name: scorer, service_type: scoring, priority_level: P0}
      backend: {type: sklearn}
      sla: {min_replicas: 2, max_replicas: 2}
    ---
    kind: ModelService
    spec:
      model: {name: chat}
      backend: {type: sim}
""")


class SteeredPolicy(EqualWeights):
    """Equal weights, unless the test sets a weight for an instance or a drop percentage for a model."""

    def __init__(self):
        self.weights: dict[str, int] = {}
        self.drops: dict[str, float] = {}

    def decide(self, model, records, now):
        decision = super().decide(model, records, now)
        endpoints = {
            iid: dataclasses.replace(ep, weight=self.weights.get(iid, ep.weight))
            for iid, ep in decision.endpoints.items()
        }
        return dataclasses.replace(
            decision, endpoints=endpoints, drop_overload_percent=self.drops.get(model.model_id, 0.0)
        )


class Plane:
    def __init__(self, server, envoy, session, sidecars, creds: CredentialDir):
        self.server = server
        self.envoy = envoy
        self.session = session
        self.sidecars: dict[str, FakeSidecar] = sidecars
        self.creds = creds
        self.signer = creds.signer()
        self.admin_headers = {"Authorization": f"Bearer {creds.token(ADMIN_TOKEN)}"}
        self.ingress = ""

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.server.admin_port}"

    async def envoy_json(self, path: str) -> dict:
        return await self.envoy.admin_json(path)

    async def call(self, path: str, body: dict | None = None, headers: dict | None = None, method: str = "POST"):
        async with self.session.request(method, self.ingress + path, json=body, headers=headers) as resp:
            text = await resp.text()
            ctype = resp.headers.get("content-type", "")
            return resp.status, ctype, json.loads(text) if ctype.startswith("application/json") else text

    async def hosts(self, model: str) -> dict[str, dict]:
        """Envoy's view of a model cluster: host port -> {weight, health}."""
        for cluster in (await self.envoy_json("/clusters?format=json")).get("cluster_statuses", []):
            if cluster["name"] == f"model.{model}":
                return {
                    str(h["address"]["socket_address"]["port_value"]): {
                        "weight": h.get("weight"),
                        "health": h["health_status"].get("eds_health_status"),
                    }
                    for h in cluster.get("host_statuses", [])
                }
        return {}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def plane(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("xds-envoy")
    cluster_file = workdir / "cluster.yaml"
    cluster_file.write_text(CLUSTER_FILE)
    creds = CredentialDir(workdir / "credentials").ensure()
    settings = Settings(
        cluster_file=cluster_file,
        credentials_dir=creds.path,
        admin_port=0,
        xds_port=0,
        listener_port=0,
        loop=ControlLoopSettings(startup_sync_s=0.3, debounce_ms=20, policy="equal", retire_s=0.5),
    )
    server = XdsServer(settings, signer=creds.signer(), policy=SteeredPolicy(), policy_name="steered")
    session = aiohttp.ClientSession()
    sidecars: dict[str, FakeSidecar] = {}
    envoy = node = None
    try:
        await server.start()
        admin = f"http://127.0.0.1:{server.admin_port}"
        signer = creds.signer()
        for iid, model in (("scorer-0", "scorer"), ("scorer-1", "scorer"), ("chat-0", "chat")):
            sidecars[iid] = await FakeSidecar(iid, model, admin, session, signer=signer).start()
        specs = {mid: e.spec_dict for mid, e in server.registry.models.items()}
        specs["extra"] = {"spec": {"model": {"name": "extra"}, "backend": {"type": "sim"}}}
        node = FakeNodeHost.for_sidecars("test-node", admin, session, sidecars, specs, signer=signer).start()
        envoy = EnvoyProcess(
            envoy_bootstrap(
                "test-envoy",
                "sie-test",
                "127.0.0.1",
                server.xds_port,
                admin_socket_in(workdir),
                token=creds.token(ENVOY_TOKEN),
            ),
            workdir,
        )
        envoy.start()
        await envoy.wait_ready(20)
        p = Plane(server, envoy, session, sidecars, creds)
        listeners = await eventually(lambda: p.envoy_json("/listeners?format=json"), what="the ingress listener")
        port = listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
        p.ingress = f"http://127.0.0.1:{port}"
        await eventually(lambda: _all_healthy(p), what="every fake sidecar HEALTHY in Envoy")
        yield p
    finally:
        if node is not None:
            await node.stop()
        for sidecar in sidecars.values():
            await sidecar.stop()
        if envoy is not None:
            await envoy.stop_async()
        await server.stop()
        await session.close()


async def _all_healthy(p: Plane) -> bool:
    scorer, chat = await p.hosts("scorer"), await p.hosts("chat")
    return (
        len(scorer) == 2
        and len(chat) == 1
        and all(h["health"] == "HEALTHY" for h in [*scorer.values(), *chat.values()])
    )


async def test_routes_by_the_body_model(plane):
    status, _, body = await plane.call("/generate", {"model": "chat", "text": "hi"})
    assert (status, body["instance"], body["path"]) == (200, "chat-0", "/generate")


async def test_routes_by_header_and_header_wins_over_the_body(plane):
    status, _, body = await plane.call("/infer", {"model": "chat"}, headers={"x-sie-model": "scorer"})
    assert status == 200 and body["instance"].startswith("scorer-")
    # A header naming a model that does not serve this path routes nothing: the body's model decides.
    status, _, body = await plane.call("/generate", {"model": "chat"}, headers={"x-sie-model": "scorer"})
    assert status == 200 and body["instance"] == "chat-0"


async def test_routes_by_path_and_strips_the_model_prefix(plane):
    status, _, body = await plane.call("/v1/models/scorer/infer", {"text": "wire transfer"})
    assert status == 200 and body["instance"].startswith("scorer-") and body["path"] == "/infer"


async def test_unknown_model_is_a_json_404_listing_the_models(plane):
    status, ctype, body = await plane.call("/generate", {"model": "nope"})
    assert (status, ctype) == (404, "application/json")
    assert body["error"]["type"] == "model_not_found" and body["error"]["known_models"] == ["chat", "scorer"]


async def test_model_list_and_internal_paths(plane):
    status, _, body = await plane.call("/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == ["chat", "scorer"]
    status, _, body = await plane.call("/-/state", method="GET", headers={"x-sie-model": "scorer"})
    assert status == 404 and body["error"]["type"] == "not_found"
    assert all(not s.requests or s.requests[-1][1] != "/-/state" for s in plane.sidecars.values())


async def test_a_body_that_is_not_json_is_400_and_a_wrong_method_405(plane):
    async with plane.session.post(
        plane.ingress + "/generate", data=b"{not json", headers={"content-type": "application/json"}
    ) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_json"
    status, _, body = await plane.call("/generate", method="GET")
    assert status == 405 and body["error"]["type"] == "method_not_allowed"


async def test_envoy_lists_each_model_cluster_with_its_endpoints_and_weights(plane):
    scorer = await plane.hosts("scorer")
    assert set(scorer) == {str(plane.sidecars[i].port) for i in ("scorer-0", "scorer-1")}
    assert {h["weight"] for h in scorer.values()} == {MAX_WEIGHT}
    assert list(await plane.hosts("chat")) == [str(plane.sidecars["chat-0"].port)]


async def test_pushed_weights_and_drop_overloads_reach_envoy(plane):
    policy = plane.server.control.policy
    policy.weights["scorer-1"] = 25
    plane.server.control.notify({"scorer"})
    try:
        port = str(plane.sidecars["scorer-1"].port)
        await eventually(lambda: _weight_is(plane, "scorer", port, 25), what="weight 25 in Envoy")
        policy.drops["chat"] = 100.0
        plane.server.control.notify({"chat"})

        async def dropped():
            status, _, body = await plane.call("/generate", {"model": "chat"})
            return status == 503 and "drop overload" in str(body)

        await eventually(dropped, what="chat shed by drop_overloads")
    finally:
        policy.weights.clear()
        policy.drops.clear()
        plane.server.control.notify({"scorer", "chat"})

    async def served():
        return (await plane.call("/generate", {"model": "chat"}))[0] == 200

    await eventually(served, what="chat served again")
    await eventually(
        lambda: _weight_is(plane, "scorer", str(plane.sidecars["scorer-1"].port), MAX_WEIGHT), what="full weight again"
    )


async def _weight_is(plane: Plane, model: str, port: str, weight: int) -> bool:
    return (await plane.hosts(model)).get(port, {}).get("weight") == weight


async def _spread(plane: Plane, n: int = 20) -> dict[str, int]:
    seen: dict[str, int] = {}
    for _ in range(n):
        status, _, body = await plane.call("/infer", {"model": "scorer"})
        assert status == 200, body
        seen[body["instance"]] = seen.get(body["instance"], 0) + 1
    return seen


async def test_a_draining_instance_gets_no_new_requests(plane):
    drained = plane.sidecars["scorer-1"]
    drained.state = InstanceState.DRAINING
    try:
        await eventually(lambda: _health_is(plane, drained, "DRAINING"), what="scorer-1 DRAINING in Envoy")
        assert await _spread(plane) == {"scorer-0": 20}
    finally:
        drained.state = InstanceState.READY
        await eventually(lambda: _health_is(plane, drained, "HEALTHY"), what="scorer-1 HEALTHY again")
    assert set(await _spread(plane)) == {"scorer-0", "scorer-1"}


async def _health_is(plane: Plane, sidecar: FakeSidecar, health: str) -> bool:
    return (await plane.hosts(sidecar.model_id)).get(str(sidecar.port), {}).get("health") == health


async def test_an_instance_whose_record_turns_failed_leaves_eds(plane):
    failed = plane.sidecars["scorer-1"]
    failed.state = InstanceState.FAILED
    try:
        await eventually(lambda: _gone(plane, failed), what="scorer-1 removed from Envoy")
        assert await _spread(plane, 10) == {"scorer-0": 10}
    finally:
        failed.state = InstanceState.READY
        await eventually(lambda: _health_is(plane, failed, "HEALTHY"), what="scorer-1 back")


async def _gone(plane: Plane, sidecar: FakeSidecar) -> bool:
    return str(sidecar.port) not in await plane.hosts(sidecar.model_id)


async def test_a_refused_request_is_retried_on_another_instance(plane):
    # scorer-1 is still HEALTHY in EDS but answers 503 + x-sie-retryable (a drain that EDS has not seen yet).
    plane.sidecars["scorer-1"].refuse = True
    try:
        before = len(plane.sidecars["scorer-0"].requests)
        assert await _spread(plane, 10) == {"scorer-0": 10}
        assert len(plane.sidecars["scorer-0"].requests) == before + 10
    finally:
        plane.sidecars["scorer-1"].refuse = False


async def test_a_nack_keeps_the_last_good_config(plane):
    server = plane.server
    good = server.cache.get(None)
    dump = await plane.envoy_json("/config_dump?resource=dynamic_active_clusters")
    good_version = dump["configs"][0]["version_info"]
    # Force an invalid cluster (connect_timeout must be > 0) past the builder, as a buggy change would.
    from envoy.config.cluster.v3 import cluster_pb2

    cluster = cluster_pb2.Cluster()
    good.get(CLUSTER)["model.chat"].packed.Unpack(cluster)
    cluster.connect_timeout.seconds = -1
    bad = Resource.of("model.chat", CLUSTER, cluster, refs=good.get(CLUSTER)["model.chat"].refs)
    nacks = server.metrics.nack_count()
    server.cache.set_snapshot(good.with_resource(bad))
    try:
        await eventually(lambda: _async(server.metrics.nack_count() > nacks), what="Envoy's NACK")
        nack = server.metrics.last_nack
        assert "Expected positive duration" in nack.message and nack.version == good_version
        dump = await plane.envoy_json("/config_dump?resource=dynamic_active_clusters")
        assert dump["configs"][0]["version_info"] == good_version
        status, _, body = await plane.call("/generate", {"model": "chat"})
        assert status == 200 and body["instance"] == "chat-0"
        async with plane.session.get(plane.admin + "/v1/status", headers=plane.admin_headers) as resp:
            control = (await resp.json())["control_plane"]
        assert control["last_nack"]["type"] == "Cluster"
        assert control["envoy_connections"][0]["acked_versions"]["Cluster"] == good_version
    finally:
        server.control.republish()
    await eventually(lambda: _cds_version_is(plane, good.version(CLUSTER)), what="the good config back")


async def _async(value):
    return value


async def _cds_version_is(plane: Plane, version: str) -> bool:
    dump = await plane.envoy_json("/config_dump?resource=dynamic_active_clusters")
    return dump["configs"][0]["version_info"] == version if dump.get("configs") else False


async def test_a_model_added_through_the_admin_api_is_routed_then_deleted(plane):
    spec = {"spec": {"model": {"name": "extra"}, "backend": {"type": "sim"}}}
    async with plane.session.post(plane.admin + "/v1/models", json=spec, headers=plane.admin_headers) as resp:
        assert resp.status == 201
    sidecar = await FakeSidecar("extra-0", "extra", plane.admin, plane.session, signer=plane.signer).start()
    plane.sidecars["extra-0"] = sidecar  # its node host registers it
    try:
        await eventually(lambda: _health_is(plane, sidecar, "HEALTHY"), what="extra-0 HEALTHY")
        status, _, body = await plane.call("/generate", {"model": "extra"})
        assert status == 200 and body["instance"] == "extra-0"
        async with plane.session.delete(plane.admin + "/v1/models/extra", headers=plane.admin_headers) as resp:
            assert resp.status == 200

        async def routed_404():
            return (await plane.call("/generate", {"model": "extra"}))[0] == 404

        await eventually(routed_404, what="extra unrouted")
        await eventually(lambda: _cluster_gone(plane, "extra"), what="model.extra cluster removed after retiring")
    finally:
        plane.sidecars.pop("extra-0", None)
        await sidecar.stop()


async def _cluster_gone(plane: Plane, model: str) -> bool:
    clusters = await plane.envoy_json("/clusters?format=json")
    return all(c["name"] != f"model.{model}" for c in clusters.get("cluster_statuses", []))
