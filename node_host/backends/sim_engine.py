"""The `sim` backend's engine: an SGLang server's timing, without a GPU (DESIGN.md section 4).

It is a simulator, for benchmarks and chaos tests at a scale this machine cannot run for real; everything
that shows its output says so. Two layers:

- `SimCore`, pure: a state machine over an explicit `now`, no clock and no I/O. It models SGLang's
  scheduler loop: each iteration is either a prefill batch (new requests admitted, when any fit) or one
  decode step of every running request, as SGLang's `get_next_batch_to_run` does.
- `SimEngine`, the asyncio shell: one named scheduler task that sleeps until the current iteration ends,
  with the clock and the sleep passed in (tests pass fakes).

Timing model (all costs multiplied by `slowdown`):

    prefill iteration = decode_base_ms + prefill_ms_per_token * (tokens recomputed by the batch)
    decode iteration  = decode_base_ms + decode_ms_per_request * running_requests

The defaults resemble a ~1B-parameter LLM on one modern GPU, scaled so four instances run on two CPU
cores: 4 ms per decode step at batch 1, 12 ms at the full batch of 32 (decode is memory-bound, so the
per-request cost is small next to the fixed cost); prefill at 50k tokens/s. A request of 100 prompt
tokens and 64 new tokens takes ~0.3 s alone and ~0.6 s in a full batch.

KV cache: a request holds prompt + generated tokens. A request is admitted when its tokens plus a
reserve for the future growth of everything running (`admit_reserve_ratio` of the tokens still to be
generated, SGLang's `new_token_ratio`) fit the budget; otherwise it waits. Before a decode step every
running request needs one more token; when they do not fit, the newest running request is retracted to
the front of the queue and later recomputes its prompt and what it had generated (as SGLang's
`retract_decode` does). Changes to the parameters (slowdown, KV budget, ...) take effect at the next
iteration; shrinking the budget below what is held retracts at the next decode step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from sie.errors import Problem, RetryableError, SpecError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimParams:
    prefill_ms_per_token: float = 0.02
    decode_base_ms: float = 4.0
    decode_ms_per_request: float = 0.25
    max_running_requests: int = 32
    kv_tokens: int = 16384
    slowdown: float = 1.0
    admit_reserve_ratio: float = 0.3

    def problems(self) -> list[Problem]:
        out = []
        for name in ("prefill_ms_per_token", "decode_base_ms", "decode_ms_per_request", "admit_reserve_ratio"):
            if not getattr(self, name) >= 0:
                out.append(Problem(name, f"must be >= 0, got {getattr(self, name)}"))
        if not self.slowdown > 0:
            out.append(Problem("slowdown", f"must be > 0 (1.0 is normal speed), got {self.slowdown}"))
        if self.max_running_requests < 1:
            out.append(Problem("max_running_requests", f"must be >= 1, got {self.max_running_requests}"))
        if self.kv_tokens < 2:
            out.append(Problem("kv_tokens", f"must be >= 2 tokens, got {self.kv_tokens}"))
        return out

    def changed(self, changes: dict[str, Any], source: str = "sim config") -> SimParams:
        """A copy with `changes` applied; SpecError names every unknown or invalid key."""
        names = {f.name: f.type for f in dataclasses.fields(self)}
        problems = [Problem(k, f"unknown sim parameter; expected one of {sorted(names)}") for k in changes if k not in names]
        typed: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in names:
                continue
            want_int = names[key] in ("int", int)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (want_int and value != int(value)):
                kind = "an integer" if want_int else "a number"
                problems.append(Problem(key, f"must be {kind}, got {value!r}"))
                continue
            typed[key] = int(value) if want_int else float(value)
        if not problems:
            candidate = dataclasses.replace(self, **typed)
            problems = candidate.problems()
        if problems:
            raise SpecError(source, problems)
        return candidate

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SimLoads:
    running: int
    waiting: int
    used_tokens: int
    max_total_tokens: int

    @property
    def token_usage(self) -> float:
        return min(1.0, self.used_tokens / self.max_total_tokens) if self.max_total_tokens else 0.0


@dataclass(frozen=True)
class SimResult:
    rid: int
    prompt_tokens: int
    completion_tokens: int
    submitted_at: float
    finished_at: float
    queue_time_s: float  # submission to first admission
    ttft_s: float | None  # submission to the first token; None if aborted before it
    retractions: int
    finish_reason: str  # "length" or "abort"
    error: str | None = None

    @property
    def e2e_latency_s(self) -> float:
        return self.finished_at - self.submitted_at


@dataclass(frozen=True)
class FirstToken:
    rid: int
    at: float
    queue_time_s: float


@dataclass(eq=False)
class _Request:
    rid: int
    prompt_tokens: int
    max_new_tokens: int
    submitted_at: float
    generated: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    retractions: int = 0
    aborted: bool = False

    @property
    def held(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(eq=False)
class _Iteration:
    kind: str  # "prefill" | "decode"
    end: float
    batch: list[_Request]


class SimCore:
    """SGLang's scheduler timing as a pure state machine; every method takes the current time."""

    def __init__(self, params: SimParams = SimParams()):
        problems = params.problems()
        if problems:
            raise SpecError("sim config", problems)
        self._params = params
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # in admission order: the last is the newest
        self._used = 0
        self._current: _Iteration | None = None
        self._outbox: list[SimResult] = []
        self._first_tokens: list[FirstToken] = []
        self._by_rid: dict[int, _Request] = {}
        self._next_rid = 0

    @property
    def params(self) -> SimParams:
        return self._params

    def set_params(self, params: SimParams) -> None:
        """Takes effect at the next iteration; the one under way keeps its cost."""
        problems = params.problems()
        if problems:
            raise SpecError("sim config", problems)
        self._params = params

    @property
    def busy_until(self) -> float | None:
        """When the iteration under way ends; None when idle."""
        return self._current.end if self._current else None

    def loads(self) -> SimLoads:
        return SimLoads(len(self._running), len(self._waiting), self._used, self._params.kv_tokens)

    def submit(self, prompt_tokens: int, max_new_tokens: int, now: float) -> int:
        """Queue a request; returns its id. Raises SpecError for a request that can never fit.

        Results of requests that ended by `now` are kept for the next `advance`.
        """
        if prompt_tokens < 1 or max_new_tokens < 1:
            sizes = f"prompt_tokens ({prompt_tokens}) and max_new_tokens ({max_new_tokens})"
            raise SpecError("sim request", [Problem("", f"{sizes} must be >= 1")])
        need = prompt_tokens + max_new_tokens
        if need > self._params.kv_tokens:
            raise SpecError(
                "sim request",
                [Problem("", f"needs {need} KV tokens (prompt {prompt_tokens} + max_new_tokens {max_new_tokens}), "
                             f"above the budget of {self._params.kv_tokens}")],
            )
        self._outbox.extend(self.advance(now))
        rid = self._next_rid
        self._next_rid += 1
        req = _Request(rid, prompt_tokens, max_new_tokens, now)
        self._by_rid[rid] = req
        self._waiting.append(req)
        if self._current is None:
            self._start_iteration(now)
        return rid

    def advance(self, now: float) -> list[SimResult]:
        """Finish every iteration that ends by `now`, starting the next ones back to back."""
        while self._current is not None and self._current.end <= now:
            end = self._current.end
            self._outbox.extend(self._finish_iteration())
            self._start_iteration(end)  # may abort a request that can no longer fit: it lands in the outbox
        done, self._outbox = self._outbox, []
        for result in done:
            self._by_rid.pop(result.rid, None)
        return done

    def take_first_tokens(self) -> list[FirstToken]:
        """First tokens produced since the last call (for streaming and time-to-first-token)."""
        out, self._first_tokens = self._first_tokens, []
        return out

    def abort(self, rid: int) -> bool:
        """Drop a request (its client went away) and free its KV tokens; False if it is not here."""
        req = self._by_rid.pop(rid, None)
        if req is None:
            return False
        req.aborted = True
        if req in self._running:
            self._running.remove(req)
            in_step = self._current is not None and any(r is req for r in self._current.batch)
            self._used -= req.held + (1 if in_step else 0)  # the slot allocated for the step under way
        else:
            self._waiting.remove(req)
        return True

    # -- the scheduler loop ---------------------------------------------------------------------------

    def _start_iteration(self, at: float) -> None:
        p = self._params
        admitted = self._admit(at)
        if admitted:
            tokens = sum(r.held for r in admitted)
            cost_ms = p.decode_base_ms + p.prefill_ms_per_token * tokens
            self._current = _Iteration("prefill", at + cost_ms * p.slowdown / 1000.0, admitted)
            return
        self._current = None
        if self._running:
            self._retract_to_fit(at)
            if not self._running:  # the budget shrank below the last one, which was aborted: admit again
                self._start_iteration(at)
                return
            self._used += len(self._running)  # the KV slot of the token each request generates now
            cost_ms = p.decode_base_ms + p.decode_ms_per_request * len(self._running)
            self._current = _Iteration("decode", at + cost_ms * p.slowdown / 1000.0, list(self._running))

    def _admit(self, at: float) -> list[_Request]:
        p = self._params
        admitted: list[_Request] = []
        reserve = sum(self._future(r) for r in self._running)
        while self._waiting and len(self._running) < p.max_running_requests:
            head = self._waiting[0]
            need = head.held + 1  # its recomputed tokens and the first token the prefill produces
            fits = self._used + need + reserve + self._future(head) <= p.kv_tokens
            if not fits and not self._running:
                fits = need <= p.kv_tokens  # a lone request runs without a reserve, so the queue always moves
                if not fits:  # the budget shrank below this request: it can never run
                    self._waiting.popleft()
                    self._outbox.append(self._result(head, at, f"needs {need} KV tokens, the budget is now {p.kv_tokens}"))
                    continue
            if not fits:
                break
            self._waiting.popleft()
            if head.admitted_at is None:
                head.admitted_at = at
            self._used += need
            reserve += self._future(head)
            self._running.append(head)
            admitted.append(head)
        return admitted

    def _future(self, req: _Request) -> int:
        return math.ceil(self._params.admit_reserve_ratio * max(0, req.max_new_tokens - req.generated - 1))

    def _retract_to_fit(self, at: float) -> None:
        # Every running request needs one more token for this step; retract the newest until they fit.
        while self._running and self._used + len(self._running) > self._params.kv_tokens:
            victim = self._running.pop()
            self._used -= victim.held
            if not self._running and victim.held + 1 > self._params.kv_tokens:
                why = f"holds {victim.held} KV tokens, above the budget of {self._params.kv_tokens}"
                self._outbox.append(self._result(victim, at, why))
                continue
            victim.retractions += 1
            self._waiting.appendleft(victim)

    def _finish_iteration(self) -> list[SimResult]:
        it = self._current
        assert it is not None
        done: list[SimResult] = []
        for req in it.batch:
            if req.aborted:
                continue
            req.generated += 1  # its KV slot was allocated when the iteration started
            if req.first_token_at is None:
                req.first_token_at = it.end
                queue = (req.admitted_at if req.admitted_at is not None else it.end) - req.submitted_at
                self._first_tokens.append(FirstToken(req.rid, it.end, queue))
            if req.generated >= req.max_new_tokens:
                self._used -= req.held
                done.append(self._result(req, it.end, None))
        if done:
            finished = {r.rid for r in done}
            self._running = [r for r in self._running if r.rid not in finished]
        self._current = None
        return done

    def _result(self, req: _Request, at: float, error: str | None) -> SimResult:
        admitted = req.admitted_at if req.admitted_at is not None else at
        return SimResult(
            rid=req.rid,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.generated,
            submitted_at=req.submitted_at,
            finished_at=at,
            queue_time_s=admitted - req.submitted_at,
            ttft_s=None if req.first_token_at is None else req.first_token_at - req.submitted_at,
            retractions=req.retractions,
            finish_reason="abort" if error else "length",
            error=error,
        )


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class SimEngineStopped(RetryableError):
    """The engine stopped while the request was queued or running; another instance may serve it."""


