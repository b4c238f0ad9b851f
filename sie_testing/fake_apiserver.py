"""FAKE Kubernetes API server, for tests only. It is not Kubernetes.

No API server can run on the test machines, so this aiohttp app on 127.0.0.1 speaks the real HTTP
protocol for the few resources the SIE controller and webhook use (pods, deployments, modelservices,
mutatingwebhookconfigurations), well enough that the official `kubernetes` client, pointed at its URL,
cannot tell:

- list: `{kind: XList, metadata: {resourceVersion}, items}`, with labelSelector (`k=v`, `k!=v`, `k`, `!k`).
- watch (`?watch=true`): newline-delimited JSON events ADDED / MODIFIED / DELETED, BOOKMARK events with
  `allowWatchBookmarks=true`, `timeoutSeconds`; from `resourceVersion=N` it replays what happened after N,
  and when N is older than the history it keeps (see `compact`) it answers with an ERROR event carrying a
  410 Gone Status, as the real server does. `expire_watches()` ends every open watch that way.
- create (POST), get, replace (PUT, with resourceVersion conflicts -> 409), patch (JSON merge patch and
  JSON patch; strategic merge and server-side apply are refused with 415), delete, and the status
  subresource of modelservices (the main endpoint ignores status, the status endpoint ignores the rest).
- The scale subresource (`.../<name>/scale`, an autoscaling/v1 Scale), what `kubectl scale`, an HPA and
  KEDA use: for Deployments, and for a custom resource as its CRD declares it (`subresources.scale`:
  specReplicasPath, statusReplicasPath, labelSelectorPath). Custom resources are served as the CRDs
  given to the constructor say (by default the repository's manifests/base/crd.yaml, so the tests see
  the subresources the product installs). GET answers 500 when the object has no value at the spec path
  (as the real server does); PUT and PATCH write only that path, a new spec being a new generation and
  a MODIFIED event like any write; a resourceVersion in the Scale is a precondition (409 when stale).
- TokenReview (POST /apis/authentication.k8s.io/v1/tokenreviews): a token a test registered with
  `review_token()` is answered with that status (user, extra, audiences); any other is unauthenticated.
- RBAC, when given `rules` (a Role's or ClusterRole's, e.g. `role_rules("sie-controller")`, read from the
  repository's manifests/base/rbac.yaml): every request is held to them as the real authoriser holds a
  service account bound to that role (verb, API group, resource and subresource, resourceNames), and one
  they do not allow is answered 403 Forbidden and kept in `denied`. So a test of a component fails when
  the component uses a verb its RBAC does not grant. A request bearing `ADMIN_TOKEN` (the test acting as
  kubectl, an HPA) is allowed everything. Rules apply cluster-wide (as through a ClusterRoleBinding).
- DELETE honours DeleteOptions' `preconditions.uid` (409 Conflict when the object's differs).

What it does not do: authentication, admission, schema validation, defaulting, garbage collection, and no
controllers run
(no pods appear for a Deployment): a test plays kubelet and the ReplicaSet controller with `put()`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import json
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from aiohttp import web

CRD_FILE = Path(__file__).resolve().parents[1] / "manifests" / "base" / "crd.yaml"
RBAC_FILE = Path(__file__).resolve().parents[1] / "manifests" / "base" / "rbac.yaml"
ADMIN_TOKEN = "fake-cluster-admin"  # `Authorization: Bearer <this>`: a request the given rules do not bind


@dataclass(frozen=True)
class _Scale:
    """Where a resource keeps what its scale subresource shows (dotted paths, as a CRD writes them)."""

    spec_replicas: str
    status_replicas: str
    label_selector: str | None = None  # a string field; None: the Deployment's spec.selector, formatted
    default_replicas: int | None = None  # a missing spec value reads as this (None: GET is an error)


@dataclass(frozen=True)
class _Resource:
    prefix: str
    plural: str
    kind: str
    api_version: str
    namespaced: bool = True
    status_subresource: bool = False
    scale: _Scale | None = None


RESOURCES = {
    "pods": _Resource("/api/v1", "pods", "Pod", "v1"),
    "secrets": _Resource("/api/v1", "secrets", "Secret", "v1"),
    "configmaps": _Resource("/api/v1", "configmaps", "ConfigMap", "v1"),
    "networkpolicies": _Resource(
        "/apis/networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", "networking.k8s.io/v1"
    ),
    "deployments": _Resource(
        "/apis/apps/v1",
        "deployments",
        "Deployment",
        "apps/v1",
        scale=_Scale(".spec.replicas", ".status.replicas", default_replicas=1),  # the server defaults it to 1
    ),
    # Without a CRD (crds=()): a ModelService with a status subresource and no scale subresource.
    "modelservices": _Resource(
        "/apis/sie.io/v1alpha1", "modelservices", "ModelService", "sie.io/v1alpha1", status_subresource=True
    ),
    "mutatingwebhookconfigurations": _Resource(
        "/apis/admissionregistration.k8s.io/v1",
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        "admissionregistration.k8s.io/v1",
        namespaced=False,
    ),
}

_EXPIRE = object()  # sentinel pushed to watchers: end with 410


def load_crds(path: Path = CRD_FILE) -> list[dict[str, Any]]:
    """The CustomResourceDefinitions in a YAML file."""
    docs = yaml.safe_load_all(path.read_text())
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "CustomResourceDefinition"]


def role_rules(name: str, path: Path = RBAC_FILE) -> list[dict[str, Any]]:
    """The rules of the Role or ClusterRole `name` in a manifests file (default: the repository's RBAC)."""
    docs = yaml.safe_load_all(path.read_text())
    (role,) = [
        d
        for d in docs
        if isinstance(d, dict) and d.get("kind") in ("Role", "ClusterRole") and d["metadata"]["name"] == name
    ]
    return list(role["rules"])


def _served(crds: Iterable[dict[str, Any]]) -> dict[str, _Resource]:
    """The resources to serve: the built-in ones, and each CRD's (its storage version) as it declares."""
    out = dict(RESOURCES)
    for crd in crds:
        spec = crd["spec"]
        version = next(v for v in spec["versions"] if v.get("storage", True))
        plural = spec["names"]["plural"]
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        out[plural] = _Resource(
            f"/apis/{spec['group']}/{version['name']}",
            plural,
            spec["names"]["kind"],
            f"{spec['group']}/{version['name']}",
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            status_subresource="status" in subresources,
            scale=_Scale(scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath", ""))
            if scale is not None
            else None,
        )
    return out


class FakeApiServer:
    """Start with `await fake.start()` (returns the base URL), stop with `await fake.stop()`."""

    def __init__(
        self,
        history: int = 10_000,
        bookmark_interval_s: float = 0.2,
        crds: Iterable[dict[str, Any]] | None = None,
        rules: Iterable[dict[str, Any]] | None = None,
    ):
        """`crds`: the CustomResourceDefinitions installed (default: the repository's, `load_crds()`);
        `rules`: the RBAC rules every request without `ADMIN_TOKEN` is held to (default None: no
        authorisation at all)."""
        self.resources = _served(load_crds() if crds is None else crds)
        self.rules = None if rules is None else [dict(r) for r in rules]
        self.denied: list[tuple[str, str, str, str | None]] = []  # (verb, group, resource, name) refused
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._log: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, resource, type, object)
        self._history = history
        self._rv = 100
        self._compacted = 0  # the history after this is kept: watches from an older resourceVersion get 410 Gone
        self._watchers: set[tuple[str, asyncio.Queue]] = set()
        self._bookmark_interval = bookmark_interval_s
        self._runner: web.AppRunner | None = None
        self.requests: list[tuple[str, str]] = []  # (method, path?query) of every request, for asserts
        self.url = ""
        self._unreachable = False
        self._reviews: dict[str, dict[str, Any]] = {}  # token -> TokenReview status

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        for _, queue in list(self._watchers):
            queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the test's side: what kubelet and other controllers would do --------------------------------
    def put(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or overwrite an object as-is (status included), with a new resourceVersion."""
        meta = obj.setdefault("metadata", {})
        key = (resource, meta.get("namespace", "") if self.resources[resource].namespaced else "", meta["name"])
        existing = self._objects.get(key)
        stored = copy.deepcopy(obj)
        stored["metadata"].setdefault("uid", (existing or {}).get("metadata", {}).get("uid") or str(uuid.uuid4()))
        stored["metadata"].setdefault("creationTimestamp", _now())
        return self._commit(resource, key, stored, "MODIFIED" if existing else "ADDED")

    def delete(self, resource: str, namespace: str, name: str) -> None:
        key = (resource, namespace, name)
        obj = self._objects.pop(key)
        self._commit(resource, key, obj, "DELETED")

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self._objects.get((resource, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def items(self, resource: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (r, _, _), o in sorted(self._objects.items()) if r == resource]

    def compact(self) -> None:
        """Forget the history so far, as etcd compaction does: old resourceVersions become 410 Gone."""
        self._compacted = self._rv
        self._log.clear()

    def expire_watches(self) -> None:
        """End every open watch with an ERROR event carrying 410 Gone, then compact."""
        self.compact()
        for _, queue in list(self._watchers):
            queue.put_nowait(_EXPIRE)

    @contextlib.asynccontextmanager
    async def unreachable(self) -> AsyncIterator[None]:
        """Within the block the server is cut off: open watches end, every request gets 503. The test
        may change objects meanwhile (put, delete, compact) as if other clients still could."""
        self._unreachable = True
        for _, queue in list(self._watchers):
            queue.put_nowait(None)
        try:
            yield
        finally:
            self._unreachable = False

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def review_token(
        self,
        label: str,
        username: str,
        *,
        pod: str | None = None,
        node: str | None = None,
        audiences: tuple[str, ...] = ("sie",),
    ) -> str:
        """A token shaped as the kubelet projects one (a JWT with the `kubernetes.io` claim; its signature
        is not real: only this fake reviews it) that reviews as `username`, bound to `pod` (and `node`)."""
        token = (
            ".".join(
                base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()
                for part in (
                    {"alg": "RS256", "kid": "fake"},
                    {"sub": username, "aud": list(audiences), "kubernetes.io": {"pod": {"name": pod}, "label": label}},
                )
            )
            + ".fake-signature"
        )
        extra: dict[str, list[str]] = {}
        if pod is not None:
            extra["authentication.kubernetes.io/pod-name"] = [pod]
        if node is not None:
            extra["authentication.kubernetes.io/node-name"] = [node]
        self._reviews[token] = {
            "authenticated": True,
            "audiences": list(audiences),
            "user": {"username": username, "uid": str(uuid.uuid4()), "extra": extra},
        }
        return token

    async def _token_review(self, request: web.Request) -> web.Response:
        body = await request.json()
        token = ((body or {}).get("spec") or {}).get("token", "")
        status = self._reviews.get(token, {"authenticated": False, "error": "invalid bearer token"})
        return web.json_response(
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": body.get("spec"),
                "status": status,
            },
            status=201,
        )

    # -- HTTP --------------------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        if self._unreachable:
            return _status(503, "ServiceUnavailable", "the fake API server is playing unreachable")
        if request.path == "/apis/authentication.k8s.io/v1/tokenreviews" and request.method == "POST":
            forbidden = self._authorize(request, "create", "authentication.k8s.io", "tokenreviews", None)
            return forbidden or await self._token_review(request)
        route = _route(self.resources, request.path)
        if route is None:
            return _status(404, "NotFound", f"the fake API server does not serve {request.path}")
        resource, namespace, name, sub = route
        res = self.resources[resource]
        group = "" if res.prefix == "/api/v1" else res.prefix.split("/")[2]
        forbidden = self._authorize(
            request, _verb(request, name), group, res.plural + (f"/{sub}" if sub else ""), name, namespace
        )
        if forbidden is not None:
            return forbidden
        if name is None:
            if request.method == "GET":
                if request.query.get("watch") in ("true", "1"):
                    return await self._watch(request, resource, namespace)
                return self._list(request, resource, namespace)
            if request.method == "POST" and (namespace or not self.resources[resource].namespaced):
                return await self._create(request, resource, namespace)
            return _status(405, "MethodNotAllowed", f"{request.method} on a collection")
        key = (resource, namespace or "", name)
        if sub == "scale":
            return await self._scale(request, resource, key)
        if sub not in (None, "status"):
            return _not_found(resource, f"{name}/{sub}")
        if request.method == "GET":
            obj = self._objects.get(key)
            return web.json_response(obj) if obj else _not_found(resource, name)
        if request.method == "DELETE":
            if key not in self._objects:
                return _not_found(resource, name)
            obj = self._objects[key]
            options = (await request.json()) if request.can_read_body else {}
            uid = ((options or {}).get("preconditions") or {}).get("uid")
            if uid and uid != obj["metadata"].get("uid"):
                return _status(
                    409,
                    "Conflict",
                    f"Operation cannot be fulfilled on {resource} {name!r}: Precondition failed: UID in precondition: "
                    f"{uid}, UID in object meta: {obj['metadata'].get('uid')}",
                )
            self.delete(resource, namespace or "", name)
            return web.json_response(obj)
        if request.method in ("PUT", "PATCH"):
            return await self._update(request, resource, key, sub)
        return _status(405, "MethodNotAllowed", request.method)

    def _authorize(
        self,
        request: web.Request,
        verb: str,
        group: str,
        resource: str,
        name: str | None,
        namespace: str | None = None,
    ) -> web.Response | None:
        """None when the request is allowed; else the 403 the real authoriser would answer."""
        if self.rules is None or request.headers.get("Authorization") == f"Bearer {ADMIN_TOKEN}":
            return None
        for rule in self.rules:
            if (
                _grants(rule.get("verbs"), verb)
                and _grants(rule.get("apiGroups"), group)
                and _grants(rule.get("resources"), resource)
                and (not rule.get("resourceNames") or name in rule["resourceNames"])
            ):
                return None
        self.denied.append((verb, group, resource, name))
        what = f"{resource}{'.' + group if group else ''}" + (f' "{name}"' if name else "")
        where = f' in the namespace "{namespace}"' if namespace else ""
        return _status(
            403,
            "Forbidden",
            f'{what} is forbidden: the caller cannot {verb} resource "{resource}" in API group "{group}"{where} '
            "(the fake API server's rules)",
        )

    def _list(self, request: web.Request, resource: str, namespace: str | None) -> web.Response:
        res = self.resources[resource]
        selector = _parse_selector(request.query.get("labelSelector", ""))
        items = [
            copy.deepcopy(o)
            for (r, ns, _), o in sorted(self._objects.items())
            if r == resource and (namespace is None or ns == namespace) and _matches(o, selector)
        ]
        return web.json_response(
            {
                "kind": f"{res.kind}List",
                "apiVersion": res.api_version,
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, resource: str, namespace: str | None) -> web.StreamResponse:
        res = self.resources[resource]
        selector = _parse_selector(request.query.get("labelSelector", ""))
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        since = request.query.get("resourceVersion", "")

        def wanted(obj: dict[str, Any]) -> bool:
            ns = obj.get("metadata", {}).get("namespace", "")
            return (namespace is None or ns == namespace) and _matches(obj, selector)

        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()
        entry = (resource, queue)
        self._watchers.add(entry)
        try:
            if since in ("", "0"):
                for (r, _, _), obj in sorted(self._objects.items()):
                    if r == resource and wanted(obj):
                        await _send(response, "ADDED", obj)
            elif int(since) < self._compacted:
                await _send(response, "ERROR", _gone(since))
                return response
            else:
                for rv, r, kind, obj in list(self._log):
                    if r == resource and rv > int(since) and wanted(obj):
                        await _send(response, kind, obj)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while (left := deadline - loop.time()) > 0:
                try:
                    item = await asyncio.wait_for(queue.get(), min(left, self._bookmark_interval))
                except TimeoutError:
                    if bookmarks:
                        await _send(
                            response,
                            "BOOKMARK",
                            {
                                "kind": res.kind,
                                "apiVersion": res.api_version,
                                "metadata": {"resourceVersion": str(self._rv)},
                            },
                        )
                    continue
                if item is None:
                    break
                if item is _EXPIRE:
                    await _send(response, "ERROR", _gone(since))
                    break
                kind, obj = item
                if wanted(obj):
                    await _send(response, kind, obj)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(entry)
        return response

    async def _create(self, request: web.Request, resource: str, namespace: str | None) -> web.Response:
        res = self.resources[resource]
        body = await request.json()
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            return _status(422, "Invalid", "metadata.name: Required value")
        if res.namespaced:
            meta["namespace"] = namespace
        key = (resource, namespace or "", meta["name"])
        if key in self._objects:
            return _status(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists')
        body.setdefault("apiVersion", res.api_version)
        body.setdefault("kind", res.kind)
        if res.status_subresource:
            body.pop("status", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        return web.json_response(self._commit(resource, key, body, "ADDED"), status=201)

    async def _update(
        self, request: web.Request, resource: str, key: tuple[str, str, str], sub: str | None
    ) -> web.Response:
        res = self.resources[resource]
        current = self._objects.get(key)
        if current is None:
            return _not_found(resource, key[2])
        if sub not in (None, "status") or (sub == "status" and not res.status_subresource):
            return _not_found(resource, f"{key[2]}/{sub}")
        body = await request.json()
        if request.method == "PUT":
            given = (body.get("metadata") or {}).get("resourceVersion")
            if given and given != current["metadata"]["resourceVersion"]:
                return _status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {res.plural} "{key[2]}": '
                    "the object has been modified; please apply your changes to the latest version",
                )
            updated = body
        else:
            kind = request.content_type
            if kind == "application/merge-patch+json":
                updated = _merge_patch(copy.deepcopy(current), body)
            elif kind == "application/json-patch+json":
                try:
                    updated = jsonpatch.apply_patch(current, body)
                except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                    return _status(422, "Invalid", f"the JSON patch does not apply: {exc}")
            else:
                return _status(415, "UnsupportedMediaType", f"the fake API server does not implement PATCH with {kind}")
        new = copy.deepcopy(current)
        if sub == "status":
            new["status"] = updated.get("status")
        else:
            for field, value in updated.items():
                if field in ("metadata", "status"):
                    continue
                new[field] = value
            new["metadata"] = {
                **updated.get("metadata", {}),
                **{
                    k: current["metadata"][k]
                    for k in ("uid", "creationTimestamp", "namespace", "name", "generation")
                    if k in current["metadata"]
                },
            }
            if not res.status_subresource and "status" in updated:
                new["status"] = updated["status"]
            if new.get("spec") != current.get("spec") and "generation" in current["metadata"]:
                new["metadata"]["generation"] = current["metadata"]["generation"] + 1
        return web.json_response(self._commit(resource, key, new, "MODIFIED"))

    async def _scale(self, request: web.Request, resource: str, key: tuple[str, str, str]) -> web.Response:
        """The scale subresource: a Scale read from the object's paths; a write sets only the spec path."""
        res = self.resources[resource]
        current = self._objects.get(key)
        if res.scale is None or current is None:
            return _not_found(resource, key[2] if current is None else f"{key[2]}/scale")
        paths = res.scale
        scale = self._scale_of(res, current)
        if request.method == "GET":
            if scale["spec"]["replicas"] is None:
                return _status(500, "InternalError", f'the spec replicas field "{paths.spec_replicas}" does not exist')
            return web.json_response(scale)
        if request.method not in ("PUT", "PATCH"):
            return _status(405, "MethodNotAllowed", f"{request.method} on {res.plural}/scale")
        body = await request.json()
        if request.method == "PUT":
            # A Scale decoded as the real server does: a missing spec.replicas is 0.
            updated = {**body, "spec": {"replicas": 0, **(body.get("spec") or {})}}
        elif request.content_type == "application/merge-patch+json":
            updated = _merge_patch(copy.deepcopy(scale), body)
        elif request.content_type == "application/json-patch+json":
            try:
                updated = jsonpatch.apply_patch(scale, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                return _status(422, "Invalid", f"the JSON patch does not apply: {exc}")
        else:
            return _status(
                415, "UnsupportedMediaType", f"the fake API server does not implement PATCH with {request.content_type}"
            )
        replicas = (updated.get("spec") or {}).get("replicas")
        if replicas is None:
            return _status(400, "BadRequest", f'the spec replicas field "{paths.spec_replicas}" cannot be empty')
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            return _status(
                422, "Invalid", f"Scale.autoscaling {key[2]!r} is invalid: spec.replicas: {replicas!r}: must be >= 0"
            )
        given = (updated.get("metadata") or {}).get("resourceVersion")
        if given and given != current["metadata"]["resourceVersion"]:
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res.plural} "{key[2]}": '
                "the object has been modified; please apply your changes to the latest version",
            )
        new = copy.deepcopy(current)
        _set_path(new, paths.spec_replicas, replicas)
        if new.get("spec") != current.get("spec") and "generation" in current["metadata"]:
            new["metadata"]["generation"] = current["metadata"]["generation"] + 1
        return web.json_response(self._scale_of(res, self._commit(resource, key, new, "MODIFIED")))

    @staticmethod
    def _scale_of(res: _Resource, obj: dict[str, Any]) -> dict[str, Any]:
        """The autoscaling/v1 Scale of an object (spec.replicas None: the spec path holds no value)."""
        assert res.scale is not None
        paths = res.scale
        meta = obj["metadata"]
        replicas = _get_path(obj, paths.spec_replicas)
        if paths.label_selector is None:
            labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        else:
            selector = (_get_path(obj, paths.label_selector) if paths.label_selector else None) or ""
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") if k in meta
            },
            "spec": {"replicas": paths.default_replicas if replicas is None else replicas},
            "status": {"replicas": _get_path(obj, paths.status_replicas) or 0, "selector": selector},
        }

    def _commit(self, resource: str, key: tuple[str, str, str], obj: dict[str, Any], kind: str) -> dict[str, Any]:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        snapshot = copy.deepcopy(obj)
        self._log.append((self._rv, resource, kind, snapshot))
        if len(self._log) > self._history:
            dropped = self._log.pop(0)
            self._compacted = dropped[0]
        for watched, queue in list(self._watchers):
            if watched == resource:
                queue.put_nowait((kind, snapshot))
        return copy.deepcopy(obj)


