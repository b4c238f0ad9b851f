"""How much GPU memory an instance will hold, before it is loaded (the ledger's first figure).

A spec that sets `resources.min_gpu_memory_mb` is taken at its word. Otherwise the figure is computed
from the model's Hugging Face `config.json`:

    total = weights + KV budget + overhead                          (MiB, per instance, tp_size 1)

    weights  = parameter count x bytes per parameter
               decoder (llama, qwen2, mistral, phi3, gemma, gemma2):
                 V*H (embeddings) + [V*H if the LM head is not tied]
                 + L * ( H*(nh*d) + 2*H*(nkv*d) + (nh*d)*H      attention q, k, v, o
                         + [nh*d + 2*nkv*d if q/k/v carry biases]
                         + 3*H*I                                  gated MLP: gate, up, down
                         + n_norm*H )                             RMSNorm weights (2 per layer, 4 for gemma2)
                 + H (final norm)
               encoder (bert, roberta, xlm-roberta): embeddings (word, position, type, LayerNorm), per layer
                 4*(H*H+H) attention + (H*I+I) + (I*H+H) MLP + 2 LayerNorms, plus the pooler
    KV       = kv_tokens x 2 (K and V) x L x nkv x d x bytes per KV element      (0 for encoders)
    overhead = CUDA context + CUDA graphs + one prefill chunk of activations,
               chunk_tokens x (4*H + 2*I) x bytes                (the MLP's gate and up outputs dominate)

with V vocab, H hidden size, L layers, nh attention heads, nkv KV heads, d head dim (config `head_dim`, else
H/nh), I intermediate size. Checked against published parameter counts: Qwen2-7B 7,615,616,512 (15.2 GB in
bf16), Llama-3-8B 8,030,261,248, Gemma-2-9B 9,241,705,984, Phi-3-mini 3,821,079,552 (see the tests).

The KV budget is the token count the engine is told it may cache (SGLang's --max-total-tokens):
`backend.config.max_total_tokens` when the spec sets it, else DEFAULT_KV_TOKENS, raised to at least one
full `max_seq_len`. The SGLang adapter launches with the same number, so estimate and engine agree.

The overhead constants are rules of thumb for SGLang on A100/H100-class GPUs (a CUDA context with cuBLAS
workspaces is about 0.5 GiB; SGLang logs about 0.3-1 GiB for CUDA graph capture of a 7B model), not
measurements made here. That is why the ledger replaces this estimate with the measured figure (NVML's
per-process memory) as soon as the instance has loaded. Quantised checkpoints and MoE models are out of
scope: give them `min_gpu_memory_mb`.

config.json comes from the model's files, which may be hostile (DESIGN §10): every figure the formula uses
is checked to be an integer in a range far beyond any published model (`_BOUNDS`), every flag a boolean,
and the result a finite, positive figure; anything else is an EstimateError naming the field and value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sie.errors import SIEError
from sie.spec import ModelService

MIB = 1024 * 1024
DEFAULT_KV_TOKENS = 32_768
MAX_KV_TOKENS = 1 << 32  # backend.config.max_total_tokens above this is a typo, not a KV budget

# The largest value config.json may give each figure the formula uses: one to two orders of magnitude
# above any published model (Llama-3-405B: H 16384, I 53248, L 126; Gemma: V 256000), and small enough
# that the arithmetic stays exact integers and the result a finite float.
_BOUNDS = {
    "hidden_size": 1 << 20,
    "num_hidden_layers": 1 << 14,
    "num_attention_heads": 1 << 14,
    "num_key_value_heads": 1 << 14,
    "head_dim": 1 << 16,
    "vocab_size": 1 << 24,
    "intermediate_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
    "type_vocab_size": 1 << 16,
}
_FIX = "set resources.min_gpu_memory_mb in the spec"

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8": 1, "fp8": 1}
_DECODERS = {"llama", "mistral", "qwen2", "phi3", "gemma", "gemma2"}
_ENCODERS = {"bert", "roberta", "xlm-roberta"}
_TIED_BY_DEFAULT = {"gemma", "gemma2"}  # their config classes default tie_word_embeddings to True


class EstimateError(SIEError, ValueError):
    """No estimate can be made; the message says which spec field to set instead."""


@dataclass(frozen=True)
class ModelShape:
    """The figures of a config.json that decide memory. Build with `ModelShape.from_config`."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    norms_per_layer: int = 2
    encoder: bool = False
    max_position_embeddings: int = 0
    type_vocab_size: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Raises EstimateError naming the field for a config whose figures are missing or out of range."""
        if not isinstance(config, Mapping):
            raise EstimateError(f"config.json is not a JSON object but {type(config).__name__}; {_FIX}")
        text_config = config.get("text_config")
        cfg: Mapping[str, Any] = (
            text_config if "hidden_size" not in config and isinstance(text_config, Mapping) else config
        )
        raw_type = cfg.get("model_type") or config.get("model_type") or ""
        model_type = raw_type.lower().replace("_", "-") if isinstance(raw_type, str) else ""
        if model_type not in _DECODERS | _ENCODERS:
            known = ", ".join(sorted(_DECODERS | _ENCODERS))
            raise EstimateError(
                f"cannot estimate memory for model_type {_show(raw_type) if raw_type else '(none)'} "
                f"(known: {known}); {_FIX}"
            )
        hidden, layers, heads = (
            _count(cfg, "hidden_size"),
            _count(cfg, "num_hidden_layers"),
            _count(cfg, "num_attention_heads"),
        )
        vocab, inter = _count(cfg, "vocab_size"), _count(cfg, "intermediate_size")
        kv_heads = _count(cfg, "num_key_value_heads", default=heads)  # absent: multi-head attention
        head_dim = _count(cfg, "head_dim", default=hidden // heads)
        if head_dim < 1:
            raise EstimateError(
                f"config.json gives no head_dim and hidden_size {hidden} is smaller than num_attention_heads "
                f"{heads}; {_FIX}"
            )
        attention_bias = _flag(cfg, "attention_bias", False)
        encoder = model_type in _ENCODERS
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            intermediate_size=inter,
            dtype_bytes=serving_dtype_bytes(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype")),
            tie_word_embeddings=_flag(cfg, "tie_word_embeddings", model_type in _TIED_BY_DEFAULT),
            qkv_bias=model_type == "qwen2" or attention_bias,  # Qwen2 always biases q, k, v
            o_bias=attention_bias,
            norms_per_layer=4 if model_type == "gemma2" else 2,
            encoder=encoder,
            # Only encoders count position and token-type embeddings (decoders use rotary positions).
            max_position_embeddings=_count(cfg, "max_position_embeddings", default=0, least=0) if encoder else 0,
            type_vocab_size=_count(cfg, "type_vocab_size", default=0, least=0) if encoder else 0,
        )

    def parameter_count(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        if self.encoder:
            embeddings = (v + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
            per_layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
            pooler = h * h + h
            return embeddings + self.num_layers * per_layer + pooler
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q_width + 2 * h * kv_width + q_width * h
        if self.qkv_bias:
            attention += q_width + 2 * kv_width
        if self.o_bias:
            attention += h
        per_layer = attention + 3 * h * i + self.norms_per_layer * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + head + self.num_layers * per_layer + h

    def weights_bytes(self) -> int:
        return self.parameter_count() * self.dtype_bytes

    def kv_bytes_per_token(self, kv_dtype_bytes: int | None = None) -> int:
        if self.encoder:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (kv_dtype_bytes or self.dtype_bytes)


def _show(value: Any) -> str:
    """A config value for a message, cut short: the file is the model's, not ours, and may be large."""
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _count(cfg: Mapping[str, Any], key: str, *, default: int | None = None, least: int = 1) -> int:
    """`cfg[key]` as an integer from `least` to its bound; `default` when absent or null (None: required)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise EstimateError(f"config.json lacks {key!r}; {_FIX}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= _BOUNDS[key]:
        raise EstimateError(
            f"config.json {key} must be an integer from {least} to {_BOUNDS[key]}, got {_show(value)}; {_FIX}"
        )
    return value


def _flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise EstimateError(f"config.json {key} must be true or false, got {_show(value)}; {_FIX}")
    return value


@dataclass(frozen=True)
class Overheads:
    """Per-process memory outside weights and KV cache (rules of thumb; see the module docstring)."""

    cuda_context_mb: float = 512.0
    cuda_graph_mb: float = 512.0
    prefill_chunk_tokens: int = 8192  # SGLang's --chunked-prefill-size on 80 GB GPUs

    def activation_mb(self, shape: ModelShape) -> float:
        return (
            self.prefill_chunk_tokens * (4 * shape.hidden_size + 2 * shape.intermediate_size) * shape.dtype_bytes / MIB
        )

    def total_mb(self, shape: ModelShape) -> float:
        graphs = 0.0 if shape.encoder else self.cuda_graph_mb
        return self.cuda_context_mb + graphs + self.activation_mb(shape)


@dataclass(frozen=True)
class MemoryEstimate:
    """An instance's memory before it is measured. `declared_mb` set means the spec gave the figure."""

    weights_mb: float = 0.0
    kv_mb: float = 0.0
    overhead_mb: float = 0.0
    kv_tokens: int = 0
    declared_mb: float | None = None
    tp_size: int = 1

    @property
    def source(self) -> str:
        return "spec" if self.declared_mb is not None else "config"

    @property
    def total_mb(self) -> float:
        """Across all the instance's GPUs."""
        if self.declared_mb is not None:
            return self.declared_mb
        return self.weights_mb + self.kv_mb + self.overhead_mb * self.tp_size

    @property
    def per_gpu_mb(self) -> float:
        """On each of its tp_size GPUs: weights and KV split across ranks, overhead on every rank."""
        if self.declared_mb is not None:
            return self.declared_mb / self.tp_size
        return (self.weights_mb + self.kv_mb) / self.tp_size + self.overhead_mb


