"""Which command runs a worker of each backend, and the environment it needs.

Every worker speaks the worker protocol on --host/--port (protocol.py). The embedded backends share one
command line; SGLang's is built by node_host/backends/sglang_server/launch.py (imported only when an SGLang instance
starts: it need not exist, or have SGLang installed, on a node that never runs one).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from sie.engine_settings import SklearnSettings, TorchSettings
from sie.errors import Problem, SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import BackendType, ModelService

_EMBEDDED = {
    BackendType.TORCH: "node_host.backends.torch_engine",
    BackendType.SKLEARN: "node_host.backends.sklearn_engine",
    BackendType.SIM: "node_host.backends.sim",
}


def worker_command(
    spec: ModelService,
    spec_file: str | Path,
    host: str,
    port: int,
    *,
    key_file: str | Path,
    key: str,
    files: ModelFilePolicy = ModelFilePolicy(),
    mem_fraction: float | None = None,
    python: str | None = None,
    **engine_options: object,
) -> list[str]:
    """argv that serves `spec` on host:port, answering only callers with the worker key (`key_file` for
    SIE's engines; `key` itself for SGLang, which reads it from its command line), loading model files
    only as `files` allows. `python` defaults to this interpreter. For SGLang, `mem_fraction` (or
    `budget_mb` and `free_mb` in `engine_options`) sizes its memory, and `nccl_port` may be given; see
    node_host/backends/sglang_server/launch.py. vLLM runs its engine's own interpreter (`engine_python`)
    with the KV size and device node_host chose (`kv_cache_bytes`, `on_gpu`, `gpu_memory_utilization`,
    `gpu_count`: node_host/main.py); Triton serves the repository written here under `run_dir`, with its
    metrics on `metrics_port`. A spec that cannot be launched raises ValueError (SpecError naming the field)."""
    backend = spec.spec.backend.type
    module = _EMBEDDED.get(backend)
    if module is not None:
        return [
            python or sys.executable,
            "-m",
            module,
            "--spec-file",
            str(spec_file),
            "--host",
            host,
            "--port",
            str(port),
            "--api-key-file",
            str(key_file),
            *files.argv(),
        ]
    if backend is BackendType.SGLANG:
        from node_host.backends.sglang_server import launch as sglang

        if python is not None:
            engine_options["python"] = python
        return sglang.launch_command(spec, host, port, mem_fraction, api_key=key, files=files, **engine_options)  # type: ignore[arg-type]
    if backend is BackendType.VLLM:
        from node_host.backends.vllm_server import launch as vllm

        options = engine_options
        on_gpu = bool(options.get("on_gpu"))
        kv_bytes = options.get("kv_cache_bytes")
        utilization = options.get("gpu_memory_utilization")
        return vllm.launch_command(
            spec,
            host,
            port,
            python=str(options.get("engine_python") or python or sys.executable),
            files=files,
            on_gpu=on_gpu,
            kv_cache_bytes=kv_bytes if isinstance(kv_bytes, int) else vllm.kv_cache_bytes_for(spec, on_gpu=on_gpu),
            gpu_count=int(options.get("gpu_count") or 1),  # type: ignore[call-overload]
            gpu_memory_utilization=float(utilization) if isinstance(utilization, (int, float)) else None,
        )
    if backend is BackendType.TRITON:
        from node_host.backends.triton_server import launch as triton
        from node_host.backends.triton_server import repository

        options = engine_options
        venv, run_dir, metrics_port = options.get("triton_venv"), options.get("run_dir"), options.get("metrics_port")
        binary = triton.find_tritonserver(Path(str(venv))) if venv else None
        if binary is None or not isinstance(run_dir, Path) or not isinstance(metrics_port, int):
            raise SpecError(
                f"ModelService {spec.model_id!r}",
                [Problem("spec.backend.type", "this node has no Triton engine (node host --engines-dir DIR/triton)")],
            )
        # The model repository SIE writes for this instance (checked as the sklearn engine checks a model
        # file), and the backends directory the wheel's Python backend needs (repository.write_backends).
        model_dir = repository.write_repository(spec, files, run_dir / "triton" / Path(str(spec_file)).stem)
        backends = repository.write_backends(binary, run_dir / "triton" / "backends")
        return triton.launch_command(
            tritonserver=str(binary),
            repository=model_dir.parent,
            model_id=spec.model_id,
            host=host,
            http_port=port,
            metrics_port=metrics_port,
            api_key=key,
            backend_directory=backends,
        )
    supported = ", ".join(sorted(b.value for b in BackendType))
    raise SpecError(
        f"ModelService {spec.model_id!r}",
        [
            Problem(
                "spec.backend.type", f"backend {backend.value!r} has no worker on this node yet; use one of {supported}"
            )
        ],
    )


def check_engine_settings(spec: ModelService) -> None:
    """Raise SpecError naming every setting an embedded engine's worker would refuse when it starts (it
    reads them with the same code). The node host calls this before it admits an assignment, so a wrong
    setting is refused once, with its field in the instance's status, instead of a worker that exits
    with code 2 and is restarted with backoff for ever. The spec loader has checked the sklearn and
    torch engines' backend.config already (sie.engine_settings); what only a node that runs SIE's
    worker refuses is a missing model path (a spec for an image of its own may go without) and the
    simulator's parameters. SGLang checks its own arguments when it starts."""
    backend = spec.spec.backend.type
    if backend is BackendType.SKLEARN:
        SklearnSettings.from_spec(spec)
    elif backend is BackendType.TORCH:
        TorchSettings.from_spec(spec)
    elif backend is BackendType.SIM:
        from node_host.backends.sim.worker import sim_params_from_spec

        sim_params_from_spec(spec)


def worker_env(
    spec: ModelService,
    gpu_index: int | None,
    *,
    key: str | None = None,
    cpus: Iterable[int] | None = None,
    on_gpu: bool = False,
    options: Mapping[str, object] | None = None,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment additions for the worker. A torch worker sees only its GPU (as cuda:0), and none when
    it was placed on no GPU, so `device: auto` cannot wander onto a GPU another instance owns. SGLang's
    /health generates a token unless told not to; the node host and the sidecar probe it twice a second.
    vLLM takes its key from the environment (not its command line, which every local user can read), its
    cores as its OpenMP binding (`cpus`), and its GPU (`on_gpu`: a real one). Triton's server needs its
    venv's libraries and interpreter first on its paths (`options`: the node host's worker options,
    `base_env`: the environment the worker inherits)."""
    backend = spec.spec.backend.type
    triton_venv = (options or {}).get("triton_venv")
    if backend is BackendType.TRITON and isinstance(triton_venv, Path):
        from node_host.backends.triton_server import launch as triton

        # Its Python backend's stub imports the venv's packages with the interpreter's own libpython.
        return triton.launch_env(venv=triton_venv, base=base_env)
    if backend is BackendType.VLLM:
        from node_host.backends.vllm_server import launch as vllm

        gpus = [gpu_index] if on_gpu and gpu_index is not None else []
        return vllm.launch_env(api_key=key or "", cpus=cpus, gpu_indices=gpus, on_gpu=on_gpu)
    if backend is BackendType.TORCH:
        return {"CUDA_VISIBLE_DEVICES": "" if gpu_index is None else str(gpu_index)}
    if backend is BackendType.SGLANG:
        return {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    return {}
