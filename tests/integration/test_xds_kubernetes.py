"""xds_server --kubernetes against the FAKE API server (xds_server.k8s.fake_apiserver): ModelServices
become models, node hosts are never asked to run them, and only pods Kubernetes reports ready (with a
serving sidecar) enter EDS."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import NodeHeartbeat
from tests.integration.test_k8s_controller import NS, eventually, qwen, running_pod
from xds_server.k8s.fake_apiserver import FakeApiServer
from xds_server.main import XdsServer
from xds_server.settings import Settings

pytestmark = pytest.mark.timeout(60)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def telemetry(pod: str, ip: str, seq: int) -> dict:
    return TelemetryRecord(instance_id=pod, model_id="qwen2-7b-scoring", version="1.2.0", address=f"{ip}:8081",
                           node="gpu-1", state=InstanceState.READY, timestamp=1.0 + seq, seq=seq).to_json()


async def test_model_services_and_ready_pods_drive_the_registry():
    fake = FakeApiServer(bookmark_interval_s=0.1)
    await fake.start()
    server = XdsServer(Settings(admin_port=0, xds_port=0, listener_port=0, startup_sync_s=0.2, kubernetes=True,
                                k8s_api_url=fake.url))
    try:
        fake.put("modelservices", {**qwen(), "metadata": {"name": "qwen2-7b-scoring", "namespace": NS, "generation": 1}})
        await server.start()
        await asyncio.wait_for(server.synced.wait(), 20)
        admin = f"http://127.0.0.1:{server.admin_port}"
        reg = server.registry
        await eventually(lambda: "qwen2-7b-scoring" in reg.models, what="the ModelService in the registry")
        assert reg.models["qwen2-7b-scoring"].source == "kubernetes"

        # The node host on that node is not asked to run it: its Deployment does.
        reply = await asyncio.to_thread(post, admin + "/v1/nodes/heartbeat",
                                        NodeHeartbeat(node="gpu-1", address="http://10.0.0.1:7070").to_json())
        assert reply["authoritative"] and reply["assignments"] == []

        # The pod's sidecar reports ready, but Kubernetes does not call the pod ready yet: not in EDS.
        deployment = await eventually(lambda: fake.get("deployments", NS, "qwen2-7b-scoring"), what="Deployment")
        fake.put("pods", running_pod(deployment, "qwen-a", "10.1.0.1", ready=False))
        await asyncio.to_thread(post, admin + "/v1/telemetry", telemetry("qwen-a", "10.1.0.1", 1))
        await asyncio.sleep(0.5)
        assert reg.eds_records("qwen2-7b-scoring", reg.clock()) == []

        fake.put("pods", running_pod(deployment, "qwen-a", "10.1.0.1"))
        await eventually(lambda: [r.instance_id for r in reg.eds_records("qwen2-7b-scoring", reg.clock())] == ["qwen-a"],
                         what="the ready pod in EDS")

        # Deleting the ModelService removes the model.
        fake.delete("modelservices", NS, "qwen2-7b-scoring")
        await eventually(lambda: "qwen2-7b-scoring" not in reg.models, what="the model deleted")
    finally:
        await server.stop()
        await fake.stop()
