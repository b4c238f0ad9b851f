"""The `sim` worker: the SGLang timing simulator (engine.py) behind the worker protocol.

    python -m node_host.backends.sim --spec-file SPEC.json --host 127.0.0.1 --port PORT

It speaks the same HTTP protocol as every SIE worker (backends/protocol.py, runtime/app.py), and adds:

    GET  /sim/config   the simulator's parameters and loads
    POST /sim/config   change them at run time, e.g. {"slowdown": 3.0} (a noisy neighbour or a degraded
                       GPU), {"kv_tokens": 4096} (less KV cache) or {"error_rate": 0.05} (fail 5% of
                       requests); unknown or invalid keys are a 400

Injected errors: with probability `error_rate` a generation request is answered, before any work (no
queueing, no decode time), with the worker protocol's engine failure: HTTP 500, error type
`worker_error`, so the sidecar counts it in its error rate. The draws are seeded (`seed`, else the model
id), so a run's failures are reproducible; setting `seed` restarts them.

It is a simulator and says so everywhere: every response carries the header `x-sie-simulated: true`,
every JSON object body carries `"simulated": true` (an error body inside its `error`), /metrics has the gauge `sie_simulated 1`, and
/model_info says `"simulated": true`. Nothing is generated: the text is the word "sim" once per token.

Parameters come from the spec's `backend.config` (the names of core.SimParams, with SGLang's
`max_total_tokens` accepted for `kv_tokens`). Prompt tokens are counted by whitespace: the words of the
prompt, or of every chat message plus one per message; `input_ids` count one each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_host.backends.protocol import (
    BadRequest,
    Delta,
    EngineState,
    GenerateRequest,
    Loads,
    Unavailable,
    WorkerError,
)
from node_host.backends.runtime.app import WorkerApp
from node_host.backends.runtime.main import run_worker
from node_host.backends.sim.core import SimParams
from node_host.backends.sim.engine import Clock, SimEngine, SimEngineStopped, SimTicket, Sleep
from node_host.backends.sim.prefix_cache import page_keys
from sie import strict_json
from sie.engine_settings.kv_budget import KV_BUDGET_SCALE, kv_budget_scale, scaled_kv_tokens
from sie.errors import Problem, SpecError, error_body
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService

log = logging.getLogger(__name__)

SIMULATED_HEADER = "x-sie-simulated"
SIMULATED_GAUGE = "sie_simulated"
SLOWDOWN_GAUGE = "sie_sim_slowdown"
_ALIASES = {"max_total_tokens": "kv_tokens"}


def sim_params_from_spec(spec: ModelService) -> SimParams:
    """The SimParams named in `backend.config`; other engine arguments there are ignored (logged)."""
    config = dict(spec.spec.backend.config.model_extra or {})
    known = set(SimParams.__dataclass_fields__)
    changes: dict[str, Any] = {}
    for key, value in config.items():
        name = _ALIASES.get(key, key)
        if name in known:
            changes[name] = value
    ignored = sorted(k for k in config if _ALIASES.get(k, k) not in known and k != KV_BUDGET_SCALE)
    if ignored:
        log.info("sim backend ignores backend.config keys %s", ignored)
    source = f"ModelService {spec.model_id!r} backend.config"
    params = SimParams().changed(changes, source=source)
    try:
        scale = kv_budget_scale(config)
    except ValueError as exc:
        raise SpecError(source, [Problem(KV_BUDGET_SCALE, str(exc))]) from None
    return dataclasses.replace(params, kv_tokens=scaled_kv_tokens(params.kv_tokens, scale)) if scale < 1 else params


def count_prompt_tokens(request: GenerateRequest) -> int:
    """Whitespace tokens (a simulator needs a count, not a tokenizer); at least one."""
    if request.input_ids is not None:
        return max(1, len(request.input_ids))
    if request.messages is not None:
        return max(1, sum(len(m.get("content", "").split()) + 1 for m in request.messages))
    return max(1, len((request.text or "").split()))


def prompt_token_ids(request: GenerateRequest) -> list[int]:
    """Token ids as deterministic as a tokenizer's: one per whitespace word (CRC-32 of the word), one
    role marker before each chat message, or the request's own input_ids; so the same text gives the
    same ids in every worker, and a shared prefix of words is a shared prefix of tokens."""
    if request.input_ids is not None:
        return [int(i) for i in request.input_ids]
    if request.messages is not None:
        ids: list[int] = []
        for m in request.messages:
            ids.append(zlib.crc32(f"<|{m.get('role', '')}|>".encode()))
            ids += [zlib.crc32(w.encode()) for w in str(m.get("content", "")).split()]
        return ids
    return [zlib.crc32(w.encode()) for w in (request.text or "").split()]


class SimWorkerEngine:
    """A GenerativeEngine (protocol.py) over SimEngine."""

    backend = "sim"
    simulated = True

    def __init__(
        self,
        spec: ModelService,
        files: ModelFilePolicy | None = None,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ):
        # `files` is unused: a simulator loads no model file.
        self.served_model_name = spec.model_id
        self.model_path = spec.spec.model.path or ""
        self.sim = SimEngine(sim_params_from_spec(spec), clock=clock, sleep=sleep, name=spec.model_id)
        self._state = EngineState.LOADING

    @property
    def state(self) -> EngineState:
        return self._state

    async def start(self) -> None:
        await self.sim.start()
        self._state = EngineState.READY

    async def close(self) -> None:
        await self.sim.stop()

    def loads(self) -> Loads:
        got = self.sim.loads()
        return Loads(got.running, got.waiting, got.used_tokens, got.max_total_tokens, got.cache_hit_rate)

    async def release(self, tags: Sequence[str]) -> None:
        self._state = EngineState.SLEEPING  # nothing to free: a simulator holds no GPU memory

    async def resume(self, tags: Sequence[str]) -> None:
        params = self.sim.params
        if params.wake_ms:
            await asyncio.sleep(params.wake_ms / 1000.0)
        if params.fail_resume:
            raise WorkerError(
                "injected failure: the sim backend fails every wake on purpose (fail_resume); "
                'stop it with POST /sim/config {"fail_resume": false}'
            )
        self._state = EngineState.READY

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        if self.sim.injects_error():  # decided first, so a failed request costs no simulated time
            rate = self.sim.params.error_rate
            raise WorkerError(
                f"injected failure: the sim backend fails {rate:.4g} of requests on purpose (error_rate); "
                'retry, or stop it with POST /sim/config {"error_rate": 0}'
            )
        prompt = count_prompt_tokens(request)
        params = self.sim.params
        keys = page_keys(prompt_token_ids(request), params.page_size) if params.prefix_cache else ()
        new = request.params.max_new_tokens
        if new == 0:
            yield Delta("", prompt, 0, "length", queue_time_s=0.0)
            return
        try:
            ticket = self.sim.submit(prompt, new, keys)
        except SpecError as exc:
            raise BadRequest(f"this request can never fit the sim engine's KV cache: {exc.problems[0]}") from None
        except SimEngineStopped as exc:
            raise Unavailable(str(exc)) from None
        try:
            queue_time = await _settled(ticket.first_token)
            if new == 1:
                await _finished(ticket)
                yield Delta("sim", prompt, 1, "length", queue_time_s=queue_time)
                return
            if not ticket.done.done():  # the first token is out: stream it
                yield Delta("sim", prompt, 1, None, queue_time_s=queue_time)
                result = await _finished(ticket)
                yield Delta(" sim" * (result.completion_tokens - 1), prompt, result.completion_tokens, "length")
            else:
                result = await _finished(ticket)
                text = " ".join(["sim"] * result.completion_tokens)
                yield Delta(text, prompt, result.completion_tokens, "length", queue_time_s=queue_time)
        finally:
            if not ticket.done.done():
                self.sim.cancel(ticket)  # the client went away: free its KV tokens


async def _settled(fut: Awaitable[Any]) -> Any:
    try:
        return await fut
    except SimEngineStopped as exc:
        raise Unavailable(str(exc)) from None


async def _finished(ticket: SimTicket):
    result = await _settled(ticket.done)
    if result.error is not None:
        raise Unavailable(f"the sim engine aborted the request: {result.error}")
    return result


class _SimulatedCollector(Collector):
    def __init__(self, model_name: str, sim: SimEngine):
        self._model = model_name
        self._sim = sim

    def collect(self) -> Iterator[Metric]:
        doc = "1: this worker is the sim backend, a timing simulator, not a model."
        flag = GaugeMetricFamily(SIMULATED_GAUGE, doc, labels=["model_name"])
        flag.add_metric([self._model], 1.0)
        yield flag
        slow = GaugeMetricFamily(
            SLOWDOWN_GAUGE, "The simulator's slowdown factor (1 is normal speed).", labels=["model_name"]
        )
        slow.add_metric([self._model], self._sim.params.slowdown)
        yield slow


@web.middleware
async def _label_json(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Add "simulated": true to every JSON object body (streams carry the header only); an error body
    carries it inside its `error`, so it stays in the one error shape."""
    response = await handler(request)
    if type(response) is web.Response and response.content_type == "application/json" and response.body:
        try:
            body = json.loads(response.body)  # type: ignore[arg-type]
        except ValueError:
            return response
        if isinstance(body, dict):
            target = body["error"] if set(body) == {"error"} and isinstance(body["error"], dict) else body
            target.setdefault("simulated", True)
            return web.json_response(body, status=response.status, reason=response.reason)
    return response


