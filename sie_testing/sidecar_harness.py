"""Test doubles for the sidecar's neighbours, and a launcher for the real sidecar process.

  FakeWorker        an aiohttp app speaking the worker protocol, with a controllable delay, a hold
                    (requests wait until released), health status, load figures and kill/restart; with
                    `api_key` it answers nothing but /health without it, as real workers do. A data body
                    may ask for an answer: {"status": 418} answers that status, {"die": true} drops the
                    connection before any byte (a worker killed mid-request).
  FakeControlPlane  collects POST /v1/telemetry records (and the credential each came with).
  SidecarProcess    runs `python -m sidecar` as a subprocess with real credentials (sie_testing), learns
                    its data and control addresses from the stdout line, stops it by pid.

They live in sie_testing (never imported by the product) so integration tests and benchmarks share them. They
run in the caller's event loop on 127.0.0.1, port 0 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from sie import metric_names as M
from sie.auth import Identity
from sie_testing.credentials import Credentials


class _Site:
    """An aiohttp app on 127.0.0.1 that can be stopped and started again on the same port."""

    def __init__(self, app: web.Application, port: int = 0, handler_cancellation: bool = False):
        self._app = app
        self.port = port
        self._cancel = handler_cancellation
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self._app, access_log=None, shutdown_timeout=0.5, handler_cancellation=self._cancel
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class FakeWorker:
    def __init__(
        self,
        delay_s: float = 0.0,
        token_usage: float | None = 0.25,
        loads_shape: str = "flat",
        api_key: str | None = None,
    ):
        self.api_key = api_key
        self.refused = 0  # calls without the key
        self.delay_s = delay_s
        self.token_usage = token_usage
        self.loads_shape = loads_shape  # "flat" | "dp" (SGLang's per-rank list) | "missing" (404)
        self.health_status = 200
        self.hold: asyncio.Event | None = None  # when set to an Event, requests wait until it is set
        self.stream_hold: asyncio.Event | None = None  # SSE streams pause after their first chunk until set
        self.running = 0
        self.max_running = 0
        self.cancelled = 0  # requests whose caller hung up before the answer
        self.seen: list[tuple[str, str, bytes]] = []  # (method, path, body) of every data request
        self.seen_headers: list[CIMultiDict[str]] = []
        self.releases: list[int] = []  # `running` at each /release_memory_occupation
        self.resumes = 0
        self.sleeping = False
        app = web.Application(client_max_size=64 << 20, middlewares=[self._key])
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/release_memory_occupation", self._release)
        app.router.add_post("/resume_memory_occupation", self._resume)
        app.router.add_route("*", "/{path:.*}", self._data)
        self._site = _Site(app, handler_cancellation=True)  # as real workers: a caller that hangs up cancels

    @property
    def url(self) -> str:
        return self._site.url

    async def start(self) -> None:
        await self._site.start()

    async def stop(self) -> None:
        """Like a killed process: the port refuses connections until start() again."""
        await self._site.stop()

    @web.middleware
    async def _key(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if (
            self.api_key is not None
            and request.path != "/health"
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            self.refused += 1
            return web.json_response({"error": {"type": "unauthenticated", "message": "no worker key"}}, status=401)
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        status = 503 if self.sleeping else self.health_status
        return web.Response(status=status, text="ok" if status == 200 else "not ready")

    def _rank(self, running: int) -> dict[str, Any]:
        return {
            "num_running_reqs": running,
            "num_waiting_reqs": 0,
            "token_usage": self.token_usage,
            "num_used_tokens": None,
            "max_total_num_tokens": None,
        }

    async def _loads(self, request: web.Request) -> web.Response:
        if self.loads_shape == "missing":
            return web.Response(status=404)
        if self.loads_shape == "dp":
            return web.json_response({"loads": [self._rank(self.running), self._rank(0)]})
        return web.json_response(self._rank(self.running))

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = [f'{M.SGLANG_RUNNING}{{model_name="fake"}} {self.running}', f'{M.SGLANG_QUEUE}{{model_name="fake"}} 0']
        if self.token_usage is not None:
            lines.append(f'{M.SGLANG_TOKEN_USAGE}{{model_name="fake"}} {self.token_usage}')
        return web.Response(text="\n".join(lines) + "\n")

    async def _release(self, request: web.Request) -> web.Response:
        self.releases.append(self.running)
        self.sleeping = True
        return web.json_response({"success": True})

    async def _resume(self, request: web.Request) -> web.Response:
        self.resumes += 1
        self.sleeping = False
        return web.json_response({"success": True})

    async def _data(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, body))
        self.seen_headers.append(CIMultiDict(request.headers))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if self.hold is not None:
                await self.hold.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            doc = json.loads(body) if body.strip().startswith(b"{") else {}
            if doc.get("die"):
                assert request.transport is not None  # a request being handled has its connection
                request.transport.close()  # like a worker killed before it answered
                return web.Response()
            if "status" in doc:
                return web.json_response(
                    {"error": {"type": "as_asked", "message": "as asked"}}, status=int(doc["status"])
                )
            if doc.get("stream"):
                return await self._sse(
                    request, int(doc.get("chunks", 3)), float(doc.get("chunk_delay_s", 0.05)), doc.get("break_after")
                )
            return web.json_response(
                {
                    "text": "hello",
                    "path": request.path,
                    "size": len(body),
                    "received": doc if len(body) < 4096 else None,
                },
                headers={"Set-Cookie": str(doc["set_cookie"])} if "set_cookie" in doc else None,
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1

    async def _sse(
        self, request: web.Request, chunks: int, gap_s: float, break_after: int | None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i in range(chunks):
            if i == break_after:
                assert request.transport is not None
                request.transport.close()  # like a worker that crashes mid-answer
                return resp
            await resp.write(f"data: {json.dumps({'index': i})}\n\n".encode())
            if i == 0 and self.stream_hold is not None:
                await self.stream_hold.wait()
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class FakeControlPlane:
    def __init__(self, status: int = 200):
        self.status = status
        self.records: list[tuple[float, dict[str, Any]]] = []  # (loop time received, record)
        self.credentials: list[str | None] = []  # the Authorization header of each post
        app = web.Application()
        app.router.add_post("/v1/telemetry", self._telemetry)
        self._site = _Site(app)
        self._arrived = asyncio.Event()

    @property
    def url(self) -> str:
        return self._site.url

    async def start(self) -> None:
        await self._site.start()

    async def stop(self) -> None:
        await self._site.stop()

    async def _telemetry(self, request: web.Request) -> web.Response:
        self.credentials.append(request.headers.get("Authorization"))
        self.records.append((asyncio.get_running_loop().time(), await request.json()))
        self._arrived.set()
        return web.json_response({"ok": True}, status=self.status)

    async def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 5.0, after: int = 0
    ) -> dict[str, Any]:
        """The first record (from index `after` on) that satisfies `predicate`; TimeoutError if none."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        index = after
        while True:
            while index < len(self.records):
                record = self.records[index][1]
                index += 1
                if predicate(record):
                    return record
            left = deadline - loop.time()
            if left <= 0:
                states = [r["state"] for _, r in self.records[after:]][-10:]
                raise TimeoutError(f"no matching telemetry record within {timeout_s}s (last states: {states})")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                pass


