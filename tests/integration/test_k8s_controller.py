"""The controller's watch loop against the FAKE API server (sie_testing.fake_apiserver), through the
official kubernetes client: ModelService -> Deployment, status, pods -> endpoints, and recovery from
410 Gone without dropping endpoints that are still there."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonpatch
import kubernetes
import pytest
import yaml

from sidecar.injection import InjectorSettings, decide
from sie.spec_loader import parse_model_service
from sie_testing.fake_apiserver import ADMIN_TOKEN, FakeApiServer, role_rules
from xds_server.k8s import Controller, ControllerSettings, EndpointsChanged, ModelsChanged, QueueSink
from xds_server.k8s.deployments import DeploymentSettings, desired_deployment

ROOT = Path(__file__).resolve().parents[2]
NS = "models"
pytestmark = pytest.mark.timeout(60)


def qwen() -> dict:
    return yaml.safe_load((ROOT / "examples" / "qwen2-7b-scoring.yaml").read_text())


def scorer() -> dict:
    return {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": "lr-fraud"},
        "spec": {
            "model": {
                "name": "lr-fraud",
                "image": "registry.internal/lr-fraud:1",
                "service_type": "scoring",
                "priority_level": "P0",
            },
            "backend": {"type": "sklearn"},
            "sla": {"p99_latency_ms": 10, "min_replicas": 1},
        },
    }


class Recorder(QueueSink):
    """Keeps every change it was given, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[ModelsChanged | EndpointsChanged] = []

    async def models_changed(self, models, records=None):
        self.log.append(ModelsChanged(dict(models)))

    async def endpoints_changed(self, model_id, endpoints):
        self.log.append(EndpointsChanged(model_id, endpoints))

    def endpoints(self, model_id: str) -> list[tuple[str, ...]]:
        return [
            tuple(e.instance_id for e in c.endpoints)
            for c in self.log
            if isinstance(c, EndpointsChanged) and c.model_id == model_id
        ]


