"""The Triton model repository SIE writes for one model, from its spec (pure but for the files it reads
and writes).

    <dir>/<model id>/config.pbtxt     name, backend "python", max_batch_size, one input per input_schema
                                      field and one output per output_schema field (dims [1] per row),
                                      instance_group, dynamic_batching when backend.config asks for it,
                                      and the checked file in `parameters` (model.py says which)
    <dir>/<model id>/1/model.py       SIE's Python-backend model (model.py in this package), as it is

model.path is a scikit-learn estimator in a .skops file, held to the rules of SIE's sklearn engine
before Triton ever sees it (node_host/backends/sklearn_engine/worker.py): under a model root, within the
archive bounds (skops_archive.py), needing no type skops does not trust beyond backend.config.trusted_types,
and a type that is not a scikit-learn class only with unsafe formats allowed and model.sha256 pinned. The
model loads the file only if its bytes are the bytes checked here (their SHA-256 goes with it). Pickle and
joblib files are not taken: a pinned pickle runs under `backend.type: sklearn`.

An operator's own Triton model (model.path a directory holding config.pbtxt, any backend) is code (a
Python backend's model.py, a custom backend's library), so it is served as it is only when the operator
allows remote code on the node (--allow-remote-code); `<dir>/<model id>` is then a link to it.

backend.config (checked, every wrong key named at once):
    dynamic_batching     {max_queue_delay_microseconds: 0..1000000, preferred_batch_size: [sizes]}: Triton
                         gathers concurrent requests into one execute; off unless given
    instance_count       model instances (each a Python stub process), 1..64, default 1
    trusted_types, demo, seed   as for the sklearn backend (sie.engine_settings.SklearnSettings)
max_batch_size is spec.batching.max_batch_size: the most rows one request or one execute may carry.

`write_backends` makes the backend directory the server needs (launch.py says why).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from node_host.backends.sklearn_engine import skops_archive
from node_host.backends.sklearn_engine.worker import _code_types
from node_host.backends.triton_server.launch import python_version
from sie import model_files
from sie.engine_settings import SklearnSettings
from sie.engine_settings.triton_engine import TritonSettings
from sie.engines.triton import DATATYPES, input_fields, output_fields
from sie.errors import Problem, SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import FieldSpec, ModelService

VERSION = "1"
MODEL_SOURCE = Path(__file__).with_name("model.py")


# ---- config.pbtxt (pure) ---------------------------------------------------------------------------


def pbtxt_string(text: str) -> str:
    """`text` as a protobuf text-format string literal: printable ASCII as is, quote and backslash escaped,
    every other byte of its UTF-8 as an octal escape (which the parser turns back into the same bytes)."""
    out = []
    for byte in text.encode("utf-8"):
        if byte in (0x22, 0x5C):
            out.append("\\" + chr(byte))
        elif 0x20 <= byte < 0x7F:
            out.append(chr(byte))
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def config_pbtxt(
    service: ModelService, settings: TritonSettings, parameters: Mapping[str, str], *, kind: str = "KIND_CPU"
) -> str:
    """config.pbtxt of the model: see the module docstring."""

    def tensors(fields: Sequence[FieldSpec]) -> str:
        items = [
            f"  {{ name: {pbtxt_string(f.name)} data_type: TYPE_{_config_type(f.type)} dims: [ 1 ] }}" for f in fields
        ]
        return "[\n" + ",\n".join(items) + "\n]"

    lines = [
        f"name: {pbtxt_string(service.model_id)}",
        'backend: "python"',
        f"max_batch_size: {settings.max_batch_size}",
        f"input {tensors(input_fields(service))}",
        f"output {tensors(output_fields(service))}",
        f"instance_group [ {{ kind: {kind} count: {settings.instance_count} }} ]",
    ]
    batching = settings.dynamic_batching
    if batching is not None:
        preferred = f" preferred_batch_size: [ {', '.join(map(str, batching.preferred_batch_size))} ]"
        lines.append(
            f"dynamic_batching {{ max_queue_delay_microseconds: {batching.max_queue_delay_microseconds}"
            f"{preferred if batching.preferred_batch_size else ''} }}"
        )
    params = [
        f"  {{ key: {pbtxt_string(k)} value: {{ string_value: {pbtxt_string(v)} }} }}" for k, v in parameters.items()
    ]
    if params:
        lines.append("parameters [\n" + ",\n".join(params) + "\n]")
    return "\n".join(lines) + "\n"


def _config_type(field_type: str) -> str:
    datatype = DATATYPES[field_type]
    return "STRING" if datatype == "BYTES" else datatype


# ---- the model file, checked as SIE's sklearn engine checks it -------------------------------------


@dataclass(frozen=True)
class CheckedModel:
    path: Path  # the real path, under a model root
    sha256: str  # of the bytes checked
    trusted: tuple[str, ...]  # the types skops may rebuild for this file (all it needs)

    def parameters(self) -> dict[str, str]:
        return {
            "sie_model_path": str(self.path),
            "sie_sha256": self.sha256,
            "sie_max_bytes": str(model_files.MAX_MODEL_FILE_BYTES),
            "sie_trusted_types": json.dumps(list(self.trusted)),
        }


def check_model_file(
    service: ModelService,
    files: ModelFilePolicy,
    settings: SklearnSettings,
    path: Path,
    limits: skops_archive.ArchiveLimits = skops_archive.ArchiveLimits(),
) -> CheckedModel:
    """The skops file at `path` (a resolved path), checked as SIE's sklearn engine checks one before it loads
    it; SpecError naming the field and the reason otherwise."""

    def refuse(field: str, reason: str) -> SpecError:
        return SpecError(f"ModelService {service.model_id!r}", [Problem(field, reason)])

    if settings.demo and not path.exists():
        from node_host.backends.sklearn_engine.demo_scorer import ensure_demo_scorer

        ensure_demo_scorer(path, seed=settings.seed)
    if not path.is_file():
        raise refuse(
            "spec.model.path",
            f"no estimator file at {path}; save a fitted estimator there with skops.io.dump, or set "
            "backend.config.demo: true to create the demo scorer",
        )
    data = model_files.read_pinned(path, service.spec.model.sha256)
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise refuse(
            "spec.model.path",
            f"{path.name} is not a skops file; the triton backend loads scikit-learn models saved with "
            "skops.io.dump only (a pinned pickle runs under backend.type: sklearn)",
        )
    node_types = skops_archive.inspect(data, path.name, limits)  # bounded before skops reads a member
    import skops.io as sio

    needed = sio.get_untrusted_types(data=data)
    untrusted = [t for t in needed if t not in settings.trusted_types]
    if untrusted:
        raise refuse(
            "spec.backend.config.trusted_types",
            f"{path.name} needs types skops does not trust by default: "
            f"{', '.join(untrusted[:10])}; list them in backend.config.trusted_types if you trust them",
        )
    code = _code_types(needed, node_types)
    if code and (not files.allow_unsafe_formats or service.spec.model.sha256 is None):
        raise refuse(
            "spec.backend.config.trusted_types",
            f"{path.name} needs {', '.join(code[:10])}, which is not a class defined in scikit-learn: "
            "skops would call it with arguments from the file, which runs code. It loads only as a "
            "pickle does: with --allow-unsafe-model-formats on the node and spec.model.sha256 pinned",
        )
    return CheckedModel(path, hashlib.sha256(data).hexdigest(), tuple(needed))


# ---- writing -----------------------------------------------------------------------------------------


def write_repository(service: ModelService, files: ModelFilePolicy, directory: Path, *, kind: str = "KIND_CPU") -> Path:
    """Write the model's directory under the repository `directory` (made if missing) and return it;
    SpecError, before anything is written, for a spec or a model file SIE does not serve."""
    model_files.check_spec(service, files)
    settings = TritonSettings.from_spec(service)
    assert service.spec.model.path is not None  # from_spec checked it
    path = model_files.resolve(service.spec.model.path, files)
    model_files.check_model_dir(path, files)  # a directory: every entry's real path under a root
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / service.model_id
    if path.is_dir():
        _check_operator_model(service, files, path)
        _replace(target, lambda staged: staged.symlink_to(path, target_is_directory=True))
        return target
    checked_file = check_model_file(service, files, settings.sklearn, path)
    config = config_pbtxt(service, settings, checked_file.parameters(), kind=kind)

    def fill(staged: Path) -> None:
        (staged / VERSION).mkdir(parents=True)
        (staged / "config.pbtxt").write_text(config)
        shutil.copyfile(MODEL_SOURCE, staged / VERSION / "model.py")

    _replace(target, fill)
    return target


def _check_operator_model(service: ModelService, files: ModelFilePolicy, path: Path) -> None:
    def refuse(reason: str) -> SpecError:
        return SpecError(f"ModelService {service.model_id!r}", [Problem("spec.model.path", reason)])

    if not files.allow_remote_code:
        raise refuse(
            f"{path} is a directory: a Triton model of its own, whose model code (a Python backend's model.py, "
            "a backend library) runs when it loads; served only when the operator allows remote code on the "
            "node (--allow-remote-code, Cluster allow_remote_code: true). Or name a .skops file"
        )
    config = path / "config.pbtxt"
    if not config.is_file():
        raise refuse(f"{path} is a directory without config.pbtxt; name a Triton model directory or a .skops file")
    found = re.search(r'^name\s*:\s*"([^"]*)"', config.read_text(errors="replace")[:1_000_000], re.MULTILINE)
    if found and found.group(1) != service.model_id:
        raise refuse(
            f"{config} names the model {found.group(1)[:100]!r}; Triton serves it as {service.model_id!r} "
            "(the spec's model.name), so the two must be equal (or leave `name` out)"
        )


def _replace(target: Path, fill: Callable[[Path], None]) -> None:
    """Make `target` anew: `fill` makes it at a temporary sibling, which is then swapped in (Triton never
    reads half a model); what was there before is removed (a link is removed, never followed)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        staged = tmp / "model"
        fill(staged)
        if target.is_symlink() or target.exists():
            os.replace(target, tmp / "old")
        os.replace(staged, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_backends(tritonserver: Path, directory: Path) -> Path:
    """`directory`/python/ holding links to the wheel's Python backend and to the stub built for the venv's
    Python version, and `directory` returned: the server's --backend-directory (launch.py says why)."""
    root = tritonserver.parent.parent  # site-packages/pytriton/tritonserver
    sources = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": root
        / "python_backend_stubs"
        / python_version(tritonserver)
        / "triton_python_backend_stub",
    }
    missing = [str(p) for p in sources.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"the Triton venv lacks {', '.join(missing)}; reinstall nvidia-pytriton there")
    python = directory / "python"
    python.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        link = python / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source)
    return directory