def write_spec(
    path: Path,
    name: str = "m1",
    max_concurrent: int = 4,
    max_queue_time_ms: float = 1000.0,
    input_fields: list[dict[str, Any]] | None = None,
    allow_extra_fields: bool = True,
    request_timeout_ms: float | None = None,
    limits: dict[str, Any] | None = None,
    routing: dict[str, Any] | None = None,
    **model: Any,
) -> Path:
    doc: dict[str, Any] = {
        "apiVersion": "sie.io/v1alpha1",
        "kind": "ModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {
                "name": name,
                "version": model.get("version", "1.0.0"),
                "service_type": model.get("service_type", "llm"),
                "priority_level": model.get("priority_level", "P1"),
            },
            "backend": {"type": model.get("backend", "sim")},
            "resources": {"max_concurrent_requests": max_concurrent},
            "sla": {"p99_latency_ms": 500, "max_queue_time_ms": max_queue_time_ms},
        },
    }
    if request_timeout_ms is not None:
        doc["spec"]["sla"]["request_timeout_ms"] = request_timeout_ms
    if input_fields is not None:
        doc["spec"]["input_schema"] = {"type": "json", "fields": input_fields, "allow_extra_fields": allow_extra_fields}
    if limits is not None:
        doc["spec"]["limits"] = limits
    if routing is not None:
        doc["spec"]["routing"] = routing
    path.write_text(json.dumps(doc))
    return path


