"""The 32-model mix of bench/packing: the source article's kind of mix, sized from public config.json files.

The source names Qwen2-7B, Llama3-8B, Phi-3-mini, DeepSeek-Coder-1.5B, Gemma-2-9B and small scorers on
8 x A100-80GB. The figures below are copied from each model's config.json on the Hugging Face hub (the
fields node_host.memory_estimate reads); the weights that follow from them are checked against the
published parameter counts in tests/unit/node_host/test_memory_estimate.py.

  Qwen/Qwen2-7B                          hidden 3584, 28 layers, 28 heads, 4 KV heads, vocab 152064, inter 18944
  meta-llama/Meta-Llama-3-8B             hidden 4096, 32 layers, 32 heads, 8 KV heads, vocab 128256, inter 14336
  microsoft/Phi-3-mini-4k-instruct       hidden 3072, 32 layers, 32 heads, 32 KV heads, vocab 32064, inter 8192
  deepseek-ai/deepseek-coder-1.3b-base   hidden 2048, 24 layers, 16 heads, 16 KV heads, vocab 32256, inter 5504
  google/gemma-2-9b                      hidden 3584, 42 layers, 16 heads, 8 KV heads, head_dim 256, vocab 256000,
                                         inter 14336, tied embeddings
  cross-encoder/ms-marco-MiniLM-L-6-v2   BERT: hidden 384, 6 layers, vocab 30522, inter 1536, 512 positions
  BAAI/bge-reranker-base                 XLM-R: hidden 768, 12 layers, vocab 250002, inter 3072, 514 positions
  dslim/bert-base-NER                    BERT: hidden 768, 12 layers, vocab 28996, inter 3072, 512 positions

There is no public "DeepSeek-Coder-1.5B"; the nearest published checkpoint is deepseek-coder-1.3b
(1.35B parameters), which is what is used here and named as such.

What is assumed, not published: how many copies of each family the cluster runs (fine-tunes of one base
count as separate models), each model's peak concurrency and typical sequence length (its KV budget at
peak), and its traffic pattern (`duty`: the fraction of the day it has traffic; `mean_load`: its load
when it does, as a fraction of its peak). They describe a platform team's day: a few always-on models,
business-hours models, and a long tail that is mostly idle. Change them and the figures change; the
JSON result records them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "intermediate_size": 18944,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "intermediate_size": 14336,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
PHI3_MINI = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "intermediate_size": 8192,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_CODER_1_3B = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 32256,
    "intermediate_size": 5504,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "model_type": "gemma2",
    "hidden_size": 3584,
    "num_hidden_layers": 42,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 256000,
    "intermediate_size": 14336,
    "torch_dtype": "float32",
}
MINILM_L6_CROSS_ENCODER = {
    "model_type": "bert",
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "vocab_size": 30522,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
BGE_RERANKER_BASE = {
    "model_type": "xlm-roberta",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 250002,
    "intermediate_size": 3072,
    "max_position_embeddings": 514,
    "type_vocab_size": 1,
}
BERT_BASE_NER = {
    "model_type": "bert",
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 28996,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}


@dataclass(frozen=True)
class Family:
    """One model family of the mix and how the cluster uses its copies."""

    name: str
    hub_id: str
    config: dict[str, Any]
    copies: int
    priority: str  # P0 | P1 | P2
    peak_kv_tokens: int  # KV tokens held at the model's peak: peak concurrency x typical sequence length
    duty: tuple[float, ...]  # per copy: fraction of the day with traffic
    mean_load: float  # load when it has traffic, as a fraction of its peak
    dtype_bytes: int | None = None  # None: as SGLang serves the checkpoint; scorers run fp32 in torch
    engine: str = "sglang"


# 32 models: 20 LLMs on SGLang, 12 scorers on the embedded torch engine.
FAMILIES: tuple[Family, ...] = (
    Family("qwen2-7b", "Qwen/Qwen2-7B", QWEN2_7B, 4, "P0", 96 * 1024, (1.0, 0.8, 0.4, 0.15), 0.45),
    Family("llama3-8b", "meta-llama/Meta-Llama-3-8B", LLAMA3_8B, 4, "P1", 64 * 1024, (1.0, 0.5, 0.2, 0.1), 0.45),
    Family(
        "phi3-mini",
        "microsoft/Phi-3-mini-4k-instruct",
        PHI3_MINI,
        6,
        "P1",
        24 * 1024,
        (0.7, 0.3, 0.15, 0.1, 0.05, 0.05),
        0.4,
    ),
    Family(
        "deepseek-coder-1.3b",
        "deepseek-ai/deepseek-coder-1.3b-base",
        DEEPSEEK_CODER_1_3B,
        4,
        "P2",
        32 * 1024,
        (0.5, 0.2, 0.1, 0.05),
        0.4,
    ),
    Family("gemma2-9b", "google/gemma-2-9b", GEMMA2_9B, 2, "P1", 24 * 1024, (0.6, 0.15), 0.4),
    Family(
        "minilm-l6-reranker",
        "cross-encoder/ms-marco-MiniLM-L-6-v2",
        MINILM_L6_CROSS_ENCODER,
        4,
        "P0",
        0,
        (1.0, 1.0, 0.8, 0.5),
        0.5,
        dtype_bytes=4,
        engine="torch",
    ),
    Family(
        "bge-reranker-base",
        "BAAI/bge-reranker-base",
        BGE_RERANKER_BASE,
        4,
        "P1",
        0,
        (1.0, 0.8, 0.5, 0.3),
        0.5,
        dtype_bytes=4,
        engine="torch",
    ),
    Family(
        "bert-base-ner",
        "dslim/bert-base-NER",
        BERT_BASE_NER,
        4,
        "P2",
        0,
        (0.9, 0.6, 0.3, 0.1),
        0.5,
        dtype_bytes=4,
        engine="torch",
    ),
)


def model_count() -> int:
    return sum(f.copies for f in FAMILIES)
