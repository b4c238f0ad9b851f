import pytest

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
