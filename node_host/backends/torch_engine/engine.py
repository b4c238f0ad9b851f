"""The embedded torch engine: a Hugging Face causal LM served with continuous batching.

Shape: one asyncio scheduler task (`scheduler:<model>`), two lanes (lanes.py: one daemon thread each) and
a pool of chat-template processes (templates.py). A request's prompt is made off the engine lane: its
chat template rendered in a child process, its text tokenized on the prompt lane (prompts.py: the bounds
and deadlines). Each iteration the task decides on the event loop which waiting requests join
(kv_budget.plan_admission: FIFO under a KV-token budget), and runs one step on the engine lane
(step.py): a decode step for every running row, a prefill for each newcomer (batch.py), sampling,
detokenization (detokenize.TextTracker). Back on the loop it hands each request its Delta, or its
error, through the request's own asyncio.Queue.

Ownership (why there are no locks): the engine lane is the only user of the model, the engine's tokenizer
(detokenization) and the batch tensors; the prompt lane the only user of a second tokenizer instance (HF
fast tokenizers are not safe to share across threads). `_waiting`, `_running` and `_reserved` are
changed only on the event loop; the engine lane receives `_running` while the loop awaits the step and
returns the new list. A consumer that goes away sets `aborted` on its sequence, which the next step
honours.

What one request can break (DESIGN §10: no single request stops a component):
- its prompt: refused with a 400 naming the problem before it costs anything (prompts.PromptRules). A
  chat template past its deadline is killed with its process; a tokenizer call past its deadline (it
  cannot be stopped, but its text is bounded) is answered then with a 500 naming it, and if it has not
  ended STUCK_GRACE_S later the prompt lane is lost for good: the engine turns FAILED and the process
  exits, for the node host to restart it.
- its own row: an error in its prefill, its sampling or its detokenization fails that request alone (its
  WorkerError as raised, else a 500), and the other rows of the step go on (step.py). sample() decides
  each row alone (top_p 0 is greedy; tiny temperatures are greedy; non-finite logits fail only their row).
- only the batched forward pass is shared: if it raises, every request in the batch gets a 503 and the
  batch starts afresh.
close() kills the template processes and waits for the lanes at most CLOSE_GRACE_S; a lane still busy
then is left behind (daemon threads do not hold the process) and the engine marked FAILED, so SIGTERM
ends the worker within the node host's stop grace.

release (only when idle; runtime/app.py gates traffic) drops the decode batch (the KV cache) and the KV
reservation (/v1/loads reads 0 used tokens while asleep), then moves every weight to a host copy and frees
the device memory with the allocator's cache (offload.py: pinned memory and empty_cache on CUDA; the same
code on CPU, where the accounting says the device is the host and nothing is freed). resume copies the
weights back from that host copy, never from disk, and starts an empty decode batch. Each returns the
figures of the move (offload.Move: seconds, bytes moved, device memory before and after), which the app
adds to its response as `memory` and which are logged in one line.

How the node host's ledger sees a sleeping torch instance: the sidecar's sleep succeeds only after this
release has returned, and the ledger then holds the instance at its residue (0 by default), its awake
figure (the measured one, or the estimate) kept for the wake. On a GPU the process keeps only its CUDA
context (some hundreds of MiB that NVML still counts; torch cannot free it without exiting). A wake is
admitted like a load; once the instance is loaded again, each heartbeat replaces its figure with what NVML
measures for the worker (node_host/agent.py `_observe`); on virtual GPUs nothing is measured and the
estimate stands.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from node_host.backends.protocol import (
    BadRequest,
    Busy,
    Delta,
    EngineState,
    GenerateRequest,
    Loads,
    Unavailable,
    WorkerError,
)
from node_host.backends.torch_engine import prompts
from node_host.backends.torch_engine.kv_budget import BudgetLimits, plan_admission
from node_host.backends.torch_engine.lanes import Lane
from node_host.backends.torch_engine.offload import Move, Offload
from node_host.backends.torch_engine.prompts import PromptRules
from node_host.backends.torch_engine.step import Event, Seq, Stepper
from node_host.backends.torch_engine.templates import TemplatePool
from sie import model_files
from sie.engine_settings import TorchSettings
from sie.model_files import ModelFilePolicy

log = logging.getLogger(__name__)

# The node host gives a worker 10 s from SIGTERM to SIGKILL (supervisor.WORKER_GRACE_S); the listener's
# clean-up comes before the engine's, so the engine waits for its lanes at most half of that.
CLOSE_GRACE_S = 5.0
# How long a tokenizer call may run past its request's deadline before the prompt lane counts as lost:
# the prompt bounds keep a call to seconds, so one this late will not return.
STUCK_GRACE_S = 5.0


class TorchEngine:
    backend = "torch"
    simulated = False

    def __init__(
        self,
        settings: TorchSettings,
        files: ModelFilePolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        prompt_deadline: Callable[[int], float] = prompts.deadline_s,
        close_grace_s: float = CLOSE_GRACE_S,
        stuck_grace_s: float = STUCK_GRACE_S,
    ):
        """`prompt_deadline(characters)`: the seconds a prompt's chat template, and then its tokenizer, may
        take on that many characters."""
        self.settings = settings
        self._files = files
        self.served_model_name = settings.served_model_name
        self.model_path = settings.model_path
        self._clock = clock
        self._limits = BudgetLimits(settings.max_total_tokens, settings.max_running, settings.max_prefill_tokens)
        self._state = EngineState.LOADING
        self._waiting: deque[Seq] = deque()
        self._admitting: list[Seq] = []
        self._running: list[Seq] = []
        self._reserved = 0
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._prompt_deadline = prompt_deadline
        self._close_grace_s = close_grace_s
        self._stuck_grace_s = stuck_grace_s
        self._lane = Lane(f"torch-{settings.served_model_name}")
        self._prompt_lane = Lane(f"prompts-{settings.served_model_name}")
        # Set by _load (on the engine lane); the model, its tokenizer and the stepper are used there only.
        self._model: Any = None
        self._tokenizer: Any = None
        self._prompt_tokenizer: Any = None  # the prompt lane's own instance
        self._chat_template: tuple[str, dict[str, str]] | None = None  # its source and special tokens
        self._templates: TemplatePool | None = None
        self._rules: PromptRules | None = None
        self._offload: Offload | None = None
        self.last_move: Move | None = None  # the figures of the latest release or resume
        self._device = torch.device("cpu")
        self._dtype = torch.float32
        self._stepper: Stepper | None = None

    # ---- Engine protocol --------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        return self._state

    def loads(self) -> Loads:
        return Loads(
            running=len(self._running) + len(self._admitting),
            waiting=len(self._waiting),
            used_tokens=self._reserved,
            max_total_tokens=self.settings.max_total_tokens,
        )

    async def start(self) -> None:
        await self._in_thread(self._load)
        if self._chat_template is not None:
            assert self._rules is not None
            self._templates = TemplatePool(self.served_model_name, *self._chat_template, self._rules.max_chars)
            await self._templates.start()
        self._scheduler = asyncio.create_task(self._schedule(), name=f"scheduler:{self.served_model_name}")
        self._scheduler.add_done_callback(self._scheduler_done)
        self._state = EngineState.READY

    async def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
        self._fail_all(Unavailable(f"model {self.served_model_name!r} is shutting down; retry elsewhere"))
        if self._templates is not None:
            await self._templates.close()
        lanes = (self._lane, self._prompt_lane)
        for lane in lanes:
            lane.close()
        ended = await asyncio.gather(*(lane.wait_closed(self._close_grace_s) for lane in lanes))
        stuck = [lane.name for lane, done in zip(lanes, ended) if not done]
        if stuck:
            self._state = EngineState.FAILED
            log.error(
                "%s: thread(s) %s still busy %.0f s after the stop; exiting without them",
                self.served_model_name,
                ", ".join(stuck),
                self._close_grace_s,
            )

    async def release(self, tags: Sequence[str]) -> dict[str, Any]:
        """Everything goes whatever the tags (weights and KV cache alike); the app calls this only when idle."""
        if self._running or self._admitting or self._waiting:
            raise Busy("requests are still in the engine; releasing memory needs an idle worker: drain it first")
        self._reserved = 0  # the KV reservation: nothing may hold tokens while asleep
        move = await self._in_thread(self._release)
        self._state = EngineState.SLEEPING
        return self._report(move)

    async def resume(self, tags: Sequence[str]) -> dict[str, Any]:
        move = await self._in_thread(self._resume)
        self._state = EngineState.READY
        return self._report(move)

    def _report(self, move: Move) -> dict[str, Any]:
        self.last_move = move
        log.info("%s: %s", self.served_model_name, move.line())
        return {
            **move.to_json(),
            "kv_used_tokens": self._reserved,
            "kv_max_total_tokens": self.settings.max_total_tokens,
        }

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        if self._state is not EngineState.READY:
            raise Unavailable(f"model {self.served_model_name!r} is {self._state.value}")
        assert self._rules is not None  # set by _load before READY
        max_new = request.params.max_new_tokens
        if request.input_ids is not None:
            self._rules.check_ids(request.input_ids, max_new)
            prompt = list(request.input_ids)
        else:
            prompt = await self._prepare(request)
            self._rules.check_fits(len(prompt), max_new)
        seq = Seq(request=request, prompt=prompt, reserved=len(prompt) + max_new)
        if request.params.max_new_tokens == 0:
            yield Delta(
                text="", prompt_tokens=len(prompt), completion_tokens=0, finish_reason="length", queue_time_s=0.0
            )
            return
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                item = await seq.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                seq.aborted = True
                if seq in self._waiting:
                    self._waiting.remove(seq)

    # ---- scheduling (event loop) ------------------------------------------------------------------

    async def _prepare(self, request: GenerateRequest) -> list[int]:
        """The prompt ids of a text or messages request: the chat template in its own process, the
        tokenizer on the prompt lane, each under its deadline."""
        assert self._rules is not None
        if request.messages is not None:
            if self._templates is None:
                raise BadRequest(f"model {self.served_model_name!r} has no chat template; use /v1/completions")
            deadline = self._prompt_deadline(prompts.request_chars(request))
            text = await self._templates.render(request.messages, deadline)
            what, special = "the conversation (after the chat template)", False
        else:
            text, what, special = request.text or "", "text", True
        self._rules.check_text(len(text), what)  # before a tokenizer spends time on it
        limit = self._prompt_deadline(len(text))
        job = functools.partial(prompts.tokenize, special=special)
        future = self._prompt_lane.submit(job, self._prompt_tokenizer, text, self._rules, what)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except TimeoutError:
            if not future.running():  # still queued (and now cancelled): the lane was busy
                raise Unavailable(
                    f"the tokenizer of {self.served_model_name!r} was busy for {limit:.3g} s; retry"
                ) from None
            self._watch_prompt_lane(future)
            raise WorkerError(
                f"model {self.served_model_name!r}: its tokenizer ran more than {limit:.3g} s on this request; "
                "the model's files need fixing (a tokenizer this slow)"
            ) from None

    def _watch_prompt_lane(self, future: Future) -> None:
        """A tokenizer call past its deadline cannot be stopped; if it has not ended after the grace, it
        never will, and the prompt lane is lost for good: the engine fails (the worker restarts)."""

        def check() -> None:
            if not future.done() and self._state is not EngineState.FAILED:
                log.error(
                    "%s: a tokenizer call did not return %.0f s after its deadline; the engine fails so that the "
                    "worker restarts",
                    self.served_model_name,
                    self._stuck_grace_s,
                )
                self._state = EngineState.FAILED
                self._fail_all(Unavailable(f"the engine of {self.served_model_name!r} failed; retry elsewhere"))

        asyncio.get_running_loop().call_later(self._stuck_grace_s, check)

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            count = plan_admission(
                [(len(s.prompt), s.reserved) for s in self._waiting], len(self._running), self._reserved, self._limits
            )
            admit = [self._waiting.popleft() for _ in range(count)]
            if not admit and not self._running:
                self._wake.clear()  # nothing to do; generate() sets it again (no await since the check)
                continue
            now = self._clock()
            for seq in admit:
                seq.admitted_at = now
                self._reserved += seq.reserved
            self._admitting = admit
            try:
                running, events = await self._in_thread(self._step, list(self._running), admit)
            except Exception as exc:  # a failed step loses its batch; later requests still get served
                log.exception(
                    "generation step failed; failing the %d requests in the batch", len(self._running) + len(admit)
                )
                for seq in [*self._running, *admit]:
                    seq.finished = True
                    seq.out.put_nowait(Unavailable(f"the engine failed during generation ({exc}); retry"))
                running, events = [], []
                await self._in_thread(self._reset_batch)
            self._admitting = []
            self._running = running
            self._reserved = sum(seq.reserved for seq in running)
            for seq, item in events:
                seq.out.put_nowait(item)

    def _scheduler_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        log.error("scheduler of %s died: %r; the engine no longer serves", self.served_model_name, exc, exc_info=exc)
        self._state = EngineState.FAILED
        self._fail_all(Unavailable(f"the engine of {self.served_model_name!r} failed; retry elsewhere"))

    def _fail_all(self, error: Exception) -> None:
        for seq in [*self._waiting, *self._admitting, *self._running]:
            if not seq.finished:
                seq.finished = True
                seq.out.put_nowait(error)
        self._waiting.clear()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._lane.run(fn, *args)

    # ---- the engine lane --------------------------------------------------------------------------

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Under a model root, symlinks resolved; weights only as safetensors unless the operator allows
        # pickled ones (torch.load of a .bin file can run code); never the model repository's own code.
        path = model_files.resolve(self.settings.model_path, self._files)
        if self.settings.demo and (not path.exists() or not any(path.iterdir())):
            from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

            log.info("creating the demo model (tiny random Qwen2) at %s", path)
            ensure_tiny_qwen2(path, seed=self.settings.seed)
        model_files.check_model_dir(path, self._files)  # transformers follows every symlink inside
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"no Hugging Face model at {path} (config.json missing); put the weights there, or set "
                "backend.config.demo: true to create a tiny random demo model"
            )
        self._device = _pick_device(self.settings.device)
        self._dtype = _pick_dtype(self.settings.dtype, self._device)
        safe_only = not self._files.allow_unsafe_formats
        remote = self._files.allow_remote_code and bool((self.settings.extra or {}).get("trust_remote_code"))
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=remote)
        self._prompt_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=remote)
        if getattr(self._tokenizer, "chat_template", None):
            try:  # the source the renderer runs (a named set of templates must name a default)
                template = self._tokenizer.get_chat_template()
            except ValueError as exc:
                log.warning("%s: no chat template to use, so no chat endpoint: %s", self.served_model_name, exc)
            else:
                self._chat_template = (template, dict(self._tokenizer.special_tokens_map))
        model = AutoModelForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            dtype=self._dtype,
            use_safetensors=True if safe_only else None,
            trust_remote_code=remote,
        )
        # transformers wraps PreTrainedModel.to in functools.wraps(torch.nn.Module.to), so typeshed's _Wrapped
        # takes the device for `self`.
        self._model = model.to(self._device).eval()  # type: ignore[arg-type]
        self._offload = Offload(self._model)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        table = model.get_input_embeddings()
        embeddings = int(getattr(table, "num_embeddings", 0) or model.config.vocab_size)
        self._rules = PromptRules(
            context=self.settings.context_length or int(getattr(model.config, "max_position_embeddings", 2048)),
            embeddings=embeddings,
            longest_token=prompts.longest_token(self._tokenizer),
            vocabulary=len(self._tokenizer),
            kv_budget=self.settings.max_total_tokens,
        )
        self._stepper = Stepper(
            self._model,
            self._tokenizer,
            self._device,
            eos=frozenset(eos_ids),
            embeddings=embeddings,
            generator=torch.Generator().manual_seed(self.settings.seed),
        )
        self._warm_up()
        log.info(
            "loaded %s from %s on %s (%s): context %d, KV budget %d tokens, batch up to %d, vocabulary %d "
            "(embedding rows %d)",
            self.served_model_name,
            path,
            self._device,
            self._dtype,
            self._rules.context,
            self.settings.max_total_tokens,
            self.settings.max_running,
            self._rules.vocabulary,
            self._rules.embeddings,
        )

    def _warm_up(self) -> None:
        """One small forward pass before the engine reports ready, so that the first request does not pay
        for torch's and the model's lazy set-up (about a second on a CPU for the demo model): what a
        user's first request after a cold load or a wake from zero would otherwise wait for."""
        token = self._tokenizer.eos_token_id if self._tokenizer.eos_token_id is not None else 0
        with torch.inference_mode():
            self._model(input_ids=torch.tensor([[token] * 4], device=self._device), use_cache=True)

    def _step(self, running: list[Seq], admit: list[Seq]) -> tuple[list[Seq], list[Event]]:
        assert self._stepper is not None
        return self._stepper.step(running, admit)

    def _reset_batch(self) -> None:
        assert self._stepper is not None
        self._stepper.reset()

    def _release(self) -> Move:
        assert self._offload is not None
        self._reset_batch()  # an empty batch: the KV cache goes before the allocator's cache is emptied
        return self._offload.release()

    def _resume(self) -> Move:
        assert self._offload is not None
        move = self._offload.resume()
        self._reset_batch()
        return move


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"backend.config.device is {name!r} but this machine has no CUDA device")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
