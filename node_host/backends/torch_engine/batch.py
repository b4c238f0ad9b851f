"""The torch engine's tensor work: prefill one sequence, decode every running sequence in one batch.

Iteration-level (continuous) batching over a Hugging Face causal LM: sequences join and leave the batch
between decode steps. The running sequences share one KV cache, left-padded to a common length:

    row 0:  [0 0 0 p p p p g g]     mask 0 where the cache holds padding, 1 where it holds a token
    row 1:  [p p p p p p g g g]     the next decode step appends one column for every row

Each row carries its own position id (tokens it really has), so padding never shifts rotary positions,
and the attention mask hides the padding. A sequence is prefilled alone (batch of one, no padding: a
padded prefill would compute attention for query rows that see nothing), then its cache is merged into
the batch. Leaving the batch selects rows; columns that are padding in every remaining row are trimmed,
so the cache never grows past the longest running sequence.

Everything here runs in the engine's single worker thread; nothing here touches asyncio.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

# The cache's per-layer tensors are [batch, kv_heads, seq, head_dim]; DynamicCache keeps them on
# `cache.layers[i].keys/.values` (transformers 5). These two helpers are the only code that knows that.


def _layers(cache: DynamicCache) -> list:
    return list(cache.layers)


def _pad_left(cache: DynamicCache, columns: int) -> None:
    if columns <= 0:
        return
    for layer in _layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)
            pad = t.new_zeros((*t.shape[:-2], columns, t.shape[-1]))
            setattr(layer, name, torch.cat([pad, t], dim=-2))


def _concat_rows(into: DynamicCache, other: DynamicCache) -> None:
    for mine, theirs in zip(_layers(into), _layers(other), strict=True):
        mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
        mine.values = torch.cat([mine.values, theirs.values], dim=0)


def _trim_left(cache: DynamicCache, columns: int) -> None:
    if columns <= 0:
        return
    for layer in _layers(cache):
        layer.keys = layer.keys[..., columns:, :]
        layer.values = layer.values[..., columns:, :]


@functools.cache
def _call_style(model_type: type[torch.nn.Module]) -> tuple[str, bool]:
    """(name of the cache argument, whether `logits_to_keep` exists): transformers 5 renamed
    `past_key_values` to `cache`; older releases only know the old name."""
    params = inspect.signature(model_type.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _forward(model: torch.nn.Module, cache: DynamicCache, **kwargs) -> torch.Tensor:
    """Run the model with `cache` (updated in place); returns the last position's logits [rows, vocab]."""
    # mypy checks a class object against lru_cache's Hashable through its instances' __hash__ (a false positive)
    cache_arg, keep = _call_style(type(model))  # type: ignore[arg-type]
    if keep:
        kwargs["logits_to_keep"] = 1
    out = model(**kwargs, **{cache_arg: cache}, use_cache=True)
    return out.logits[:, -1].float()


@dataclass
class Prefilled:
    """One sequence after its prefill: its cache (batch of one) and the logits for its first new token."""

    cache: DynamicCache
    length: int
    logits: torch.Tensor  # [vocab]


@torch.inference_mode()
def prefill(model: torch.nn.Module, input_ids: list[int], device: torch.device) -> Prefilled:
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    cache = DynamicCache()
    logits = _forward(model, cache, input_ids=ids)
    return Prefilled(cache=cache, length=len(input_ids), logits=logits[0])