def serving_dtype_bytes(dtype: Any) -> int:
    """Bytes per weight as SGLang serves the checkpoint: its `--dtype auto` serves float32 models in float16."""
    if dtype is None:
        return 2
    size = _DTYPE_BYTES.get(dtype.lower().removeprefix("torch.")) if isinstance(dtype, str) else None
    if size is None:
        raise EstimateError(f"unknown dtype {_show(dtype)} in config.json; {_FIX}")
    return min(size, 2)


def estimate_from_config(
    config: Mapping[str, Any],
    *,
    kv_tokens: int,
    tp_size: int = 1,
    overheads: Overheads = Overheads(),
    dtype_bytes: int | None = None,
    kv_dtype_bytes: int | None = None,
) -> MemoryEstimate:
    """The formula of the module docstring over a config.json mapping. `dtype_bytes` overrides the serving dtype."""
    shape = ModelShape.from_config(config)
    if dtype_bytes is not None:
        shape = replace(shape, dtype_bytes=dtype_bytes)
    return _held(
        MemoryEstimate(
            weights_mb=shape.weights_bytes() / MIB,
            kv_mb=kv_tokens * shape.kv_bytes_per_token(kv_dtype_bytes) / MIB,
            overhead_mb=overheads.total_mb(shape),
            kv_tokens=0 if shape.encoder else kv_tokens,
            tp_size=tp_size,
        )
    )


