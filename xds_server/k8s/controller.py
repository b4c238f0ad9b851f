"""The ModelService controller: the I/O shell around `reconcile` and `pods`.

Four informers (ModelServices, the Deployments and NetworkPolicies it manages, the pods of models) keep
caches; every change queues the ModelService it concerns; one reconciler applies `reconcile()`'s plan
(create or patch the NetworkPolicy and the Deployments, delete the Deployments of builds no longer
wanted, write the status); one publisher turns the caches into what the control plane needs, the valid models and each
model's ready endpoints, and hands over only what changed to a `DiscoverySink`.

A write the API server refuses is reported in the ModelService's status (condition Applied=False) and
the reconcile is retried, after `retry_s` doubled per consecutive failure up to `retry_max_s`. The
verbs used, and so the ones manifests/base/rbac.yaml grants: list and watch on ModelServices, pods,
Deployments and NetworkPolicies; create, patch (merge patch) and delete on Deployments; create and
patch on NetworkPolicies; patch on modelservices/status; create on TokenReviews (tokenreview.py).

Tasks are named, supervised (a task that dies is logged and restarted after `retry_s`), and cancelled
and awaited by `stop()`. Nothing is reconciled or published before every informer has listed once, so
a restart never reports a model with no endpoints just because the pods were not listed yet.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sie import crd
from sie.spec import API_GROUP, ModelService
from xds_server.k8s.deployments import MANAGED_BY, Build, DeploymentSettings, deployment_name, policy_name
from xds_server.k8s.informer import Informer
from xds_server.k8s.pods import Endpoint, endpoints_by_model, model_id_of
from xds_server.k8s.reconcile import Plan, parse, reconcile, status_patch, with_write_failures

log = logging.getLogger("sie.k8s.controller")

MERGE_PATCH = "application/merge-patch+json"


class DiscoverySink(Protocol):
    """What the control plane receives. Calls come from one task, in order; each carries the full,
    current value (not a delta), and is made only when that value changed. `records` carries each
    model's `status.build` as last written (the control plane's record of its build and rollout)."""

    async def models_changed(
        self, models: Mapping[str, ModelService], records: Mapping[str, dict[str, Any]] | None = None
    ) -> None: ...

    async def endpoints_changed(self, model_id: str, endpoints: tuple[Endpoint, ...]) -> None: ...


class Fleet(Protocol):
    """What the control plane wants run of a model: its builds (a rollout runs two), and its record."""

    def builds(self, model_id: str) -> list[Build] | None:
        """The builds to run, the serving one first; None: the spec's one build."""
        ...

    def record(self, model_id: str) -> dict[str, Any] | None:
        """The record to keep in the ModelService's `status.build` (None: nothing to record)."""
        ...


