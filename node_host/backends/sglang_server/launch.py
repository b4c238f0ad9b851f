"""The `sglang` backend, pure parts: launch arguments, start order, sleep/wake calls.

Its /v1/loads and /metrics figures are read by sie.worker_loads, shared with the sidecar.

One SGLang server serves one model (FACTS.md), so several models on one GPU means several servers, each
with its own absolute memory budget from the ledger. SGLang takes that budget as `--mem-fraction-static`,
a fraction of the memory FREE when the server starts. Hence:
  * the fraction is computed at start time from the budget and the free memory measured just then
    (`mem_fraction_for`), and servers on one GPU start one after another (`SequentialStarter`), so each
    measures free memory with the previous one fully allocated;
  * `--max-total-tokens` is set explicitly to the KV budget the ledger's estimate used
    (memory_estimate.kv_token_budget), so the KV pool is the size that was budgeted whatever the fraction;
  * every server gets its own `--port` and `--nccl-port`, metrics on, and the memory saver with weights
    CPU backup on, so `/release_memory_occupation` can free the GPU and `/resume_memory_occupation`
    bring it back without reloading from disk.

Release asserts inside SGLang that the server is idle, and a failed assert takes the server down; nothing
stops traffic while it is released either. So `memory_call` refuses unless the sidecar reports the
instance drained (nothing in flight or queued): drain first, then release.

The I/O (spawning the process, HTTP calls) lives in node_host's worker supervisor; this module only
builds and reads values, so it is tested without SGLang or a GPU.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from node_host.memory_estimate import kv_token_budget
from sie import model_files
from sie.engine_settings.kv_budget import kv_budget_scale, scaled_kv_tokens
from sie.engine_settings.sglang_args import PATH_ARGS, SPEC_KEYS, flag_key, sglang_arg_problems
from sie.errors import SIEError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService

MIN_MEM_FRACTION = 0.01
# SGLang allocates activations and CUDA graphs outside its static pool; leaving it less than 5% of the
# free memory for them makes the first large batch run out of memory.
MAX_MEM_FRACTION = 0.95

RELEASE_PATH = "/release_memory_occupation"
RESUME_PATH = "/resume_memory_occupation"
HEALTH_PATH = "/health"
LOADS_PATH = "/v1/loads"
METRICS_PATH = "/metrics"
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# Keys of backend.config that node_host sets itself (or the spec spells elsewhere); a spec that passes
# them as engine args would fight the ledger, so they are refused rather than silently overridden.
_MANAGED = {
    "model_path",
    "model",  # SGLang's alias of --model-path
    "tensor_parallel_size",  # and of --tp-size
    "served_model_name",
    "host",
    "port",
    "nccl_port",
    "mem_fraction_static",
    "max_total_tokens",
    "max_running_requests",
    "context_length",
    "tp_size",
    "tp",
    "enable_metrics",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "skip_server_warmup",
    "api_key",
    "admin_api_key",
}


class SGLangConfigError(SIEError, ValueError):
    """The spec cannot be turned into an SGLang launch; the message names the field to change."""


class NotDrainedError(SIEError):
    """Releasing memory while requests are in flight would crash SGLang; drain the instance first."""


def mem_fraction_for(budget_mb: float, free_mb: float) -> float:
    """`--mem-fraction-static` for an absolute budget: budget / free memory now, rounded down, clamped.

    Rounded down to 3 decimals so the server never takes more than its budget. Clamped to
    [MIN_MEM_FRACTION, MAX_MEM_FRACTION]; a budget above MAX of what is free cannot be honoured and is
    an error (the ledger should not have admitted it, or someone else took memory since).
    """
    if free_mb <= 0:
        raise SGLangConfigError(f"no free GPU memory to start in (free {free_mb:.0f} MiB)")
    if budget_mb <= 0:
        raise SGLangConfigError(f"the memory budget must be positive, got {budget_mb:.0f} MiB")
    fraction = budget_mb / free_mb
    if fraction > MAX_MEM_FRACTION:
        raise SGLangConfigError(
            f"a budget of {budget_mb:.0f} MiB is {fraction:.0%} of the {free_mb:.0f} MiB free now; SGLang needs "
            f"{1 - MAX_MEM_FRACTION:.0%} left for activations. Free memory on this GPU or lower the budget"
        )
    return max(MIN_MEM_FRACTION, math.floor(fraction * 1000) / 1000)


def launch_command(
    spec: ModelService,
    host: str,
    port: int,
    mem_fraction: float | None,
    *,
    free_mb: float | None = None,
    budget_mb: float | None = None,
    nccl_port: int | None = None,
    api_key: str | None = None,
    files: ModelFilePolicy | None = None,
    python: str = sys.executable,
) -> list[str]:
    """`python -m sglang.launch_server ...` for one instance of `spec`.

    Pass `mem_fraction`, or leave it None and pass `budget_mb` and `free_mb` (measured just before the
    start) to have it computed. Engine arguments in backend.config pass through: snake_case keys become
    --kebab-case flags, True becomes a bare flag, False and None are left out, lists give one value each.
    With `files` (the node's model-file policy), model.path and the file-naming engine arguments are
    resolved under its model roots and SGLang gets the real paths (SpecError for one outside them, or for
    a directory with an entry whose real path leaves them: sie.model_files.check_model_dir).
    `api_key` is the worker key: SGLang then answers every endpoint but /health* and /metrics only to
    `Authorization: Bearer <key>` (its own api-key middleware). SGLang reads it from its command line
    only, so a local user who can read /proc can see it; the server listens on loopback (standalone) or
    the pod's loopback (Kubernetes), which bounds who could use it.
    """
    s = spec.spec
    if not s.model.path:
        raise SGLangConfigError(
            f"model {spec.model_id!r}: the sglang backend needs model.path (a local directory or a Hugging Face repo id)"
        )
    if mem_fraction is None:
        if budget_mb is None or free_mb is None:
            raise SGLangConfigError("give mem_fraction, or budget_mb and free_mb to compute it from")
        mem_fraction = mem_fraction_for(budget_mb, free_mb)
    if not 0 < mem_fraction <= MAX_MEM_FRACTION:
        raise SGLangConfigError(f"mem_fraction must be in (0, {MAX_MEM_FRACTION}], got {mem_fraction}")
    config = s.backend.config
    try:
        kv_scale = kv_budget_scale(config.model_extra)
    except ValueError as exc:
        raise SGLangConfigError(f"model {spec.model_id!r}: {exc}") from None
    resolve = None
    if files is not None:
        policy = files

        def resolve(value: str, what: str) -> str:
            real = model_files.resolve(value, policy, what)
            model_files.check_model_dir(real, policy, what)  # SGLang follows every symlink inside a directory
            return str(real)

    args = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.model.path if resolve is None else resolve(s.model.path, "spec.model.path"),
        "--served-model-name",
        spec.model_id,
        "--host",
        host,
        "--port",
        str(port),
        "--mem-fraction-static",
        f"{mem_fraction:g}",
        "--max-total-tokens",
        str(scaled_kv_tokens(kv_token_budget(spec), kv_scale)),
        "--max-running-requests",
        str(s.resources.max_concurrent_requests),
        "--tp-size",
        str(config.tp_size),
    ]
    if nccl_port is not None:
        args += ["--nccl-port", str(nccl_port)]
    if config.max_seq_len is not None:
        args += ["--context-length", str(config.max_seq_len)]
    if api_key is not None:
        args += ["--api-key", api_key]
    args += ["--enable-metrics", "--enable-memory-saver", "--enable-weights-cpu-backup", "--skip-server-warmup"]
    return args + engine_args(config.model_extra or {}, model_id=spec.model_id, resolve=resolve)


def engine_args(
    extra: Mapping[str, Any], *, model_id: str = "?", resolve: Callable[[str, str], str] | None = None
) -> list[str]:
    """backend.config's pass-through engine arguments as command-line flags, in the spec's order: a
    scalar or an object as one `--flag=value` word (so no value is ever read as a flag of its own), a
    list as the flag and one word per item, True as a bare flag. Which keys a spec may pass the spec's
    admission decided (sie.engine_settings.sglang_args); here a key that names or abbreviates a flag
    node_host sets itself, or a list item SGLang would read as a flag, is refused whatever the policy.
    `resolve(value, field)` turns the value of a file-naming flag (sglang_args.PATH_ARGS) into the path
    to pass, under the node's model roots."""
    out: list[str] = []
    for key, value in extra.items():
        name = flag_key(key)
        if name in SPEC_KEYS:
            continue
        managed = next((m for m in sorted(_MANAGED) if m == name or m.startswith(name)), None)
        if managed is not None:
            raise SGLangConfigError(
                f"model {model_id!r}: backend.config.{key} {'is' if managed == name else 'abbreviates'} {managed}, "
                "which node_host sets from the ledger and the spec; remove it "
                "(use resources.max_concurrent_requests, backend.config.max_seq_len, tp_size or max_total_tokens)"
            )
        problems = sglang_arg_problems({key: value}, allow_any=True)
        if problems:
            raise SGLangConfigError(f"model {model_id!r}: {problems[0]}")
        flag = "--" + name.replace("_", "-")  # the spelling the check compared
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out.append(f"{flag}={json.dumps(value, separators=(',', ':'))}")
        elif name in PATH_ARGS and resolve is not None and (name != "chat_template" or "/" in str(value)):
            out.append(f"{flag}={resolve(str(value), f'spec.backend.config.{key}')}")
        else:
            out.append(f"{flag}={value}")
    return out


def launch_env(gpu_indices: Iterable[int]) -> dict[str, str]:
    """Environment to add for the server: its GPUs, and a /health that does not run a generation."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_indices),
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
    }


def memory_call(action: str, *, in_flight: int, queued: int = 0, tags: Iterable[str] | None = None) -> tuple[str, dict]:
    """(path, JSON body) to release or resume an instance's GPU memory; refuses a release that is not drained."""
    chosen = list(tags) if tags is not None else None
    unknown = sorted(set(chosen or ()) - set(MEMORY_TAGS))
    if unknown:
        raise SGLangConfigError(f"unknown memory tags {unknown}; SGLang knows {list(MEMORY_TAGS)}")
    body = {} if chosen is None else {"tags": chosen}
    if action == "release":
        if in_flight or queued:
            raise NotDrainedError(
                f"{in_flight} requests in flight and {queued} queued: SGLang asserts it is idle on release and "
                "crashes otherwise; drain the instance (DRAINING in EDS, wait for zero) before releasing"
            )
        return RELEASE_PATH, body
    if action == "resume":
        return RESUME_PATH, body
    raise SGLangConfigError(f"memory action must be 'release' or 'resume', got {action!r}")


@dataclass(frozen=True)
class SequentialStarter:
    """One server start at a time per GPU, first come first served.

    `submit` and `finished` return the new starter and the instances that may start now. A waiting
    instance starts when every GPU it needs is free and no earlier waiter needs any of them, so a
    tensor-parallel start is not overtaken forever by single-GPU ones.
    """

    starting: Mapping[int, str] = field(default_factory=dict)  # gpu index -> instance starting on it
    waiting: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def submit(self, instance_id: str, gpus: Iterable[int]) -> tuple[SequentialStarter, tuple[str, ...]]:
        gpu_tuple = tuple(sorted(set(gpus)))
        if not gpu_tuple:
            raise ValueError(f"{instance_id!r} names no GPU to start on")
        if instance_id in self.starting.values() or any(w == instance_id for w, _ in self.waiting):
            return self, ()
        return SequentialStarter(dict(self.starting), self.waiting + ((instance_id, gpu_tuple),))._admit()

    def finished(self, instance_id: str) -> tuple[SequentialStarter, tuple[str, ...]]:
        """The start of `instance_id` ended (ready or failed): its GPUs are free for the next."""
        starting = {g: i for g, i in self.starting.items() if i != instance_id}
        waiting = tuple(w for w in self.waiting if w[0] != instance_id)
        return SequentialStarter(starting, waiting)._admit()

    def _admit(self) -> tuple[SequentialStarter, tuple[str, ...]]:
        starting = dict(self.starting)
        claimed: set[int] = set()
        still: list[tuple[str, tuple[int, ...]]] = []
        started: list[str] = []
        for instance_id, gpus in self.waiting:
            if not claimed.intersection(gpus) and not any(g in starting for g in gpus):
                for g in gpus:
                    starting[g] = instance_id
                started.append(instance_id)
            else:
                still.append((instance_id, gpus))
            claimed.update(gpus)
        return SequentialStarter(starting, tuple(still)), tuple(started)
