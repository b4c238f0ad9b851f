import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# config.json figures as published on the Hugging Face hub: the catalog bench/packing sizes its models
# from, so these tests check the very figures the benchmark uses against the published parameter counts.
from bench.models_catalog import (  # noqa: E402
    DEEPSEEK_CODER_1_3B,
    GEMMA2_9B,
    LLAMA3_8B,
    PHI3_MINI,
    QWEN2_7B,
)
from bench.models_catalog import MINILM_L6_CROSS_ENCODER as MINILM_L6  # noqa: E402
from node_host.memory_estimate import (
    DEFAULT_KV_TOKENS,
    MIB,
    EstimateError,
    ModelShape,
    Overheads,
    estimate_for_spec,
    estimate_from_config,
    kv_token_budget,
    serving_dtype_bytes,
)
from sie.spec import ModelService


@pytest.mark.parametrize(
    "config, parameters",
    [
        (QWEN2_7B, 7_615_616_512),  # Qwen2-7B model card: 7.62B
        (LLAMA3_8B, 8_030_261_248),  # Meta-Llama-3-8B: 8.03B
        (GEMMA2_9B, 9_241_705_984),  # gemma-2-9b: 9.24B (tied embeddings, 4 norms per layer)
        (PHI3_MINI, 3_821_079_552),  # Phi-3-mini: 3.8B
        (DEEPSEEK_CODER_1_3B, 1_346_471_936),  # deepseek-coder-1.3b: 1.35B
        (MINILM_L6, 22_713_216),  # ms-marco-MiniLM-L-6-v2: 22.7M
    ],
)
def test_parameter_count_matches_published_figures(config, parameters):
    assert ModelShape.from_config(config).parameter_count() == parameters


@pytest.mark.parametrize(
    "config, weights_gb, kv_kib_per_token",
    [
        (QWEN2_7B, 15.23, 56),  # 2 x 28 layers x 4 kv heads x 128 x 2 bytes
        (LLAMA3_8B, 16.06, 128),
        (GEMMA2_9B, 18.48, 336),
        (PHI3_MINI, 7.64, 384),  # no GQA: every head keeps its K and V
        (MINILM_L6, 0.045, 0),  # encoders keep no KV cache
    ],
)
def test_weights_and_kv_per_token(config, weights_gb, kv_kib_per_token):
    shape = ModelShape.from_config(config)
    assert shape.weights_bytes() / 1e9 == pytest.approx(weights_gb, abs=0.01)
    assert shape.kv_bytes_per_token() == kv_kib_per_token * 1024


def test_estimate_adds_weights_kv_and_overhead():
    est = estimate_from_config(QWEN2_7B, kv_tokens=65_536)
    assert est.weights_mb == pytest.approx(7_615_616_512 * 2 / MIB)
    assert est.kv_mb == pytest.approx(65_536 * 56 * 1024 / MIB)  # 3584 MiB
    activation = 8192 * (4 * 3584 + 2 * 18944) * 2 / MIB
    assert est.overhead_mb == pytest.approx(512 + 512 + activation)
    assert est.total_mb == pytest.approx(est.weights_mb + est.kv_mb + est.overhead_mb)
    assert est.source == "config"


def test_tensor_parallel_splits_weights_and_kv_but_not_overhead():
    est = estimate_from_config(LLAMA3_8B, kv_tokens=32_768, tp_size=2)
    assert est.per_gpu_mb == pytest.approx((est.weights_mb + est.kv_mb) / 2 + est.overhead_mb)
    assert est.total_mb == pytest.approx(est.weights_mb + est.kv_mb + 2 * est.overhead_mb)


def test_overheads_are_parameters():
    lean = estimate_from_config(
        QWEN2_7B, kv_tokens=0, overheads=Overheads(cuda_context_mb=0, cuda_graph_mb=0, prefill_chunk_tokens=0)
    )
    assert lean.total_mb == pytest.approx(lean.weights_mb)


@pytest.mark.parametrize(
    "dtype, size", [(None, 2), ("bfloat16", 2), ("float16", 2), ("float32", 2), ("torch.float16", 2), ("fp8", 1)]
)
def test_serving_dtype(dtype, size):
    assert serving_dtype_bytes(dtype) == size


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({**QWEN2_7B, "model_type": "mixtral"}, "model_type 'mixtral'"),
        ({k: v for k, v in QWEN2_7B.items() if k != "intermediate_size"}, "lacks 'intermediate_size'"),
        ({**QWEN2_7B, "torch_dtype": "int4"}, "unknown dtype"),
    ],
)
def test_configs_it_cannot_read_point_at_min_gpu_memory_mb(config, fragment):
    with pytest.raises(EstimateError) as err:
        estimate_from_config(config, kv_tokens=1024)
    assert fragment in str(err.value) and "min_gpu_memory_mb" in str(err.value)


def _service(resources=None, config=None):
    return ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "m", "path": "/models/m"},
                "backend": {"type": "sglang", "config": config or {}},
                "resources": resources or {},
            }
        }
    )


@pytest.mark.parametrize(
    "backend_config, tokens",
    [
        ({}, DEFAULT_KV_TOKENS),
        ({"max_seq_len": 131_072}, 131_072),  # one full-length request must fit
        ({"max_seq_len": 4096}, DEFAULT_KV_TOKENS),
        ({"max_total_tokens": 8192, "max_seq_len": 4096}, 8192),  # explicit budget wins
    ],
)
def test_kv_token_budget(backend_config, tokens):
    assert kv_token_budget(_service(config=backend_config)) == tokens


