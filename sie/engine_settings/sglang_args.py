"""Which SGLang engine arguments a spec may pass through backend.config (DESIGN §10: engine arguments
are code unless proven otherwise).

The node host turns each backend.config key it does not set itself into a `--flag` of
`sglang.launch_server`. SGLang has hundreds of flags and adds more every release; some import code
(`--trust-remote-code`, a custom weight loader, plugins), some read further arguments or templates from
a file (`--config`, `--chat-template`), and argparse accepts any unambiguous prefix of a flag
(`--trust-remote` is `--trust-remote-code`). A list of forbidden flags cannot keep up with that, so
the rule is the other way round: unless the operator lets specs run model code on the node
(`--allow-remote-code`, Cluster `allow_remote_code: true`), a spec may pass only the tuning flags
below, which neither run code nor read files, and the file-naming flags in PATH_ARGS, whose value the
node host resolves under its model roots like model.path. Every value is checked too: a string or
list item that starts with "-" would be read as a flag of its own, so it must be a number.

    sglang_arg_problems(extra, allow_any)  the Problems of backend.config's pass-through keys
    flag_key(key)                          a key as the check compares it ("Trust-Remote_Code" -> "trust_remote_code")
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sie.engine_settings.kv_budget import KV_BUDGET_SCALE
from sie.errors import Problem

# SGLang flags a spec may pass without the operator's leave: scheduling, kernels, precision, caching,
# parsers chosen by name from SGLang's own registries, logging. None runs code or reads a file.
# Checked against the flags of the SGLang releases the pin takes (tests/fixtures/sglang/, read from their
# code): `enable_flashinfer` (the source article's spec has it) and `cuda_graph_bs` are gone (GONE, below).
PASS_THROUGH = frozenset(
    {
        "allow_auto_truncate",
        "attention_backend",
        "chunked_prefill_size",
        "cuda_graph_bs_decode",
        "cuda_graph_max_bs_decode",
        "decode_attention_backend",
        "disable_cuda_graph",
        "disable_cuda_graph_padding",
        "disable_overlap_schedule",
        "disable_radix_cache",
        "dp_size",
        "dtype",
        "enable_cache_report",
        "enable_dp_attention",
        "enable_hierarchical_cache",
        "enable_mixed_chunk",
        "enable_torch_compile",
        "ep_size",
        "grammar_backend",
        "hicache_ratio",
        "is_embedding",
        "kv_cache_dtype",
        "log_level",
        "log_requests",
        "max_prefill_tokens",
        "moe_runner_backend",
        "num_continuous_decode_steps",
        "page_size",
        "prefill_attention_backend",
        "quantization",
        "radix_eviction_policy",
        "random_seed",
        "reasoning_parser",
        "revision",
        "sampling_backend",
        "schedule_conservativeness",
        "schedule_policy",
        "show_time_cost",
        "skip_tokenizer_init",
        "speculative_algorithm",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "speculative_num_steps",
        "stream_interval",
        "tokenizer_mode",
        "tool_call_parser",
        "torch_compile_max_bs",
        "triton_attention_num_kv_splits",
        "watchdog_timeout",
    }
)
# Flags whose value names a file or directory: allowed, and the node host passes SGLang the value
# resolved under its model roots (node_host.backends.sglang_server.launch). A chat template without a
# "/" is one of SGLang's built-in templates, by name.
PATH_ARGS = frozenset({"tokenizer_path", "chat_template"})
# backend.config keys SIE reads itself (sie.spec.BackendConfig, the KV budget): never passed as flags.
SPEC_KEYS = frozenset({"tp_size", "max_seq_len", "max_total_tokens", KV_BUDGET_SCALE})

_NUMBER = re.compile(r"-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def flag_key(key: str) -> str:
    """`key` as SIE compares it: lower case, "-" as "_" (SGLang's flags are --kebab-case of these)."""
    return key.lower().replace("-", "_")


# Flags the SGLang releases the pin takes no longer have, and what says the same now. Passing one would not
# fail: SGLang's argparse takes a prefix of a longer flag (enable_flashinfer is read as
# --enable-flashinfer-allreduce-fusion) or exits 2 on an ambiguous one, so each is refused naming the new.
GONE = {
    "enable_flashinfer": "attention_backend: flashinfer",
    "cuda_graph_bs": "cuda_graph_bs_decode",
    "cuda_graph_max_bs": "cuda_graph_max_bs_decode",
}


def sglang_arg_problems(extra: Mapping[str, Any], allow_any: bool) -> list[Problem]:
    """What in backend.config's pass-through engine arguments the node would refuse to hand SGLang:
    a key outside PASS_THROUGH and PATH_ARGS unless `allow_any` (the operator allows remote code), and
    any value that SGLang's command line would read as a flag."""
    problems: list[Problem] = []
    for key, value in extra.items():
        name = flag_key(key)
        if name in SPEC_KEYS:
            continue
        field = f"spec.backend.config.{key}"
        if value is None or value is False:
            continue  # left off SGLang's command line
        if name in GONE:
            problems.append(
                Problem(
                    field,
                    f"SGLang 0.5 has no --{name.replace('_', '-')} (its argparse would read it as another flag, or "
                    f"exit); use {GONE[name]}",
                )
            )
            continue
        if not allow_any and name not in PASS_THROUGH and name not in PATH_ARGS:
            problems.append(
                Problem(
                    field,
                    "is not one of the SGLang arguments a spec may pass without the operator's leave (they "
                    "neither run code nor read files: see sie/engine_settings/sglang_args.py); an operator who "
                    "trusts the spec's authors with code on the node allows any (--allow-remote-code, Cluster "
                    "allow_remote_code: true)",
                )
            )
            continue
        problem = flag_value_problem(field, value, "SGLang")
        if problem is not None:
            problems.append(problem)
    return problems


def flag_value_problem(field: str, value: Any, engine: str) -> Problem | None:
    """Why `value` cannot go on `engine`'s command line as a flag's value, or None: a list holds only
    scalars, and no item may start with '-' (the engine's argparse would read it as a flag of its own)
    unless it is a number. Shared by every engine whose arguments a spec passes (SGLang, vLLM)."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (dict, list, tuple)) and isinstance(value, (list, tuple)):
            return Problem(field, "a list of engine argument values holds numbers, strings or booleans")
        if isinstance(item, str) and item.startswith("-") and not _NUMBER.fullmatch(item):
            return Problem(field, f"{item[:60]!r} starts with '-', so {engine} would read it as a flag of its own")
    return None
