"""The `sim` backend's scheduler model, pure (DESIGN.md section 4): `SimCore` is a state machine over an
explicit `now`, with no clock and no I/O. engine.py has the timing and KV model in full and the
asyncio shell (`SimEngine`) that drives this core in real time; the closed-loop tests and
bench/routing drive it in simulated time.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from node_host.backends.sim.prefix_cache import PrefixCache
from sie.engine_settings.fields import shown
from sie.errors import Problem, SpecError

HIT_WINDOW = 256  # prefills the reported cache hit rate spans
# Upper bounds of the parameters: far beyond any simulated engine, small enough that every time stays finite.
_MAX_COST_MS = 60_000.0  # a minute per token or per iteration
_MAX_WAKE_MS = 600_000.0  # ten minutes
_MAX_SLOWDOWN = 1000.0
_MAX_KV_TOKENS = 1 << 30


@dataclass(frozen=True)
class SimParams:
    prefill_ms_per_token: float = 0.02
    decode_base_ms: float = 4.0
    decode_ms_per_request: float = 0.25
    max_running_requests: int = 32
    kv_tokens: int = 16384
    slowdown: float = 1.0
    admit_reserve_ratio: float = 0.3
    # The fraction of requests (0..1) answered with an injected 500 before any work (chaos tests).
    error_rate: float = 0.0
    # Seeds the per-request error draws; None seeds them from the model id. Setting it restarts the draws.
    seed: int | None = None
    # Milliseconds a wake (resume_memory_occupation) takes: copying weights back, as a real engine would.
    wake_ms: float = 0.0
    # The wake fails on purpose: resume_memory_occupation answers 500 (chaos tests of scale to zero).
    fail_resume: bool = False
    # SGLang's RadixAttention (prefix_cache.py): computed prompt pages stay in the KV budget and a request
    # whose prompt starts with cached pages prefills only the rest. Off by default, so benchmarks written
    # before it (identical prompts of repeated words) keep their timing; bench/prefix turns it on.
    prefix_cache: bool = False
    page_size: int = 16  # tokens per cached page (vLLM's block size; SGLang's default is 1)

    def problems(self) -> list[Problem]:
        """Every parameter out of its range, named. Each has an upper bound: /sim/config takes them at run
        time, and one cost of 1e308 ms put the scheduler's next iteration at infinity, so nothing was
        answered again whatever came after, while /health said ok."""
        out = []
        for name, high in (
            ("prefill_ms_per_token", _MAX_COST_MS),
            ("decode_base_ms", _MAX_COST_MS),
            ("decode_ms_per_request", _MAX_COST_MS),
            ("admit_reserve_ratio", 1.0),
            ("wake_ms", _MAX_WAKE_MS),
        ):
            if not 0 <= getattr(self, name) <= high:
                out.append(Problem(name, f"must be in 0..{high:g}, got {getattr(self, name)}"))
        if not 0 < self.slowdown <= _MAX_SLOWDOWN:
            out.append(
                Problem(
                    "slowdown",
                    f"must be above 0 and at most {_MAX_SLOWDOWN:g} (1.0 is normal speed), got {self.slowdown}",
                )
            )
        if not 0 <= self.error_rate <= 1:
            out.append(Problem("error_rate", f"must be a fraction from 0 to 1 (0.05 fails 5%), got {self.error_rate}"))
        if not 1 <= self.max_running_requests <= 100_000:
            out.append(Problem("max_running_requests", f"must be 1..100,000, got {self.max_running_requests}"))
        if not 2 <= self.kv_tokens <= _MAX_KV_TOKENS:
            out.append(Problem("kv_tokens", f"must be 2..{_MAX_KV_TOKENS:,} tokens, got {self.kv_tokens}"))
        if not 1 <= self.page_size <= 4096:
            out.append(Problem("page_size", f"must be 1..4096 tokens, got {self.page_size}"))
        return out

    def changed(self, changes: dict[str, Any], source: str = "sim config") -> SimParams:
        """A copy with `changes` applied; SpecError names every unknown or invalid key."""
        names = {f.name: f.type for f in dataclasses.fields(self)}
        problems = [
            Problem(k, f"unknown sim parameter; expected one of {sorted(names)}") for k in changes if k not in names
        ]
        typed: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in names:
                continue
            kind = str(names[key])
            if value is None and kind.endswith("| None"):
                typed[key] = None
                continue
            if kind == "bool":
                if not isinstance(value, bool):
                    problems.append(Problem(key, f"must be true or false, got {shown(value)}"))
                else:
                    typed[key] = value
                continue
            want_int = kind.startswith("int")
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or (want_int and value != int(value))
            ):
                what = "an integer" if want_int else "a number"
                problems.append(Problem(key, f"must be {what}, got {shown(value)}"))
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


class ErrorDraws:
    """Which requests the simulator fails on purpose (`SimParams.error_rate`), reproducibly.

    One draw per request whatever the rate, so with one seed request n fails at rate r whenever it fails
    at any lower rate, and a run's failures are the same run after run.
    """

    def __init__(self, seed: int | str):
        self._rng = random.Random(seed)  # a str seed is hashed with SHA-512: stable across processes

    def fails(self, error_rate: float) -> bool:
        return self._rng.random() < error_rate


@dataclass(frozen=True)
class SimLoads:
    running: int
    waiting: int
    used_tokens: int
    max_total_tokens: int
    cache_hit_rate: float | None = None  # prompt tokens found cached, over the last HIT_WINDOW prefills

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
    keys: tuple[int, ...] = ()  # the prompt's page keys (prefix_cache.page_keys)
    shared_pages: int = 0  # leading pages it holds locked in the prefix cache (counted there, not in _used)
    cached: int = 0  # prompt tokens found cached at its last admission: its prefill skips them

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
        self._cache = PrefixCache(params.page_size)
        self._hits: deque[tuple[int, int]] = deque(maxlen=HIT_WINDOW)  # (cached, prompt) tokens per prefill

    @property
    def params(self) -> SimParams:
        return self._params

    def set_params(self, params: SimParams) -> None:
        """Takes effect at the next iteration; the one under way keeps its cost. A new page size (or the
        cache turned off) empties the prefix cache's unlocked pages."""
        problems = params.problems()
        if problems:
            raise SpecError("sim config", problems)
        if params.page_size != self._params.page_size or not params.prefix_cache:
            self._cache.evict(self._cache.evictable)
        if params.page_size != self._params.page_size and not self._cache.tokens:
            self._cache = PrefixCache(params.page_size)
        self._params = params

    @property
    def _caching(self) -> bool:
        return self._params.prefix_cache and self._cache.page_size == self._params.page_size

    @property
    def busy_until(self) -> float | None:
        """When the iteration under way ends; None when idle."""
        return self._current.end if self._current else None

    def loads(self) -> SimLoads:
        """KV use counts what running requests hold, their cached pages included; unlocked cached pages
        are free memory the engine takes back when it needs it (SGLang's token_usage counts the same)."""
        hit = sum(h for h, _ in self._hits)
        total = sum(t for _, t in self._hits)
        return SimLoads(
            len(self._running),
            len(self._waiting),
            self._used + self._cache.locked_tokens,
            self._params.kv_tokens,
            (hit / total if total else 0.0) if self._params.prefix_cache else None,
        )

    @property
    def cache(self) -> PrefixCache:
        return self._cache

    def submit(self, prompt_tokens: int, max_new_tokens: int, now: float, keys: tuple[int, ...] = ()) -> int:
        """Queue a request; returns its id. Raises SpecError for a request that can never fit. `keys`
        are its prompt's page keys (prefix_cache.page_keys), for the prefix cache.

        Results of requests that ended by `now` are kept for the next `advance`.
        """
        if prompt_tokens < 1 or max_new_tokens < 1:
            sizes = f"prompt_tokens ({prompt_tokens}) and max_new_tokens ({max_new_tokens})"
            raise SpecError("sim request", [Problem("", f"{sizes} must be >= 1")])
        need = prompt_tokens + max_new_tokens
        if need > self._params.kv_tokens:
            raise SpecError(
                "sim request",
                [
                    Problem(
                        "",
                        f"needs {need} KV tokens (prompt {prompt_tokens} + max_new_tokens {max_new_tokens}), "
                        f"above the budget of {self._params.kv_tokens}",
                    )
                ],
            )
        # Not `self._outbox.extend(self.advance(now))`: that binds extend to the list advance() is about
        # to hand out and replace, so these results would be dropped.
        ended = self.advance(now)
        self._outbox.extend(ended)
        rid = self._next_rid
        self._next_rid += 1
        req = _Request(rid, prompt_tokens, max_new_tokens, now, keys=keys)
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
            self._used -= self._own(req) + (1 if in_step else 0)  # the slot allocated for the step under way
            self._release_pages(req)
        else:
            self._waiting.remove(req)
        return True

    # -- the scheduler loop ---------------------------------------------------------------------------

    def _start_iteration(self, at: float) -> None:
        p = self._params
        admitted = self._admit(at)
        if admitted:
            tokens = sum(r.held - r.cached for r in admitted)  # cached prompt pages are not computed again
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
            # Cached leading pages (at least one prompt token is always computed) are locked now, so
            # making room below cannot evict them.
            matched = min(self._cache.match(head.keys), (head.prompt_tokens - 1) // p.page_size) if self._caching else 0
            self._cache.lock(head.keys[:matched])
            need = head.held + 1 - matched * p.page_size  # its uncached tokens and the first generated one
            extra = reserve + self._future(head)
            fits = self._room_for(need + extra)
            if not fits and not self._running:
                fits = self._room_for(need)  # a lone request runs without a reserve, so the queue always moves
                if not fits and need > p.kv_tokens - self._cache.locked_tokens:  # the budget shrank: never
                    self._cache.unlock(head.keys[:matched])
                    self._waiting.popleft()
                    self._outbox.append(
                        self._result(head, at, f"needs {need} KV tokens, the budget is now {p.kv_tokens}")
                    )
                    continue
            if not fits:
                self._cache.unlock(head.keys[:matched])
                break
            self._waiting.popleft()
            if head.admitted_at is None:
                head.admitted_at = at
            head.shared_pages, head.cached = matched, matched * p.page_size
            if self._caching:
                self._hits.append((head.cached, head.prompt_tokens))
            self._used += need
            reserve += self._future(head)
            self._running.append(head)
            admitted.append(head)
        return admitted

    def _room_for(self, tokens: int) -> bool:
        """Whether `tokens` more fit the KV budget, evicting unlocked cached pages (LRU) as needed."""
        deficit = self._used + self._cache.tokens + tokens - self._params.kv_tokens
        if deficit > 0:
            self._cache.evict(deficit)
        return self._used + self._cache.tokens + tokens <= self._params.kv_tokens

    def _own(self, req: _Request) -> int:
        """The KV tokens a running request holds outside the prefix cache."""
        return req.held - req.shared_pages * self._cache.page_size

    def _release_pages(self, req: _Request) -> None:
        self._cache.unlock(req.keys[: req.shared_pages])
        req.shared_pages, req.cached = 0, 0

    def _future(self, req: _Request) -> int:
        return math.ceil(self._params.admit_reserve_ratio * max(0, req.max_new_tokens - req.generated - 1))

    def _retract_to_fit(self, at: float) -> None:
        # Every running request needs one more token for this step: unlocked cached pages go first, then
        # the newest requests are retracted until they fit.
        while self._running and not self._room_for(len(self._running)):
            victim = self._running.pop()
            self._used -= self._own(victim)
            self._release_pages(victim)
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
            if it.kind == "prefill" and self._caching and len(req.keys) > req.shared_pages:
                # Its prompt's pages are computed: they go into the prefix cache (locked while it runs), and
                # count there from now on instead of in what it holds on its own.
                self._cache.unlock(req.keys[: req.shared_pages])
                self._cache.insert(req.keys)
                self._used -= (len(req.keys) - req.shared_pages) * self._cache.page_size
                req.shared_pages = len(req.keys)
            if req.first_token_at is None:
                req.first_token_at = it.end
                queue = (req.admitted_at if req.admitted_at is not None else it.end) - req.submitted_at
                self._first_tokens.append(FirstToken(req.rid, it.end, queue))
            if req.generated >= req.max_new_tokens:
                self._used -= self._own(req)
                self._release_pages(req)
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
