"""A rollout on Kubernetes, against the FAKE API server (sie_testing.fake_apiserver): a changed image on a
ModelService goes through the same gated rollout as a standalone model. The new build runs as its own
Deployment (`<model>-g1`, its pods labelled with their generation), the ModelService status shows the
rollout (step, shares, gates, a `Rollout` condition with its reason, the printer column's summary), and
on success the old build's Deployment is deleted and the status records the serving build.

No kubelet runs here: the test plays it, putting Ready pods made from each Deployment's template, and
plays their sidecars, posting telemetry with the pods' service-account tokens.
"""

from __future__ import annotations

import asyncio
import copy

import pytest

from sie.auth import Signer
from sie.telemetry import InstanceState, TelemetryRecord
from sie_testing.fake_apiserver import FakeApiServer, role_rules
from tests.integration.test_k8s_controller import NS, eventually, running_pod, scorer
from tests.integration.test_xds_kubernetes import post_telemetry, stop_k8s_rig, stop_played_sidecar
from xds_server.main import XdsServer
from xds_server.settings import ControlLoopSettings, KubernetesSettings, Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

MODEL = "lr-fraud"


def model_service(image: str) -> dict:
    obj = copy.deepcopy(scorer())
    obj["metadata"] = {"name": MODEL, "namespace": NS, "generation": 1}
    obj["spec"]["model"]["image"] = image
    obj["spec"]["model"]["version"] = image.rsplit(":", 1)[1]
    obj["spec"]["rollout"] = {"steps": [50, 100], "hold_s": 0.5, "gates": {"min_requests": 5}}
    return obj


class PodSidecars:
    """Telemetry from each pod's sidecar every 0.2 s, with its own service-account token. A refused post is
    logged (pytest shows it with a failure) and the next one goes out as usual."""

    def __init__(self, admin: str):
        self.admin = admin
        self.pods: dict[str, tuple[str, str, str]] = {}  # name -> (ip, version, token)
        self._seq = 0
        self._task: asyncio.Task | None = None

    def add(self, name: str, ip: str, version: str, token: str) -> None:
        self.pods[name] = (ip, version, token)

    async def _run(self) -> None:
        while True:
            for name, (ip, version, token) in list(self.pods.items()):
                self._seq += 1
                record = TelemetryRecord(
                    instance_id=name,
                    model_id=MODEL,
                    version=version,
                    address=f"{ip}:8081",
                    node="gpu-1",
                    state=InstanceState.READY,
                    timestamp=float(self._seq),
                    seq=self._seq,
                    reporter=f"sidecar-{name}",
                    window_requests=200,
                    latency_p99_ms=4.0,
                    error_rate=0.0,
                    queue_time_ms=0.1,
                ).to_json()
                await post_telemetry(self.admin, record, token)
            await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            await stop_played_sidecar(self._task)


