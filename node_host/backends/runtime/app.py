"""The HTTP side of the worker protocol (see backends/protocol.py for the endpoints and the Engine contract).

The app owns what is the same for every engine: parsing and answering the SGLang/OpenAI bodies, SSE
streaming, the gate that refuses traffic while memory is released, the idleness check before a release,
and the metrics it can measure from outside the engine (latency, time to first token, throughput).

Invariant of the gate: `_in_flight` counts requests between admission and their answer; a request is
admitted only when the engine is READY and no memory transition runs, and the check and the increment
happen with no await between them, so a release that sees `_in_flight == 0` cannot race a new request.

Trust: with an `api_key` (the node host always gives one), every endpoint but /health needs
`Authorization: Bearer <key>`; only the instance's sidecar and node host hold it. Bodies are read up to
the spec's limits.max_body_bytes, as the sidecar reads them (413 above), parsed by sie.strict_json, and
every way a body can be wrong is a 400 naming it, never a 500 (a 500 would count toward the instance's
error rate and get good traffic shed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from node_host.backends.protocol import (
    BadRequest,
    Busy,
    Completion,
    Delta,
    Engine,
    EngineState,
    GenerateRequest,
    Unavailable,
    WorkerError,
    collect,
)
from node_host.backends.runtime import bodies
from node_host.backends.runtime.batching import BatchLimits, MicroBatcher
from node_host.backends.runtime.metrics import WorkerMetrics
from sie import strict_json
from sie.auth import same_secret
from sie.auth.http import bearer
from sie.errors import InputError, error_body
from sie.http import as_json, internal_error

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


# The error `type` each WorkerError class answers with (sie.errors.error_body; `code` is the status, as
# SGLang's own error bodies carry it).
_KINDS = {"BadRequest": "bad_request", "Unavailable": "unavailable", "Busy": "busy", "WorkerError": "worker_error"}
OPEN_PATHS = frozenset({"/health", "/health_generate"})
# A worker run without a spec's limits (tests, embedding) takes bodies up to the largest
# limits.max_body_bytes a spec may set; run_worker passes the spec's own (main.WorkerOptions).
MAX_BODY_BYTES = 64 * 1024 * 1024


def _error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return error_body(_KINDS.get(kind, kind), message, code=status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except WorkerError as exc:
        return web.json_response(_error_body(exc.status, str(exc), type(exc).__name__), status=exc.status)
    except InputError as exc:
        return web.json_response(error_body(exc.kind, str(exc), code=exc.status), status=exc.status)
    except web.HTTPException as exc:
        raise as_json(exc, request) from None
    except Exception:  # a bug or an engine failure: answer JSON like every other error, and log it
        return internal_error(request)


def _key_check(api_key: str) -> Callable:
    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path not in OPEN_PATHS and not same_secret(bearer(request.headers.get("Authorization")), api_key):
            return web.json_response(
                error_body(
                    "unauthenticated",
                    "this worker answers only its own sidecar and node host: send Authorization: Bearer <worker key>",
                    code=401,
                ),
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="sie-worker"'},
            )
        return await handler(request)

    return check


def _memory_body(message: str, memory: Mapping[str, Any] | None) -> dict[str, Any]:
    """SGLang's {"success", "message"}, plus `memory` (the engine's figures of the move) when it gives them."""
    body: dict[str, Any] = {"success": True, "message": message}
    if memory is not None:
        body["memory"] = dict(memory)
    return body


async def _json(request: web.Request) -> Any:
    return strict_json.loads(await request.read(), what="the body")


class WorkerApp:
    """Binds one engine to the worker protocol. `clock` is monotonic seconds, `wall` is unix time."""

    def __init__(
        self,
        engine: Engine,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        api_key: str | None = None,
        max_new_tokens: int | None = None,
        batching: BatchLimits = BatchLimits(),
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self.engine = engine
        self._api_key = api_key
        self._max_body = max_body_bytes
        self._max_new = max_new_tokens
        self._clock = clock
        self._wall = wall
        self._generative = callable(getattr(engine, "generate", None))
        self._scoring = callable(getattr(engine, "infer", None))
        self._in_flight = 0
        self._transition: str | None = None  # "release" / "resume" while one runs
        self._memory_lock = asyncio.Lock()
        self.metrics = WorkerMetrics(engine.served_model_name, engine.loads, generative=self._generative, clock=clock)
        self._batcher = (
            MicroBatcher(engine.infer, batching, observe=self.metrics.observe_batch, clock=clock)  # type: ignore[attr-defined]
            if self._scoring
            else None
        )

    def build(self) -> web.Application:
        middlewares = [_errors] if self._api_key is None else [_errors, _key_check(self._api_key)]
        app = web.Application(middlewares=middlewares, client_max_size=self._max_body)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/release_memory_occupation", self._release)
        app.router.add_post("/resume_memory_occupation", self._resume)
        if self._generative:
            app.router.add_post("/generate", self._generate)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/v1/completions", self._completions)
        if self._scoring:
            app.router.add_post("/infer", self._infer)
        return app

    # ---- state ------------------------------------------------------------------------------------

    def _status(self) -> str:
        if self._transition is not None:
            return "sleeping"  # mid-release or mid-resume: not serving either way
        state = self.engine.state
        return "ok" if state is EngineState.READY else state.value

    def _admit(self) -> None:
        status = self._status()
        if status != "ok":
            raise Unavailable(f"model {self.engine.served_model_name!r} is {status}; retry on another instance")
        self._in_flight += 1

    async def _health(self, _: web.Request) -> web.Response:
        status = self._status()
        return web.json_response({"status": status}, status=200 if status == "ok" else 503)

    async def _models(self, _: web.Request) -> web.Response:
        model = {
            "id": self.engine.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "sie",
            "root": self.engine.model_path,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.engine.model_path,
                "served_model_name": self.engine.served_model_name,
                "backend": self.engine.backend,
                "is_generation": self._generative,
                "simulated": bool(getattr(self.engine, "simulated", False)),
            }
        )

    async def _loads(self, _: web.Request) -> web.Response:
        loads = self.engine.loads()
        return web.json_response(
            {
                "num_running_reqs": loads.running,
                "num_waiting_reqs": loads.waiting,
                "token_usage": loads.token_usage,
                "num_used_tokens": loads.used_tokens,
                "max_total_num_tokens": loads.max_total_tokens,
                "cache_hit_rate": loads.cache_hit_rate,
                "timestamp": self._wall(),
            }
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    # ---- memory -----------------------------------------------------------------------------------

    async def _tags(self, request: web.Request) -> list[str]:
        if not request.can_read_body:
            return []
        body = await _json(request)
        tags = (body or {}).get("tags") if isinstance(body, dict) else None
        if tags is None:
            return []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise BadRequest("tags: expected a list of strings such as ['weights', 'kv_cache']")
        return tags

    async def _release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        async with self._memory_lock:
            state = self.engine.state
            if state is EngineState.SLEEPING:
                return web.json_response({"success": True, "message": "already released"})
            if state is not EngineState.READY:
                raise Unavailable(f"cannot release memory while the model is {state.value}")
            loads = self.engine.loads()
            busy = max(self._in_flight, loads.running + loads.waiting)
            if busy:
                raise Busy(
                    f"{busy} request(s) are in flight; releasing memory needs an idle worker: drain it first "
                    "(stop routing new requests and wait for these to finish), then retry"
                )
            self._transition = "release"
            try:
                memory = await self.engine.release(tags)
            finally:
                self._transition = None
        log.info("released memory (tags %s)", tags or "all")
        return web.json_response(_memory_body("released", memory))

    async def _resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        async with self._memory_lock:
            if self.engine.state is EngineState.READY:
                return web.json_response({"success": True, "message": "already resident"})
            if self.engine.state is not EngineState.SLEEPING:
                raise Unavailable(f"cannot resume while the model is {self.engine.state.value}")
            self._transition = "resume"
            try:
                memory = await self.engine.resume(tags)
            finally:
                self._transition = None
        log.info("resumed memory (tags %s)", tags or "all")
        return web.json_response(_memory_body("resumed", memory))

    # ---- generation -------------------------------------------------------------------------------

    async def _run(self, request: GenerateRequest) -> AsyncGenerator[Delta, None]:
        """The engine's deltas, with the measurements every engine gets for free. Closes the engine's
        generator when the consumer stops early, so the engine frees the request."""
        counted = 0  # tokens already added to the throughput window
        async with contextlib.aclosing(self.engine.generate(request)) as deltas:  # type: ignore[attr-defined]
            async for delta in deltas:
                if delta.queue_time_s is not None:
                    self.metrics.observe_queue(delta.queue_time_s)
                if counted == 0 and delta.completion_tokens > 0:
                    self.metrics.observe_ttft(self._clock() - request.arrival)
                self.metrics.add_tokens(delta.completion_tokens - counted)
                counted = max(counted, delta.completion_tokens)
                yield delta
                if delta.finish_reason is not None:
                    self.metrics.observe_e2e(self._clock() - request.arrival)

    async def _collect(self, request: GenerateRequest) -> Completion:
        return await collect(self._run(request))

    async def _generate(self, http: web.Request) -> web.StreamResponse:
        request, stream = bodies.parse_generate(await _json(http), self._clock(), self._max_new)
        self._admit()
        try:
            if not stream:
                done = await self._collect(request)
                return web.json_response(
                    bodies.generate_body(
                        request.rid,
                        done.text,
                        done.prompt_tokens,
                        done.completion_tokens,
                        done.finish_reason,
                        done.matched_stop,
                        self._clock() - request.arrival,
                    )
                )
            text = ""

            def render(delta: Delta) -> dict[str, Any]:
                nonlocal text
                text += delta.text  # SGLang streams the text so far, not the increment
                return bodies.generate_body(
                    request.rid,
                    text,
                    delta.prompt_tokens,
                    delta.completion_tokens,
                    delta.finish_reason,
                    delta.matched_stop,
                    self._clock() - request.arrival,
                )

            response, _ = await self._sse(http, request, render)
            return await self._close_sse(response)
        finally:
            self._in_flight -= 1

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        request, stream, include_usage = bodies.parse_chat(await _json(http), self._clock(), self._max_new)
        return await self._openai(http, request, stream, include_usage, chat=True)

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        request, stream, include_usage = bodies.parse_completion(await _json(http), self._clock(), self._max_new)
        return await self._openai(http, request, stream, include_usage, chat=False)

    async def _openai(
        self, http: web.Request, request: GenerateRequest, stream: bool, include_usage: bool, *, chat: bool
    ) -> web.StreamResponse:
        model = self.engine.served_model_name
        created = int(self._wall())
        self._admit()
        try:
            if not stream:
                done = await self._collect(request)
                make = bodies.chat_body if chat else bodies.completion_body
                return web.json_response(make(request.rid, model, done, created))
            if chat:
                opening = bodies.chat_chunk(request.rid, model, created, None, first=True)
                response, last = await self._sse(
                    http, request, lambda d: bodies.chat_chunk(request.rid, model, created, d, first=False), opening
                )
            else:
                response, last = await self._sse(
                    http, request, lambda d: bodies.completion_chunk(request.rid, model, created, d)
                )
            if include_usage and last is not None and last.finish_reason is not None:
                obj = "chat.completion.chunk" if chat else "text_completion"
                await self._send(response, bodies.usage_chunk(request.rid, model, created, obj, last))
            return await self._close_sse(response)
        finally:
            self._in_flight -= 1

    # ---- SSE --------------------------------------------------------------------------------------

    async def _sse(
        self,
        http: web.Request,
        request: GenerateRequest,
        render: Callable[[Delta], dict[str, Any]],
        opening: dict[str, Any] | None = None,
    ) -> tuple[web.StreamResponse, Delta | None]:
        """Stream a generation as SSE events; returns the response (not yet closed) and the last Delta.

        The first Delta is awaited before the 200 header goes out, so an error the engine raises up
        front (a prompt over the context) still gets its own HTTP status. After that the status is
        sent: an error goes into the stream as an error event (as SGLang does), then [DONE].
        """
        async with contextlib.aclosing(self._run(request)) as deltas:
            try:
                first = await anext(deltas)
            except StopAsyncIteration:
                raise RuntimeError("engine ended a generation without any Delta") from None
            response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
            await response.prepare(http)
            if opening is not None:
                await self._send(response, opening)
            await self._send(response, render(first))
            last = first
            while last.finish_reason is None:
                try:
                    last = await anext(deltas)
                except StopAsyncIteration:
                    break
                except WorkerError as exc:
                    await self._send(response, _error_body(exc.status, str(exc), type(exc).__name__))
                    break
                except Exception as exc:
                    log.exception("generation %s failed mid-stream", request.rid)
                    await self._send(response, _error_body(500, f"internal error: {exc!r}", "internal_error"))
                    break
                await self._send(response, render(last))
        return response, last

    async def _send(self, response: web.StreamResponse, body: dict[str, Any]) -> None:
        await response.write(b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n")

    async def _close_sse(self, response: web.StreamResponse) -> web.StreamResponse:
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # ---- scoring ----------------------------------------------------------------------------------

    async def _infer(self, http: web.Request) -> web.Response:
        body = await _json(http)
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object: one row of input fields, or {'instances': [...]}")
        batched = "instances" in body
        rows = body["instances"] if batched else [body]
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise BadRequest("instances: expected a non-empty list of objects")
        start = self._clock()
        self._admit()
        try:
            assert self._batcher is not None  # the route exists only for a scoring engine
            out = await self._batcher.submit(rows)
        finally:
            self._in_flight -= 1
        self.metrics.observe_e2e(self._clock() - start)
        # orjson: compact, and several times faster than json.dumps for the small rows a scorer returns.
        answer = orjson.dumps({"predictions": out} if batched else out[0])
        return web.Response(body=answer, content_type="application/json")
