"""One iteration of the torch engine on its engine lane: decode the running rows, prefill the newcomers,
sample, detokenize, and hand each request its Delta or its own error.

Failure containment: only the batched forward pass (DecodeBatch.step) and the batch's own bookkeeping
may raise out of `Stepper.step`, and the scheduler then fails the whole batch (engine.py). Whatever
belongs to one request (its prefill, its row of sampling, its detokenization and stop strings) fails
that request alone (`_fail`): a WorkerError as raised, so a BadRequest stays a 400, anything else a 500
naming the stage; its row leaves the batch at the end of the step, and the other rows go on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from node_host.backends.protocol import Delta, FinishReason, GenerateRequest, WorkerError
from node_host.backends.torch_engine.batch import DecodeBatch, prefill, sample
from node_host.backends.torch_engine.detokenize import TextTracker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Seq:
    request: GenerateRequest
    prompt: list[int]
    reserved: int  # prompt + max_new_tokens: the KV tokens held from admission to the end
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # Delta or a WorkerError, loop side
    tracker: TextTracker | None = None
    admitted_at: float = 0.0
    generated: int = 0
    last_token: int = 0
    finished: bool = False
    aborted: bool = False  # set by the loop when the consumer went away


Event = tuple[Seq, Delta | WorkerError]  # what a step hands one request


class Stepper:
    """The engine lane's state between steps: the model, the decode batch (the KV cache), the tokenizer
    used for detokenization and the sampling generator. Used on the engine lane only."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        *,
        eos: frozenset[int],
        embeddings: int,
        generator: torch.Generator,
    ):
        self.model = model
        self.device = device
        self.batch = DecodeBatch(device)
        self._tokenizer = tokenizer
        self._eos = eos
        self._embeddings = embeddings  # rows of the input embedding table
        self._generator = generator

    def reset(self) -> None:
        """An empty batch: the KV cache is dropped (after a failed step, and before a release)."""
        self.batch = DecodeBatch(self.device)

    def step(self, running: list[Seq], admit: list[Seq]) -> tuple[list[Seq], list[Event]]:
        """One iteration: drop aborted rows, decode every running row, prefill the newcomers, drop
        finished rows. Returns the new running list (batch row order) and the Deltas or errors to deliver.
        Only the batched forward pass (batch.step) and the batch's own bookkeeping may raise; whatever
        belongs to one request fails that request alone (`_fail`)."""
        batch = self.batch
        keep = [i for i, seq in enumerate(running) if not seq.aborted]
        batch.keep(keep)
        running = [running[i] for i in keep]
        events: list[Event] = []
        if running:
            logits = batch.step(self.model, [seq.last_token for seq in running])
            for seq, token in zip(running, self._sample(running, logits, events)):
                if token is not None:
                    self._emit(seq, token, events)
        for seq in admit:
            if seq.aborted:
                continue
            try:
                first = prefill(self.model, seq.prompt, self.device)
            except Exception as exc:  # its own forward pass: the batch is untouched
                self._fail(seq, exc, "prefill", events)
                continue
            (token,) = self._sample([seq], first.logits[None], events)
            if token is None:
                continue
            seq.tracker = TextTracker(self._decode, seq.request.params.stop)
            batch.add(first)
            running.append(seq)
            self._emit(seq, token, events)
        keep = [i for i, seq in enumerate(running) if not seq.finished]
        batch.keep(keep)
        return [running[i] for i in keep], events

    def _sample(self, seqs: list[Seq], logits: torch.Tensor, events: list[Event]) -> list[int | None]:
        """A token per row, None for a row that failed (its error is in `events`)."""
        # A head wider than the embedding table (a padded vocabulary) must not pick an id that the next
        # decode step could not embed.
        logits = logits[:, : self._embeddings]
        temps, tops = self._sampling(seqs)
        try:
            tokens = sample(logits, temps, tops, self._generator)
        except Exception:  # sample() keeps rows apart; should it fail anyway, each row is tried alone
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
            tokens = []
            for i, seq in enumerate(seqs):
                try:
                    tokens.extend(sample(logits[i : i + 1], temps[i : i + 1], tops[i : i + 1], self._generator))
                except Exception as exc:
                    self._fail(seq, exc, "sampling", events)
                    tokens.append(None)
        for seq, token in zip(seqs, tokens):
            if token is None and not seq.finished:
                self._fail(
                    seq,
                    WorkerError(
                        "the model's scores for this request's next token were not finite numbers (NaN or inf)"
                    ),
                    "sampling",
                    events,
                )
        return tokens

    def _emit(self, seq: Seq, token: int, events: list[Event]) -> None:
        try:
            self._advance(seq, token, events)
        except Exception as exc:  # detokenizing or a stop string: this request's alone
            self._fail(seq, exc, "detokenization", events)

    def _fail(self, seq: Seq, exc: Exception, stage: str, events: list[Event]) -> None:
        """End one request with its own error: a WorkerError as raised (a BadRequest stays a 400), anything
        else a 500 that names the stage; the request's row leaves the batch at the end of the step."""
        if isinstance(exc, WorkerError):
            error = exc
        else:
            log.error("request %s failed in %s: %r", seq.request.rid, stage, exc, exc_info=exc)
            error = WorkerError(
                f"the engine failed on this request during {stage} ({type(exc).__name__}: {exc}); "
                "the other requests were not affected"
            )
        seq.finished = True
        events.append((seq, error))

    def _sampling(self, seqs: list[Seq]) -> tuple[list[float], list[float]]:
        return [s.request.params.temperature for s in seqs], [s.request.params.top_p for s in seqs]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, seq: Seq, token: int, events: list[Event]) -> None:
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
