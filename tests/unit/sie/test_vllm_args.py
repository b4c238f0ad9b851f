"""Which vLLM arguments a spec may pass (sie.engine_settings.vllm_args), applied at admission by
sie.model_files.spec_problems with the node's policy, and SIE's own vLLM keys, checked by the spec loader."""

from __future__ import annotations

import pytest

from sie.engine_settings import engine_settings_problems
from sie.engine_settings.vllm_args import (
    DEFAULT_KV_CACHE_MB,
    MANAGED,
    NEGATABLE,
    PASS_THROUGH,
    PATH_ARGS,
    SPEC_KEYS,
    managed_flag,
    vllm_arg_problems,
    vllm_settings,
)
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy, spec_problems
from sie.spec import ModelService
from sie.spec_loader import parse_model_service


def service(config: dict, max_concurrent_requests: int = 8) -> ModelService:
    return ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "tiny", "path": "/models/tiny"},
                "backend": {"type": "vllm", "config": config},
                "resources": {"max_concurrent_requests": max_concurrent_requests},
            }
        }
    )


def paths(problems) -> list[str]:
    return [p.path for p in problems]


@pytest.mark.parametrize(
    "config",
    [
        {"dtype": "bfloat16"},
        {"enable_prefix_caching": False},  # becomes --no-enable-prefix-caching, not nothing
        {"block_size": 16, "max_num_batched_tokens": 4096, "enable_chunked_prefill": True},
        {"seed": "-1"},  # a negative number is a value, not a flag
        {"enforce_eager": True, "quantization": "fp8", "kv_cache_dtype": "fp8"},
        {"max_logprobs": 5, "num_gpu_blocks_override": 64, "enable_prompt_tokens_details": False},
        {"cudagraph_capture_sizes": [1, 2, 4]},
        {"override_generation_config": {"temperature": 0.5}},
        {"generation_config": "vllm", "revision": "main", "tokenizer_mode": "auto"},
        {"chat_template": "/models/tiny/chat.jinja", "tokenizer": "/models/tok", "hf_config_path": "/models/cfg"},
        {"trust_remote_code": False, "worker_cls": None},  # left off the command line
        {"max_num_seqs": 4, "kv_cache_mb": 32, "kv_budget_scale": 0.5, "max_total_tokens": 4096},  # SIE's own keys
    ],
)
def test_tuning_arguments_pass_without_the_operators_leave(config):
    assert vllm_arg_problems(config, allow_any=False) == []
    assert spec_problems(service(config), ModelFilePolicy()) == []


@pytest.mark.parametrize(
    "key, value",
    [
        ("trust_remote_code", True),
        ("Trust-Remote-Code", True),
        ("trust_remote", True),  # vLLM's parser takes any unambiguous prefix
        ("worker_cls", "evil.Worker"),
        ("logits_processors", ["evil.Processor"]),
        ("hf_overrides", {"architectures": ["X"]}),
        ("load_format", "pt"),  # unpickles
        ("download_dir", "/tmp/anywhere"),
        ("lora_modules", ["a=/etc"]),
        ("speculative_config", {"model": "/elsewhere"}),
        ("prefix_caching_hash_algo", "xxhash"),  # SIE's prefix routing reads the engine's block hashes
        ("enable_prompt_embeds", True),
        ("override_generation_config.temperature", 0.5),  # one key of a JSON flag: not an allowed name
    ],
)
def test_other_arguments_need_the_operators_leave(key, value):
    assert paths(vllm_arg_problems({key: value}, allow_any=False)) == [f"spec.backend.config.{key}"]
    assert paths(spec_problems(service({key: value}), ModelFilePolicy())) == [f"spec.backend.config.{key}"]
    assert spec_problems(service({key: value}), ModelFilePolicy(allow_remote_code=True)) == []