def test_spec_figure_wins_over_the_config():
    est = estimate_for_spec(_service(resources={"min_gpu_memory_mb": 20_000}, config={"tp_size": 2}), QWEN2_7B)
    assert (est.source, est.total_mb, est.per_gpu_mb) == ("spec", 20_000, 10_000)


def test_spec_without_figure_uses_config_and_its_kv_budget():
    est = estimate_for_spec(_service(config={"max_total_tokens": 16_384}), QWEN2_7B)
    assert est.kv_tokens == 16_384
    assert est.kv_mb == pytest.approx(16_384 * 56 / 1024)


def test_spec_without_figure_or_config_is_refused_with_the_fix():
    with pytest.raises(EstimateError, match="set one of them"):
        estimate_for_spec(_service(), None)


def test_bad_max_total_tokens_is_refused():
    with pytest.raises(EstimateError, match="positive integer"):
        kv_token_budget(_service(config={"max_total_tokens": "lots"}))


# ---- config.json is the model's, not ours: every figure checked (DESIGN §10) ------------------------------


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"hidden_size": "big"}, "hidden_size must be an integer from 1 to 1048576, got 'big'"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
        ({"num_hidden_layers": -2000}, "num_hidden_layers must be an integer from 1 to 16384, got -2000"),
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer from 1 to 16384, got 0"),
        ({"num_key_value_heads": -4}, "num_key_value_heads must be an integer from 1 to 16384, got -4"),
        ({"vocab_size": 152064.0}, "vocab_size must be an integer from 1 to 16777216, got 152064.0"),
        ({"vocab_size": 10**18}, "vocab_size must be an integer from 1 to 16777216"),
        ({"intermediate_size": True}, "intermediate_size must be an integer from 1 to 4194304, got True"),
        ({"intermediate_size": [18944]}, "intermediate_size must be an integer from 1 to 4194304, got [18944]"),
        ({"head_dim": 0}, "head_dim must be an integer from 1 to 65536, got 0"),
        ({"hidden_size": 8, "num_attention_heads": 28}, "smaller than num_attention_heads"),  # head_dim 0
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"attention_bias": 1}, "attention_bias must be true or false, got 1"),
        ({"torch_dtype": ["bfloat16"]}, "unknown dtype ['bfloat16']"),
        ({"model_type": ["qwen2"]}, "model_type ['qwen2']"),
    ],
)
def test_figures_out_of_range_are_refused_naming_the_field_and_value(changes, fragment):
    with pytest.raises(EstimateError) as err:
        estimate_from_config({**QWEN2_7B, **changes}, kv_tokens=1024)
    assert fragment in str(err.value) and "min_gpu_memory_mb" in str(err.value)


def test_an_encoders_position_figures_are_checked_and_a_decoder_ignores_them():
    with pytest.raises(EstimateError, match="max_position_embeddings must be an integer from 0"):
        estimate_from_config({**MINILM_L6, "max_position_embeddings": -512}, kv_tokens=0)
    with pytest.raises(EstimateError, match="type_vocab_size must be an integer from 0"):
        estimate_from_config({**MINILM_L6, "type_vocab_size": "two"}, kv_tokens=0)
    assert estimate_from_config({**QWEN2_7B, "max_position_embeddings": "long"}, kv_tokens=1024).total_mb > 0


def test_a_config_that_is_not_an_object_and_a_long_value_are_refused_briefly():
    with pytest.raises(EstimateError, match="not a JSON object but list"):
        estimate_from_config([1, 2], kv_tokens=1024)  # type: ignore[arg-type]
    with pytest.raises(EstimateError) as err:
        estimate_from_config({**QWEN2_7B, "model_type": "x" * 100_000}, kv_tokens=1024)
    assert len(str(err.value)) < 400  # the file is the model's: its values are cut short in messages


@pytest.mark.parametrize(
    "overheads",
    [Overheads(cuda_context_mb=-(10.0**9)), Overheads(cuda_context_mb=math.inf), Overheads(cuda_graph_mb=math.nan)],
)
def test_an_estimate_that_is_not_finite_and_positive_is_refused(overheads):
    with pytest.raises(EstimateError, match="MiB per GPU, which no instance holds"):
        estimate_from_config(QWEN2_7B, kv_tokens=1024, overheads=overheads)


def test_min_gpu_memory_mb_zero_declares_nothing():
    est = estimate_for_spec(_service(resources={"min_gpu_memory_mb": 0}), QWEN2_7B)
    assert est.source == "config" and est.per_gpu_mb > 0


def test_a_kv_budget_beyond_any_gpu_is_refused():
    with pytest.raises(EstimateError, match="positive integer up to"):
        kv_token_budget(_service(config={"max_total_tokens": 10**30}))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
    "attention_bias",
    "text_config",
]


@settings(max_examples=150, deadline=None)
@given(
    base=st.sampled_from([QWEN2_7B, GEMMA2_9B, MINILM_L6]),
    changes=st.dictionaries(st.sampled_from(FIELDS), JSON | st.integers(min_value=-3, max_value=70_000), max_size=4),
)
def test_any_config_gives_a_finite_positive_estimate_or_an_estimate_error(base, changes):
    try:
        est = estimate_from_config({**base, **changes}, kv_tokens=1024, tp_size=2)
    except EstimateError:
        return
    assert math.isfinite(est.per_gpu_mb) and est.per_gpu_mb > 0
