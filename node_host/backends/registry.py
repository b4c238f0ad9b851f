"""Which command runs a worker of each backend, and the environment it needs.

Every worker speaks the worker protocol on --host/--port (protocol.py). The embedded backends share one
command line; SGLang's is built by node_host/backends/sglang_server/launch.py (imported only when an SGLang instance
starts: it need not exist, or have SGLang installed, on a node that never runs one).
"""

from __future__ import annotations

import sys
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
    **sglang_options: object,
) -> list[str]:
    """argv that serves `spec` on host:port, answering only callers with the worker key (`key_file` for
    SIE's engines; `key` itself for SGLang, which reads it from its command line), loading model files
    only as `files` allows. `python` defaults to this interpreter. For SGLang, `mem_fraction` (or
    `budget_mb` and `free_mb` in `sglang_options`) sizes its memory, and `nccl_port` may be given; see
    node_host/backends/sglang_server/launch.py. A spec that cannot be launched raises ValueError."""
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
            sglang_options["python"] = python
        return sglang.launch_command(spec, host, port, mem_fraction, api_key=key, files=files, **sglang_options)  # type: ignore[arg-type]
    supported = ", ".join(sorted(b.value for b in (*_EMBEDDED, BackendType.SGLANG)))
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


def worker_env(spec: ModelService, gpu_index: int | None) -> dict[str, str]:
    """Environment additions for the worker. A torch worker sees only its GPU (as cuda:0), and none when
    it was placed on no GPU, so `device: auto` cannot wander onto a GPU another instance owns. SGLang's
    /health generates a token unless told not to; the node host and the sidecar probe it twice a second."""
    backend = spec.spec.backend.type
    if backend is BackendType.TORCH:
        return {"CUDA_VISIBLE_DEVICES": "" if gpu_index is None else str(gpu_index)}
    if backend is BackendType.SGLANG:
        return {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
    return {}
