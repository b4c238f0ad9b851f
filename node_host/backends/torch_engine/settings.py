"""The torch engine's settings, read once from the ModelService (backend.config) with errors that name
the field. Unknown config keys are left alone: they may be meant for another engine (spec.py lets
engine arguments pass through)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node_host.backends.protocol import KV_BUDGET_SCALE, kv_budget_scale, scaled_kv_tokens
from sie.errors import Problem, SpecError
from sie.spec import ModelService

DEFAULT_MAX_TOTAL_TOKENS = 8192
DEFAULT_MAX_RUNNING = 16
DEFAULT_MAX_PREFILL_TOKENS = 2048


@dataclass(frozen=True)
class TorchSettings:
    model_path: str
    served_model_name: str
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS  # KV-token budget (sglang:max_total_num_tokens)
    max_running: int = DEFAULT_MAX_RUNNING  # rows in the decode batch
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # prompt tokens prefilled per iteration
    context_length: int | None = None  # spec max_seq_len; None: the model config's max_position_embeddings
    seed: int = 0  # sampling and demo-model weights
    device: str = "auto"  # "auto" (cuda when present), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "float16", "bfloat16"
    num_threads: int = 1  # torch intra-op threads; several workers share a node's cores
    demo: bool = False  # create a tiny random model at model_path when nothing is there
    extra: dict[str, Any] | None = None  # every backend.config engine argument, as given

    @classmethod
    def from_spec(cls, service: ModelService) -> TorchSettings:
        spec = service.spec
        config = spec.backend.config
        extra: dict[str, Any] = dict(config.model_extra or {})
        problems: list[Problem] = []
        where = "spec.backend.config."

        def integer(key: str, default: int, *aliases: str, minimum: int = 1) -> int:
            for name in (key, *aliases):
                if name in extra:
                    value = extra[name]
                    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                        problems.append(Problem(where + name, f"expected an integer >= {minimum}, got {value!r}"))
                        return default
                    return value
            return default

        def choice(key: str, default: str, allowed: tuple[str, ...]) -> str:
            value = extra.get(key, default)
            ok = isinstance(value, str) and (value in allowed or (key == "device" and value.startswith("cuda:")))
            if not ok:
                problems.append(Problem(where + key, f"expected one of {', '.join(allowed)}, got {value!r}"))
                return default
            return value

        if not spec.model.path:
            problems.append(Problem("spec.model.path", "the torch backend needs a local model directory"))
        demo = extra.get("demo", False)
        if not isinstance(demo, bool):
            problems.append(Problem(where + "demo", f"expected true or false, got {demo!r}"))
        try:
            kv_scale = kv_budget_scale(extra)  # < 1 after the node host saw it OOM-killed repeatedly
        except ValueError as exc:
            problems.append(Problem(where + KV_BUDGET_SCALE, str(exc)))
            kv_scale = 1.0
        kv_tokens = integer("max_total_tokens", DEFAULT_MAX_TOTAL_TOKENS, "max_total_num_tokens")
        settings = cls(
            model_path=spec.model.path or "",
            served_model_name=service.model_id,
            max_total_tokens=scaled_kv_tokens(kv_tokens, kv_scale) if kv_scale < 1 else kv_tokens,
            max_running=integer("max_running_requests", DEFAULT_MAX_RUNNING),
            max_prefill_tokens=integer("max_prefill_tokens", DEFAULT_MAX_PREFILL_TOKENS),
            context_length=config.max_seq_len,
            seed=integer("seed", 0, minimum=0),
            device=choice("device", "auto", ("auto", "cpu", "cuda")),
            dtype=choice("dtype", "auto", ("auto", "float32", "float16", "bfloat16")),
            num_threads=integer("num_threads", 1),
            demo=demo is True,
            extra=extra,
        )
        if problems:
            raise SpecError(f"ModelService {service.model_id!r} (torch backend)", problems)
        return settings
