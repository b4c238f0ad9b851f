"""Model files and engine arguments are code unless proven otherwise (DESIGN §10).

A model file is loaded, or a demo model written, only at a path under one of the operator's model roots
(symlinks resolved, `..` refused). Formats that run code when loaded (pickle, joblib) load only when the
operator allowed unsafe formats for the node and the spec pins the file's SHA-256, and the bytes that are
hashed are the bytes that are loaded (no window to swap the file). Engine arguments that execute code
from a model repository (`trust_remote_code` and its kin) are refused unless the operator allows them.

`spec_problems` is pure and runs wherever a spec is accepted (the control plane, the node host);
`resolve` and `read_pinned` touch the filesystem and run where the file is loaded (node host, worker).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sie.engine_settings.sglang_args import flag_key, sglang_arg_problems
from sie.errors import Problem, SpecError
from sie.spec import BackendType, ModelService

# Engine arguments (SGLang, vLLM, transformers) that make the engine import and run code it finds in the
# model's files or that the request names, refused for every backend but SGLang in any spelling or
# abbreviation; SGLang's arguments go by a list of those a spec may pass (sie/engine_settings/sglang_args.py).
CODE_ARGS = (
    "trust_remote_code",
    "tokenizer_trust_remote_code",
    "enable_custom_logit_processor",
    "custom_logit_processor",
    "worker_cls",
    "worker_extension_cls",
    "hf_overrides",
    "model_impl",
    "enable_remote_code",
    "plugins",
)
# File suffixes of formats that execute code when loaded.
PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib", ".jl", ".pt", ".pth", ".bin", ".sav", ".dill", ".cloudpickle")


@dataclass(frozen=True)
class ModelFilePolicy:
    """What the operator lets a node load: node host flags, from the Cluster spec under `sie up`."""

    roots: tuple[Path, ...] = ()
    allow_unsafe_formats: bool = False
    allow_remote_code: bool = False

    def resolved(self) -> ModelFilePolicy:
        """The same policy with every root an absolute, symlink-free path (for another process's cwd)."""
        return dataclasses.replace(self, roots=tuple(Path(os.path.realpath(r)) for r in self.roots))

    def argv(self) -> list[str]:
        """The flags (`add_arguments`) that hand this policy to another process."""
        out: list[str] = []
        for root in self.roots:
            out += ["--model-root", str(root)]
        if self.allow_unsafe_formats:
            out.append("--allow-unsafe-model-formats")
        if self.allow_remote_code:
            out.append("--allow-remote-code")
        return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The policy's command-line flags, the same on the node host and on every worker."""
    parser.add_argument(
        "--model-root",
        action="append",
        default=[],
        type=Path,
        help="directory model files may be loaded from and demo models written to (repeat for several)",
    )
    parser.add_argument(
        "--allow-unsafe-model-formats",
        action="store_true",
        help="let specs load pickle/joblib files pinned by spec.model.sha256 (they run code)",
    )
    parser.add_argument(
        "--allow-remote-code",
        action="store_true",
        help="let specs set trust_remote_code and other engine arguments that run model code",
    )


def from_arguments(args: argparse.Namespace) -> ModelFilePolicy:
    return ModelFilePolicy(
        roots=tuple(args.model_root),
        allow_unsafe_formats=args.allow_unsafe_model_formats,
        allow_remote_code=args.allow_remote_code,
    )


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "", "false", "False", "0", [], {})


def _code_arg(key: str) -> str | None:
    """The CODE_ARGS entry `key` names, in any case and with "-" or "_", or abbreviates (argparse takes
    any unambiguous prefix of a flag); None if it names none."""
    name = flag_key(key)
    return next((arg for arg in CODE_ARGS if arg == name or arg.startswith(name)), None)


def spec_problems(service: ModelService, policy: ModelFilePolicy) -> list[Problem]:
    """What in the spec this policy refuses, without touching the filesystem."""
    spec = service.spec
    problems: list[Problem] = []
    path = spec.model.path
    if path is not None and ".." in Path(path).parts:
        problems.append(Problem("spec.model.path", f"{path[:200]!r} contains '..'; name the file under a model root"))
    extra = spec.backend.config.model_extra or {}
    if spec.backend.type is BackendType.SGLANG:  # the node host turns these into SGLang's flags
        problems += sglang_arg_problems(extra, allow_any=policy.allow_remote_code)
    elif not policy.allow_remote_code:
        for key, value in extra.items():
            code_arg = _code_arg(key)
            if code_arg is not None and _truthy(value):
                problems.append(
                    Problem(
                        f"spec.backend.config.{key}",
                        f"{'is' if code_arg == flag_key(key) else 'abbreviates'} {code_arg}, which runs code from "
                        "the model's files or the request; refused unless the operator allows remote code on the "
                        "node (--allow-remote-code, Cluster allow_remote_code: true)",
                    )
                )
    if spec.backend.type is BackendType.SKLEARN and path is not None and path.lower().endswith(PICKLE_SUFFIXES):
        if not policy.allow_unsafe_formats:
            problems.append(
                Problem(
                    "spec.model.path",
                    f"{Path(path).name}: pickle/joblib files run code when "
                    "loaded; save the model with skops (.skops) or have the operator allow unsafe "
                    "formats (--allow-unsafe-model-formats) and pin spec.model.sha256",
                )
            )
        elif spec.model.sha256 is None:
            problems.append(
                Problem(
                    "spec.model.sha256",
                    "required to load a pickle/joblib file: the SHA-256 of the file you trust (`sha256sum FILE`)",
                )
            )
    return problems


def check_spec(service: ModelService, policy: ModelFilePolicy) -> None:
    problems = spec_problems(service, policy)
    if problems:
        raise SpecError(f"ModelService {service.model_id!r}", problems)


def resolve(path: str | Path, policy: ModelFilePolicy, what: str = "spec.model.path") -> Path:
    """The real path of `path` if it lies under a model root; SpecError saying why not otherwise."""
    if ".." in Path(path).parts:
        raise SpecError(what, [Problem(what, f"{str(path)[:200]!r} contains '..'")])
    if not policy.roots:
        raise SpecError(
            what,
            [
                Problem(
                    what,
                    "this node has no model roots, so it loads no model files: start "
                    "the node host with --model-root DIR (Cluster model_roots)",
                )
            ],
        )
    real = Path(os.path.realpath(path))
    for root in policy.roots:
        base = Path(os.path.realpath(root))
        if real == base or base in real.parents:
            return real
    roots = ", ".join(str(r) for r in policy.roots)
    raise SpecError(what, [Problem(what, f"{str(path)[:200]!r} resolves to {real}, outside the model roots ({roots})")])


def read_pinned(path: Path, sha256: str | None, limit_bytes: int = 16 * 1024**3) -> bytes:
    """The file's bytes, checked against `sha256` when given (the same bytes are then loaded)."""
    size = path.stat().st_size
    if size > limit_bytes:
        raise SpecError(
            "spec.model.path", [Problem("spec.model.path", f"{path} has {size} bytes, more than {limit_bytes}")]
        )
    data = path.read_bytes()
    if sha256 is not None:
        found = hashlib.sha256(data).hexdigest()
        if found != sha256:
            raise SpecError(
                "spec.model.sha256",
                [
                    Problem(
                        "spec.model.sha256",
                        f"{path.name} has SHA-256 {found}, not the pinned {sha256}: the file changed; refusing it",
                    )
                ],
            )
    return data
