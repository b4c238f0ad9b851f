"""The torch engine's settings, read once from the ModelService (backend.config) with errors that name
the field. Unknown config keys are left alone: they may be meant for another engine (spec.py lets
engine arguments pass through)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sie.engine_settings.fields import ConfigReader, checked
from sie.engine_settings.kv_budget import KV_BUDGET_SCALE, kv_budget_scale, scaled_kv_tokens
from sie.errors import Problem
from sie.spec import ModelService

DEFAULT_MAX_TOTAL_TOKENS = 8192
DEFAULT_MAX_RUNNING = 16
DEFAULT_MAX_PREFILL_TOKENS = 2048
MAX_BUDGET = 10**9  # tokens or rows: far beyond any engine, but bounded (the spec comes from outside)
MAX_SEED = 2**64 - 1  # torch.manual_seed refuses more
MAX_THREADS = 1024


@dataclass(frozen=True)
class TorchSettings:
    model_path: str
    """spec.model.path: the Hugging Face model directory, under one of the node's model roots."""
    served_model_name: str
    """The model id the worker answers for."""
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS
    """backend.config.max_total_tokens (or max_total_num_tokens): the KV-token budget
    (sglang:max_total_num_tokens), times kv_budget_scale when the node host set one."""
    max_running: int = DEFAULT_MAX_RUNNING
    """backend.config.max_running_requests: rows in the decode batch."""
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    """backend.config.max_prefill_tokens: prompt tokens prefilled per iteration."""
    context_length: int | None = None
    """backend.config.max_seq_len; None: the model config's max_position_embeddings."""
    seed: int = 0
    """backend.config.seed: sampling and the demo model's weights."""
    device: str = "auto"
    """backend.config.device: "auto" (cuda when present), "cpu", "cuda", "cuda:N"."""
    dtype: str = "auto"
    """backend.config.dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "float16", "bfloat16"."""
    num_threads: int = 1
    """backend.config.num_threads: torch intra-op threads; several workers share a node's cores."""
    demo: bool = False
    """backend.config.demo: create a tiny random model at model_path when nothing is there."""
    extra: dict[str, Any] | None = None
    """Every backend.config engine argument, as given."""

    @classmethod
    def from_spec(cls, service: ModelService) -> TorchSettings:
        """The settings, or SpecError naming every wrong field at once (a model path included: the
        engine needs one; a spec for an image of its own may go without)."""
        return checked(*cls.read(service), service, "torch", "a local model directory")

    @classmethod
    def read(cls, service: ModelService) -> tuple[TorchSettings, list[Problem]]:
        """The settings (defaults where a value is wrong) and the problems of backend.config found."""
        spec = service.spec
        extra: dict[str, Any] = dict(spec.backend.config.model_extra or {})
        config = ConfigReader(extra)
        try:
            kv_scale = kv_budget_scale(extra)  # < 1 after the node host saw it OOM-killed repeatedly
        except ValueError as exc:
            config.refuse(KV_BUDGET_SCALE, str(exc))
            kv_scale = 1.0
        kv_tokens = config.integer(
            "max_total_tokens", DEFAULT_MAX_TOTAL_TOKENS, "max_total_num_tokens", maximum=MAX_BUDGET
        )
        settings = cls(
            model_path=spec.model.path or "",
            served_model_name=service.model_id,
            max_total_tokens=scaled_kv_tokens(kv_tokens, kv_scale) if kv_scale < 1 else kv_tokens,
            max_running=config.integer("max_running_requests", DEFAULT_MAX_RUNNING, maximum=MAX_BUDGET),
            max_prefill_tokens=config.integer("max_prefill_tokens", DEFAULT_MAX_PREFILL_TOKENS, maximum=MAX_BUDGET),
            context_length=spec.backend.config.max_seq_len,
            seed=config.integer("seed", 0, minimum=0, maximum=MAX_SEED),
            device=config.choice("device", "auto", ("auto", "cpu", "cuda", "cuda:N")),
            dtype=config.choice("dtype", "auto", ("auto", "float32", "float16", "bfloat16")),
            num_threads=config.integer("num_threads", 1, maximum=MAX_THREADS),
            demo=config.flag("demo", False),
            extra=extra,
        )
        return settings, config.problems