@pytest.mark.parametrize(
    "key, how",
    [
        ("port", "is port"),
        ("host", "is host"),
        ("api_key", "is api_key"),
        ("model", "is model"),
        ("served_model_name", "is served_model_name"),
        ("Max-Model-Len", "is max_model_len"),
        ("max_model", "abbreviates max_model_len"),
        ("tensor_parallel_size", "is tensor_parallel_size"),
        ("pipeline_parallel_size", "is pipeline_parallel_size"),
        ("kv_cache_memory", "abbreviates kv_cache_memory_bytes"),
        ("gpu_memory_utilization", "is gpu_memory_utilization"),
        ("no_enable_sleep_mode", "negates enable_sleep_mode"),
        ("enable_sleep_mode", "is enable_sleep_mode"),
        ("kv_events_config", "is kv_events_config"),
        ("kv_events_config.endpoint", "is kv_events_config"),
        ("disable_log_stats", "is disable_log_stats"),
        ("enable_log_requests", "is enable_log_requests"),
        ("uvicorn_log_level", "is uvicorn_log_level"),
        ("ssl_keyfile", "is ssl_keyfile"),
        ("allowed_origins", "is allowed_origins"),
        ("middleware", "is middleware"),
        ("root_path", "is root_path"),
        ("config", "is config"),
        ("grpc", "is grpc"),
        ("kv_transfer_config", "is kv_transfer_config"),
        ("data_parallel_rpc_port", "is data_parallel_rpc_port"),
        ("otlp_traces_endpoint", "is otlp_traces_endpoint"),
    ],
)
def test_what_the_node_host_sets_is_refused_even_with_the_operators_leave(key, how):
    for allow_any in (False, True):
        (problem,) = vllm_arg_problems({key: 1}, allow_any=allow_any)
        assert problem.path == f"spec.backend.config.{key}"
        assert problem.reason.startswith(f"{how}, which the node host sets itself")
    assert paths(spec_problems(service({key: 1}), ModelFilePolicy(allow_remote_code=True))) == [
        f"spec.backend.config.{key}"
    ]


@pytest.mark.parametrize("key", ["Max-Num-Seqs", "kv-cache-mb", "KV_BUDGET_SCALE"])
def test_sies_own_keys_are_read_by_their_exact_name_only(key):
    (problem,) = vllm_arg_problems({key: 4}, allow_any=True)
    assert problem.path == f"spec.backend.config.{key}" and problem.reason.startswith("write it as ")


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"dtype": "--trust-remote-code"}, "starts with '-'"),
        ({"cudagraph_capture_sizes": [1, "-x"]}, "starts with '-'"),
        ({"cudagraph_capture_sizes": [{"a": 1}]}, "numbers, strings or booleans"),
        ({"chat_template": ["/models/a"]}, "expected a path"),
        ({"tokenizer": ""}, "expected a path"),
        ({"tokenizer": "/models/../etc"}, "contains '..'"),
    ],
)
def test_values_vllm_would_misread_are_refused(config, fragment):
    for allow_any in (False, True):
        (problem,) = vllm_arg_problems(config, allow_any=allow_any)
        assert problem.path == f"spec.backend.config.{next(iter(config))}" and fragment in problem.reason


def test_the_lists_hold_together():
    assert not PASS_THROUGH & MANAGED and not PATH_ARGS & MANAGED and not SPEC_KEYS & PASS_THROUGH
    assert NEGATABLE <= PASS_THROUGH
    # An allowed flag is taken exactly, never as the abbreviation of a managed one.
    assert [name for name in PASS_THROUGH | PATH_ARGS if managed_flag(name) is not None] == []
    assert managed_flag("enable_prefix") is None  # abbreviates an allowed flag only: the allowlist decides


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, (DEFAULT_KV_CACHE_MB, None, 1.0)),
        ({"kv_cache_mb": 16, "max_num_seqs": 8, "kv_budget_scale": 0.5}, (16, 8, 0.5)),
        ({"kv_cache_mb": 1 << 20, "max_num_seqs": 1}, (1 << 20, 1, 1.0)),
        ({"max_num_seqs": None}, (DEFAULT_KV_CACHE_MB, None, 1.0)),
    ],
)
def test_sies_own_vllm_keys(config, expected):
    settings, problems = vllm_settings(service(config))
    assert problems == []
    assert (settings.kv_cache_mb, settings.max_num_seqs, settings.kv_budget_scale) == expected


@pytest.mark.parametrize(
    "key, value",
    [
        ("kv_cache_mb", 15),
        ("kv_cache_mb", (1 << 20) + 1),
        ("kv_cache_mb", "64"),
        ("kv_cache_mb", True),
        ("max_num_seqs", 0),
        ("max_num_seqs", 9),  # more than resources.max_concurrent_requests: SIE would admit fewer
        ("max_num_seqs", 2.5),
        ("kv_budget_scale", 2),
    ],
)
def test_the_spec_loader_refuses_a_wrong_vllm_key_naming_it(key, value):
    doc = {
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"name": "tiny", "path": "/models/tiny", "service_type": "llm"},
            "backend": {"type": "vllm", "config": {key: value}},
            "resources": {"max_concurrent_requests": 8},
        },
    }
    with pytest.raises(SpecError) as caught:
        parse_model_service(doc, "the file")
    assert paths(caught.value.problems) == [f"spec.backend.config.{key}"]
    assert engine_settings_problems(service({key: value})) != []