async def eventually(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def fake():
    # Held to the controller's RBAC (manifests/base/rbac.yaml): a verb it uses but is not granted is a 403.
    server = FakeApiServer(bookmark_interval_s=0.1, rules=role_rules("sie-controller"))
    await server.start()
    yield server
    await server.stop()
    assert server.denied == [], "the controller used verbs its RBAC does not grant"


@pytest.fixture
def api(fake):
    """The controller's client: what its service account may do."""
    config = kubernetes.client.Configuration()
    config.host = fake.url
    with kubernetes.client.ApiClient(config) as client:
        yield client


@pytest.fixture
def admin(fake):
    """The test's own client, as a cluster admin with kubectl: it creates and edits ModelServices."""
    config = kubernetes.client.Configuration()
    config.host = fake.url
    config.api_key = {"authorization": ADMIN_TOKEN}
    config.api_key_prefix = {"authorization": "Bearer"}
    with kubernetes.client.ApiClient(config) as client:
        yield client


@pytest.fixture
async def running(api):
    started: list[Controller] = []

    async def start(**overrides) -> tuple[Controller, Recorder]:
        sink = Recorder()
        settings = ControllerSettings(
            watch_timeout_s=overrides.pop("watch_timeout_s", 30),
            request_timeout_s=5,
            resync_s=3600,
            retry_s=0.1,
            **overrides,
        )
        controller = Controller(api, sink, settings)
        await controller.start()
        started.append(controller)
        await asyncio.wait_for(controller.wait_synced(), 10)
        return controller, sink

    yield start
    for controller in started:
        await controller.stop()


async def create_model_service(api, doc: dict) -> dict:
    # The client blocks; the fake server runs on this event loop, so the call goes to a thread.
    custom = kubernetes.client.CustomObjectsApi(api)
    return await asyncio.to_thread(
        custom.create_namespaced_custom_object, "sie.io", "v1alpha1", NS, "modelservices", doc
    )


async def patch_spec(api, name: str, spec: dict) -> dict:
    custom = kubernetes.client.CustomObjectsApi(api)
    return await asyncio.to_thread(
        custom.patch_namespaced_custom_object,
        "sie.io",
        "v1alpha1",
        NS,
        "modelservices",
        name,
        {"spec": spec},
        _content_type="application/merge-patch+json",
    )


def running_pod(deployment: dict, name: str, ip: str, ready: bool = True) -> dict:
    """The pod the ReplicaSet controller, the injection webhook and the kubelet would make together."""
    template = copy.deepcopy(deployment["spec"]["template"])
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": deployment["metadata"]["namespace"], **template["metadata"]},
        "spec": template["spec"],
    }
    decision = decide(pod, InjectorSettings())
    assert decision.allowed and decision.patch, decision.message
    pod = jsonpatch.apply_patch(pod, list(decision.patch))
    pod["spec"]["nodeName"] = "gpu-1"
    pod["status"] = {
        "phase": "Running",
        "podIP": ip,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    return pod


async def test_model_service_becomes_a_deployment_with_status_and_endpoints(fake, admin, running):
    await create_model_service(admin, qwen())
    controller, sink = await running()

    deployment = await eventually(lambda: fake.get("deployments", NS, "qwen2-7b-scoring"), what="the Deployment")
    assert deployment["spec"]["replicas"] == 2
    # Its pods are fenced before they exist: the NetworkPolicy was created first, owned by the ModelService.
    policy = fake.get("networkpolicies", NS, "qwen2-7b-scoring-sie")
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["metadata"]["ownerReferences"][0]["kind"] == "ModelService"
    assert policy["metadata"]["creationTimestamp"] <= deployment["metadata"]["creationTimestamp"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["sie.io/p99-latency-ms"] == "350" and annotations["sie.io/inject"] == "true"
    status = await eventually(lambda: (fake.get("modelservices", NS, "qwen2-7b-scoring") or {}).get("status"))
    assert (status["phase"], status["replicas"], status["readyReplicas"]) == ("Pending", 2, 0)

    await eventually(lambda: sink.endpoints("qwen2-7b-scoring") == [()], what="empty endpoints announced")
    assert isinstance(sink.log[0], ModelsChanged) and set(sink.log[0].models) == {"qwen2-7b-scoring"}

    fake.put("pods", running_pod(deployment, "qwen-a", "10.1.0.1"))
    fake.put("pods", running_pod(deployment, "qwen-b", "10.1.0.2", ready=False))
    await eventually(lambda: sink.endpoints("qwen2-7b-scoring")[-1] == ("qwen-a",), what="qwen-a")
    await eventually(lambda: fake.get("modelservices", NS, "qwen2-7b-scoring")["status"]["readyReplicas"] == 1)
    assert fake.get("modelservices", NS, "qwen2-7b-scoring")["status"]["phase"] == "Progressing"

    # qwen-b turns ready and the Deployment reports the rollout complete: the model is Ready.
    fake.put("pods", running_pod(deployment, "qwen-b", "10.1.0.2"))
    stored = fake.get("deployments", NS, "qwen2-7b-scoring")
    stored["status"] = {
        "observedGeneration": stored["metadata"]["generation"],
        "replicas": 2,
        "updatedReplicas": 2,
        "readyReplicas": 2,
    }
    fake.put("deployments", stored)
    await eventually(lambda: fake.get("modelservices", NS, "qwen2-7b-scoring")["status"]["phase"] == "Ready")
    changes = [c for c in sink.log if isinstance(c, EndpointsChanged)]
    assert [e.address for e in changes[-1].endpoints] == ["10.1.0.1:8081", "10.1.0.2:8081"]
    status = fake.get("modelservices", NS, "qwen2-7b-scoring")["status"]
    assert {c["type"]: c["reason"] for c in status["conditions"]} == {
        "Valid": "SpecValid",
        "Deployed": "DeploymentUpToDate",
        "Ready": "ReplicasReady",
    }

    # Our own status writes are not model changes: the models were announced once.
    assert sum(isinstance(c, ModelsChanged) for c in sink.log) == 1

    # An edit of the spec rolls out through the Deployment, and the control plane hears of it.
    await patch_spec(admin, "qwen2-7b-scoring", {"replicas": 3})
    await eventually(lambda: fake.get("deployments", NS, "qwen2-7b-scoring")["spec"]["replicas"] == 3)
    await eventually(
        lambda: isinstance(sink.log[-1], ModelsChanged) and sink.log[-1].models["qwen2-7b-scoring"].spec.replicas == 3,
        what="the edited model",
    )

    # A broken edit is reported, and the Deployment keeps serving the last good spec.
    await patch_spec(admin, "qwen2-7b-scoring", {"replicas": 9})
    status = await eventually(
        lambda: (s := fake.get("modelservices", NS, "qwen2-7b-scoring")["status"])["phase"] == "Invalid" and s
    )
    assert "replicas (9) must lie within" in status["conditions"][0]["message"]
    assert fake.get("deployments", NS, "qwen2-7b-scoring")["spec"]["replicas"] == 3
    # ... and the control plane keeps that spec too: a bad edit must not take the model out of EDS.
    assert controller.current_models()["qwen2-7b-scoring"][1].spec.replicas == 3
    last = [c for c in sink.log if isinstance(c, ModelsChanged)][-1]
    assert last.models["qwen2-7b-scoring"].spec.replicas == 3


async def test_a_refused_delete_is_reported_in_the_status_which_keeps_updating(fake, admin, running):
    """A write the API server refuses (here the RBAC before delete was granted on Deployments) does not
    stop the status: it says what failed, the rest of it is kept current, and the reconcile is retried,
    more slowly each time, until the write succeeds."""
    fake.rules = [
        {**rule, "verbs": [v for v in rule["verbs"] if v != "delete"]} for rule in role_rules("sie-controller")
    ]
    created = await create_model_service(admin, scorer())
    # A build no build wants any more (the old one after a promotion, say), owned by the ModelService.
    retired = desired_deployment(created, parse_model_service(created), DeploymentSettings(), 1, 1)
    fake.put("deployments", retired)
    controller, sink = await running(retry_max_s=0.4)

    def refused() -> dict | None:
        status = (fake.get("modelservices", NS, "lr-fraud") or {}).get("status") or {}
        return {c["type"]: c for c in status.get("conditions") or []}.get("Applied") and status

    status = await eventually(refused, what="the refusal in the status")
    applied = {c["type"]: c for c in status["conditions"]}["Applied"]
    assert (applied["status"], applied["reason"]) == ("False", "WriteFailed")
    assert applied["message"].startswith("delete Deployment lr-fraud-g1: HTTP 403 Forbidden")
    assert "rbac.yaml" in applied["message"]  # how to fix it
    assert fake.get("deployments", NS, "lr-fraud") is not None, "the serving build was made all the same"
    assert fake.get("deployments", NS, "lr-fraud-g1") is not None
    assert ("delete", "apps", "deployments", "lr-fraud-g1") in fake.denied

    # The status keeps following the pods while the delete is refused.
    fake.put("pods", running_pod(fake.get("deployments", NS, "lr-fraud"), "lr-a", "10.2.0.1"))

    def settled() -> bool:
        # The pod counted, and a reconcile since the one that created the Deployment (whose condition
        # then says DeploymentUpToDate, not DeploymentCreated: one more status write, which on a loaded
        # machine came after the pod was counted and inside the window below).
        status = fake.get("modelservices", NS, "lr-fraud")["status"]
        deployed = {c["type"]: c for c in status.get("conditions") or []}.get("Deployed") or {}
        return status["readyReplicas"] == 1 and deployed.get("reason") == "DeploymentUpToDate"

    await eventually(settled, what="the status following the pod")
    # Retried, backing off (0.1 s doubled up to 0.4 s: at most 6 tries in 1.5 s, 15 without), and the same
    # refusal is not written again and again.
    version = fake.get("modelservices", NS, "lr-fraud")["metadata"]["resourceVersion"]
    tries = len(fake.denied)
    await asyncio.sleep(1.5)
    assert 1 <= len(fake.denied) - tries <= 6, fake.denied
    assert fake.get("modelservices", NS, "lr-fraud")["metadata"]["resourceVersion"] == version

    # Granted: the next try deletes it and the condition goes.
    fake.rules = role_rules("sie-controller")
    await eventually(lambda: fake.get("deployments", NS, "lr-fraud-g1") is None, what="the retired build deleted")
    await eventually(lambda: not refused(), what="the Applied condition gone")
    assert fake.get("deployments", NS, "lr-fraud") is not None
    fake.denied.clear()


async def test_relist_after_410_keeps_endpoints_still_there_and_drops_removed_ones(fake, admin, running):
    await create_model_service(admin, qwen())
    await create_model_service(admin, scorer())
    controller, sink = await running()
    qwen_dep = await eventually(lambda: fake.get("deployments", NS, "qwen2-7b-scoring"))
    lr_dep = await eventually(lambda: fake.get("deployments", NS, "lr-fraud"))
    for name, ip in (("qwen-a", "10.1.0.1"), ("qwen-b", "10.1.0.2"), ("qwen-c", "10.1.0.3")):
        fake.put("pods", running_pod(qwen_dep, name, ip))
    fake.put("pods", running_pod(lr_dep, "lr-a", "10.2.0.1"))
    await eventually(lambda: sink.endpoints("qwen2-7b-scoring")[-1:] == [("qwen-a", "qwen-b", "qwen-c")])
    await eventually(lambda: sink.endpoints("lr-fraud")[-1:] == [("lr-a",)])
    seen = len(sink.log)
    lists_before = controller.pods.lists

    # While the controller cannot reach the API server, qwen-c goes away, qwen-d comes, and the
    # server compacts its history: the watch resumes into 410 Gone and the controller lists again.
    async with fake.unreachable():
        fake.delete("pods", NS, "qwen-c")
        fake.put("pods", running_pod(qwen_dep, "qwen-d", "10.1.0.4"))
        fake.compact()
        await asyncio.sleep(0.3)
    assert sink.log[seen:] == []  # nothing was dropped while the server was out of reach

    await eventually(lambda: controller.pods.lists == lists_before + 1, what="a relist")
    await eventually(lambda: sink.endpoints("qwen2-7b-scoring")[-1] == ("qwen-a", "qwen-b", "qwen-d"))
    await asyncio.sleep(0.3)
    after = sink.log[seen:]
    # exactly one change for qwen (a and b never left), none for the scorer, no model churn
    assert [type(c).__name__ for c in after] == ["EndpointsChanged"], after
    assert sink.endpoints("lr-fraud")[-1] == ("lr-a",)


async def test_410_error_event_relists_without_any_change_downstream(fake, admin, running):
    await create_model_service(admin, scorer())
    controller, sink = await running()
    lr_dep = await eventually(lambda: fake.get("deployments", NS, "lr-fraud"))
    fake.put("pods", running_pod(lr_dep, "lr-a", "10.2.0.1"))
    await eventually(lambda: sink.endpoints("lr-fraud")[-1:] == [("lr-a",)])
    seen, lists = len(sink.log), (controller.services.lists, controller.deployments.lists, controller.pods.lists)

    fake.expire_watches()  # every open watch gets an ERROR event with a 410 Status
    await eventually(
        lambda: (
            (controller.services.lists, controller.deployments.lists, controller.pods.lists)
            == tuple(n + 1 for n in lists)
        ),
        what="all three informers relisted",
    )
    await asyncio.sleep(0.3)
    assert sink.log[seen:] == []


async def test_watch_resumes_from_bookmarks_without_relisting(fake, api, running):
    controller, sink = await running(watch_timeout_s=1)
    listed_at = int(controller.pods.resource_version)
    # Other objects change; the pods watch sees none of them, only bookmarks that move its version on.
    for i in range(3):
        fake.put(
            "deployments",
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": f"other-{i}", "namespace": NS},
                "spec": {},
            },
        )
    await eventually(lambda: int(controller.pods.resource_version) > listed_at, what="a bookmark")
    # The server ends each watch after timeoutSeconds=1; the informer resumes, it does not list again.
    await asyncio.sleep(2.5)
    assert controller.pods.lists == 1
    watched_from = [
        int(parse_qs(urlsplit(q).query)["resourceVersion"][0])
        for _, q in fake.requests
        if urlsplit(q).path == "/api/v1/pods" and "watch=true" in q
    ]
    assert len(watched_from) >= 2 and max(watched_from) > listed_at, watched_from


async def test_controller_process_reconciles_prints_changes_and_stops_on_sigterm(fake):
    """`python -m xds_server.k8s --api-url <fake>` as a real process."""
    import json
    import subprocess
    import sys

    fake.put("modelservices", {**scorer(), "metadata": {"name": "lr-fraud", "namespace": NS, "generation": 1}})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "xds_server.k8s",
        "--api-url",
        fake.url,
        "--watch-timeout-s",
        "5",
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert first == {"models": ["lr-fraud"]}
        deployment = await eventually(lambda: fake.get("deployments", NS, "lr-fraud"), what="the Deployment")
        fake.put("pods", running_pod(deployment, "lr-a", "10.2.0.1"))
        while True:
            line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
            if line.get("endpoints"):
                break
        assert line == {
            "model_id": "lr-fraud",
            "endpoints": [{"instance_id": "lr-a", "address": "10.2.0.1:8081", "node": "gpu-1"}],
        }
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert fake.open_watches == 0 or await eventually(lambda: fake.open_watches == 0, what="watches closed")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