class _InformerOptions(TypedDict):
    """The keyword arguments every informer of a controller shares."""

    executor: Executor
    watch_timeout_s: int
    request_timeout_s: float
    sleep: Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class ControllerSettings:
    namespace: str | None = None  # None: every namespace
    deployment: DeploymentSettings = field(default_factory=DeploymentSettings)
    watch_timeout_s: int = 300
    request_timeout_s: float = 10.0
    resync_s: float = 300.0  # reconcile everything this often, whatever the watches said
    retry_s: float = 2.0  # a failed reconcile is retried after this
    retry_max_s: float = 60.0
    """The longest wait before retrying a ModelService whose reconcile keeps failing (seconds, default
    60): each consecutive failure doubles the wait from `retry_s`, so a write the API server refuses
    every time (a missing RBAC verb) is not retried every 2 s for ever."""


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Controller:
    def __init__(
        self,
        api_client: client.ApiClient,
        sink: DiscoverySink,
        settings: ControllerSettings = ControllerSettings(),
        now: Callable[[], str] = utc_now,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        fleet: Fleet | None = None,
    ):
        self._settings = settings
        self._sink = sink
        self._fleet = fleet
        self._now = now
        self._sleep = sleep
        self._apps = client.AppsV1Api(api_client)
        self._net = client.NetworkingV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sie-k8s")
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._failures: dict[str, int] = {}  # key -> consecutive failed reconciles (the retry's backoff)
        self._retrying: set[str] = set()  # keys with a retry pending
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._published_models: dict[str, ModelService] | None = None
        self._published_endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._parsed: dict[str, tuple[str, ModelService | None]] = {}  # key -> (resourceVersion, published form)
        self.reconciles = 0
        core = client.CoreV1Api(api_client)
        ns = settings.namespace
        common = _InformerOptions(
            executor=self._executor,
            watch_timeout_s=settings.watch_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            sleep=sleep,
        )
        if ns is None:
            services_call = functools.partial(
                self._custom.list_cluster_custom_object, API_GROUP, crd.VERSION, crd.PLURAL
            )
            deployments_call, pods_call = (
                self._apps.list_deployment_for_all_namespaces,
                core.list_pod_for_all_namespaces,
            )
            policies_call = self._net.list_network_policy_for_all_namespaces
        else:
            services_call = functools.partial(
                self._custom.list_namespaced_custom_object, API_GROUP, crd.VERSION, ns, crd.PLURAL
            )
            deployments_call = functools.partial(self._apps.list_namespaced_deployment, ns)
            pods_call = functools.partial(core.list_namespaced_pod, ns)
            policies_call = functools.partial(self._net.list_namespaced_network_policy, ns)
        self.services = Informer("modelservices", services_call, self._service_changed, **common)
        self.deployments = Informer(
            "deployments",
            deployments_call,
            self._owned_changed,
            label_selector=f"app.kubernetes.io/managed-by={MANAGED_BY}",
            **common,
        )
        self.pods = Informer("pods", pods_call, self._owned_changed, label_selector=crd.A_MODEL_ID, **common)
        self.policies = Informer(
            "networkpolicies",
            policies_call,
            self._owned_changed,
            label_selector=f"app.kubernetes.io/managed-by={MANAGED_BY}",
            **common,
        )
        self._informers = (self.services, self.deployments, self.pods, self.policies)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        for informer in self._informers:
            self._spawn(f"sie-k8s-informer-{informer.name}", informer.run)
        self._spawn("sie-k8s-reconciler", self._reconcile_loop)
        self._spawn("sie-k8s-publisher", self._publish_loop)
        self._spawn("sie-k8s-resync", self._resync_loop)

    async def wait_synced(self) -> None:
        await asyncio.gather(*(informer.synced.wait() for informer in self._informers))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _spawn(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        async def supervised() -> None:
            while True:
                try:
                    await body()
                    log.error("task %s returned; restarting it", name)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("task %s died; restarting it in %.1f s", name, self._settings.retry_s)
                await self._sleep(self._settings.retry_s)

        self._tasks.append(asyncio.create_task(supervised(), name=name))

    def pod_instance(self, namespace: str, name: str) -> tuple[str, str] | None:
        """(model id, node) of a pod this controller serves as a model instance, or None: the pod must
        carry a served model's label and live in that ModelService's namespace (for TokenReview)."""
        pod = self.pods.store.get(f"{namespace}/{name}")
        model_id = model_id_of(pod) if pod is not None else None
        served = self.current_models().get(model_id) if model_id else None
        if pod is None or not model_id or served is None or served[0] != namespace:
            return None
        return model_id, (pod.get("spec") or {}).get("nodeName") or ""

    # -- change routing ----------------------------------------------------------------------------
    def _service_changed(self, key: str, old: dict | None, new: dict | None) -> None:
        if new is None:
            self._parsed.pop(key, None)
        self._enqueue(key)
        self._dirty.set()

    def _owned_changed(self, key: str, old: dict | None, new: dict | None) -> None:
        obj = new or old or {}
        model_id = model_id_of(obj)
        if model_id:
            self._enqueue(f"{obj['metadata'].get('namespace', '')}/{model_id}")
        self._dirty.set()

    def model_changed(self, model_id: str) -> None:
        """The control plane changed what it wants run of a model (a rollout moved): reconcile it."""
        key = self._owners().get(model_id)
        if key is not None:
            self._enqueue(key)

    def _enqueue(self, key: str) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    # -- reconcile ---------------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        await self.wait_synced()
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            try:
                settled = await self._reconcile(key)
            except ApiException as exc:
                log.warning(
                    "reconcile %s: HTTP %s %s; retrying in %.1f s", key, exc.status, exc.reason, self._backoff(key)
                )
                settled = False
            except Exception:
                log.exception("reconcile %s failed; retrying in %.1f s", key, self._backoff(key))
                settled = False
            if settled:
                self._failures.pop(key, None)
            else:
                self._retry_later(key)

    def _backoff(self, key: str) -> float:
        """The wait before the next retry of `key`: `retry_s`, doubled per consecutive failure, at most
        `retry_max_s`."""
        failed = self._failures.get(key, 0)
        return min(self._settings.retry_max_s, self._settings.retry_s * 2 ** min(failed, 30))

    def _retry_later(self, key: str) -> None:
        """Reconcile `key` again after its backoff; one retry pending per key, however many reconciles
        (one per watch event) failed meanwhile, so the backoff holds."""
        delay = self._backoff(key)
        self._failures[key] = self._failures.get(key, 0) + 1
        if key in self._retrying:
            return

        async def later() -> None:
            await self._sleep(delay)
            self._retrying.discard(key)
            self._enqueue(key)

        task = asyncio.create_task(later(), name=f"sie-k8s-retry-{key}")
        self._tasks.append(task)
        self._retrying.add(key)

        def forget(t: asyncio.Task[None]) -> None:
            if t in self._tasks:
                self._tasks.remove(t)

        task.add_done_callback(forget)

    async def _reconcile(self, key: str) -> bool:
        """One ModelService's reconcile; False when a write failed (the status says which) and it must be
        retried."""
        obj = self.services.store.get(key)
        if obj is None:
            self._failures.pop(key, None)
            return True  # deleted: the Deployment goes with it (ownerReferences, Kubernetes garbage collection)
        namespace, name = key.split("/", 1)
        model_id = ((obj.get("spec") or {}).get("model") or {}).get("name") or name
        builds = self._fleet.builds(model_id) if self._fleet is not None else None
        if self._fleet is not None and builds is None and self._published_form(key, obj) is not None:
            # A valid ModelService the control plane does not know yet (it is being published, or the
            # control plane restarted and restores its rollout from status.build): acting now on the
            # spec alone could patch the serving build into the new one. The fleet enqueues it when known.
            return True
        record = self._fleet.record(model_id) if self._fleet is not None else None
        serving = deployment_name(model_id, builds[0].generation if builds else 0)
        deployment = self.deployments.store.get(f"{namespace}/{serving}")
        others = {
            d["metadata"]["name"]: d
            for d in self.deployments.store.values()
            if d["metadata"].get("namespace") == namespace
            and model_id_of(d) == model_id
            and d["metadata"]["name"] != serving
        }
        pods = [
            p
            for p in self.pods.store.values()
            if p["metadata"].get("namespace") == namespace and model_id_of(p) == model_id
        ]
        owner = self._owners().get(model_id)
        duplicate_of = owner if owner is not None and owner != key else None
        policy = self.policies.store.get(f"{namespace}/{policy_name(model_id)}")
        plan = reconcile(
            obj,
            deployment,
            pods,
            self._settings.deployment,
            self._now(),
            duplicate_of,
            policy,
            builds=builds,
            others=others,
            record=record,
        )
        self.reconciles += 1
        failures = await self._apply(namespace, name, plan, obj.get("status"))
        return not failures

    async def _apply(self, namespace: str, name: str, plan: Plan, stored_status: dict[str, Any] | None) -> list[str]:
        """Carry out a plan; the writes the API server refused, each said as `what: HTTP code reason`.

        A refused write does not stop the status: it is written with the failures (with_write_failures),
        so the ModelService says what the controller could not do. Writes that depend on a refused one
        are skipped: no Deployment before its NetworkPolicy, no build deleted unless every other write
        succeeded (new before old). An error other than an HTTP answer (the API server out of reach)
        raises, as no status write could succeed either."""
        loop = asyncio.get_running_loop()
        failures: list[str] = []

        def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
            kwargs.update(_preload_content=False, _request_timeout=self._settings.request_timeout_s)
            return loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

        async def write(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
            try:
                await run(fn, *args, **kwargs)
            except ApiException as exc:
                if exc.status == 404 and what.startswith("delete "):
                    return True  # already gone
                hint = " (the controller's RBAC lacks this verb: manifests/base/rbac.yaml)" if exc.status == 403 else ""
                failures.append(f"{what}: HTTP {exc.status} {exc.reason}{hint}")
                log.warning("%s/%s: %s", namespace, name, failures[-1])
                return False
            return True

        # The NetworkPolicy first: a model's pods never run unfenced, not even for a moment.
        fenced = True
        if plan.policy_action == "create" and plan.policy_body is not None:
            policy = plan.policy_body["metadata"]["name"]
            log.info("creating NetworkPolicy %s/%s", namespace, policy)
            fenced = await write(
                f"create NetworkPolicy {policy}",
                self._net.create_namespaced_network_policy,
                namespace,
                plan.policy_body,
            )
        elif plan.policy_action == "patch" and plan.policy_body is not None and plan.service is not None:
            policy = policy_name(plan.service.model_id)
            fenced = await write(
                f"patch NetworkPolicy {policy}",
                self._net.patch_namespaced_network_policy,
                policy,
                namespace,
                plan.policy_body,
                _content_type=MERGE_PATCH,
            )
        body = plan.deployment_body if fenced else None
        if plan.deployment_action == "create" and body is not None:
            target = body["metadata"]["name"]
            log.info("creating Deployment %s/%s", namespace, target)
            await write(f"create Deployment {target}", self._apps.create_namespaced_deployment, namespace, body)
        elif plan.deployment_action == "patch" and body is not None:
            target = body.get("metadata", {}).get("name") or (
                deployment_name(plan.service.model_id) if plan.service else name
            )
            log.info("updating Deployment %s/%s to the spec", namespace, target)
            await write(
                f"patch Deployment {target}",
                self._apps.patch_namespaced_deployment,
                target,
                namespace,
                body,
                _content_type=MERGE_PATCH,
            )
        for action, other, other_body in plan.others if fenced else ():
            what = f"{action} Deployment {other}"
            if action == "create" and other_body is not None:
                log.info("creating Deployment %s/%s (a rollout's build)", namespace, other)
                await write(what, self._apps.create_namespaced_deployment, namespace, other_body)
            elif action == "patch" and other_body is not None:
                log.info("updating Deployment %s/%s (a rollout's build)", namespace, other)
                await write(
                    what,
                    self._apps.patch_namespaced_deployment,
                    other,
                    namespace,
                    other_body,
                    _content_type=MERGE_PATCH,
                )
            elif action == "delete" and not failures:
                log.info("deleting Deployment %s/%s (a build no longer wanted)", namespace, other)
                await write(what, self._apps.delete_namespaced_deployment, other, namespace, body=other_body)
        status = plan.status if plan.status is not None else stored_status
        if status is not None and failures:
            status = with_write_failures(status, failures, stored_status, plan.now)
        if status is not None and status != stored_status:
            try:
                await run(
                    self._custom.patch_namespaced_custom_object_status,
                    API_GROUP,
                    crd.VERSION,
                    namespace,
                    crd.PLURAL,
                    name,
                    # The whole new status as a merge patch from the stored one: a key the new status lacks
                    # is removed (a plain merge patch would leave it, and the status would never settle).
                    {"status": status_patch(stored_status, status)},
                    _content_type=MERGE_PATCH,
                )
            except ApiException as exc:
                if exc.status != 404:  # deleted meanwhile: nothing to report on
                    raise
        return failures

    async def _resync_loop(self) -> None:
        await self.wait_synced()
        while True:
            await self._sleep(self._settings.resync_s)
            for key in list(self.services.store):
                self._enqueue(key)
            self._dirty.set()

    # -- publish -----------------------------------------------------------------------------------
    def _owners(self) -> dict[str, str]:
        """model id -> key of the ModelService that serves it: the oldest one when several namespaces
        name the same model (the others are reported as duplicates)."""
        owners: dict[str, tuple[str, str]] = {}
        for key, obj in self.services.store.items():
            model_id = ((obj.get("spec") or {}).get("model") or {}).get("name")
            if not isinstance(model_id, str):
                continue
            rank = ((obj.get("metadata") or {}).get("creationTimestamp") or "", key)
            if model_id not in owners or rank < owners[model_id]:
                owners[model_id] = rank
        return {model_id: rank[1] for model_id, rank in owners.items()}

    def current_models(self) -> dict[str, tuple[str, ModelService]]:
        """model id -> (namespace, spec) for every valid ModelService that owns its model id."""
        out = {}
        for model_id, key in self._owners().items():
            service = self._published_form(key, self.services.store[key])
            if service is not None:
                out[model_id] = (key.split("/", 1)[0], service)
        return out

    def _published_form(self, key: str, obj: dict[str, Any]) -> ModelService | None:
        """The ModelService as the control plane sees it: the spec and the name only, so our own status
        writes (and label or annotation edits) are not model changes. Parsed once per resourceVersion.

        An invalid edit of a valid ModelService of the same model id keeps the last valid spec published:
        its Deployment keeps running that spec (reconcile), so the control plane keeps routing to it; a
        bad edit (say `kubectl scale` past sla.max_replicas) must not take a serving model out of EDS."""
        version = (obj.get("metadata") or {}).get("resourceVersion", "")
        cached = self._parsed.get(key)
        if cached is None or cached[0] != version:
            meta = obj.get("metadata") or {}
            bare = {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
                "spec": obj.get("spec"),
            }
            service = parse(bare, self._settings.deployment)[0]
            if service is None and cached is not None and cached[1] is not None:
                model_id = ((obj.get("spec") or {}).get("model") or {}).get("name")
                service = cached[1] if cached[1].model_id == model_id else None
            cached = (version, service)
            self._parsed[key] = cached
        return cached[1]

    async def _publish_loop(self) -> None:
        await asyncio.gather(self.services.synced.wait(), self.pods.synced.wait())
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self._publish()

    async def _publish(self) -> None:
        current = self.current_models()
        models = {model_id: service for model_id, (_, service) in current.items()}
        endpoints = endpoints_by_model(self.pods.store.values(), {m: ns for m, (ns, _) in current.items()})
        # Order that drops nothing: a model's endpoints are emptied before the model goes, and a new
        # model is announced before its endpoints.
        for model_id in sorted(set(self._published_endpoints) - set(endpoints)):
            if self._published_endpoints.pop(model_id):
                await self._sink.endpoints_changed(model_id, ())
        if models != self._published_models:
            self._published_models = models
            records = {}
            for model_id, key in self._owners().items():
                build = ((self.services.store.get(key) or {}).get("status") or {}).get("build")
                if model_id in models and isinstance(build, dict):
                    records[model_id] = build
            await self._sink.models_changed(dict(models), records)
        for model_id, eps in sorted(endpoints.items()):
            if self._published_endpoints.get(model_id) != eps:
                self._published_endpoints[model_id] = eps
                await self._sink.endpoints_changed(model_id, eps)
