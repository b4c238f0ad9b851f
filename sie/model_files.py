"""Model files and engine arguments are code unless proven otherwise (DESIGN §10).

A model file is loaded, or a demo model written, only at a path under one of the operator's model roots
(symlinks resolved, `..` refused). Formats that run code when loaded (pickle, joblib) load only when the
operator allowed unsafe formats for the node and the spec pins the file's SHA-256, and the bytes that are
hashed are the bytes that are loaded (no window to swap the file). Engine arguments that execute code
from a model repository (`trust_remote_code` and its kin) are refused unless the operator allows them.

A scikit-learn model loads through skops, which rebuilds the types it trusts by default and those the
spec lists in backend.config.trusted_types. skops *calls* a trusted type with arguments from the file
(ConstructorFromReduceNode) or rebuilds it with `__new__` and `__setstate__`, so trusting a function
(`eval`, `os.system`, `joblib.load`) or a class whose constructor reaches files or processes
(`subprocess.Popen`, `numpy.memmap`) runs what the file says, as a pickle does. A spec alone may
therefore trust only scikit-learn's own classes (`spec_may_trust`; the worker checks that the name
resolves to a class defined in scikit-learn); any other type needs what a pickle needs.

A model directory (torch, SGLang, vLLM) is read by libraries that follow every symlink in it (transformers
reads config.json, the tokenizer and chat_template.jinja wherever they point), so `check_model_dir`
walks it, bounded, and refuses an entry whose real path leaves the model roots, or one that is neither a
regular file nor a directory (a FIFO named config.json would block the loader for ever). It guards
against what a model directory ships, not against someone rewriting it while it loads: who can write
under a root can replace the weights anyway.

`spec_problems` is pure and runs wherever a spec is accepted (the control plane, the node host);
`resolve`, `check_model_dir` and `read_pinned` touch the filesystem and run where the file is loaded
(node host, worker).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sie.engine_settings.sglang_args import flag_key, sglang_arg_problems
from sie.engine_settings.sklearn_engine import SklearnSettings
from sie.engine_settings.vllm_args import vllm_arg_problems
from sie.errors import Problem, SpecError
from sie.spec import BackendType, ModelService

# Engine arguments (SGLang, vLLM, transformers) that make the engine import and run code it finds in the
# model's files or that the request names, refused for every backend but SGLang and vLLM in any spelling or
# abbreviation; SGLang's and vLLM's arguments go by lists of those a spec may pass
# (sie/engine_settings/sglang_args.py, vllm_args.py).
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
# The package whose classes a spec may ask skops to trust without the operator: the one skops trusts
# estimators from by default. Its classes keep parameters in their constructors (scikit-learn's own
# convention, which its check_estimator tests) and arrays in their state; a forest's sklearn.tree._tree.Tree,
# an MLP's optimiser and a KNN's KDTree are what specs actually list. NumPy and SciPy are not in it: numpy.memmap
# and scipy.io.FortranFile write files when constructed.
SPEC_TRUSTABLE_PACKAGE = "sklearn"
MAX_DIR_ENTRIES = 10_000  # entries under one model directory: shards, tokenizer files, a few hundred at most
MAX_DIR_DEPTH = 16  # directory levels under one model directory (a Hugging Face cache snapshot has 1 or 2)
MAX_MODEL_FILE_BYTES = 4 * 1024**3  # one file read whole into memory (a scorer's model), and loaded from there


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


def trustable_module(module: str) -> bool:
    """Whether `module` is a dotted name of identifiers in scikit-learn (SPEC_TRUSTABLE_PACKAGE) outside its
    test code (importing a test module runs pytest's machinery)."""
    parts = module.split(".")
    return (
        parts[0] == SPEC_TRUSTABLE_PACKAGE
        and all(p.isidentifier() for p in parts)
        and not any(p.startswith(("test", "_test")) or p == "conftest" for p in parts)
    )


def spec_may_trust(name: str) -> bool:
    """Whether a spec alone may ask skops to trust the type `name` ("module.Class"): one in scikit-learn
    (`trustable_module`). Pure: the spec's admission decides on the name alone; the worker further requires
    the name to resolve to a class defined there (a function or a class scikit-learn imports is refused)."""
    module, _, cls = name.rpartition(".")
    return bool(module) and cls.isidentifier() and trustable_module(module)


def _trusted_type_problems(service: ModelService, policy: ModelFilePolicy) -> list[Problem]:
    """backend.config.trusted_types the policy refuses: any type that is not scikit-learn's needs unsafe formats
    allowed and the file pinned, as a pickle does (the worker checks the file's types again)."""
    foreign = [t for t in SklearnSettings.read(service)[0].trusted_types if not spec_may_trust(t)]
    if not foreign:
        return []
    names = ", ".join(repr(t[:100]) for t in foreign[:5]) + (
        f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
    )
    if not policy.allow_unsafe_formats:
        return [
            Problem(
                "spec.backend.config.trusted_types",
                f"{names}: not a scikit-learn class, and skops calls a trusted type with arguments from the file, "
                "so trusting a function (joblib.load, eval) or another package's class runs code when the model "
                "loads; list only sklearn.* classes, or have the operator allow unsafe formats "
                "(--allow-unsafe-model-formats, Cluster allow_unsafe_model_formats: true) and pin spec.model.sha256",
            )
        ]
    if service.spec.model.sha256 is None:
        return [
            Problem(
                "spec.model.sha256",
                f"required to trust {names} (not a scikit-learn class, so it may run code): "
                "the SHA-256 of the file you trust (`sha256sum FILE`)",
            )
        ]
    return []


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
    elif spec.backend.type is BackendType.VLLM:  # and these into vLLM's
        problems += vllm_arg_problems(extra, allow_any=policy.allow_remote_code)
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
    if spec.backend.type is BackendType.SKLEARN:
        problems += _trusted_type_problems(service, policy)
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
    if _under_roots(real, _real_roots(policy)):
        return real
    roots = ", ".join(str(r) for r in policy.roots)
    raise SpecError(what, [Problem(what, f"{str(path)[:200]!r} resolves to {real}, outside the model roots ({roots})")])


def _real_roots(policy: ModelFilePolicy) -> tuple[Path, ...]:
    return tuple(Path(os.path.realpath(root)) for root in policy.roots)


def _under_roots(real: Path, bases: tuple[Path, ...]) -> bool:
    return any(real == base or base in real.parents for base in bases)


def check_model_dir(
    path: Path,
    policy: ModelFilePolicy,
    what: str = "spec.model.path",
    *,
    max_entries: int = MAX_DIR_ENTRIES,
    max_depth: int = MAX_DIR_DEPTH,
) -> None:
    """SpecError naming the entry unless every entry under the directory `path` (a `resolve`d path) is a
    regular file or a directory whose real path lies under a model root, within `max_entries` entries and
    `max_depth` levels; nothing to check when `path` is not a directory (`resolve` checked a file itself).
    Symlinked directories are walked at their real path, each once (a link loop ends there)."""
    if not path.is_dir():
        return

    def refuse(reason: str) -> SpecError:
        return SpecError(what, [Problem(what, f"model directory {path}: {reason}")])

    bases = _real_roots(policy)
    top = Path(os.path.realpath(path))
    if not _under_roots(top, bases):
        raise refuse(f"resolves to {top}, outside the model roots")
    pending: list[tuple[Path, str, int]] = [(top, "", 0)]
    walked = {top}
    count = 0
    while pending:
        real_dir, shown, depth = pending.pop()
        with os.scandir(real_dir) as entries:
            for entry in entries:
                count += 1
                if count > max_entries:
                    raise refuse(f"more than {max_entries} entries; a model directory holds its weights and tokenizer")
                name = f"{shown}{entry.name}"
                real = Path(os.path.realpath(entry.path)) if entry.is_symlink() else Path(entry.path)
                if not _under_roots(real, bases):
                    raise refuse(f"{name[:200]!r} is a symlink to {real}, outside the model roots")
                try:
                    mode = os.stat(real).st_mode
                except OSError:
                    continue  # a dangling link (under a root): the loader fails on it, reading nothing
                if stat.S_ISDIR(mode):
                    if depth + 1 > max_depth:
                        raise refuse(f"{name[:200]!r} is more than {max_depth} directories deep")
                    if real not in walked:
                        walked.add(real)
                        pending.append((real, f"{name}/", depth + 1))
                elif not stat.S_ISREG(mode):
                    raise refuse(
                        f"{name[:200]!r} is neither a regular file nor a directory (a FIFO or a device would block "
                        "or feed the loader)"
                    )


def read_pinned(path: Path, sha256: str | None, limit_bytes: int = MAX_MODEL_FILE_BYTES) -> bytes:
    """The file's bytes, checked against `sha256` when given (the same bytes are then loaded). The file is
    held in memory while it loads, so it is bounded (MAX_MODEL_FILE_BYTES by default)."""
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
