"""Autoscaling on Kubernetes, against the FAKE API server (sie_testing.fake_apiserver, serving the CRD's
subresources as manifests/base/crd.yaml declares them): SIE's autoscaler sets the Deployment's replicas
and the ModelService status says who decided, what, why and how many pods are ready; `kubectl scale`
(a merge patch of the scale subresource, what kubectl, an HPA and KEDA send) sets `spec.replicas`, which
hands the count to that external scaler; removing `spec.replicas` hands it back.

No kubelet runs here: the test plays it (a Ready pod made from the Deployment's template) and plays the
pod's sidecar, posting telemetry with the pod's service-account token and the demand it reports.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from sie.auth import Signer
from sie.telemetry import InstanceState, TelemetryRecord
from sie_testing.fake_apiserver import ADMIN_TOKEN, FakeApiServer, role_rules
from sie_testing.polling import eventually
from tests.integration.test_k8s_controller import NS, running_pod
from tests.integration.test_xds_kubernetes import post_telemetry, stop_k8s_rig, stop_played_sidecar
from xds_server.main import XdsServer
from xds_server.settings import ControlLoopSettings, KubernetesSettings, Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

MODEL = "chat"
MS = f"/apis/sie.io/v1alpha1/namespaces/{NS}/modelservices/{MODEL}"
MERGE = {"Content-Type": "application/merge-patch+json"}
SELECTOR = f"app.kubernetes.io/managed-by=sie-controller,sie.io/model-id={MODEL}"


def demand_in(reason: str) -> float:
    """The demand figure an autoscaler reason gives ("up: demand 1.3 over 6 s > ...")."""
    found = re.search(r"demand (\d+(?:\.\d+)?)", reason)
    assert found, f"no demand figure in the reason {reason!r}"
    return float(found.group(1))


def model_service() -> dict:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": MODEL, "namespace": NS, "generation": 1},
        "spec": {
            "model": {"name": MODEL, "version": "1", "image": "registry.internal/sie-sim:1", "service_type": "llm"},
            "backend": {"type": "sim"},
            "resources": {"max_concurrent_requests": 8},
            "sla": {"min_replicas": 1, "max_replicas": 3, "p99_latency_ms": 5000},
            # One request in flight per instance is the target: a pod reporting 2 asks for 2 instances.
            "autoscale": {"target_concurrency": 1},
        },
    }


class Sidecar:
    """One pod's sidecar: telemetry every 0.2 s with `in_flight` requests, under the pod's own token."""

    def __init__(self, admin: str, pod: str, ip: str, token: str, in_flight: int):
        self.admin, self.pod, self.ip, self.token, self.in_flight = admin, pod, ip, token, in_flight
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        seq = 0
        while True:
            seq += 1
            record = TelemetryRecord(
                instance_id=self.pod,
                model_id=MODEL,
                version="1",
                address=f"{self.ip}:8081",
                node="gpu-1",
                state=InstanceState.READY,
                timestamp=float(seq),
                seq=seq,
                reporter=f"sidecar-{self.pod}",
                in_flight=self.in_flight,
                max_concurrent=8,
                window_requests=100,
                latency_p99_ms=40.0,
                queue_time_ms=0.1,
            ).to_json()
            await post_telemetry(self.admin, record, self.token)
            await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"sidecar-{self.pod}")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_played_sidecar(self._task)


async def test_the_status_shows_the_autoscalers_decision_and_kubectl_scale_hands_the_count_over():
    fake = FakeApiServer(bookmark_interval_s=0.1, rules=role_rules("sie-controller"))
    await fake.start()
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
    sidecar: Sidecar | None = None

    def status() -> dict:
        return (fake.get("modelservices", NS, MODEL) or {}).get("status") or {}

    def status_writes() -> int:
        return sum(1 for method, path in fake.requests if method == "PATCH" and path.startswith(f"{MS}/status"))

    def deployment_replicas() -> int | None:
        deployment = fake.get("deployments", NS, MODEL)
        return deployment["spec"]["replicas"] if deployment else None

    try:
        fake.put("modelservices", model_service())
        await server.start()
        await asyncio.wait_for(server.synced.wait(), 20)
        deployment = await eventually(lambda: fake.get("deployments", NS, MODEL), 20, "the model's Deployment")
        assert deployment["spec"]["replicas"] == 1, "sla.min_replicas before any demand"

        fake.put("pods", running_pod(deployment, "chat-a", "10.1.0.1"))
        token = fake.review_token("tok-a", f"system:serviceaccount:{NS}:default", pod="chat-a", node="gpu-1")
        sidecar = Sidecar(f"http://127.0.0.1:{server.admin_port}", "chat-a", "10.1.0.1", token, in_flight=2)
        sidecar.start()

        # SIE's autoscaler: demand 2 at target 1 asks for 2; the Deployment and the status follow it.
        scaled = await eventually(
            lambda: (a := status().get("autoscale")) and a.get("by") == "sie" and a.get("desired") == 2 and a,
            30,
            "the autoscaler's decision (2) in status.autoscale",
        )
        # The reason names the demand that moved it: a mean over the stable window, which still holds some
        # of the quiet before the sidecar reported, so it lies between the band's top (1 x 1 x 1.1) and 2.
        assert 1.1 < demand_in(scaled["reason"]) <= 2.0 and scaled["reason"].startswith("up: "), scaled
        await eventually(lambda: deployment_replicas() == 2, 10, "the Deployment at the autoscaler's 2")
        current = await eventually(
            lambda: status().get("autoscale", {}).get("current") == 1 and status(), 10, "current"
        )
        assert current["replicas"] == 2 and current["selector"] == SELECTOR

        # The test plays kubectl, as a cluster admin; the control plane is held to its own RBAC.
        async with aiohttp.ClientSession(fake.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as session:
            # `kubectl scale modelservice/chat --replicas 3`: a merge patch of the scale subresource.
            async with session.patch(f"{MS}/scale", data=json.dumps({"spec": {"replicas": 3}}), headers=MERGE) as resp:
                assert resp.status == 200, await resp.text()
            assert fake.get("modelservices", NS, MODEL)["spec"]["replicas"] == 3
            await eventually(lambda: deployment_replicas() == 3, 20, "the Deployment at kubectl scale's 3")
            handed = await eventually(
                lambda: (a := status().get("autoscale")) and a.get("by") == "spec.replicas" and a,
                20,
                "status.autoscale naming the external scaler",
            )
            assert handed["desired"] == 3 and handed["reason"].startswith("an external scaler owns the count"), handed
            await eventually(lambda: MODEL not in server.autoscaler.states, 5, "SIE's autoscaler to stand aside")
            assert "recommended" not in handed, "nothing of SIE's last decision lingers in the status"
            # The status settles: written when it changes, not again and again.
            await asyncio.sleep(0.5)
            before = status_writes()
            await asyncio.sleep(1.0)
            assert status_writes() - before <= 10, "the controller rewrites an unchanged status"

            # What an HPA reads back: the count it set, the count the status reports, the pods' selector.
            await eventually(lambda: status().get("replicas") == 3, 10, "status.replicas 3")
            async with session.get(f"{MS}/scale") as resp:
                scale = await resp.json()
            assert resp.status == 200 and scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
            assert scale["spec"]["replicas"] == 3 and scale["status"] == {"replicas": 3, "selector": SELECTOR}

            # A count past sla.max_replicas makes the spec invalid (the API server accepts it: the bound is
            # the model's, not the CRD's): the status says so, the Deployment and the routes keep the last
            # valid count.
            async with session.patch(f"{MS}/scale", data=json.dumps({"spec": {"replicas": 5}}), headers=MERGE) as resp:
                assert resp.status == 200, await resp.text()
            invalid = await eventually(lambda: status().get("phase") == "Invalid" and status(), 10, "phase Invalid")
            valid = {c["type"]: c for c in invalid["conditions"]}["Valid"]
            assert valid["reason"] == "SpecInvalid" and "replicas (5) must lie within" in valid["message"]
            await asyncio.sleep(0.5)
            assert deployment_replicas() == 3 and server.registry.models[MODEL].replicas == 3

            # Removing spec.replicas hands the count back: SIE's autoscaler decides again from the demand.
            async with session.patch(MS, data=json.dumps({"spec": {"replicas": None}}), headers=MERGE) as resp:
                assert resp.status == 200, await resp.text()
            back = await eventually(
                lambda: (a := status().get("autoscale")) and a.get("by") == "sie" and a.get("desired") == 2 and a,
                30,
                "SIE's autoscaler back at 2",
            )
            assert 1.1 < demand_in(back["reason"]) <= 2.0, back
            await eventually(lambda: deployment_replicas() == 2, 20, "the Deployment back at the autoscaler's 2")
            # With no spec.replicas the scale subresource has nothing to read (as on the real API server).
            async with session.get(f"{MS}/scale") as resp:
                assert resp.status == 500
    finally:
        await stop_k8s_rig(sidecar, server, fake)
