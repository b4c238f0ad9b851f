"""The worker protocol: what every SIE worker backend speaks, over an `Engine` it plugs in.

The protocol is the subset of a real SGLang server's HTTP API that SIE uses (DESIGN.md section 3), so the
sidecar and the control plane are the same code for real SGLang and for SIE's own engines:

    GET  /health                      200 {"status": "ok"} when serving; 503 {"status": "loading"|"sleeping"|"failed"}
    GET  /v1/models                   OpenAI model list (the served model name is the model id)
    GET  /model_info                  {"model_path", "served_model_name", "backend", "is_generation", "simulated"}
    POST /generate                    SGLang native generation (stream: SSE with the text so far in each chunk)
    POST /v1/chat/completions         OpenAI chat (stream and non-stream, with usage)
    POST /v1/completions              OpenAI completions
    GET  /v1/loads                    {"num_running_reqs", "num_waiting_reqs", "token_usage", "num_used_tokens",
                                       "max_total_num_tokens", "timestamp"}  (token fields null for scorers)
    GET  /metrics                     Prometheus text, SGLang metric names, label model_name
    POST /release_memory_occupation   {"tags": [...]}; 409 unless idle; then /health says sleeping, requests get 503;
                                      answers {"success", "message"} and, when the engine measures it, "memory":
                                      the figures of the move (torch: offload.Move, seconds and bytes)
    POST /resume_memory_occupation    {"tags": [...]}; answers as the release does
    POST /infer                       scorers only: {field: value} -> {field: value};
                                      {"instances": [{...}, ...]} -> {"predictions": [{...}, ...]}

This module is the contract only: what a backend implements (the `Engine` protocols, `EngineState`),
the request and response values, and the errors an engine raises. The worker process that serves an
engine is `node_host.backends.runtime` (the HTTP side in runtime/app.py). A backend is an object that
satisfies `GenerativeEngine` (LLMs) or `ScoringEngine` (scorers), plus a one-line `main` that hands a
factory to `runtime.main.run_worker`, which owns the command line every backend shares
(`--spec-file SPEC.json --host H --port P`), signals, logging and the server:

    # node_host/backends/echo/__main__.py
    from node_host.backends.protocol import Delta, EngineState, GenerateRequest, Loads
    from node_host.backends.runtime.main import run_worker

    class EchoEngine:
        backend = "echo"
        simulated = False

        def __init__(self, spec, files):             # spec: sie.spec.ModelService; files: ModelFilePolicy
            self.served_model_name = spec.model_id
            self.model_path = spec.spec.model.path or ""
            self.state = EngineState.LOADING
            self._running = 0

        async def start(self):                       # load weights here; /health says "loading" meanwhile
            self.state = EngineState.READY

        async def close(self): ...

        def loads(self):
            return Loads(running=self._running, waiting=0)

        async def release(self, tags):               # called only when idle; traffic is already gated
            self.state = EngineState.SLEEPING

        async def resume(self, tags):
            self.state = EngineState.READY

        async def generate(self, request):           # an async generator of Deltas
            self._running += 1
            try:
                yield Delta(text=request.text or "", prompt_tokens=1, completion_tokens=1,
                            finish_reason="stop", queue_time_s=0.0)
            finally:
                self._running -= 1

    def main(argv=None):
        return run_worker(EchoEngine, argv, description="echo worker")

    if __name__ == "__main__":
        raise SystemExit(main())

registry.py maps the backend type to the package to run (`python -m node_host.backends.echo`).

Invariants an engine keeps:
- `generate` yields at least one Delta and exactly one carrying `finish_reason` (the last one). Each
  Delta's `text` is new text only; `completion_tokens` is the running total. The first Delta carries
  `queue_time_s` (arrival to admission). If the consumer stops early (client gone), the generator is
  closed (`aclose`): the engine must then free the request's resources in a `finally`.
- Raise `BadRequest` for a request the engine can never serve (prompt longer than the context), and
  `Unavailable` for one it cannot serve now. Anything else is a 500.
- `release` is called only while no request is running or waiting, and the app refuses new requests
  until `resume` returns; `state` must be SLEEPING after `release` and READY after `resume`.
- `loads` is called on the event loop and must be cheap and non-blocking.
- Never block the event loop: do model work in a thread executor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Protocol, runtime_checkable

from sie.errors import RetryableError, SIEError

# SGLang's default when a request names no max_new_tokens; OpenAI bodies without max_tokens get it too.
DEFAULT_MAX_NEW_TOKENS = 128

FinishReason = Literal["length", "stop"]


# A worker whose model load ran out of memory (MemoryError, torch's OutOfMemoryError) exits with this code,
# so its node host can tell an OOM from other crashes (a kernel OOM kill shows as SIGKILL).
OOM_EXIT_CODE = 3


class EngineState(str, Enum):
    LOADING = "loading"
    READY = "ready"
    SLEEPING = "sleeping"
    FAILED = "failed"


class WorkerError(SIEError):
    """Base of the errors an engine raises on purpose; the app maps each to an HTTP status."""

    status = 500


class BadRequest(WorkerError, ValueError):
    """The request can never be served as sent (fix it): 400."""

    status = 400


class Unavailable(WorkerError, RetryableError):
    """The engine cannot serve now (loading, sleeping, shutting down): 503, retry elsewhere or later."""

    status = 503


class Busy(WorkerError, RetryableError):
    """The operation needs an idle engine (memory release with requests in flight): 409, drain first."""

    status = 409


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # generation ends before the first of these strings; it is not returned
    ignore_eos: bool = False  # keep generating past EOS (benchmarks that want exactly max_new_tokens)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, whichever endpoint it came through. Exactly one of text, input_ids and
    messages is set; for messages the engine applies its chat template."""

    rid: str
    params: SamplingParams
    text: str | None = None
    input_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, str], ...] | None = None  # [{"role": ..., "content": ...}], content a string
    arrival: float = 0.0  # time.monotonic() when the worker received it


