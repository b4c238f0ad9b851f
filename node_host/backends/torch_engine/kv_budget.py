"""Admission under a KV-token budget: which waiting requests join the running batch now (pure).

The torch engine reserves, per request, its prompt plus its max_new_tokens when it is admitted, and
never retracts: a running request always has room to finish. `used / max_total` is what it reports as
KV-cache use (sglang:token_usage), so the figure says how close the engine is to queueing, which is
what the weight policy needs. SGLang reserves less up front and retracts when it guessed wrong; the
worst-case reservation is simpler and cannot thrash, at the price of admitting fewer long requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetLimits:
    max_total_tokens: int  # KV tokens the engine may hold at once
    max_running: int  # rows in the decode batch
    max_prefill_tokens: int  # prompt tokens prefilled per iteration, so decoding rows are not stalled long

    def __post_init__(self) -> None:
        if min(self.max_total_tokens, self.max_running, self.max_prefill_tokens) < 1:
            raise ValueError(f"every budget limit must be >= 1, got {self}")


def plan_admission(waiting: Sequence[tuple[int, int]], running: int, reserved: int, limits: BudgetLimits) -> int:
    """How many requests from the head of `waiting` ((prompt_tokens, reserved_tokens) in FIFO order) to
    admit now, given `running` rows holding `reserved` tokens.

    Strict FIFO: a request that does not fit blocks those behind it, so a long request is never starved
    by a stream of short ones. At least one request is prefilled per iteration when anything fits, even
    if its prompt alone exceeds max_prefill_tokens.
    """
    admitted = 0
    prefill = 0
    for prompt_tokens, need in waiting:
        if running + admitted >= limits.max_running:
            break
        if reserved + need > limits.max_total_tokens:
            break
        if admitted and prefill + prompt_tokens > limits.max_prefill_tokens:
            break
        admitted += 1
        reserved += need
        prefill += prompt_tokens
    return admitted