def _verb(request: web.Request, name: str | None) -> str:
    """The RBAC verb of a request on a resource (or a collection, when `name` is None)."""
    if request.method == "GET":
        if name is not None:
            return "get"
        return "watch" if request.query.get("watch") in ("true", "1") else "list"
    if request.method == "DELETE":
        return "delete" if name is not None else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(request.method, request.method.lower())


def _grants(allowed: list[str] | None, wanted: str) -> bool:
    if not allowed:
        return False
    return "*" in allowed or wanted in allowed


def _route(resources: dict[str, _Resource], path: str) -> tuple[str, str | None, str | None, str | None] | None:
    """(resource, namespace, name, subresource) for a request path, or None."""
    for resource, res in resources.items():
        if not path.startswith(res.prefix + "/"):
            continue
        parts = path[len(res.prefix) + 1 :].split("/")
        namespace = None
        if parts[0] == "namespaces" and len(parts) >= 3 and res.namespaced:
            namespace, parts = parts[1], parts[2:]
        if parts[0] != res.plural or len(parts) > 3:
            continue
        name = parts[1] if len(parts) > 1 else None
        sub = parts[2] if len(parts) > 2 else None
        return resource, namespace, name, sub
    return None


def _get_path(obj: dict[str, Any], path: str) -> Any:
    """The value at a dotted path (`.spec.replicas`), or None."""
    value: Any = obj
    for part in path.lstrip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.lstrip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def _parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            out.append(("!=", k.strip(), v.strip()))
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            out.append(("=", k.strip(), v.strip()))
        elif term.startswith("!"):
            out.append(("!", term[1:].strip(), None))
        else:
            out.append(("exists", term, None))
    return out


def _matches(obj: dict[str, Any], selector: list[tuple[str, str, str | None]]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for op, key, value in selector:
        if (
            (op == "=" and labels.get(key) != value)
            or (op == "!=" and labels.get(key) == value)
            or (op == "exists" and key not in labels)
            or (op == "!" and key in labels)
        ):
            return False
    return True


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    out = target if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(out.get(key), value)
    return out


async def _send(response: web.StreamResponse, kind: str, obj: dict[str, Any]) -> None:
    await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")


def _gone(since: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {since}",
        "reason": "Expired",
        "code": 410,
    }


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        status=code,
    )


def _not_found(resource: str, name: str) -> web.Response:
    return _status(404, "NotFound", f'{resource} "{name}" not found')


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
