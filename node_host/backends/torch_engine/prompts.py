"""Turning a request into prompt token ids, and the bounds a prompt is held to before and after.

`PromptRules` (pure) decides; `tokenize` runs on the prompt lane (lanes.py) with a tokenizer instance of
its own, never on the engine lane, so a long text never delays a decode step. Chat templates render in
child processes (templates.py).

Bounds, cheapest first, so the costly steps only see input that can fit:
- a text longer than `max_chars` is refused before tokenizing: each token stands for at most
  `longest_token` characters (the longest entry of the vocabulary: for byte-level BPE one character
  per byte, for SentencePiece "▁" for a space, an added token its content), so a text of more than
  context × longest_token characters needs more tokens than the context holds. NORMALIZER_SLACK covers
  normalizers that merge characters (NFC composes up to a few code points into one; Qwen's uses NFC).
  A normalizer that deletes characters (whitespace or control-character stripping) would make any such
  bound unsound; a text it shrinks below the context is degenerate, and it is told what limit it broke.
- input_ids longer than the context are refused before their ids are scanned.
- every id must have a row in the model's input embedding table (`embeddings`, which may be smaller
  than len(tokenizer): a fine-tune that added tokens without resizing the model); an id past it fails
  the whole forward pass of the batch it joins, so it is refused here, by name.
- rendering and tokenizing each have a deadline (`deadline_s`), generous for the text's size: a
  template past it is killed with its process; a tokenizer call cannot be stopped, but it is bounded
  by the text's size, and its request is answered at the deadline anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from node_host.backends.protocol import BadRequest, GenerateRequest

NORMALIZER_SLACK = 4
# The deadline for rendering and tokenizing one prompt: a base for the chat template, plus time for the
# text at a rate far below any tokenizer's (the demo's byte-level BPE does 1.3 M characters/s on one core).
PROMPT_DEADLINE_S = 10.0
SLOWEST_CHARS_PER_S = 200_000.0


@dataclass(frozen=True)
class PromptRules:
    context: int  # tokens of prompt + new tokens the model takes
    embeddings: int  # rows of the input embedding table: every token id must be below it
    longest_token: int  # characters of the vocabulary's longest token
    vocabulary: int  # len(tokenizer), named when a text holds a token past the embedding table
    kv_budget: int  # backend.config.max_total_tokens

    @property
    def max_chars(self) -> int:
        return self.context * max(1, self.longest_token) * NORMALIZER_SLACK

    def check_text(self, chars: int, what: str) -> None:
        if chars > self.max_chars:
            raise BadRequest(
                f"{what} has {chars} characters, more than this model's context of {self.context} tokens can "
                f"hold ({self.max_chars}: its longest token has {self.longest_token} characters); shorten it"
            )

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        need = prompt_tokens + max_new_tokens
        if prompt_tokens == 0:
            raise BadRequest("the prompt is empty after tokenization")
        if need > self.context:
            raise BadRequest(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {need} is "
                f"over the context length {self.context}; shorten the prompt or lower max_new_tokens"
            )
        if need > self.kv_budget:
            raise BadRequest(
                f"prompt + max_new_tokens = {need} tokens is over this engine's KV budget "
                f"({self.kv_budget}, backend.config.max_total_tokens)"
            )

    def unknown(self, ids: Sequence[int]) -> list[int]:
        """The ids (first five) the model has no embedding for."""
        return [t for t in ids if t >= self.embeddings][:5]

    def check_ids(self, ids: Sequence[int], max_new_tokens: int) -> None:
        """input_ids as given: their length first (cheap), then every id."""
        self.check_fits(len(ids), max_new_tokens)
        bad = self.unknown(ids)
        if bad:
            raise BadRequest(
                f"input_ids: token ids {bad} are outside this model's vocabulary: its embedding table has "
                f"{self.embeddings} rows (ids 0..{self.embeddings - 1})"
            )


def deadline_s(chars: int) -> float:
    return PROMPT_DEADLINE_S + chars / SLOWEST_CHARS_PER_S


def request_chars(request: GenerateRequest) -> int:
    """The characters the prompt lane will work on (before a chat template adds its own)."""
    if request.messages is not None:
        return sum(len(m.get("content", "")) + len(m.get("role", "")) for m in request.messages)
    return len(request.text or "")


def longest_token(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (added tokens included)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def tokenize(tokenizer: Any, text: str, rules: PromptRules, what: str, *, special: bool) -> list[int]:
    """The ids of `text` (the prompt lane), every one with a row in the embedding table. `special`:
    add the tokenizer's BOS and the like (a chat template has written its own)."""
    rules.check_text(len(text), what)
    ids = list(tokenizer.encode(text, add_special_tokens=special))
    bad = rules.unknown(ids)
    if bad:
        names = tokenizer.convert_ids_to_tokens(bad)
        raise BadRequest(
            f"{what} holds tokens this model has no embedding for: {names} (ids {bad}); its tokenizer has "
            f"{rules.vocabulary} tokens but its embedding table only {rules.embeddings} rows (tokens added "
            "without resizing the model); remove them from the prompt"
        )
    return ids