@dataclass(frozen=True)
class Delta:
    """A step of a generation: new text, running token counts, and on the last one why it ended."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    queue_time_s: float | None = None  # first Delta only
    matched_stop: str | int | None = None  # the stop string or token id that ended it, if any


@dataclass(frozen=True)
class Completion:
    """A whole generation, as the non-streaming endpoints answer it."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    queue_time_s: float | None = None
    matched_stop: str | int | None = None


@dataclass(frozen=True)
class Loads:
    """What the engine holds now. Token fields are None for engines without a KV cache (scorers):
    absent is not zero (sie.telemetry)."""

    running: int
    waiting: int
    used_tokens: int | None = None
    max_total_tokens: int | None = None
    cache_hit_rate: float | None = None  # prefix-cache hits, 0..1 (sglang:cache_hit_rate); None: no prefix cache

    @property
    def token_usage(self) -> float | None:
        if self.used_tokens is None or not self.max_total_tokens:
            return None
        return min(1.0, self.used_tokens / self.max_total_tokens)


@runtime_checkable
class Engine(Protocol):
    """What every backend provides (see the module docstring for the invariants)."""

    served_model_name: str
    model_path: str
    backend: str  # "torch", "sklearn", "sim", ...
    simulated: bool  # True only for the timing simulator; shown in /model_info

    @property
    def state(self) -> EngineState: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def loads(self) -> Loads: ...

    async def release(self, tags: Sequence[str]) -> Mapping[str, Any] | None:
        """Free the accelerator memory; may return the figures of the move (JSON values) for the response."""
        ...

    async def resume(self, tags: Sequence[str]) -> Mapping[str, Any] | None:
        """Take the memory back; may return the figures of the move, as `release` does."""
        ...


@runtime_checkable
class GenerativeEngine(Engine, Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]: ...


@runtime_checkable
class ScoringEngine(Engine, Protocol):
    async def infer(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Typed rows in (the spec's input_schema fields), typed rows out (output_schema), same order.
        Raise BadRequest naming the row and field for input that cannot be converted."""
        ...


async def collect(deltas: AsyncIterator[Delta]) -> Completion:
    """Drain a generation into one Completion (for the non-streaming endpoints and for tests)."""
    parts: list[str] = []
    last: Delta | None = None
    queue_time: float | None = None
    async for delta in deltas:
        parts.append(delta.text)
        if delta.queue_time_s is not None:
            queue_time = delta.queue_time_s
        last = delta
    if last is None or last.finish_reason is None:
        raise RuntimeError("engine ended a generation without a final Delta (finish_reason unset)")
    return Completion(
        text="".join(parts),
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        finish_reason=last.finish_reason,
        queue_time_s=queue_time,
        matched_stop=last.matched_stop,
    )
