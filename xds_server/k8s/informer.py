"""A list/watch cache of one kind of Kubernetes object, on the official `kubernetes` client.

The protocol (Kubernetes API concepts, "efficient detection of changes"): list to get every object and
the collection's resourceVersion, then watch from that resourceVersion; every event carries the object's
new resourceVersion, and BOOKMARK events (asked for with allowWatchBookmarks) carry only a newer
resourceVersion, so a watch that ends (timeoutSeconds, a dropped connection) resumes from the last one
seen without a relist. When the server no longer has that history it answers 410 Gone (as an HTTP
status or as an ERROR event): only then do we list again.

Invariant: a relist replaces the cache by difference. Objects that are still there produce no event at
all, so a model's endpoints survive a watch error untouched; only objects that were deleted while we
were not watching produce DELETED, and changed ones MODIFIED.

The client is blocking (urllib3), so each list and each watch stream runs in a worker thread; events
cross into the event loop through `call_soon_threadsafe`, and all cache updates and callbacks happen on
the loop. Cancelling `run()` shuts the stream's socket so the thread returns at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from sie.errors import RetryableError

log = logging.getLogger("sie.k8s.informer")

OnChange = Callable[[str, "dict[str, Any] | None", "dict[str, Any] | None"], None]  # key, old, new
_END = object()


class Gone(RetryableError):
    """The server no longer has the history we asked for (410): list again."""


class WatchError(RetryableError):
    """The watch stream carried an ERROR event other than 410: watch again after a backoff."""


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class Informer:
    """Keeps `store` (key "namespace/name" -> object as JSON) equal to the server's objects.

    `call` is a list function of the kubernetes client (e.g. CoreV1Api().list_pod_for_all_namespaces,
    or a functools.partial of CustomObjectsApi().list_cluster_custom_object); it is called with the
    standard list/watch keyword arguments.
    """

    def __init__(
        self,
        name: str,
        call: Callable[..., Any],
        on_change: OnChange,
        executor: Executor,
        *,
        label_selector: str | None = None,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 10.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        backoff_s: tuple[float, float] = (0.2, 5.0),
    ):
        self.name = name
        self.store: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.resource_version: str | None = None
        self.lists = 0  # how many times we listed: 1 plus one per 410
        self._call = call
        self._on_change = on_change
        self._executor = executor
        self._selector = label_selector
        self._watch_timeout = watch_timeout_s
        self._request_timeout = request_timeout_s
        self._sleep = sleep
        self._backoff = backoff_s
        self._response: Any = None

    async def run(self) -> None:
        """List, then watch forever; returns only by cancellation."""
        failures = 0
        while True:
            listed = False
            try:
                if self.resource_version is None:
                    await self._relist()
                    listed = True
                await self._watch()
                failures = 0
            except Gone as exc:
                log.info("%s: %s; listing again", self.name, exc)
                self.resource_version = None
                if listed:  # Gone straight after a list: do not spin against a confused server
                    failures += 1
                    await self._sleep(self._delay(failures))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # network errors, 5xx, a server restart: retry, keep the cache
                failures += 1
                log.warning(
                    "%s: watch failed (%s); retrying in %.1f s from resourceVersion %s",
                    self.name,
                    _describe(exc),
                    self._delay(failures),
                    self.resource_version,
                )
                await self._sleep(self._delay(failures))

    def _delay(self, failures: int) -> float:
        return min(self._backoff[1], self._backoff[0] * 2 ** (failures - 1))

    async def _relist(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            items, version = await loop.run_in_executor(self._executor, self._list_blocking)
        except ApiException as exc:
            if exc.status == 410:
                raise Gone(f"list answered 410: {exc.reason}") from None
            raise
        fresh = {object_key(o): o for o in items}
        old_store, self.store = self.store, fresh
        self.resource_version = version
        self.lists += 1
        for key, old in old_store.items():
            if key not in fresh:
                self._on_change(key, old, None)
        for key, new in fresh.items():
            previous = old_store.get(key)
            if previous is None or _version(previous) != _version(new):
                self._on_change(key, previous, new)
        self.synced.set()

    def _list_blocking(self) -> tuple[list[dict[str, Any]], str]:
        kwargs: dict[str, Any] = {"_preload_content": False, "_request_timeout": self._request_timeout}
        if self._selector:
            kwargs["label_selector"] = self._selector
        response = self._call(**kwargs)
        body = json.loads(response.data)
        return body.get("items") or [], body["metadata"]["resourceVersion"]

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def deliver(item: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        stop = threading.Event()
        future = loop.run_in_executor(self._executor, self._watch_blocking, self.resource_version, deliver, stop)
        try:
            while True:
                item = await events.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                self._apply(item)
        finally:
            stop.set()
            if not future.done():
                self._abort()
            try:
                await asyncio.shield(future)
            except Exception:
                pass

    def _watch_blocking(self, version: str | None, deliver: Callable[[Any], None], stop: threading.Event) -> None:
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "resource_version": version,
            "timeout_seconds": self._watch_timeout,
            "_preload_content": False,
            # connect timeout, then a read timeout a little past the server's own end of the watch
            "_request_timeout": (self._request_timeout, self._watch_timeout + self._request_timeout),
        }
        if self._selector:
            kwargs["label_selector"] = self._selector
        try:
            try:
                response = self._call(**kwargs)
            except ApiException as exc:
                deliver(Gone(f"watch answered 410: {exc.reason}") if exc.status == 410 else exc)
                return
            self._response = response
            try:
                if stop.is_set():  # cancelled while connecting: _abort found no response to shut
                    return
                for line in iter_resp_lines(response):
                    if stop.is_set():
                        return
                    if line.strip():
                        deliver(json.loads(line))
            finally:
                self._response = None
                response.release_conn()
            deliver(_END)
        except Exception as exc:  # a read error, a shut socket: the loop side decides
            deliver(exc)

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone(f"watch event 410: {obj.get('message', '')}")
            raise WatchError(f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        version = _version(obj)
        if kind == "BOOKMARK":
            self.resource_version = version or self.resource_version
            return
        key = object_key(obj)
        old = self.store.get(key)
        if kind == "DELETED":
            self.store.pop(key, None)
            self._on_change(key, old, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.store[key] = obj
            self._on_change(key, old, obj)
        else:
            raise WatchError(f"unknown watch event type {kind!r}")
        self.resource_version = version or self.resource_version

    def _abort(self) -> None:
        """Unblock the thread reading the stream: shut its socket (close alone can wait on the read)."""
        response = self._response
        if response is None:
            return
        try:
            sock = getattr(getattr(response, "connection", None), "sock", None)
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _version(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
