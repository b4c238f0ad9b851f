"""Every control API authenticates its caller and authorises by identity (DESIGN §10), tried on the running
stack as a pod or a local process would: the admin API, the node host's API, every sidecar's control
listener, every worker, and the ADS stream. No credential, a forged one, another key's, or a valid one of
the wrong identity: a JSON 401 or 403, and nothing changes."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import yaml
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sie.auth import Identity, Signer
from sie.auth.tokens import _b64
from tests.integration.standalone_helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ANOTHER_KEY = Signer.generate()


def _forged(who: Identity) -> list[tuple[str, dict[str, str]]]:
    """Credentials an attacker can make: none, garbage, another key's, unsigned, and one with alg none."""
    header = _b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    claims = _b64(
        json.dumps(
            {
                "iss": "sie",
                "role": who.role.value,
                "sub": who.name,
                "node": who.node,
                "model": who.model,
                "iat": int(time.time()),
            }
        ).encode()
    )
    real = ANOTHER_KEY.issue(who)
    return [
        ("no credential", {}),
        ("garbage", {"Authorization": "Bearer not-a-token"}),
        ("basic", {"Authorization": "Basic YWRtaW46YWRtaW4="}),
        ("another key", {"Authorization": f"Bearer {real}"}),
        ("alg none", {"Authorization": f"Bearer {header}.{claims}."}),
        ("tampered", {"Authorization": f"Bearer {real.rsplit('.', 2)[0]}.{claims}.{real.rsplit('.', 1)[1]}"}),
    ]


def _admin_routes(admin: str) -> list[tuple[str, str, object]]:
    spec = {"spec": {"model": {"name": "evil"}, "backend": {"type": "sim"}}}
    return [
        ("GET", admin + "/v1/models", None),
        ("POST", admin + "/v1/models", spec),
        ("PUT", admin + "/v1/models/gold", spec),
        ("DELETE", admin + "/v1/models/gold", None),
        ("GET", admin + "/v1/endpoints", None),
        ("GET", admin + "/v1/status", None),
        ("GET", admin + "/v1/nodes", None),
        ("GET", admin + "/metrics", None),
        ("GET", admin + "/v1/prometheus/targets", None),
        ("POST", admin + "/v1/telemetry", {"instance_id": "gold-0"}),
        ("POST", admin + "/v1/nodes/heartbeat", {"node": "local", "address": "x", "instances": []}),
    ]


def test_the_admin_api_answers_nobody_without_a_valid_credential(target):
    for method, url, body in _admin_routes(target.stack.admin):
        for what, headers in _forged(Identity.admin()):
            code, got, answer = request(method, url, body, headers=headers, timeout=10)
            assert code == 401, (method, url, what, answer)
            assert answer["error"]["type"] == "unauthenticated" and got["WWW-Authenticate"].startswith("Bearer")
    assert {m["model_id"] for m in target.stack.status()["models"]} == {"gold", "bronze", "scorer"}
    target.gold_serves()


def test_valid_credentials_of_the_wrong_identity_are_forbidden(target):
    creds = target.stack.run_dir / "credentials"
    reader = {"Authorization": f"Bearer {(creds / 'reader.token').read_text().strip()}"}
    node = {"Authorization": f"Bearer {(creds / 'node-local.token').read_text().strip()}"}
    envoy = {"Authorization": f"Bearer {(creds / 'envoy.token').read_text().strip()}"}
    admin = target.stack.admin
    for headers, method, url, body in (
        (reader, "DELETE", admin + "/v1/models/gold", None),
        (reader, "POST", admin + "/v1/models", {"spec": {"model": {"name": "evil"}, "backend": {"type": "sim"}}}),
        (node, "PUT", admin + "/v1/models/gold", {"spec": {"model": {"name": "gold"}, "backend": {"type": "sim"}}}),
        (node, "POST", admin + "/v1/telemetry", {"instance_id": "gold-0"}),
        (envoy, "GET", admin + "/v1/status", None),
        (envoy, "POST", admin + "/v1/nodes/heartbeat", {"node": "local", "address": "x"}),
    ):
        code, _, answer = request(method, url, body, headers=headers)
        assert code == 403 and answer["error"]["type"] == "forbidden", (url, answer)
    assert {m["model_id"] for m in target.stack.status()["models"]} == {"gold", "bronze", "scorer"}


def test_the_node_hosts_api_answers_only_readers(target):
    for path in ("/v1/instances", "/v1/gpus", "/v1/events", "/metrics"):
        for what, headers in _forged(Identity.admin()):
            code, _, answer = request("GET", target.node + path, headers=headers)
            assert code == 401 and answer["error"]["type"] == "unauthenticated", (path, what)
        sidecar = {
            "Authorization": f"Bearer {target.stack.run_dir.joinpath('secrets', 'gold-0.token').read_text().strip()}"
        }
        code, _, answer = request("GET", target.node + path, headers=sidecar)
        assert code == 403, (path, answer)
    code, _, answer = request("GET", target.node + "/healthz")
    assert code == 200 and answer["status"] == "ok"


