"""The `sim` backend's engine: an SGLang server's timing, without a GPU (DESIGN.md section 4).

It is a simulator, for benchmarks and chaos tests at a scale this machine cannot run for real; everything
that shows its output says so. Two layers:

- `SimCore` (core.py), pure: a state machine over an explicit `now`, no clock and no I/O. It models SGLang's
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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from node_host.backends.sim.core import ErrorDraws, SimCore, SimLoads, SimParams, SimResult
from sie.errors import RetryableError

log = logging.getLogger(__name__)

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

    def __init__(
        self,
        params: SimParams = SimParams(),
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        *,
        name: str = "sim",
    ):
        self._core = SimCore(params)
        self._clock = clock
        self._sleep = sleep
        self._name = name  # seeds the error draws when params.seed is None
        self._draws = self._new_draws(params)
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
        if "seed" in changes:
            self._draws = self._new_draws(params)
        self._wake.set()
        return params

    def injects_error(self) -> bool:
        """Whether the next request is to be failed on purpose (`error_rate`); one draw per call."""
        return self._draws.fails(self._core.params.error_rate)

    def _new_draws(self, params: SimParams) -> ErrorDraws:
        return ErrorDraws(self._name if params.seed is None else params.seed)

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

    def submit(self, prompt_tokens: int, max_new_tokens: int, keys: tuple[int, ...] = ()) -> SimTicket:
        """Queue a request (`keys`: its prompt's page keys, for the prefix cache); SpecError if it can
        never fit, SimEngineStopped if the engine is not running."""
        if self._task is None:
            raise SimEngineStopped("the sim engine is not running")
        self._settle()
        rid = self._core.submit(prompt_tokens, max_new_tokens, self._clock(), keys)
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
