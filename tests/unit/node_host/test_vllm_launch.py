"""The vLLM backend's pure launch side (node_host.backends.vllm_server.launch): the command line, the KV
cache it is given, its environment; and the demo model's width, which vLLM's CPU attention needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from node_host.backends.torch_engine.demo_model import MARKER, ensure_tiny_qwen2
from node_host.backends.torch_engine.demo_model import main as demo_main
from node_host.backends.vllm_server.launch import (
    MIN_KV_CACHE_BYTES,
    VLLMConfigError,
    engine_args,
    gpu_memory_utilization_for,
    kv_cache_bytes_for,
    launch_command,
    launch_env,
    server_env,
)
from node_host.memory_estimate import MIB, estimate_for_spec
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie.spec_loader import parse_model_service

QWEN2_TINY = {  # the shape of the vLLM demo model (ensure_tiny_qwen2(hidden_size=256))
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def service(config=None, resources=None, path="/models/tiny"):
    return ModelService.model_validate(
        {
            "spec": {
                "model": {"name": "tiny", "path": path},
                "backend": {"type": "vllm", "config": config or {}},
                "resources": resources or {"max_concurrent_requests": 8},
            }
        }
    )


def flag_value(args, flag):
    return args[args.index(flag) + 1]


def test_a_cpu_launch_is_the_whole_command_line():
    spec = parse_model_service(
        {
            "metadata": {"name": "tiny"},
            "spec": {
                "model": {"name": "tiny", "path": "/models/tiny", "service_type": "llm"},
                "backend": {"type": "vllm", "config": {"max_seq_len": 512}},
                "resources": {"max_concurrent_requests": 8},
            },
        }
    )
    kv = kv_cache_bytes_for(spec, on_gpu=False)
    args = launch_command(spec, "127.0.0.1", 8123, python="/engines/vllm/bin/python", on_gpu=False, kv_cache_bytes=kv)
    assert args == [
        "/engines/vllm/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-model-len",
        "512",
        "--tensor-parallel-size",
        "1",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(64 * MIB),
        "--disable-uvicorn-access-log",
        "--enable-prompt-tokens-details",
    ]  # no API key: it travels in the environment (launch_env)


def test_a_gpu_launch_sleeps_and_starts_only_where_its_budget_is_free():
    args = launch_command(
        service({"tp_size": 2, "max_num_seqs": 4}),
        "127.0.0.1",
        1,
        python="py",
        on_gpu=True,
        kv_cache_bytes=2 * 1024 * MIB,
        gpu_count=2,
        gpu_memory_utilization=0.25,
    )
    assert flag_value(args, "--tensor-parallel-size") == "2"
    assert flag_value(args, "--max-num-seqs") == "4"  # the spec's lower figure: vLLM queues the rest
    assert flag_value(args, "--gpu-memory-utilization") == "0.25"
    assert flag_value(args, "--kv-cache-memory-bytes") == str(2 * 1024 * MIB)
    assert "--enable-sleep-mode" in args and "--max-model-len" not in args


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"on_gpu": True, "gpu_memory_utilization": 0.5, "gpu_count": 2}, "tp_size 1 needs as many GPUs"),
        ({"on_gpu": True}, "give gpu_memory_utilization"),
        ({"on_gpu": True, "gpu_memory_utilization": 1.5}, "give gpu_memory_utilization"),
        ({"on_gpu": False, "kv_cache_bytes": MIN_KV_CACHE_BYTES - 1}, "kv_cache_bytes must be"),
        ({"on_gpu": False, "kv_cache_bytes": True}, "kv_cache_bytes must be"),
    ],
)
def test_a_launch_that_cannot_work_is_refused(kwargs, fragment):
    kwargs = {"kv_cache_bytes": 64 * MIB, **kwargs}
    with pytest.raises(VLLMConfigError, match=fragment):
        launch_command(service(), "h", 1, python="py", **kwargs)


def test_a_launch_needs_a_model_path_and_right_sie_keys():
    with pytest.raises(VLLMConfigError, match="needs model.path"):
        launch_command(service(path=None), "h", 1, python="py", on_gpu=False, kv_cache_bytes=64 * MIB)
    with pytest.raises(VLLMConfigError, match=r"spec\.backend\.config\.max_num_seqs"):
        launch_command(service({"max_num_seqs": 9}), "h", 1, python="py", on_gpu=False, kv_cache_bytes=64 * MIB)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"dtype": "bfloat16"}, ["--dtype=bfloat16"]),
        ({"enforce_eager": True}, ["--enforce-eager"]),
        ({"enable_prefix_caching": False}, ["--no-enable-prefix-caching"]),  # off, not left at vLLM's default on
        ({"trust_remote_code": False}, []),  # no --no- form: left off
        ({"quantization": None}, []),
        ({"cudagraph_capture_sizes": [1, 2, 4]}, ["--cudagraph-capture-sizes", "1", "2", "4"]),
        ({"override_generation_config": {"temperature": 0.5}}, ['--override-generation-config={"temperature":0.5}']),
        ({"Seed": "-1"}, ["--seed=-1"]),  # the spelling that was checked; a negative number
        ({"max-num-batched-tokens": 2048}, ["--max-num-batched-tokens=2048"]),
        ({"compilation_config.cudagraph_mode": "NONE"}, ["--compilation-config.cudagraph_mode=NONE"]),  # JSON key kept
        ({"max_num_seqs": 4, "kv_cache_mb": 32, "max_seq_len": 1}, []),  # SIE's keys are no flags
    ],
)
def test_engine_args_pass_through(extra, expected):
    assert engine_args(extra) == expected


@pytest.mark.parametrize(
    "extra, allow_any, fragment",
    [
        ({"port": 1}, True, "is port, which the node host sets"),
        ({"max_model": 1}, True, "abbreviates max_model_len"),
        ({"no_enable_sleep_mode": True}, True, "negates enable_sleep_mode"),
        ({"kv_events_config.endpoint": "tcp://x"}, True, "is kv_events_config"),
        ({"trust_remote_code": True}, False, "without the operator's leave"),
        ({"dtype": "--trust-remote-code"}, True, "starts with '-'"),
    ],
)
def test_engine_args_refuse_what_the_node_must_not_pass(extra, allow_any, fragment):
    with pytest.raises(VLLMConfigError, match=fragment):
        engine_args(extra, allow_any=allow_any)


def test_prompt_token_details_are_on_unless_the_spec_says_otherwise():
    def args(config):
        return launch_command(service(config), "h", 1, python="py", on_gpu=False, kv_cache_bytes=64 * MIB)

    assert args({}).count("--enable-prompt-tokens-details") == 1
    assert args({"enable_prompt_tokens_details": True}).count("--enable-prompt-tokens-details") == 1
    off = args({"enable_prompt_tokens_details": False})
    assert "--no-enable-prompt-tokens-details" in off and "--enable-prompt-tokens-details" not in off


def test_paths_are_resolved_under_the_model_roots_and_the_policy_applies_again(tmp_path):
    root = tmp_path / "models"
    (root / "llm").mkdir(parents=True)
    (root / "tok").mkdir()
    (root / "chat.jinja").write_text("{{ messages }}")
    files = ModelFilePolicy(roots=(root,))

    def args(config, path=str(root / "llm") + "/", policy=files):
        return launch_command(
            service(config, path=path), "h", 1, python="py", files=policy, on_gpu=False, kv_cache_bytes=64 * MIB
        )

    inside = {"tokenizer": str(root / "tok"), "chat_template": str(root / "chat.jinja"), "generation_config": "vllm"}
    out = args(inside)
    assert flag_value(out, "--model") == str((root / "llm").resolve())
    assert f"--tokenizer={(root / 'tok').resolve()}" in out
    assert f"--chat-template={(root / 'chat.jinja').resolve()}" in out
    assert "--generation-config=vllm" in out  # a word, not a path
    for key, outside in (("tokenizer", "/etc"), ("chat_template", "/etc/passwd"), ("generation_config", "/etc")):
        with pytest.raises(SpecError, match=f"spec.backend.config.{key}.*outside the model roots"):
            args({key: outside})
    with pytest.raises(SpecError, match="spec.model.path.*outside the model roots"):
        args({}, path="/etc")
    with pytest.raises(VLLMConfigError, match="trust_remote_code.*operator's leave"):
        args({"trust_remote_code": True})
    allowed = ModelFilePolicy(roots=(root,), allow_remote_code=True)
    assert "--trust-remote-code" in args({"trust_remote_code": True}, policy=allowed)


def test_a_model_directory_linking_out_of_the_roots_is_refused(tmp_path):
    root, outside = tmp_path / "models", tmp_path / "outside"
    (root / "llm").mkdir(parents=True)
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (root / "llm" / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(SpecError, match="spec.model.path.*'config.json' is a symlink to .*outside the model roots"):
        launch_command(
            service(path=str(root / "llm")),
            "h",
            1,
            python="py",
            files=ModelFilePolicy(roots=(root,)),
            on_gpu=False,
            kv_cache_bytes=64 * MIB,
        )


@pytest.mark.parametrize(
    "config, expected_mib",
    [
        ({}, 64),
        ({"kv_cache_mb": 32}, 32),
        ({"kv_cache_mb": 256, "kv_budget_scale": 0.5}, 128),  # cut after repeated OOM kills
        ({"kv_cache_mb": 16, "kv_budget_scale": 0.25}, 16),  # never below the floor
    ],
)
def test_cpu_kv_cache_is_kv_cache_mb(config, expected_mib):
    assert kv_cache_bytes_for(service(config), on_gpu=False, budget_mb=10) == expected_mib * MIB


@pytest.mark.parametrize("tp", [1, 2])
def test_gpu_kv_cache_is_the_kv_part_of_the_ledgers_budget(tp):
    spec = service({"tp_size": tp, "max_total_tokens": 65_536})
    estimate = estimate_for_spec(spec, QWEN2_TINY)  # what the ledger budgets for the instance, per GPU
    got = kv_cache_bytes_for(spec, on_gpu=True, budget_mb=estimate.per_gpu_mb, config=QWEN2_TINY)
    per_token = 2 * 2 * 2 * 64 * 2  # K and V, 2 layers, 2 KV heads, head size 64, 2 bytes
    assert got == pytest.approx(65_536 * per_token / tp, abs=1)
    halved = service({"tp_size": tp, "max_total_tokens": 65_536, "kv_budget_scale": 0.5})
    assert kv_cache_bytes_for(halved, on_gpu=True, budget_mb=estimate.per_gpu_mb, config=QWEN2_TINY) == got // 2


def test_gpu_kv_cache_without_a_config_to_estimate_from_is_kv_cache_mb():
    spec = service({"kv_cache_mb": 512}, {"max_concurrent_requests": 8, "min_gpu_memory_mb": 4096})
    assert kv_cache_bytes_for(spec, on_gpu=True, budget_mb=4096) == 512 * MIB
    odd = {**QWEN2_TINY, "model_type": "mixtral"}  # an architecture the estimate does not know
    assert kv_cache_bytes_for(spec, on_gpu=True, budget_mb=4096, config=odd) == 512 * MIB


@pytest.mark.parametrize(
    "config, resources, budget_mb, model_config, fragment",
    [
        ({}, {"min_gpu_memory_mb": 1000}, 1000, QWEN2_TINY, "raise resources.min_gpu_memory_mb"),
        ({}, {}, 1000, QWEN2_TINY, "raise backend.config.max_total_tokens"),
        ({"kv_cache_mb": 4096}, {"min_gpu_memory_mb": 4096}, 4096, None, "kv_cache_mb 4096 leaves nothing"),
        ({}, {}, None, QWEN2_TINY, "give budget_mb"),
        ({}, {}, 0, QWEN2_TINY, "give budget_mb"),
    ],
)
def test_a_budget_that_cannot_hold_the_model_is_refused_naming_the_field(
    config, resources, budget_mb, model_config, fragment
):
    spec = service(config, {"max_concurrent_requests": 8, **resources})
    with pytest.raises(VLLMConfigError, match=fragment):
        kv_cache_bytes_for(spec, on_gpu=True, budget_mb=budget_mb, config=model_config)


@pytest.mark.parametrize(
    "budget, total, expected",
    [(20_000, 80_000, 0.25), (20_000, 60_000, 0.333), (1, 80_000, 0.001), (80_000, 80_000, 1.0)],
)
def test_gpu_memory_utilization_is_the_budget_over_the_gpu_rounded_down(budget, total, expected):
    assert gpu_memory_utilization_for(budget, total) == expected
    assert expected * total <= max(budget, 0.001 * total)


@pytest.mark.parametrize("budget, total", [(90_000, 80_000), (0, 80_000), (10, 0)])
def test_gpu_memory_utilization_refuses_what_no_gpu_holds(budget, total):
    with pytest.raises(VLLMConfigError):
        gpu_memory_utilization_for(budget, total)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (
            {"cpus": [3], "gpu_indices": [], "on_gpu": False},
            {"CUDA_VISIBLE_DEVICES": "", "VLLM_SERVER_DEV_MODE": "0", "VLLM_CPU_OMP_THREADS_BIND": "3"},
        ),
        (
            {"cpus": {3, 2}, "gpu_indices": [], "on_gpu": False},
            {"CUDA_VISIBLE_DEVICES": "", "VLLM_SERVER_DEV_MODE": "0", "VLLM_CPU_OMP_THREADS_BIND": "2-3"},
        ),
        ({"cpus": None, "gpu_indices": [], "on_gpu": False}, {"CUDA_VISIBLE_DEVICES": "", "VLLM_SERVER_DEV_MODE": "0"}),
        (
            {"cpus": [0], "gpu_indices": [1, 2], "on_gpu": True},
            {"CUDA_VISIBLE_DEVICES": "1,2", "VLLM_SERVER_DEV_MODE": "1"},
        ),
    ],
)
def test_launch_env(kwargs, expected):
    common = {
        "VLLM_API_KEY": "K",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    assert launch_env(api_key="K", **kwargs) == {**common, **expected}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"api_key": "", "cpus": None, "gpu_indices": [], "on_gpu": False}, "key is empty"),
        ({"api_key": "K", "cpus": [], "gpu_indices": [], "on_gpu": False}, "no CPUs"),
    ],
)
def test_launch_env_refuses_what_would_open_or_starve_the_server(kwargs, fragment):
    with pytest.raises(VLLMConfigError, match=fragment):
        launch_env(**kwargs)


def test_server_env_drops_an_inherited_kv_cache_size_and_adds_the_launch_env():
    inherited = {"PATH": "/bin", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_SERVER_DEV_MODE": "1"}
    added = launch_env(api_key="K", cpus=[1], gpu_indices=[], on_gpu=False)
    env = server_env(inherited, added)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    assert env["PATH"] == "/bin" and env["VLLM_SERVER_DEV_MODE"] == "0" and env["VLLM_API_KEY"] == "K"


@pytest.mark.integration
def test_every_flag_of_a_launch_is_one_the_real_vllm_parses():
    """vLLM's own parser over a command with every allowed argument (skipped where vLLM is not installed;
    sie_testing.engines). A vLLM upgrade that renames a flag fails here, not at a model's start."""
    from sie.engine_settings.vllm_args import MANAGED, NEGATABLE, PASS_THROUGH, PATH_ARGS
    from sie_testing import engines

    python = engines.require("vllm").vllm_python
    probe = (
        "import json, sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "p = make_arg_parser(FlexibleArgumentParser())\n"
        "print(json.dumps(sorted({o for a in p._actions for o in a.option_strings})))\n"
    )
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    known = set(json.loads(out.stdout.strip().splitlines()[-1]))
    flag = {name: "--" + name.replace("_", "-") for name in PASS_THROUGH | PATH_ARGS | MANAGED}
    assert sorted(n for n, f in flag.items() if f not in known) == []
    assert sorted(n for n in NEGATABLE if "--no-" + flag[n][2:] not in known) == []
    args = launch_command(service({"max_seq_len": 512}), "h", 1, python="py", on_gpu=False, kv_cache_bytes=64 * MIB)
    assert [a for a in args[3:] if a.startswith("--") and a.split("=")[0] not in known] == []


def test_the_demo_model_for_vllm_has_a_head_size_of_64(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tiny-vllm"
    assert demo_main([str(path), "--hidden-size", "256"]) == 0
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads) == (256, 512, 4)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU attention refuses 16
    assert json.loads((path / MARKER).read_text())["hidden_size"] == 256
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert ensure_tiny_qwen2(path, hidden_size=256) == path and os.stat(path / "model.safetensors").st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-vllm"]  # built aside, renamed into place


@pytest.mark.parametrize("size", [0, 60, -8, True])
def test_the_demo_model_refuses_a_width_its_heads_cannot_split(tmp_path, size):
    with pytest.raises(ValueError, match="multiple of 8"):
        ensure_tiny_qwen2(tmp_path / "m", hidden_size=size)
    assert not (tmp_path / "m").exists()
    assert demo_main([str(tmp_path / "m"), "--hidden-size", str(int(size))]) == 2


def test_the_demo_model_cli_reads_its_width_from_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "node_host.backends.torch_engine.demo_model", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--hidden-size" in out.stdout
