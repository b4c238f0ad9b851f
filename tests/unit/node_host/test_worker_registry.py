"""Backend -> worker command line, and the environment each worker gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_host.backends.registry import worker_command, worker_env
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec_loader import parse_model_service


def svc(backend: str):
    return parse_model_service({"spec": {"model": {"name": "m", "path": "/m"}, "backend": {"type": backend}}})


@pytest.mark.parametrize(
    "backend, module",
    [
        ("torch", "node_host.backends.torch_engine"),
        ("sklearn", "node_host.backends.sklearn_engine"),
        ("sim", "node_host.backends.sim"),
    ],
)
def test_embedded_backends_share_one_command_line(backend, module):
    files = ModelFilePolicy(roots=(Path("/models"),), allow_unsafe_formats=True)
    assert worker_command(
        svc(backend), "/run/s.json", "127.0.0.1", 4321, python="py", key_file="/run/k", key="K", files=files
    ) == [
        "py",
        "-m",
        module,
        "--spec-file",
        "/run/s.json",
        "--host",
        "127.0.0.1",
        "--port",
        "4321",
        "--api-key-file",
        "/run/k",
        "--model-root",
        "/models",
        "--allow-unsafe-model-formats",
    ]  # the key travels as a file path, never on the command line


def test_vllm_runs_the_engines_own_interpreter_with_its_key_in_the_environment(tmp_path):
    (tmp_path / "m").mkdir()
    spec = parse_model_service(
        {"spec": {"model": {"name": "m", "path": str(tmp_path / "m")}, "backend": {"type": "vllm"}}}
    )
    argv = worker_command(
        spec,
        "/s.json",
        "127.0.0.1",
        7,
        key_file="/k",
        key="K",
        files=ModelFilePolicy(roots=(tmp_path,)),
        engine_python="/engines/vllm/bin/python",
    )
    assert argv[:3] == ["/engines/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "K" not in argv  # the key travels in the environment (worker_env), never on the command line
    assert worker_env(svc("vllm"), None, key="K")["VLLM_API_KEY"] == "K"


@pytest.mark.parametrize(
    "backend, gpu, env",
    [
        ("torch", None, {"CUDA_VISIBLE_DEVICES": ""}),
        ("torch", 1, {"CUDA_VISIBLE_DEVICES": "1"}),
        ("sklearn", 0, {}),
        ("sglang", 0, {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}),
    ],
)
def test_worker_env(backend, gpu, env):
    assert worker_env(svc(backend), gpu) == env


def test_sglang_command_comes_from_the_sglang_module():
    argv = worker_command(
        svc("sglang"),
        "/s.json",
        "127.0.0.1",
        7000,
        mem_fraction=0.5,
        python="py",
        nccl_port=7001,
        key_file="/k",
        key="K",
        files=ModelFilePolicy(roots=(Path("/m"),)),
    )
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "/m"  # resolved under the node's model roots
    assert argv[argv.index("--api-key") + 1] == "K"  # SGLang's own middleware then asks callers for it
    assert argv[argv.index("--port") + 1] == "7000" and argv[argv.index("--nccl-port") + 1] == "7001"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.5"


def test_sglang_loads_nothing_on_a_node_without_model_roots():
    with pytest.raises(SpecError, match="spec.model.path.*no model roots"):
        worker_command(svc("sglang"), "/s.json", "127.0.0.1", 7000, mem_fraction=0.5, key_file="/k", key="K")


def test_sglang_without_a_memory_size_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="mem_fraction"):
        worker_command(svc("sglang"), "/s.json", "127.0.0.1", 7000, key_file="/k", key="K")