def sidecar_argv(
    spec_file: Path,
    worker_url: str,
    *,
    creds: Credentials,
    instance_id: str,
    node: str,
    worker_key_file: Path | None = None,
    control_url: str | None = None,
    token_file: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of a real sidecar (`python -m sidecar`) on a free data port, trusting `creds`, in
    front of the worker at `worker_url`: the one copy the test launcher and the benchmarks share. With
    `control_url` it reports there with `token_file`; `extra` is appended as given."""
    argv = [
        sys.executable,
        "-m",
        "sidecar",
        "--instance-id",
        instance_id,
        "--spec-file",
        str(spec_file),
        "--listen",
        "127.0.0.1:0",
        "--worker-url",
        worker_url,
        "--node",
        node,
        "--trust-file",
        str(creds.trust_file),
    ]
    if worker_key_file is not None:
        argv += ["--worker-key-file", str(worker_key_file)]
    if control_url is not None:
        if token_file is None:
            raise ValueError("a sidecar that reports to a control plane needs its token file")
        argv += ["--control-url", control_url, "--token-file", str(token_file)]
    return [*argv, *extra]


class SidecarProcess:
    """`python -m sidecar` in a subprocess, with the credentials a node host would give it (its token, the
    trust bundle, its worker's key). Always call stop() (or kill()) in teardown."""

    def __init__(
        self,
        spec_file: Path,
        worker_url: str,
        control_url: str | None = None,
        *extra: str,
        creds: Credentials,
        worker_key_file: Path | None = None,
        instance_id: str = "m1-0",
        node: str = "node-a",
        model_id: str = "m1",
    ):
        secrets_dir = Path(spec_file).parent / "secrets"
        self.argv = sidecar_argv(
            spec_file,
            worker_url,
            creds=creds,
            instance_id=instance_id,
            node=node,
            worker_key_file=worker_key_file,
            control_url=control_url or None,
            token_file=creds.sidecar_token_file(secrets_dir, instance_id, model_id, node) if control_url else None,
            extra=("--control-listen", "127.0.0.1:0", *extra),
        )
        # Who calls its control listener: the node host of its node.
        self.headers = creds.headers(Identity.for_node(node))
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.control_address = ""
        self.returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def control_url(self) -> str:
        return f"http://{self.control_address}"

    async def start(self, timeout_s: float = 20.0) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=None, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        assert self.proc.stdout is not None  # started with stdout=PIPE just above
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout_s)
        if not line:
            raise RuntimeError(f"sidecar exited before listening (code {self.proc.wait(5)}); see its stderr above")
        announced = json.loads(line)
        self.address, self.control_address = announced["address"], announced["control"]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        self.returncode = await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
        return self.returncode

    async def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None and self.proc.stdout:
                self.proc.stdout.close()  # it exited on its own (a test's SIGTERM): its pipe still needs closing
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return await self.wait(timeout_s)
        except TimeoutError:
            self.proc.kill()
            return await self.wait(5.0)
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()


@dataclass
class Stack:
    worker: FakeWorker
    control: FakeControlPlane | None
    sidecar: SidecarProcess
    http: aiohttp.ClientSession
    creds: Credentials

    @property
    def url(self) -> str:
        return self.sidecar.url

    @property
    def control_url(self) -> str:
        return self.sidecar.control_url

    @property
    def headers(self) -> dict[str, str]:
        """The node host's credential, for the control listener."""
        return self.sidecar.headers

    async def state(self) -> dict[str, Any]:
        async with self.http.get(self.control_url + "/-/state", headers=self.headers) as resp:
            return await resp.json()

    async def wait_state(self, state: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Poll GET /-/state until it reads `state`; TimeoutError naming the last state if not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            doc = await self.state()
            if doc["state"] == state:
                return doc
            if loop.time() > deadline:
                raise TimeoutError(f"sidecar state is {doc['state']!r}, not {state!r}, after {timeout_s}s")
            await asyncio.sleep(0.05)


@asynccontextmanager
async def sidecar_stack(
    directory: Path, *flags: str, worker: FakeWorker | None = None, control: bool = True, **spec: Any
) -> AsyncIterator[Stack]:
    """A fake worker (asking for its key), a fake control plane and the real sidecar process with real
    credentials, torn down in reverse."""
    creds = Credentials.create(directory)
    worker = worker or FakeWorker()
    key, key_file = creds.worker_key(directory / "secrets")
    worker.api_key = key
    plane = FakeControlPlane() if control else None
    http = aiohttp.ClientSession()
    sidecar: SidecarProcess | None = None
    try:
        await worker.start()
        if plane is not None:
            await plane.start()
        spec_file = write_spec(directory / "spec.json", **spec)
        sidecar = SidecarProcess(
            spec_file,
            worker.url,
            plane.url if plane else None,
            *flags,
            creds=creds,
            worker_key_file=key_file,
            model_id=spec.get("name", "m1"),
        )
        await sidecar.start()
        yield Stack(worker, plane, sidecar, http, creds)
    finally:
        for hold in (worker.hold, worker.stream_hold):
            if hold is not None:
                hold.set()  # let held requests finish, so the sidecar's own drain is short
        if sidecar is not None:
            await sidecar.stop()
        await http.close()
        await worker.stop()
        if plane is not None:
            await plane.stop()