def test_only_an_instances_own_sidecar_or_an_admin_may_ask_its_node_host_for_a_wake(target):
    url = target.node + "/v1/instances/gold-0/wake"
    for what, headers in _forged(Identity.for_sidecar("gold-0", "gold", "local")):
        code, _, answer = request("POST", url, headers=headers)
        assert code == 401 and answer["error"]["type"] == "unauthenticated", what
    secrets = target.stack.run_dir / "secrets"
    creds = target.stack.run_dir / "credentials"
    for who, token in (
        ("another instance's sidecar", (secrets / "bronze-0.token").read_text().strip()),
        ("a reader", (creds / "reader.token").read_text().strip()),
        ("the node itself", (creds / "node-local.token").read_text().strip()),
    ):
        code, _, answer = request("POST", url, headers={"Authorization": f"Bearer {token}"})
        assert code == 403 and answer["error"]["type"] == "forbidden", (who, answer)
    own = {"Authorization": f"Bearer {(secrets / 'gold-0.token').read_text().strip()}"}
    code, _, answer = request("POST", url, headers=own)
    assert code == 200 and answer["state"] == "ready", "awake already: the wake is a no-op"
    target.gold_serves()


def test_sidecar_control_listeners_obey_only_their_node_host_and_admins(target):
    inst = target.instance("gold-0")
    control, data = inst["control_address"], inst["sidecar_address"]
    assert control != data
    for path in ("/-/drain", "/-/sleep", "/-/wake"):
        for what, headers in [
            *_forged(Identity.for_node("local")),
            ("another node's host", {"Authorization": f"Bearer {ANOTHER_KEY.issue(Identity.for_node('n9'))}"}),
        ]:
            code, _, answer = request("POST", f"http://{control}{path}?timeout_s=1", headers=headers)
            assert code == 401 and answer["error"]["type"] == "unauthenticated", (path, what, answer)
        # On the data listener the control endpoints do not exist at all.
        code, _, answer = request("POST", f"http://{data}{path}")
        assert code == 404 and answer["error"]["type"] == "not_found"
    reader = {"Authorization": f"Bearer {(target.stack.run_dir / 'credentials' / 'reader.token').read_text().strip()}"}
    code, _, answer = request("POST", f"http://{control}/-/sleep?timeout_s=1", headers=reader)
    assert code == 403
    assert target.instance("gold-0")["sidecar_state"] == "ready"
    target.gold_serves()


def test_workers_answer_only_their_own_sidecar_and_node_host(target):
    gold0, gold1 = target.instance("gold-0"), target.instance("gold-1")
    worker = f"http://{gold0['worker_address']}"
    other_key = target.stack.run_dir.joinpath("secrets", "gold-1.worker-key").read_text().strip()
    for path, body in (
        ("/release_memory_occupation", {}),
        ("/sim/config", {"slowdown": 100}),
        ("/generate", {"text": "x"}),
        ("/v1/loads", None),
        ("/metrics", None),
    ):
        method = "POST" if body is not None else "GET"
        for headers in ({}, {"Authorization": "Bearer guess"}, {"Authorization": f"Bearer {other_key}"}):
            code, _, answer = request(method, worker + path, body, headers=headers)
            assert code == 401 and answer["error"]["type"] == "unauthenticated", (path, headers, answer)
    code, _, answer = request("GET", worker + "/health")
    assert code == 200  # liveness stays open
    assert gold1["worker_address"] != gold0["worker_address"]
    target.gold_serves()


def test_the_ads_stream_needs_envoys_credential(target):
    xds = json.loads((target.stack.run_dir / "sie.json").read_text())
    port = _xds_port(target)
    request_one = discovery_pb2.DiscoveryRequest(
        type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster", node={"id": "intruder", "cluster": "x"}
    )
    creds = target.stack.run_dir / "credentials"
    for metadata, expected in (
        ((), grpc.StatusCode.UNAUTHENTICATED),
        ((("authorization", "Bearer junk"),), grpc.StatusCode.UNAUTHENTICATED),
        (
            (("authorization", f"Bearer {(creds / 'reader.token').read_text().strip()}"),),
            grpc.StatusCode.PERMISSION_DENIED,
        ),
    ):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                for _ in stub.StreamAggregatedResources(iter([request_one]), metadata=metadata, timeout=5):
                    pass
            assert err.value.code() == expected, (metadata, err.value)
    assert xds["envoy_url"]  # the real Envoy, with its token, is still connected and serving
    target.gold_serves()


def _xds_port(target) -> int:
    """The ADS port, read from Envoy's bootstrap as a local process could."""
    boot = yaml.safe_load((target.stack.run_dir / "envoy.yaml").read_text())
    endpoint = boot["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    return endpoint["endpoint"]["address"]["socket_address"]["port_value"]
