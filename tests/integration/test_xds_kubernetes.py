"""xds_server --kubernetes against the FAKE API server (sie_testing.fake_apiserver): ModelServices
become models, node hosts are never asked to run them, and only pods Kubernetes reports ready (with a
serving sidecar) enter EDS, at the address Kubernetes gives the pod. Sidecars and node hosts prove who
they are with service-account tokens the control plane checks with TokenReview."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest

from sie.auth import Signer
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import NodeHeartbeat
from sie_testing.fake_apiserver import FakeApiServer, role_rules
from tests.integration.test_k8s_controller import NS, eventually, qwen, running_pod
from xds_server.main import XdsServer
from xds_server.settings import ControlLoopSettings, KubernetesSettings, Settings

pytestmark = pytest.mark.timeout(60)
log = logging.getLogger(__name__)


def post(url: str, body: dict, token: str) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def post_telemetry(admin: str, record: dict, token: str) -> None:
    """One telemetry post of a played sidecar. The control plane refuses a pod its watch has not seen yet
    (401, "not an instance of any ModelService"); a played sidecar that starts beside a freshly put pod
    may get that once or twice: it is logged (pytest shows it with a failure) and the next post goes
    out, as a real sidecar's reporter does. Any other answer but 200 fails the post, and so the task that
    made it: stop_played_sidecar raises it."""
    status, body = await asyncio.to_thread(post, admin + "/v1/telemetry", record, token)
    message = (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""
    if status == 401 and "is not an instance of any ModelService" in message:
        log.warning("telemetry from %s refused: %s %s", record.get("reporter"), status, body)
        return
    assert status == 200, body


async def stop_played_sidecar(task: asyncio.Task) -> None:
    """Cancel a played sidecar's telemetry task, and raise what ended it if it ended by itself (a refused
    post, the admin API away): a test then fails with that, not with only its wait's timeout."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def stop_k8s_rig(sidecars: Any, server: XdsServer, fake: FakeApiServer) -> None:
    """A test's end: its played sidecars (None if it never made them), then the control plane and the
    fake API server, which stop even when stopping the sidecars raises what ended one of them. The fake
    held the control plane to its RBAC (role_rules("sie-controller")): nothing may have been refused."""
    try:
        if sidecars is not None:
            await sidecars.stop()
    finally:
        await server.stop()
        await fake.stop()
    assert fake.denied == [], "the control plane used verbs its RBAC does not grant"


def telemetry(pod: str, ip: str, seq: int) -> dict:
    return TelemetryRecord(
        instance_id=pod,
        model_id="qwen2-7b-scoring",
        version="1.2.0",
        address=f"{ip}:8081",
        node="gpu-1",
        state=InstanceState.READY,
        timestamp=1.0 + seq,
        seq=seq,
        reporter="p1",
    ).to_json()


async def test_model_services_and_ready_pods_drive_the_registry():
    fake = FakeApiServer(bookmark_interval_s=0.1, rules=role_rules("sie-controller"))
    await fake.start()
    # Projected service-account tokens, as the kubelet would mount them (audience sie).
    tokens = {
        "node-gpu-1": fake.review_token(
            "node-gpu-1", "system:serviceaccount:sie-system:sie-node-host", pod="sie-node-host-x1", node="gpu-1"
        ),
        "pod-qwen-a": fake.review_token(
            "pod-qwen-a", f"system:serviceaccount:{NS}:default", pod="qwen-a", node="gpu-1"
        ),
        "pod-stranger": fake.review_token(
            "pod-stranger", f"system:serviceaccount:{NS}:default", pod="stranger", node="gpu-1"
        ),
        "no-pod": fake.review_token("no-pod", f"system:serviceaccount:{NS}:default"),
    }
    server = XdsServer(
        Settings(
            admin_port=0,
            xds_port=0,
            listener_port=0,
            loop=ControlLoopSettings(startup_sync_s=0.2),
            kubernetes=KubernetesSettings(enabled=True, api_url=fake.url),
        ),
        signer=Signer.generate(),
    )
    try:
        fake.put(
            "modelservices", {**qwen(), "metadata": {"name": "qwen2-7b-scoring", "namespace": NS, "generation": 1}}
        )
        await server.start()
        await asyncio.wait_for(server.synced.wait(), 20)
        admin = f"http://127.0.0.1:{server.admin_port}"
        reg = server.registry
        await eventually(lambda: "qwen2-7b-scoring" in reg.models, what="the ModelService in the registry")
        assert reg.models["qwen2-7b-scoring"].source == "kubernetes"

        # The node host on that node is not asked to run it: its Deployment does. It heartbeats as its own
        # node only (its token is bound to gpu-1).
        beat = NodeHeartbeat(node="gpu-1", address="http://10.0.0.1:7070").to_json()
        status, reply = await asyncio.to_thread(post, admin + "/v1/nodes/heartbeat", beat, tokens["node-gpu-1"])
        assert status == 200 and reply["authoritative"] and reply["assignments"] == []
        status, _ = await asyncio.to_thread(
            post, admin + "/v1/nodes/heartbeat", {**beat, "node": "gpu-2"}, tokens["node-gpu-1"]
        )
        assert status == 403
        status, _ = await asyncio.to_thread(post, admin + "/v1/nodes/heartbeat", beat, "made-up")
        assert status == 401

        # The pod's sidecar reports ready, but Kubernetes does not call the pod ready yet: not in EDS.
        deployment = await eventually(lambda: fake.get("deployments", NS, "qwen2-7b-scoring"), what="Deployment")
        fake.put("pods", running_pod(deployment, "qwen-a", "10.1.0.1", ready=False))
        await eventually(lambda: server._controller.pod_instance(NS, "qwen-a") is not None, what="the pod seen")
        record = {**telemetry("qwen-a", "10.1.0.1", 1), "address": "10.6.6.6:8081"}  # it names another address
        assert (await asyncio.to_thread(post, admin + "/v1/telemetry", record, tokens["pod-qwen-a"]))[0] == 200
        await asyncio.sleep(0.5)
        assert reg.eds_records("qwen2-7b-scoring", reg.clock()) == []
        # No other pod speaks for it, and a token bound to no pod is no sidecar at all.
        assert (
            await asyncio.to_thread(
                post, admin + "/v1/telemetry", telemetry("qwen-a", "1.1.1.1", 2), tokens["pod-stranger"]
            )
        )[0] == 401
        assert (
            await asyncio.to_thread(post, admin + "/v1/telemetry", telemetry("qwen-a", "1.1.1.1", 3), tokens["no-pod"])
        )[0] == 401

        fake.put("pods", running_pod(deployment, "qwen-a", "10.1.0.1"))
        await eventually(
            lambda: (
                [(r.instance_id, r.address) for r in reg.eds_records("qwen2-7b-scoring", reg.clock())]
                == [("qwen-a", "10.1.0.1:8081")]
            ),
            what="the ready pod in EDS, at its pod address",
        )

        # Deleting the ModelService removes the model.
        fake.delete("modelservices", NS, "qwen2-7b-scoring")
        await eventually(lambda: "qwen2-7b-scoring" not in reg.models, what="the model deleted")
    finally:
        await stop_k8s_rig(None, server, fake)