async def _label_header(_: web.Request, response: web.StreamResponse) -> None:
    response.headers[SIMULATED_HEADER] = "true"


def build_app(engine: SimWorkerEngine, **worker_options: Any) -> web.Application:
    """The worker protocol app (runtime.app.WorkerApp) plus /sim/config and the simulator labels."""
    worker = WorkerApp(engine, **worker_options)
    worker.metrics.registry.register(_SimulatedCollector(engine.served_model_name, engine.sim))
    app = worker.build()
    app.middlewares.insert(0, _label_json)  # outermost, so error bodies are labelled too
    app.on_response_prepare.append(_label_header)

    def config_body() -> dict[str, Any]:
        loads = engine.sim.loads()
        return {
            **engine.sim.params.to_json(),
            "loads": {
                "running": loads.running,
                "waiting": loads.waiting,
                "used_tokens": loads.used_tokens,
                "token_usage": loads.token_usage,
            },
        }

    async def get_config(_: web.Request) -> web.Response:
        return web.json_response(config_body())

    async def set_config(request: web.Request) -> web.Response:
        changes = strict_json.loads(await request.read(), what="the body")  # InputError: a 400 from the app
        if not isinstance(changes, dict):
            return web.json_response(
                error_body("invalid_json", 'expected a JSON object such as {"slowdown": 3.0, "kv_tokens": 4096}'),
                status=400,
            )
        try:
            params = engine.sim.set_params(changes)
        except SpecError as exc:
            return web.json_response(exc.to_json(), status=400)
        log.info("sim config changed: %s -> %s", changes, params)
        return web.json_response(config_body())

    app.router.add_get("/sim/config", get_config)
    app.router.add_post("/sim/config", set_config)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m node_host.backends.sim --spec-file F --host H --port P`: the shared worker entry
    point (runtime.run_worker) with the simulator's engine and its extra /sim/config routes."""
    return run_worker(
        SimWorkerEngine,
        argv,
        description="SIE sim worker: an SGLang timing simulator (not a real model)",
        build_app=build_app,
    )