async def test_a_changed_image_rolls_out_as_a_second_deployment_with_status_conditions():
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
    sidecars: PodSidecars | None = None
    try:
        fake.put("modelservices", model_service("registry.internal/lr-fraud:1"))
        await server.start()
        await asyncio.wait_for(server.synced.wait(), 20)
        reg = server.registry
        sidecars = PodSidecars(f"http://127.0.0.1:{server.admin_port}")
        sidecars.start()

        old = await eventually(lambda: fake.get("deployments", NS, MODEL), what="the first build's Deployment")
        fake.put("pods", running_pod(old, "lr-fraud-a", "10.1.0.1"))
        token = fake.review_token("tok-a", f"system:serviceaccount:{NS}:default", pod="lr-fraud-a", node="gpu-1")
        sidecars.add("lr-fraud-a", "10.1.0.1", "1", token)
        await eventually(lambda: reg.ready_instances(MODEL, 0) == 1, what="the first build serving")

        # A new image: a rollout, not a rolling restart of the one Deployment.
        fake.put(
            "modelservices",
            {
                **model_service("registry.internal/lr-fraud:2"),
                "status": fake.get("modelservices", NS, MODEL).get("status"),
            },
        )
        new = await eventually(lambda: fake.get("deployments", NS, "lr-fraud-g1"), what="the new build's Deployment")
        assert new["spec"]["selector"]["matchLabels"]["sie.io/generation"] == "1"
        assert new["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.internal/lr-fraud:2"
        assert fake.get("deployments", NS, MODEL)["spec"]["template"]["spec"]["containers"][0]["image"] == (
            "registry.internal/lr-fraud:1"
        ), "the serving build's Deployment is left as it was"
        status = await eventually(
            lambda: (fake.get("modelservices", NS, MODEL).get("status") or {}).get("rollout"), what="rollout status"
        )
        assert status["phase"] == "progressing" and status["toVersion"] == "2"

        fake.put("pods", running_pod(new, "lr-fraud-g1-a", "10.1.0.2"))
        token = fake.review_token("tok-b", f"system:serviceaccount:{NS}:default", pod="lr-fraud-g1-a", node="gpu-1")
        sidecars.add("lr-fraud-g1-a", "10.1.0.2", "2", token)

        def split() -> dict | None:
            rollout = (fake.get("modelservices", NS, MODEL).get("status") or {}).get("rollout") or {}
            return rollout if rollout.get("share", {}).get("new") == 50 else None

        halfway = await eventually(split, timeout=20, what="step 1 (50%) in the status")
        assert halfway["summary"] == "50% step 1/2"
        conditions = {c["type"]: c for c in fake.get("modelservices", NS, MODEL)["status"]["conditions"]}
        assert conditions["Rollout"]["status"] == "True" and conditions["Rollout"]["reason"] == "Progressing"

        def done() -> dict | None:
            st = fake.get("modelservices", NS, MODEL).get("status") or {}
            return st if (st.get("rollout") or {}).get("phase") == "succeeded" else None

        final = await eventually(done, timeout=30, what="the rollout to succeed")
        conditions = {c["type"]: c for c in final["conditions"]}
        assert conditions["Rollout"]["reason"] == "Succeeded"
        assert final["build"]["generation"] == 1 and final["rollout"]["summary"] == "100% step 2/2 succeeded"
        await eventually(lambda: fake.get("deployments", NS, MODEL) is None, what="the old build's Deployment gone")
        assert reg.models[MODEL].service.spec.model.image == "registry.internal/lr-fraud:2"
        assert reg.models[MODEL].generation == 1
    finally:
        await stop_k8s_rig(sidecars, server, fake)


async def test_a_restarted_control_plane_resumes_the_rollout_from_the_modelservice_status():
    fake = FakeApiServer(bookmark_interval_s=0.1, rules=role_rules("sie-controller"))
    await fake.start()
    settings = Settings(
        admin_port=0,
        xds_port=0,
        listener_port=0,
        loop=ControlLoopSettings(startup_sync_s=0.2),
        kubernetes=KubernetesSettings(enabled=True, api_url=fake.url),
    )
    signer = Signer.generate()
    server = XdsServer(settings, signer=signer)
    sidecars: PodSidecars | None = None
    try:
        first = model_service("registry.internal/lr-fraud:1")
        first["spec"]["rollout"]["hold_s"] = 3.0
        fake.put("modelservices", first)
        await server.start()
        await asyncio.wait_for(server.synced.wait(), 20)
        sidecars = PodSidecars(f"http://127.0.0.1:{server.admin_port}")
        sidecars.start()
        old = await eventually(lambda: fake.get("deployments", NS, MODEL), what="the first build's Deployment")
        fake.put("pods", running_pod(old, "lr-fraud-a", "10.1.0.1"))
        sidecars.add(
            "lr-fraud-a",
            "10.1.0.1",
            "1",
            fake.review_token("tok-a", f"system:serviceaccount:{NS}:default", pod="lr-fraud-a", node="gpu-1"),
        )
        await eventually(lambda: server.registry.ready_instances(MODEL, 0) == 1, what="the first build serving")
        second = model_service("registry.internal/lr-fraud:2")
        second["spec"]["rollout"]["hold_s"] = 3.0
        fake.put("modelservices", {**second, "status": fake.get("modelservices", NS, MODEL).get("status")})
        new = await eventually(lambda: fake.get("deployments", NS, "lr-fraud-g1"), what="the new build's Deployment")
        fake.put("pods", running_pod(new, "lr-fraud-g1-a", "10.1.0.2"))
        sidecars.add(
            "lr-fraud-g1-a",
            "10.1.0.2",
            "2",
            fake.review_token("tok-b", f"system:serviceaccount:{NS}:default", pod="lr-fraud-g1-a", node="gpu-1"),
        )

        def live() -> dict | None:
            build = (fake.get("modelservices", NS, MODEL).get("status") or {}).get("build") or {}
            rollout = build.get("rollout") or {}
            return rollout if rollout.get("live") else None

        recorded = await eventually(live, timeout=20, what="step 1 live, recorded in status.build")
        uid = new["metadata"]["uid"]

        await sidecars.stop()
        await server.stop()
        server = XdsServer(settings, signer=signer)
        await server.start()
        await asyncio.wait_for(server.synced.wait(), 20)
        entry = await eventually(lambda: server.registry.models.get(MODEL), what="the model back from Kubernetes")
        assert entry.rollout is not None and entry.rolling, "the rollout came back from status.build"
        assert (entry.rollout.step, entry.rollout.step_since) == (recorded["step"] - 1, recorded["step_since"])
        assert entry.service.spec.model.image == "registry.internal/lr-fraud:1", "the old build still serves"
        sidecars = PodSidecars(f"http://127.0.0.1:{server.admin_port}")
        sidecars.pods = {
            "lr-fraud-a": (
                "10.1.0.1",
                "1",
                fake.review_token("tok-c", f"system:serviceaccount:{NS}:default", pod="lr-fraud-a", node="gpu-1"),
            ),
            "lr-fraud-g1-a": (
                "10.1.0.2",
                "2",
                fake.review_token("tok-d", f"system:serviceaccount:{NS}:default", pod="lr-fraud-g1-a", node="gpu-1"),
            ),
        }
        sidecars.start()

        def done() -> dict | None:
            st = fake.get("modelservices", NS, MODEL).get("status") or {}
            return st if (st.get("rollout") or {}).get("phase") == "succeeded" else None

        final = await eventually(done, timeout=30, what="the resumed rollout to succeed")
        events = [e["what"] for e in final["build"]["rollout"]["events"]]
        assert events == ["started", "step 1/2", "step 2/2", "succeeded"], events
        assert fake.get("deployments", NS, "lr-fraud-g1")["metadata"]["uid"] == uid, "no second canary"
    finally:
        await stop_k8s_rig(sidecars, server, fake)