def _held(estimate: MemoryEstimate) -> MemoryEstimate:
    """The estimate, if it is one the ledger can hold: a negative or infinite figure would let a GPU's
    level fall below zero or never come back, so it is refused whatever produced it."""
    per_gpu = estimate.per_gpu_mb
    if not (math.isfinite(per_gpu) and per_gpu > 0):
        raise EstimateError(f"the memory estimate came to {per_gpu} MiB per GPU, which no instance holds; {_FIX}")
    return estimate


def kv_token_budget(service: ModelService) -> int:
    """Tokens of KV cache the instance gets: backend.config.max_total_tokens, else the default, >= max_seq_len."""
    config = service.spec.backend.config
    explicit = (config.model_extra or {}).get("max_total_tokens")
    if explicit is not None:
        if not isinstance(explicit, int) or isinstance(explicit, bool) or not 1 <= explicit <= MAX_KV_TOKENS:
            raise EstimateError(
                f"backend.config.max_total_tokens must be a positive integer up to {MAX_KV_TOKENS}, "
                f"got {_show(explicit)}"
            )
        return explicit
    return max(DEFAULT_KV_TOKENS, config.max_seq_len or 0)


def estimate_for_spec(
    service: ModelService,
    config: Mapping[str, Any] | None,
    *,
    overheads: Overheads = Overheads(),
) -> MemoryEstimate:
    """`resources.min_gpu_memory_mb` when set; else the config.json formula with the spec's KV budget."""
    spec = service.spec
    tp_size = spec.backend.config.tp_size
    if spec.resources.min_gpu_memory_mb:  # 0 declares nothing, as in gpu_manager.gpu_need
        return _held(MemoryEstimate(declared_mb=float(spec.resources.min_gpu_memory_mb), tp_size=tp_size))
    if config is None:
        raise EstimateError(
            f"model {service.model_id!r} sets no resources.min_gpu_memory_mb and no config.json was found "
            f"under model.path ({spec.model.path!r}); set one of them so its GPU memory can be budgeted"
        )
    return estimate_from_config(config, kv_tokens=kv_token_budget(service), tp_size=tp_size, overheads=overheads)