@dataclass(eq=False)
class SimTicket:
    """A submitted request: `first_token` resolves with its queue time, `done` with its result."""

    rid: int
    first_token: asyncio.Future[float]
    done: asyncio.Future[SimResult]


class SimEngine:
    """The asyncio shell over SimCore: `await generate(...)` returns when the simulated request ends."""

    def __init__(self, params: SimParams = SimParams(), clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep):
        self._core = SimCore(params)
        self._clock = clock
        self._sleep = sleep
        self._tickets: dict[int, SimTicket] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def params(self) -> SimParams:
        return self._core.params

    def set_params(self, changes: dict[str, Any]) -> SimParams:
        """Apply run-time changes (e.g. {"slowdown": 3.0, "kv_tokens": 4096}); SpecError if invalid."""
        self._settle()
        params = self._core.params.changed(changes)
        self._core.set_params(params)
        self._wake.set()
        return params

    def loads(self) -> SimLoads:
        self._settle()
        return self._core.loads()

    @property
    def running(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine-scheduler")
            self._task.add_done_callback(self._on_task_done)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(SimEngineStopped("the sim engine stopped before the request finished"))

    def submit(self, prompt_tokens: int, max_new_tokens: int) -> SimTicket:
        """Queue a request; SpecError if it can never fit, SimEngineStopped if the engine is not running."""
        if self._task is None:
            raise SimEngineStopped("the sim engine is not running")
        self._settle()
        rid = self._core.submit(prompt_tokens, max_new_tokens, self._clock())
        loop = asyncio.get_running_loop()
        ticket = SimTicket(rid, loop.create_future(), loop.create_future())
        for fut in (ticket.first_token, ticket.done):
            fut.add_done_callback(_mark_retrieved)
        self._tickets[rid] = ticket
        self._wake.set()
        return ticket

    def cancel(self, ticket: SimTicket) -> None:
        """Abandon a request (the client went away): its KV tokens are freed at once."""
        self._settle()
        if self._core.abort(ticket.rid):
            self._tickets.pop(ticket.rid, None)
            for fut in (ticket.first_token, ticket.done):
                fut.cancel()

    async def generate(self, prompt_tokens: int, max_new_tokens: int) -> SimResult:
        ticket = self.submit(prompt_tokens, max_new_tokens)
        try:
            return await ticket.done
        finally:
            if not ticket.done.done():
                self.cancel(ticket)

    def _settle(self) -> None:
        """Bring the core up to the clock and hand out what it produced."""
        finished = self._core.advance(self._clock())
        for first in self._core.take_first_tokens():
            ticket = self._tickets.get(first.rid)
            if ticket is not None and not ticket.first_token.done():
                ticket.first_token.set_result(first.queue_time_s)
        for result in finished:
            ticket = self._tickets.pop(result.rid, None)
            if ticket is None:
                continue
            if not ticket.first_token.done():
                ticket.first_token.set_result(result.queue_time_s)
            if not ticket.done.done():
                ticket.done.set_result(result)

    async def _run(self) -> None:
        while True:
            self._settle()
            until = self._core.busy_until
            self._wake.clear()
            if until is None:
                await self._wake.wait()
            else:
                await self._sleep(max(0.0, until - self._clock()))

    def _fail_all(self, exc: Exception) -> None:
        tickets, self._tickets = self._tickets, {}
        for ticket in tickets.values():
            for fut in (ticket.first_token, ticket.done):
                if not fut.done():
                    fut.set_exception(exc)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the sim engine scheduler died", exc_info=task.exception())
            self._task = None
            self._fail_all(SimEngineStopped(f"the sim engine scheduler died: {task.exception()!r}"))


def _mark_retrieved(fut: asyncio.Future[Any]) -> None:
    # A ticket's futures may fail without anyone awaiting both (a stop before the first token);
    # retrieving the exception here keeps asyncio from logging "exception was never retrieved".
    if not fut.cancelled():
        fut.exception()
