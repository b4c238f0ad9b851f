"""The embedded torch engine: a Hugging Face causal LM served with continuous batching.

Shape: one asyncio scheduler task (`scheduler:<model>`) and one worker thread. Each iteration the task
decides on the event loop which waiting requests join (kv_budget.plan_admission: FIFO under a KV-token
budget), then runs one step in the thread: a decode step for every running row, a prefill for each
newcomer (batch.py), sampling, detokenization (detokenize.TextTracker). Back on the loop it hands
each request its Delta through the request's own asyncio.Queue.

Ownership (why there are no locks): the thread is the only user of the model, the tokenizer and the
batch tensors, including tokenization of new prompts (HF fast tokenizers are not safe to share across
threads). `_waiting`, `_running` and `_reserved` are changed only on the event loop; the thread receives
`_running` while the loop awaits the step and returns the new list. A consumer that goes away sets
`aborted` on its sequence, which the next step honours.

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
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from node_host.backends.protocol import (
    BadRequest,
    Busy,
    Delta,
    EngineState,
    FinishReason,
    GenerateRequest,
    Loads,
    Unavailable,
)
from node_host.backends.torch_engine.batch import DecodeBatch, prefill, sample
from node_host.backends.torch_engine.detokenize import TextTracker
from node_host.backends.torch_engine.kv_budget import BudgetLimits, plan_admission
from node_host.backends.torch_engine.offload import Move, Offload
from sie import model_files
from sie.engine_settings import TorchSettings
from sie.model_files import ModelFilePolicy

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Seq:
    request: GenerateRequest
    prompt: list[int]
    reserved: int  # prompt + max_new_tokens: the KV tokens held from admission to the end
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta or an exception, loop side
    tracker: TextTracker | None = None
    admitted_at: float = 0.0
    generated: int = 0
    last_token: int = 0
    finished: bool = False
    aborted: bool = False  # set by the loop when the consumer went away


class TorchEngine:
    backend = "torch"
    simulated = False

    def __init__(self, settings: TorchSettings, files: ModelFilePolicy, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._files = files
        self.served_model_name = settings.served_model_name
        self.model_path = settings.model_path
        self._clock = clock
        self._limits = BudgetLimits(settings.max_total_tokens, settings.max_running, settings.max_prefill_tokens)
        self._state = EngineState.LOADING
        self._waiting: deque[_Seq] = deque()
        self._admitting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._reserved = 0
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"torch-{settings.served_model_name}")
        # Set by _load, used only on the engine thread afterwards.
        self._model: Any = None
        self._tokenizer: Any = None
        self._offload: Offload | None = None
        self.last_move: Move | None = None  # the figures of the latest release or resume
        self._device = torch.device("cpu")
        self._dtype = torch.float32
        self._eos: frozenset[int] = frozenset()
        self._context = 0
        self._batch: DecodeBatch | None = None
        self._generator = torch.Generator().manual_seed(settings.seed)

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
        self._scheduler = asyncio.create_task(self._schedule(), name=f"scheduler:{self.served_model_name}")
        self._scheduler.add_done_callback(self._scheduler_done)
        self._state = EngineState.READY

    async def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
        self._fail_all(Unavailable(f"model {self.served_model_name!r} is shutting down; retry elsewhere"))
        self._executor.shutdown(wait=True, cancel_futures=True)

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
        prompt = await self._in_thread(self._encode, request)
        seq = self._check(request, prompt)
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

    def _check(self, request: GenerateRequest, prompt: list[int]) -> _Seq:
        need = len(prompt) + request.params.max_new_tokens
        if not prompt:
            raise BadRequest("the prompt is empty after tokenization")
        if need > self._context:
            raise BadRequest(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({request.params.max_new_tokens}) = {need} is "
                f"over the context length {self._context}; shorten the prompt or lower max_new_tokens"
            )
        if need > self.settings.max_total_tokens:
            raise BadRequest(
                f"prompt + max_new_tokens = {need} tokens is over this engine's KV budget "
                f"({self.settings.max_total_tokens}, backend.config.max_total_tokens)"
            )
        return _Seq(request=request, prompt=prompt, reserved=need)

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
            for seq, delta in events:
                seq.out.put_nowait(delta)

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
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- the engine thread ------------------------------------------------------------------------

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # Under a model root, symlinks resolved; weights only as safetensors unless the operator allows
        # pickled ones (torch.load of a .bin file can run code); never the model repository's own code.
        path = model_files.resolve(self.settings.model_path, self._files)
        if self.settings.demo and (not path.exists() or not any(path.iterdir())):
            from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

            log.info("creating the demo model (tiny random Qwen2) at %s", path)
            ensure_tiny_qwen2(path, seed=self.settings.seed)
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
        self._eos = frozenset(eos_ids)
        self._context = self.settings.context_length or int(getattr(model.config, "max_position_embeddings", 2048))
        self._batch = DecodeBatch(self._device)
        self._warm_up()
        log.info(
            "loaded %s from %s on %s (%s): context %d, KV budget %d tokens, batch up to %d",
            self.served_model_name,
            path,
            self._device,
            self._dtype,
            self._context,
            self.settings.max_total_tokens,
            self.settings.max_running,
        )

    def _encode(self, request: GenerateRequest) -> list[int]:
        if request.input_ids is not None:
            vocab = len(self._tokenizer)
            bad = [t for t in request.input_ids if t >= vocab]
            if bad:
                raise BadRequest(f"input_ids: token ids {bad[:5]} are outside the vocabulary (size {vocab})")
            return list(request.input_ids)
        if request.messages is not None:
            if not getattr(self._tokenizer, "chat_template", None):
                raise BadRequest(f"model {self.served_model_name!r} has no chat template; use /v1/completions")
            text = self._tokenizer.apply_chat_template(
                [dict(m) for m in request.messages], add_generation_prompt=True, tokenize=False
            )
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return list(self._tokenizer.encode(request.text or "", add_special_tokens=True))

    def _step(self, running: list[_Seq], admit: list[_Seq]) -> tuple[list[_Seq], list[tuple[_Seq, Delta]]]:
        """One iteration: drop aborted rows, decode every running row, prefill the newcomers, drop
        finished rows. Returns the new running list (batch row order) and the Deltas to deliver."""
        batch = self._batch
        assert batch is not None and self._model is not None
        keep = [i for i, seq in enumerate(running) if not seq.aborted]
        batch.keep(keep)
        running = [running[i] for i in keep]
        events: list[tuple[_Seq, Delta]] = []
        if running:
            logits = batch.step(self._model, [seq.last_token for seq in running])
            tokens = sample(logits, *self._sampling(running), self._generator)
            for seq, token in zip(running, tokens):
                self._advance(seq, token, events)
        for seq in admit:
            if seq.aborted:
                continue
            seq.tracker = TextTracker(self._decode, seq.request.params.stop)
            first = prefill(self._model, seq.prompt, self._device)
            token = sample(first.logits[None], *self._sampling([seq]), self._generator)[0]
            batch.add(first)
            running.append(seq)
            self._advance(seq, token, events)
        keep = [i for i, seq in enumerate(running) if not seq.finished]
        batch.keep(keep)
        return [running[i] for i in keep], events

    def _sampling(self, seqs: list[_Seq]) -> tuple[list[float], list[float]]:
        return [s.request.params.temperature for s in seqs], [s.request.params.top_p for s in seqs]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, seq: _Seq, token: int, events: list[tuple[_Seq, Delta]]) -> None:
        assert seq.tracker is not None
        params = seq.request.params
        first = seq.generated == 0
        seq.generated += 1
        finish: FinishReason | None = None
        matched: str | int | None = None
        if token in self._eos and not params.ignore_eos:
            finish, matched = "stop", token
            text = seq.tracker.flush()
        else:
            seq.last_token = token
            text = seq.tracker.push(token)
            if seq.tracker.matched is not None:
                finish, matched = "stop", seq.tracker.matched
            elif seq.generated >= params.max_new_tokens:
                finish = "length"
                text += seq.tracker.flush()
        if finish is not None:
            seq.finished = True
        if text or finish is not None or first:
            events.append(
                (
                    seq,
                    Delta(
                        text=text,
                        prompt_tokens=len(seq.prompt),
                        completion_tokens=seq.generated,
                        finish_reason=finish,
                        queue_time_s=max(0.0, seq.admitted_at - seq.request.arrival) if first else None,
                        matched_stop=matched,
                    ),
                )
            )

    def _warm_up(self) -> None:
        """One small forward pass before the engine reports ready, so that the first request does not pay
        for torch's and the model's lazy set-up (about a second on a CPU for the demo model): what a
        user's first request after a cold load or a wake from zero would otherwise wait for."""
        token = self._tokenizer.eos_token_id if self._tokenizer.eos_token_id is not None else 0
        with torch.inference_mode():
            self._model(input_ids=torch.tensor([[token] * 4], device=self._device), use_cache=True)

    def _reset_batch(self) -> None:
        self._batch = DecodeBatch(self._device)

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
