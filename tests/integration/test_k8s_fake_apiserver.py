"""The FAKE API server keeps the parts of the Kubernetes API protocol the controller relies on; if it
drifted, the controller tests would prove nothing."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from sie_testing.fake_apiserver import ADMIN_TOKEN, FakeApiServer

pytestmark = pytest.mark.timeout(30)
PODS = "/api/v1/namespaces/models/pods"
MS = "/apis/sie.io/v1alpha1/namespaces/models/modelservices"


def pod(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": {"containers": []}}


@pytest.fixture
async def api():
    fake = FakeApiServer(bookmark_interval_s=0.05)
    await fake.start()
    async with aiohttp.ClientSession(fake.url) as session:
        yield fake, session
    await fake.stop()


async def events(session: aiohttp.ClientSession, path: str, count: int, **query: str) -> list[dict]:
    out = []
    async with session.get(path, params={"watch": "true", **query}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            out.append(json.loads(line))
            if len(out) == count:
                break
    return out


async def test_list_then_watch_from_its_resource_version_sees_only_later_changes(api):
    fake, session = api
    await session.post(PODS, json=pod("a", app="x"))
    async with session.get(PODS) as resp:
        listed = await resp.json()
    assert listed["kind"] == "PodList" and [p["metadata"]["name"] for p in listed["items"]] == ["a"]
    await session.post(PODS, json=pod("b", app="x"))
    await session.delete(f"{PODS}/a")
    got = await events(session, PODS, 2, resourceVersion=listed["metadata"]["resourceVersion"])
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in got] == [("ADDED", "b"), ("DELETED", "a")]
    assert int(got[1]["object"]["metadata"]["resourceVersion"]) > int(got[0]["object"]["metadata"]["resourceVersion"])


async def test_watch_without_version_starts_with_the_current_objects_and_honours_selectors(api):
    fake, session = api
    await session.post(PODS, json=pod("a", app="x"))
    await session.post(PODS, json=pod("b", app="y"))
    got = await events(session, PODS, 1, labelSelector="app=y")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in got] == [("ADDED", "b")]


async def test_bookmarks_carry_the_current_version(api):
    fake, session = api
    await session.post(
        MS, json={"apiVersion": "sie.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "m"}, "spec": {}}
    )
    async with session.get(PODS) as resp:
        version = (await resp.json())["metadata"]["resourceVersion"]
    (bookmark,) = await events(session, PODS, 1, resourceVersion=version, allowWatchBookmarks="true")
    assert bookmark["type"] == "BOOKMARK" and bookmark["object"]["metadata"]["resourceVersion"] == version


async def test_too_old_version_is_an_error_event_with_410(api):
    fake, session = api
    async with session.get(PODS) as resp:
        version = (await resp.json())["metadata"]["resourceVersion"]
    await session.post(PODS, json=pod("a"))
    fake.compact()
    (error,) = await events(session, PODS, 1, resourceVersion=version)
    assert error["type"] == "ERROR" and error["object"]["code"] == 410 and error["object"]["reason"] == "Expired"


async def test_expire_ends_open_watches_with_410(api):
    fake, session = api
    async with session.get(PODS) as resp:
        version = (await resp.json())["metadata"]["resourceVersion"]
    watch = asyncio.create_task(events(session, PODS, 1, resourceVersion=version))
    while fake.open_watches == 0:
        await asyncio.sleep(0.01)
    fake.expire_watches()
    (error,) = await watch
    assert error["object"]["code"] == 410


async def test_writes_conflicts_patch_types_and_the_status_subresource(api):
    fake, session = api
    async with session.post(
        MS,
        json={
            "apiVersion": "sie.io/v1alpha1",
            "kind": "ModelService",
            "metadata": {"name": "m"},
            "spec": {"a": 1},
            "status": {"phase": "Ready"},
        },
    ) as resp:
        created = await resp.json()
    assert resp.status == 201 and "status" not in created and created["metadata"]["generation"] == 1
    async with session.post(MS, json=created) as resp:
        assert resp.status == 409 and (await resp.json())["reason"] == "AlreadyExists"
    stale = {**created, "metadata": {**created["metadata"], "resourceVersion": "1"}}
    async with session.put(f"{MS}/m", json=stale) as resp:
        assert resp.status == 409 and (await resp.json())["reason"] == "Conflict"
    merge = {"Content-Type": "application/merge-patch+json"}
    async with session.patch(
        f"{MS}/m", data=json.dumps({"spec": {"b": 2}, "status": {"phase": "X"}}), headers=merge
    ) as resp:
        patched = await resp.json()
    assert patched["spec"] == {"a": 1, "b": 2} and "status" not in patched and patched["metadata"]["generation"] == 2
    async with session.patch(
        f"{MS}/m/status", data=json.dumps({"spec": {"c": 3}, "status": {"phase": "Ready"}}), headers=merge
    ) as resp:
        patched = await resp.json()
    assert (
        patched["status"] == {"phase": "Ready"}
        and patched["spec"] == {"a": 1, "b": 2}
        and patched["metadata"]["generation"] == 2
    )
    async with session.patch(
        f"{MS}/m", data="{}", headers={"Content-Type": "application/strategic-merge-patch+json"}
    ) as resp:
        assert resp.status == 415
    async with session.get(f"{MS}/nope") as resp:
        assert resp.status == 404 and (await resp.json())["kind"] == "Status"


async def test_the_scale_subresource_reads_and_writes_the_paths_the_crd_declares(api):
    fake, session = api
    merge = {"Content-Type": "application/merge-patch+json"}
    async with session.post(
        MS, json={"apiVersion": "sie.io/v1alpha1", "kind": "ModelService", "metadata": {"name": "m"}, "spec": {}}
    ) as resp:
        created = await resp.json()
    # No value at specReplicasPath: GET is an error, as on the real server; a write that sets it is not.
    async with session.get(f"{MS}/m/scale") as resp:
        assert resp.status == 500 and (await resp.json())["reason"] == "InternalError"
    async with session.patch(
        f"{MS}/m/scale", data=json.dumps({"metadata": {"labels": {"a": "b"}}}), headers=merge
    ) as resp:
        assert resp.status == 400 and "cannot be empty" in (await resp.json())["message"]
    fake.put(
        "modelservices",
        {**fake.get("modelservices", "models", "m"), "status": {"replicas": 1, "selector": "sie.io/model-id=m"}},
    )
    version = fake.get("modelservices", "models", "m")["metadata"]["resourceVersion"]
    watch = asyncio.create_task(events(session, MS, 1, resourceVersion=version))
    async with session.patch(f"{MS}/m/scale", data=json.dumps({"spec": {"replicas": 2}}), headers=merge) as resp:
        scale = await resp.json()
    assert resp.status == 200
    assert (scale["apiVersion"], scale["kind"], scale["spec"], scale["status"]) == (
        "autoscaling/v1",
        "Scale",
        {"replicas": 2},
        {"replicas": 1, "selector": "sie.io/model-id=m"},
    )
    stored = fake.get("modelservices", "models", "m")
    assert (
        stored["spec"] == {"replicas": 2} and stored["metadata"]["generation"] == created["metadata"]["generation"] + 1
    )
    assert scale["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"] != version
    (event,) = await watch
    assert event["type"] == "MODIFIED" and event["object"]["spec"]["replicas"] == 2
    # PUT: a stale resourceVersion is a conflict; none (or the current one) writes.
    async with session.put(
        f"{MS}/m/scale", json={**scale, "metadata": {**scale["metadata"], "resourceVersion": version}}
    ) as resp:
        assert resp.status == 409 and (await resp.json())["reason"] == "Conflict"
    async with session.put(f"{MS}/m/scale", json={**scale, "spec": {"replicas": 3}}) as resp:
        assert resp.status == 200 and (await resp.json())["spec"]["replicas"] == 3
    async with session.put(f"{MS}/m/scale", json={"spec": {"replicas": -1}}) as resp:
        assert resp.status == 422
    async with session.get(f"{MS}/m/scale") as resp:
        got = await resp.json()
    assert got["spec"]["replicas"] == 3 and got["metadata"]["name"] == "m" and got["metadata"]["namespace"] == "models"
    assert fake.get("modelservices", "models", "m")["status"] == {"replicas": 1, "selector": "sie.io/model-id=m"}
    async with session.get(f"{MS}/m/other") as resp:
        assert resp.status == 404


async def test_deployments_have_a_scale_subresource_and_a_crd_without_one_has_none():
    fake = FakeApiServer(crds=())
    await fake.start()
    try:
        fake.put(
            "deployments",
            {
                "metadata": {"name": "d", "namespace": "models", "generation": 1},
                "spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}}},
                "status": {"replicas": 1},
            },
        )
        fake.put("modelservices", {"metadata": {"name": "m", "namespace": "models"}, "spec": {"replicas": 1}})
        async with aiohttp.ClientSession(fake.url) as session:
            path = "/apis/apps/v1/namespaces/models/deployments/d/scale"
            async with session.get(path) as resp:
                scale = await resp.json()
            assert scale["spec"] == {"replicas": 1} and scale["status"] == {"replicas": 1, "selector": "a=1,b=2"}
            async with session.patch(
                path,
                data=json.dumps({"spec": {"replicas": 4}}),
                headers={"Content-Type": "application/merge-patch+json"},
            ) as resp:
                assert resp.status == 200
            assert fake.get("deployments", "models", "d")["spec"]["replicas"] == 4
            async with session.get(f"{MS}/m/scale") as resp:
                assert resp.status == 404
    finally:
        await fake.stop()


async def test_given_rules_it_refuses_what_rbac_would_and_an_admin_may_do_anything():
    fake = FakeApiServer(
        rules=[
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["list", "watch", "create", "patch"]},
            {"apiGroups": ["sie.io"], "resources": ["modelservices/status"], "verbs": ["patch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["mine"], "verbs": ["get"]},
        ]
    )
    await fake.start()
    deployments = "/apis/apps/v1/namespaces/models/deployments"
    merge = {"Content-Type": "application/merge-patch+json"}
    try:
        fake.put("deployments", {"metadata": {"name": "d", "namespace": "models"}, "spec": {}})
        fake.put("modelservices", {"metadata": {"name": "m", "namespace": "models"}, "spec": {}})
        for name in ("mine", "theirs"):
            fake.put("configmaps", {"metadata": {"name": name, "namespace": "models"}, "data": {}})
        async with aiohttp.ClientSession(fake.url) as session:
            async with session.get(deployments) as resp:
                assert resp.status == 200
            async with session.delete(f"{deployments}/d") as resp:
                body = await resp.json()
                assert resp.status == 403 and body["reason"] == "Forbidden" and "cannot delete" in body["message"]
            async with session.get(f"{deployments}/d") as resp:  # get is not list
                assert resp.status == 403
            async with session.patch(f"{MS}/m/status", data=json.dumps({"status": {"phase": "x"}}), headers=merge) as r:
                assert r.status == 200
            async with session.patch(f"{MS}/m", data=json.dumps({"spec": {"replicas": 2}}), headers=merge) as r:
                assert r.status == 403  # the status subresource is not the resource
            async with session.get("/api/v1/namespaces/models/configmaps/mine") as resp:
                assert resp.status == 200
            async with session.get("/api/v1/namespaces/models/configmaps/theirs") as resp:
                assert resp.status == 403  # resourceNames
        assert fake.denied == [
            ("delete", "apps", "deployments", "d"),
            ("get", "apps", "deployments", "d"),
            ("patch", "sie.io", "modelservices", "m"),
            ("get", "", "configmaps", "theirs"),
        ]
        assert fake.get("deployments", "models", "d") is not None
        async with aiohttp.ClientSession(fake.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as session:
            async with session.delete(f"{deployments}/d") as resp:
                assert resp.status == 200
        assert fake.get("deployments", "models", "d") is None
    finally:
        await fake.stop()


async def test_a_delete_with_a_uid_precondition_deletes_that_object_only(api):
    fake, session = api
    uid = fake.put("pods", {**pod("a"), "metadata": {"name": "a", "namespace": "models"}})["metadata"]["uid"]
    async with session.delete(f"{PODS}/a", json={"preconditions": {"uid": "another"}}) as resp:
        assert resp.status == 409 and "Precondition failed" in (await resp.json())["message"]
    assert fake.get("pods", "models", "a") is not None
    async with session.delete(
        f"{PODS}/a", json={"preconditions": {"uid": uid}, "propagationPolicy": "Background"}
    ) as r:
        assert r.status == 200
    assert fake.items("pods") == []