class DecodeBatch:
    """The running sequences' shared cache. Row i of `mask`, `positions` and the cache belong to the
    i-th sequence the caller added and kept; the caller keeps its own list in the same order."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.positions = torch.zeros((0,), dtype=torch.long, device=device)

    @property
    def size(self) -> int:
        return int(self.positions.shape[0])

    @property
    def columns(self) -> int:
        return int(self.mask.shape[1])

    def add(self, seq: Prefilled) -> None:
        """Append one prefilled sequence as the last row."""
        width = max(self.columns, seq.length)
        row_mask = torch.zeros((1, width), dtype=torch.long, device=self.device)
        row_mask[0, width - seq.length :] = 1
        _pad_left(seq.cache, width - seq.length)
        if self.cache is None or self.size == 0:
            self.cache = seq.cache
            self.mask = row_mask
        else:
            _pad_left(self.cache, width - self.columns)
            self.mask = torch.cat([self.mask.new_zeros((self.size, width - self.columns)), self.mask], dim=1)
            _concat_rows(self.cache, seq.cache)
            self.mask = torch.cat([self.mask, row_mask], dim=0)
        self.positions = torch.cat([self.positions, torch.tensor([seq.length], device=self.device)])

    @torch.inference_mode()
    def step(self, model: torch.nn.Module, last_tokens: list[int]) -> torch.Tensor:
        """Feed each row its last sampled token; returns next-token logits [rows, vocab] (float32)."""
        if self.size == 0 or self.cache is None:
            raise RuntimeError("decode step on an empty batch")
        if len(last_tokens) != self.size:
            raise ValueError(f"{len(last_tokens)} tokens for {self.size} rows")
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        mask = torch.cat([self.mask, self.mask.new_ones((self.size, 1))], dim=1)
        logits = _forward(model, self.cache, input_ids=ids, attention_mask=mask, position_ids=self.positions[:, None])
        self.mask = mask
        self.positions = self.positions + 1
        return logits

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order; then drop columns that are padding in every row."""
        if len(rows) == self.size:
            return
        if not rows:
            self.cache = None
            self.mask = self.mask.new_zeros((0, 0))
            self.positions = self.positions.new_zeros((0,))
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        assert self.cache is not None
        self.cache.batch_select_indices(index)
        self.mask = self.mask.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        used = self.mask.any(dim=0)
        first = int(torch.argmax(used.to(torch.int8)).item())  # first column some row still uses
        if first > 0:
            _trim_left(self.cache, first)
            self.mask = self.mask[:, first:]


# Temperatures below this are greedy, as vLLM treats them (_SAMPLING_EPS): the distribution is one-hot
# to float32 precision anyway, and dividing by 1e-40 overflowed to inf, whose softmax is NaN.
GREEDY_BELOW = 1e-5


def sample(
    logits: torch.Tensor, temperature: list[float], top_p: list[float], generator: torch.Generator
) -> list[int | None]:
    """One token per row, decided for each row alone: no row's values can make another row fail.

    A temperature below GREEDY_BELOW (or not a number) is greedy; top_p keeps the smallest set of tokens
    whose probability reaches top_p (nucleus sampling), and always the most likely token, so top_p 0 is
    greedy too rather than an empty distribution. A row whose logits hold NaN or +inf, or are all -inf,
    gets None: the model failed for that row, and only its request should fail."""
    logits = logits.float()
    broken = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)
    if bool(broken.any()):
        logits = torch.where(broken[:, None], torch.zeros_like(logits), logits)
    temps = torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    greedy = ~(temps >= GREEDY_BELOW)  # written so that NaN is greedy too
    tokens = torch.argmax(logits, dim=-1)
    if not bool(greedy.all()):
        temps = torch.where(greedy, torch.ones_like(temps), temps)
        # Shifted so the largest logit is 0: divided by any temperature the rest stay <= 0 (-inf at worst),
        # so every row keeps probability 1 on its best token before normalising; never inf - inf.
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(shifted / temps[:, None], dim=-1)
        tops = torch.tensor(top_p, dtype=torch.float32, device=logits.device).nan_to_num(1.0).clamp(0.0, 1.0)
        if bool((tops < 1.0).any()):
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
            keep = before < tops[:, None]
            keep[:, 0] = True
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        drawn = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
        tokens = torch.where(greedy, tokens, drawn)
    return [None if bad else token for token, bad in zip(tokens.tolist(), broken.tolist())]
