"""Which vLLM engine arguments a spec may pass through backend.config, and the vLLM settings SIE reads
itself (DESIGN §10: engine arguments are code unless proven otherwise).

The node host turns each backend.config key it does not read itself into a `--flag` of vLLM's OpenAI
server (node_host.backends.vllm_server.launch). vLLM has over 300 flags and adds more every release; some
import code (`--trust-remote-code`, `--worker-cls`, `--logits-processors`, `--middleware`), some read
files anywhere (`--config`, `--download-dir`, `--lora-modules`), some open listeners or connect out
(`--kv-transfer-config`, `--grpc`, `--otlp-traces-endpoint`), and vLLM's parser takes any unambiguous
prefix of a flag (`--trust-remote` is `--trust-remote-code`), underscores for dashes, and `--flag.key`
for one key of a JSON flag. So, as for SGLang (sglang_args.py), the rule is an allowlist: unless the
operator lets specs run model code on the node (`--allow-remote-code`, Cluster `allow_remote_code:
true`), a spec may pass only the tuning flags in PASS_THROUGH, which neither run code nor read files,
and the file-naming flags in PATH_ARGS, whose value the node host resolves under its model roots like
model.path. One thing goes further than SGLang: the flags in MANAGED are refused even with the
operator's leave, in any spelling, abbreviation or `--no-` form, because they are the ledger's and the
node host's (the model, its name, ports, memory, concurrency, sleep mode, the API key) or the server's
own face (listeners, TLS, CORS, middleware, request logging): letting a spec set them would either fight
the ledger or change what the trust model says reaches the worker. Every value is checked too: a string
or list item that starts with "-" would be read as a flag of its own, so it must be a number.

SIE reads a few backend.config keys of its own for vLLM (SPEC_KEYS), never passed as flags:
`kv_cache_mb` (the KV cache on a CPU, MiB) and `max_num_seqs` (the requests vLLM runs at once, at most
resources.max_concurrent_requests); `vllm_settings` reads them with their bounds.

    vllm_arg_problems(extra, allow_any)  the Problems of backend.config's pass-through keys
    vllm_settings(service)               SIE's own vLLM keys, with the problems found
    managed_flag(key)                    the MANAGED flag a key is, abbreviates or negates, if any

Every name below was checked against `python -m vllm.entrypoints.openai.api_server --help=all` of vLLM
0.32 (the CPU build; the GPU build has the same parser).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from sie.engine_settings.fields import ConfigReader
from sie.engine_settings.kv_budget import KV_BUDGET_SCALE, kv_budget_scale
from sie.engine_settings.sglang_args import flag_key, flag_value_problem
from sie.errors import Problem
from sie.spec import ModelService

# vLLM flags a spec may pass without the operator's leave: precision, caching, scheduling, kernels chosen
# by name, sampling defaults, parsers chosen by name from vLLM's own registries (their plugin flags are not
# here), response shape. None runs code, reads a file or opens a socket. Left out on purpose, among others:
# `prefix_caching_hash_algo` (the KV-event block hashes SIE's prefix routing reads must not change under
# it), `load_format` (`pt` unpickles), the LoRA flags (adapters are SIE's placement, DESIGN §12),
# `max_num_queued_reqs`/`max_num_active_seqs` (admission and queueing are SIE's), `enable_prompt_embeds`
# (tensors deserialised from the request).
PASS_THROUGH = frozenset(
    {
        "async_scheduling",
        "attention_backend",
        "block_size",
        "chat_template_content_format",
        "cudagraph_capture_sizes",
        "default_chat_template_kwargs",
        "disable_cascade_attn",
        "disable_hybrid_kv_cache_manager",
        "disable_sliding_window",
        "dtype",
        "enable_auto_tool_choice",
        "enable_chunked_prefill",
        "enable_force_include_usage",
        "enable_prefix_caching",
        "enable_prompt_tokens_details",
        "enforce_eager",
        "kv_cache_dtype",
        "kv_cache_metrics",
        "logprobs_mode",
        "long_prefill_token_threshold",
        "max_cudagraph_capture_size",
        "max_logprobs",
        "max_num_batched_tokens",
        "num_gpu_blocks_override",  # meant to lower the KV cache (cache pressure in tests); it overrides the ledger's size
        "optimization_level",
        "override_generation_config",
        "performance_mode",
        "quantization",
        "reasoning_parser",
        "response_role",
        "return_tokens_as_token_ids",
        "revision",
        "scheduling_policy",
        "seed",
        "skip_tokenizer_init",
        "stream_interval",
        "tokenizer_mode",
        "tokenizer_revision",
        "tool_call_parser",
    }
)
# Flags whose value names a file or directory: allowed, and the node host passes vLLM the value resolved
# under its model roots (node_host.backends.vllm_server.launch). vLLM's `--chat-template` also takes a
# template inline or one of its built-in names; here it is always a path, so what a spec's template says
# comes from a file under the roots like the model's own. `--generation-config` takes "auto" (the model
# directory's generation_config.json) or "vllm" (none) as words (PATH_WORDS), else a directory.
PATH_ARGS = frozenset({"chat_template", "generation_config", "hf_config_path", "tokenizer"})
PATH_WORDS = {"generation_config": frozenset({"auto", "vllm"})}
# Boolean flags of PASS_THROUGH that vLLM parses with a `--no-` form (argparse BooleanOptionalAction):
# false in the spec becomes `--no-<flag>`, so `enable_prefix_caching: false` turns off what is on by
# default instead of being left off the command line.
NEGATABLE = frozenset(
    {
        "async_scheduling",
        "disable_cascade_attn",
        "disable_hybrid_kv_cache_manager",
        "disable_sliding_window",
        "enable_auto_tool_choice",
        "enable_chunked_prefill",
        "enable_force_include_usage",
        "enable_prefix_caching",
        "enable_prompt_tokens_details",
        "enforce_eager",
        "kv_cache_metrics",
        "return_tokens_as_token_ids",
        "skip_tokenizer_init",
    }
)
# Refused whatever the operator allows (see the module docstring).
MANAGED = frozenset(
    {
        # what node_host sets from the spec and the ledger
        "model",
        "served_model_name",
        "host",
        "port",
        "api_key",
        "tensor_parallel_size",
        "pipeline_parallel_size",  # more GPUs than the ledger placed
        "max_model_len",
        "max_num_seqs",
        "kv_cache_memory_bytes",
        "gpu_memory_utilization",
        "enable_sleep_mode",
        "disable_log_stats",  # turns off the Prometheus metrics SIE reads load and KV usage from
        "kv_events_config",  # SIE's prefix routing subscribes to these
        "device_ids",
        "numa_bind",
        "numa_bind_cpus",
        "numa_bind_nodes",
        # the server's listeners and face
        "uds",
        "grpc",
        "grpc_port",
        "headless",
        "api_server_count",
        "config",  # a YAML file of further arguments, read from anywhere
        "root_path",
        "middleware",
        "allowed_origins",
        "allowed_methods",
        "allowed_headers",
        "allow_credentials",
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_ca_certs",
        "ssl_cert_reqs",
        "ssl_ciphers",
        "enable_ssl_refresh",
        "uvicorn_log_level",
        "disable_uvicorn_access_log",
        "disable_access_log_for_endpoints",
        "log_config_file",
        "h11_max_incomplete_event_size",
        "h11_max_header_count",
        "disable_fastapi_docs",
        "enable_offline_docs",
        "enable_request_id_headers",
        "enable_tokenizer_info_endpoint",
        "enable_server_load_tracking",
        "enable_scale_out",
        "enable_fault_tolerance",
        "fault_tolerance_config",
        "enable_log_requests",  # prompts in the log
        "enable_log_outputs",
        "enable_log_deltas",
        "max_log_len",
        "shutdown_timeout",  # stop and drain are the node host's
        # what connects out or listens for peers
        "master_addr",
        "master_port",
        "nnodes",
        "node_rank",
        "data_parallel_size",
        "data_parallel_size_local",
        "data_parallel_rank",
        "data_parallel_start_rank",
        "data_parallel_address",
        "data_parallel_rpc_port",
        "data_parallel_backend",
        "data_parallel_hybrid_lb",
        "data_parallel_external_lb",
        "data_parallel_multi_port_external_lb",
        "data_parallel_supervisor_port",
        "kv_transfer_config",
        "ec_transfer_config",
        "weight_transfer_config",
        "otlp_traces_endpoint",
        "tool_server",
    }
)
# backend.config keys SIE reads itself (sie.spec.BackendConfig, the KV budget, vllm_settings): never flags.
KV_CACHE_MB = "kv_cache_mb"
MAX_NUM_SEQS = "max_num_seqs"
DEMO = "demo"
SPEC_KEYS = frozenset({"tp_size", "max_seq_len", "max_total_tokens", KV_BUDGET_SCALE, KV_CACHE_MB, MAX_NUM_SEQS, DEMO})

DEFAULT_KV_CACHE_MB = 64  # FACTS: about 1.3 GiB of RAM per server with it, and room for a tiny model's context
MIN_KV_CACHE_MB = 16
MAX_KV_CACHE_MB = 1 << 20  # 1 TiB: a typo beyond it, not a cache


def managed_flag(key: str) -> str | None:
    """The MANAGED flag `key` is, abbreviates (vLLM's parser takes any unambiguous prefix), or negates
    (`no_<flag>`), in any case and with "-" or "_", or names one key of (`flag.key`); None for none."""
    name = flag_key(key).split(".", 1)[0]
    if name in PASS_THROUGH or name in PATH_ARGS:
        return None  # an exact flag: argparse takes it as it is, never as an abbreviation
    for candidate in (name, name.removeprefix("no_")):
        found = next((m for m in sorted(MANAGED) if m == candidate or m.startswith(candidate)), None)
        if found is not None and candidate:
            return found
    return None


def vllm_arg_problems(extra: Mapping[str, Any], allow_any: bool) -> list[Problem]:
    """What in backend.config's pass-through engine arguments the node would refuse to hand vLLM: a
    MANAGED flag in any spelling, whatever `allow_any`; a key outside PASS_THROUGH and PATH_ARGS unless
    `allow_any` (the operator allows remote code); a path that is not a string or climbs out with "..";
    and any value that vLLM's command line would read as a flag."""
    problems: list[Problem] = []
    for key, value in extra.items():
        name = flag_key(key)
        if key in SPEC_KEYS:
            continue
        field = f"spec.backend.config.{key}"
        if name in SPEC_KEYS:  # SIE reads its own keys by their exact name only
            problems.append(Problem(field, f"write it as {name}: SIE reads its own keys by that name only"))
            continue
        managed = managed_flag(key)
        if managed is not None:
            head = name.partition(".")[0]  # `flag.key` sets one key of the JSON flag `flag`
            how = "is" if managed == head else ("negates" if head == f"no_{managed}" else "abbreviates")
            problems.append(
                Problem(
                    field,
                    f"{how} {managed}, which the node host sets itself (from the spec, the ledger or the "
                    "trust model) and no spec may change; remove it (use resources.max_concurrent_requests, "
                    "backend.config.max_seq_len, tp_size, max_num_seqs or kv_cache_mb)",
                )
            )
            continue
        if value is None or (value is False and name not in NEGATABLE):
            continue  # left off vLLM's command line
        if not allow_any and name not in PASS_THROUGH and name not in PATH_ARGS:
            problems.append(
                Problem(
                    field,
                    "is not one of the vLLM arguments a spec may pass without the operator's leave (they "
                    "neither run code nor read files: see sie/engine_settings/vllm_args.py); an operator who "
                    "trusts the spec's authors with code on the node allows any (--allow-remote-code, Cluster "
                    "allow_remote_code: true)",
                )
            )
            continue
        if name in PATH_ARGS:
            if not isinstance(value, str) or not value:
                problems.append(Problem(field, "expected a path (a string) under the node's model roots"))
                continue
            if ".." in PurePath(value).parts:
                problems.append(Problem(field, f"{value[:200]!r} contains '..'; name the file under a model root"))
                continue
        problem = flag_value_problem(field, value, "vLLM")
        if problem is not None:
            problems.append(problem)
    return problems


@dataclass(frozen=True)
class VLLMSettings:
    """The backend.config keys SIE reads for a vLLM instance (the rest are vLLM's flags)."""

    kv_cache_mb: int = DEFAULT_KV_CACHE_MB
    """backend.config.kv_cache_mb: vLLM's KV cache on a CPU, MiB (--kv-cache-memory-bytes); unset, vLLM's
    CPU build takes 92% of the machine's RAM. On a GPU the ledger's budget sizes it instead, and this is
    the fallback when the model has no config.json to estimate its weights from."""
    max_num_seqs: int | None = None
    """backend.config.max_num_seqs: requests vLLM runs at once; None: resources.max_concurrent_requests.
    Lower gives vLLM a queue of its own (vllm:num_requests_waiting)."""
    kv_budget_scale: float = 1.0
    """backend.config.kv_budget_scale: what the node host cuts the KV cache to after repeated OOM kills."""
    demo: bool = False
    """backend.config.demo: make a tiny random-weight model at model.path (head size 64, which vLLM's CPU
    attention takes) before vLLM starts, when nothing is there: the demo and the tests need no download."""


def vllm_settings(service: ModelService) -> tuple[VLLMSettings, list[Problem]]:
    """SIE's own vLLM keys of `service` (defaults where a value is wrong) and the problems found."""
    config = ConfigReader(service.spec.backend.config.model_extra or {})
    kv_cache_mb = config.integer(KV_CACHE_MB, DEFAULT_KV_CACHE_MB, minimum=MIN_KV_CACHE_MB, maximum=MAX_KV_CACHE_MB)
    max_num_seqs: int | None = None
    if config.config.get(MAX_NUM_SEQS) is not None:
        limit = service.spec.resources.max_concurrent_requests
        max_num_seqs = config.integer(MAX_NUM_SEQS, limit, minimum=1, maximum=limit)
    scale = 1.0
    try:
        scale = kv_budget_scale(config.config)
    except ValueError as exc:
        config.refuse(KV_BUDGET_SCALE, str(exc))
    demo = config.flag(DEMO, False)
    return VLLMSettings(kv_cache_mb, max_num_seqs, scale, demo), config.problems
