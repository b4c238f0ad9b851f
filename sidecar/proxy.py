"""The data path: the data listener serves exactly the model's inference paths, through `Proxy.handle`.

Only `POST` on the paths of the model's public API (sie.spec: by service type, plus the spec's
routing.inference_paths) reaches the worker; any other path is a 404 and any other method a 405, so a
request Envoy should have refused is refused again here (DESIGN §10). Control endpoints live on the
control listener (sidecar/admin.py), never on this one.

Per request, in order: refuse at once if the instance is not serving (503, retryable), unless it holds
requests while it sleeps or loads (sidecar/waking.py: at most max_concurrent + max_queue, more get 429
queue_full at once; after the checks below, the request waits for the instance to serve, or gets 503
wake_failed naming why); read the body
once, up to limits.max_body_bytes (413); parse it with sie.strict_json (400 on invalid UTF-8, lone
surrogates, depth, huge integers, duplicate keys); hold every spelling of the token limit to the
model's (max_tokens, max_completion_tokens, sampling_params.max_new_tokens in the object or in each
object of a list: 400); hold a generation's temperature and top_p to their ranges (validation.py
`sampling_problem`: 400); check the input
schema (400, the worker never sees it); take a slot or queue for one (429 when the queue is full, 503
after max_queue_time_ms; both retryable); forward on the sidecar's keep-alive connections to its worker
(sidecar/worker_http.py) with the worker's key (the client's Authorization never reaches the worker); pass the answer back (SSE and other unsized
bodies chunk by chunk as they arrive); give the slot back; record metrics. Client errors (4xx) go
into neither the latency window nor the error rate, so malformed requests cannot move weights or shed
good traffic. Telemetry reads what this leaves behind; it adds nothing here.

A worker that dies mid-request: while nothing of the answer has reached the client, the request is
answered 503 `worker_lost` marked retryable (Envoy retries it on another instance; inference has no
side effects; routing.retry_on_worker_loss: false makes it a 502); a stream whose headers are out ends
with an SSE error event naming the cause. A worker that answers, with something the sidecar does not
pass on (over max_answer_bytes, not HTTP/1.1, a control character in its head: worker_http.BadAnswer),
gets 502 `worker_error`, not retried: another instance would answer the same.

A slot is never held for longer than someone waits for the answer. When the client hangs up (Envoy
does at its route timeout) the server cancels the handler (sidecar.main), which closes the worker's
connection, so the worker aborts the request too; it is counted as 499. And the worker call has the
model's route timeout as its own deadline, for callers that never hang up: past it the answer is a
504 `worker_timeout`, and the slot is free.

"Retryable" means the worker never saw the request: the response carries `x-sie-retryable: true`,
and Envoy retries exactly those on another instance. Every answer carries `x-sie-instance: <id>`, so
clients and benchmarks can see which instance served them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, MultiMapping

from sidecar.admission import Gate, Verdict
from sidecar.metrics import Metrics
from sidecar.status import Status
from sidecar.validation import CompiledSchema, check_document, sampling_problem
from sidecar.waking import Waker
from sidecar.window import SlidingWindow
from sidecar.worker_http import AnswerFailed, BadAnswer, ConnectFailed, Upstream, WorkerHTTP
from sie import strict_json
from sie.engines import InferCodec
from sie.errors import InputError, error_bytes

log = logging.getLogger(__name__)

RETRYABLE = "x-sie-retryable"
INSTANCE = "x-sie-instance"
CLIENT_GONE = 499  # nginx's code for "the client closed the connection first"

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
_HOP_BY_HOP = frozenset(
    (
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    )
)
# The worker client sets Host and Content-Length for the hop it makes; Expect was answered on our side;
# the client's Authorization is for SIE's ingress, never the worker's (which gets its own key). The body
# forwarded is the one checked, which aiohttp's server has already decoded (a gzip, deflate, br or zstd
# Content-Encoding; any other coding fails the JSON check), so its Content-Encoding no longer holds.
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "expect", "authorization", "content-encoding"}
_RESPONSE_DROP = _HOP_BY_HOP | {"content-length"}


def forward_headers(headers: MultiMapping[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """Headers for the next hop: without hop-by-hop ones, nor those any Connection header names."""
    listed = ",".join(headers.getall("Connection", ()))  # a second Connection line adds to the first
    named = {token.strip().lower() for token in listed.split(",")} if listed else ()
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        lower = key.lower()
        if lower not in drop and lower not in named:
            out.add(key, value)
    return out


def _is_stream(upstream: Upstream) -> bool:
    fields = upstream.fields
    media = fields.get("content-type", "").partition(";")[0].strip().lower()
    return media == "text/event-stream" or "content-length" not in fields


def error_body(kind: str, model: str, message: str, **extra: Any) -> bytes:
    return error_bytes(kind, message, model=model, **extra)


# Where each generation endpoint takes its token limit (sie.spec Limits.max_new_tokens).
TOKEN_KEYS = ("max_tokens", "max_completion_tokens")


def token_problem(doc: dict[str, Any], limit: int | None) -> tuple[str, str] | None:
    """(field, why) when a body asks for more new tokens than the model allows, under any spelling.

    SGLang's /generate takes `sampling_params` as one object or as a list of them (one per prompt), so
    every element is held to the limit; any other shape is refused, since the worker would read a
    limit from it that nobody checked."""
    if limit is None:
        return None
    asked: list[tuple[str, Any]] = [(k, doc.get(k)) for k in TOKEN_KEYS]
    params = doc.get("sampling_params")
    if isinstance(params, dict):
        asked.append(("sampling_params.max_new_tokens", params.get("max_new_tokens")))
    elif isinstance(params, list):
        for i, each in enumerate(params):
            if not isinstance(each, dict):
                return f"sampling_params[{i}]", "must be an object"
            asked.append((f"sampling_params[{i}].max_new_tokens", each.get("max_new_tokens")))
    elif params is not None:
        return "sampling_params", "must be an object or a list of objects"
    for key, value in asked:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return key, "must be a non-negative integer"
        if value > limit:
            return key, f"is {value}, more than this model allows ({limit})"
    return None


class Proxy:
    def __init__(
        self,
        *,
        worker: WorkerHTTP,
        instance_id: str,
        model_id: str,
        schema: CompiledSchema | None,
        paths: frozenset[str],
        max_body_bytes: int,
        max_new_tokens: int | None,
        retry_on_worker_loss: bool,
        gate: Gate,
        status: Status,
        metrics: Metrics,
        window: SlidingWindow,
        clock: Callable[[], float],
        on_worker_unreachable: Callable[[], None],
        worker_timeout_s: float,
        connect_timeout_s: float,
        waker: Waker | None = None,
        targets: Mapping[str, str] | None = None,
        codec: InferCodec | None = None,
        error_shape: Callable[[int, bytes], bytes] | None = None,
    ):
        self._worker = worker
        # Where each public path goes at the worker (the engine's own path, sie.engines); the same path when
        # not given. `codec` translates /infer bodies for an engine that does not take SIE's JSON (Triton).
        self._targets = dict(targets or {})
        self._codec = codec
        self._error_shape = error_shape  # the engine's error answers into SIE's one shape (sie.engines)
        self._model = model_id
        self._instance = instance_id
        self._plain = {INSTANCE: instance_id}
        self._waker = waker  # holds requests while the instance sleeps or loads (None: refuse them)
        self._retryable = {"Retry-After": "1", RETRYABLE: "true", INSTANCE: instance_id}
        self._schema = schema
        self._paths = paths
        self._max_body = max_body_bytes
        self._max_new = max_new_tokens
        self._retry_lost = retry_on_worker_loss
        self._gate = gate
        self._status = status
        self._metrics = metrics
        self._window = window
        self._clock = clock
        self._on_unreachable = on_worker_unreachable
        self._worker_timeout_s = worker_timeout_s
        # A connection is made well before the call's deadline, so a worker that never got the request is
        # a retryable 503 (ConnectFailed), never the 504 of one that had it.
        self._connect_timeout_s = min(connect_timeout_s, worker_timeout_s / 2)
        self.answered_total = 0
        # Requests admitted and not yet answered: arrival time by a serial number. Their ages join the
        # window's fast signal (sidecar.window), so a slowdown shows before the slow answers arrive.
        self._running: dict[int, float] = {}
        self._serial = 0
        self.worker_answered_at = float("-inf")  # loop time of the worker's latest answer (proof of life)
        limits = gate.core.limits
        # Refusals are answered from bytes built once: refusing must cost less than serving.
        self._queue_full = error_body(
            "queue_full",
            model_id,
            f"model {model_id} has {limits.max_queue} requests queued behind {limits.max_concurrent} in flight "
            "(the queue bound); retry later or on another instance",
            max_queue=limits.max_queue,
            max_concurrent_requests=limits.max_concurrent,
        )
        wait_ms = round(limits.max_wait_s * 1000.0, 3)
        self._queue_timeout = error_body(
            "queue_timeout",
            model_id,
            f"model {model_id}: the request waited longer than max_queue_time_ms={wait_ms:g} for a slot; "
            "retry later or on another instance",
            max_queue_time_ms=wait_ms,
        )
        self._handed_back = error_body(
            "draining",
            model_id,
            f"model {model_id}: this instance is draining and handed the request back unserved; retry on another instance",
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        start = self._clock()
        if request.path not in self._paths:
            return self._refuse(
                404,
                error_body(
                    "not_found",
                    self._model,
                    f"model {self._model} serves POST on {', '.join(sorted(self._paths))} "
                    f"only; {request.path[:128]!r} is not one of them",
                    paths=sorted(self._paths),
                ),
                retryable=False,
            )
        if request.method != "POST":
            return self._refuse(
                405,
                error_body("method_not_allowed", self._model, f"{request.path} takes POST, not {request.method[:16]}"),
                retryable=False,
                extra={"Allow": "POST"},
            )
        # Held while the instance sleeps or first loads: the place is taken on arrival, before the body is
        # read, so the bodies waiting in memory are bounded as the Gate's are. One that arrived while it
        # served is never held (it finds the gate shut below: a retryable 503).
        serving = self._status.serving
        waker = self._waker if not serving and self._waker is not None and self._waker.holds() else None
        if waker is None and not serving:
            return self._refuse(503, self._unavailable_body())
        if waker is not None and not waker.enter():
            return self._refuse(429, self._queue_full)
        try:
            refusal, body = await self._read(request)
            if refusal is not None:
                return refusal  # a bad request never wakes anything
            # The instance may have begun serving, or failed, while the body was read.
            why = await waker.hold() if waker is not None and waker.holds() else None
        finally:
            if waker is not None:
                waker.leave()
        if why is not None:
            self.answered_total += 1
            self._metrics.answered(503)
            return web.Response(
                status=503,
                body=error_body("wake_failed", self._model, f"model {self._model}: {why}; retry shortly"),
                content_type="application/json",
                headers={**self._plain, "Retry-After": "1"},
            )
        if not self._status.serving:
            # The state changed while the body was read (a drain began): the gate must stay shut.
            return self._refuse(503, self._unavailable_body())
        verdict, waiter = self._gate.arrive()
        if waiter is not None:
            verdict = await self._gate.wait(waiter)
        if verdict is not Verdict.ADMITTED:
            if verdict is Verdict.QUEUE_FULL:
                return self._refuse(429, self._queue_full)
            return self._refuse(503, self._queue_timeout if verdict is Verdict.QUEUE_TIMEOUT else self._handed_back)

        admitted = self._clock()
        code = 502
        self._serial += 1
        serial = self._serial
        self._running[serial] = start
        try:
            resp, code = await self._forward(request, body)
            return resp
        except asyncio.CancelledError:
            code = CLIENT_GONE  # the client hung up; cancelling here abandons the worker's call as well
            raise
        finally:
            del self._running[serial]
            self._gate.release()
            done = self._clock()
            self._metrics.answered(code)
            if not 400 <= code < 500:  # a client's error says nothing about how this instance serves
                self._metrics.served(done - start, admitted - start)
                self._window.add(done, done - start, admitted - start, code >= 500)
            self.answered_total += 1

    async def _read(self, request: web.Request) -> tuple[web.Response | None, bytes]:
        """The body, parsed and checked: (a refusal, b"") or (None, the bytes to forward)."""
        length = request.content_length
        if length is not None and length > self._max_body:
            return self._too_large(length), b""
        body = b""
        if request.body_exists:
            parts: list[bytes] = []
            size = 0
            async for chunk in request.content.iter_any():  # a chunked body has no length to check up front
                size += len(chunk)
                if size > self._max_body:
                    return self._too_large(None), b""
                parts.append(chunk)
            body = b"".join(parts)
        try:
            doc = strict_json.loads_object(body, what=f"the body of {request.path}")
        except InputError as exc:
            return self._refuse(exc.status, error_body(exc.kind, self._model, str(exc)), retryable=False), b""
        problem = token_problem(doc, self._max_new)
        if problem is not None:
            field, reason = problem
            return self._refuse(
                400,
                error_body(
                    "token_limit",
                    self._model,
                    f"model {self._model}: {field} {reason}",
                    field=field,
                    reason=reason,
                    max_new_tokens=self._max_new,
                ),
                retryable=False,
            ), b""
        sampling = sampling_problem(request.path, doc)
        if sampling is not None:
            return self._refuse(
                400,
                error_body(
                    "invalid_sampling_params",
                    self._model,
                    f"model {self._model}: {sampling.field} {sampling.reason}",
                    field=sampling.field,
                    reason=sampling.reason,
                ),
                retryable=False,
            ), b""
        if self._schema is not None:
            violation = check_document(self._schema, doc)
            if violation is not None:
                self._metrics.invalid_schema()
                return self._refuse(
                    400,
                    error_body(
                        "invalid_schema",
                        self._model,
                        f"model {self._model}: field {violation.field!r} {violation.reason}"
                        if violation.field
                        else f"model {self._model}: {violation.reason}",
                        field=violation.field,
                        reason=violation.reason,
                    ),
                    retryable=False,
                ), b""
        if self._codec is not None and request.path == "/infer":
            try:
                body = self._codec.request(doc)
            except InputError as exc:
                return self._refuse(exc.status, error_body(exc.kind, self._model, str(exc)), retryable=False), b""
        return None, body

    def _too_large(self, length: int | None) -> web.Response:
        size = f"{length} bytes" if length is not None else "more"
        return self._refuse(
            413,
            error_body(
                "body_too_large",
                self._model,
                f"model {self._model} takes bodies up to {self._max_body} bytes "
                f"(limits.max_body_bytes), this one has {size}",
                max_body_bytes=self._max_body,
            ),
            retryable=False,
        )

    def running_since(self) -> list[float]:
        """Arrival times (the proxy's clock) of the requests at the worker now."""
        return list(self._running.values())

    async def _forward(self, request: web.Request, body: bytes) -> tuple[web.StreamResponse, int]:
        headers = forward_headers(request.headers, _REQUEST_DROP)  # the worker's key is the client's own
        if self._codec is not None or self._error_shape is not None:
            # The answer may be rewritten (sie.engines: Triton's v2 JSON, an engine's error shape), so it must
            # come back as plain bytes: Triton gzips for a client that accepts it, and the codec reads JSON.
            headers.popall("Accept-Encoding", None)
        # The path forwarded is the one checked (one of this model's paths, literally), never the raw one.
        query = request.rel_url.raw_query_string
        target = self._targets.get(request.path, request.path) + (f"?{query}" if query else "")
        # The whole answer, a stream's included, is due by the model's route timeout.
        deadline = asyncio.get_running_loop().time() + self._worker_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                upstream = await self._worker.open(target, body, headers.items(), self._connect_timeout_s)
        except ConnectFailed as exc:
            # No connection was made, so the worker never saw the request: safe to retry elsewhere.
            self._on_unreachable()
            log.warning("worker unreachable for %s %s: %s", request.method, request.path, exc)
            return self._error(503, "worker_unreachable", f"cannot connect to the worker: {exc}", True), 503
        except TimeoutError:
            return self._timed_out(request), 504
        except BadAnswer as exc:
            return self._bad_answer(request, exc)
        except AnswerFailed as exc:
            self._on_unreachable()
            log.warning("worker failed on %s %s: %s", request.method, request.path, exc)
            return self._lost(exc, "dropped the request")
        except ValueError as exc:  # a header or query the client sent that HTTP/1.1 cannot carry on
            return self._error(400, "bad_request", f"model {self._model}: {exc}", False), 400
        self.worker_answered_at = self._clock()
        try:
            if _is_stream(upstream):
                return await self._stream(request, upstream, deadline)
            async with asyncio.timeout_at(deadline):
                payload = await upstream.read_all()
        except TimeoutError:
            return self._timed_out(request), 504
        except BadAnswer as exc:
            return self._bad_answer(request, exc)
        except AnswerFailed as exc:
            self._on_unreachable()
            log.warning("worker broke off the answer to %s %s: %s", request.method, request.path, exc)
            return self._lost(exc, "broke off its answer")
        finally:
            upstream.release()  # back to the pool when read to its end; closed otherwise
        if self._codec is not None and request.path == "/infer":
            status, payload = self._codec.response(upstream.status, payload)
            headers = self._answer_headers(upstream)
            headers["Content-Type"] = "application/json"
            return web.Response(status=status, body=payload, headers=headers), status
        if self._error_shape is not None and upstream.status >= 400:
            headers = self._answer_headers(upstream)
            headers["Content-Type"] = "application/json"
            body = self._error_shape(upstream.status, payload)
            return web.Response(status=upstream.status, body=body, headers=headers), upstream.status
        return web.Response(
            status=upstream.status, reason=upstream.reason or None, body=payload, headers=self._answer_headers(upstream)
        ), upstream.status

    def _answer_headers(self, upstream: Upstream) -> CIMultiDict[str]:
        headers = forward_headers(CIMultiDict(upstream.headers), _RESPONSE_DROP)
        headers[INSTANCE] = self._instance
        return headers

    async def _stream(
        self, request: web.Request, upstream: Upstream, deadline: float
    ) -> tuple[web.StreamResponse, int]:
        resp = web.StreamResponse(
            status=upstream.status, reason=upstream.reason or None, headers=self._answer_headers(upstream)
        )
        # A client that hangs up can make aiohttp's writes (the head, a chunk, the end) raise
        # ConnectionResetError before the server cancels this handler: that is the client's hang-up (499),
        # as a cancellation is, not the worker's fault.
        try:
            await resp.prepare(request)
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await upstream.read_some()  # whatever has arrived: no whole-stream buffering
                except (AnswerFailed, TimeoutError) as exc:
                    return resp, await self._cut(request, resp, exc)
                if not chunk:
                    break
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionResetError:
            return resp, CLIENT_GONE  # release() closes the worker's side too
        return resp, upstream.status

    async def _cut(self, request: web.Request, resp: web.StreamResponse, exc: AnswerFailed | TimeoutError) -> int:
        """End a stream the worker broke off or did not finish in time; the code to count.

        Headers are out, so the status cannot change: the stream ends with an SSE error event naming the
        cause, then the connection is cut, so no client mistakes it for a clean end. The deadline covers
        the whole answer, as Envoy's route timeout does."""
        if isinstance(exc, TimeoutError):
            self._timed_out(request)
            code, kind, why = 504, "worker_timeout", f"the worker did not finish within {self._worker_timeout_s:g}s"
        else:
            log.warning("worker broke off the stream for %s %s: %s", request.method, request.path, exc)
            code, kind, why = 502, "worker_lost", f"the worker broke off the stream: {exc}"
        event = b"data: " + error_body(kind, self._model, f"model {self._model}: {why}") + b"\n\n"
        try:
            await resp.write(event)
        except (ConnectionResetError, RuntimeError):
            pass  # the client is gone too
        if request.transport is not None:
            request.transport.close()
        return code

    def _timed_out(self, request: web.Request) -> web.Response:
        """The worker call passed its deadline (the model's route timeout): 504, not retryable."""
        self._on_unreachable()  # a health probe now tells a hung worker from one slow request
        log.warning("the worker did not answer %s %s within %gs", request.method, request.path, self._worker_timeout_s)
        return self._error(
            504,
            "worker_timeout",
            f"the worker did not answer within {self._worker_timeout_s:g}s (the model's route timeout)",
            False,
        )

    def _bad_answer(self, request: web.Request, exc: BadAnswer) -> tuple[web.Response, int]:
        """The worker answered, with something the sidecar will not pass on (too large, not HTTP/1.1):
        the worker's error, 502, not retried (another instance would answer the same) and no reason to
        probe the worker's health."""
        log.warning("worker's answer to %s %s cannot be passed on: %s", request.method, request.path, exc)
        message = f"model {self._model}: the worker's answer cannot be passed on: {exc}"
        return self._error(502, "worker_error", message, False), 502

    def _lost(self, exc: BaseException, what: str) -> tuple[web.Response, int]:
        """The worker went away before any byte of its answer reached the client: retryable elsewhere,
        unless the model turned that off (routing.retry_on_worker_loss)."""
        message = f"model {self._model}: the worker {what} ({exc!r})"
        if self._retry_lost:
            return self._error(503, "worker_lost", message + "; retry on another instance", True), 503
        return self._error(502, "worker_error", message, False), 502

    def _refuse(
        self, status: int, body: bytes, retryable: bool = True, extra: dict[str, str] | None = None
    ) -> web.Response:
        self._metrics.answered(status)
        self.answered_total += 1
        headers = self._retryable if retryable else self._plain
        if extra:
            headers = {**headers, **extra}
        return web.Response(status=status, body=body, content_type="application/json", headers=headers)

    def _error(self, status: int, kind: str, message: str, retryable: bool) -> web.Response:
        headers = self._retryable if retryable else self._plain
        return web.Response(
            status=status, body=error_body(kind, self._model, message), content_type="application/json", headers=headers
        )

    def _unavailable_body(self) -> bytes:
        state = self._status.state.value
        return error_body(
            "unavailable",
            self._model,
            f"model {self._model}: this instance is {state} and takes no new requests; retry on another instance",
            state=state,
        )
