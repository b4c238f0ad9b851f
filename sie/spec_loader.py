"""Reading ModelService specs from files, dicts and model packages, with errors that name the field.

A file may hold several YAML documents (or one JSON document, or a JSON list). Documents of other kinds
(e.g. the cluster settings, `kind: Cluster`) are returned separately by `load_documents`.

A model package may carry a `model-spec.yaml` (the source article's "model plane"): a flat file with
`name`, `version`, `backend`, `min_gpu_memory_mb`, `max_concurrent_requests`, `input_schema`,
`output_schema` and `slas`. `merge_model_package_spec` folds it under the ModelService that deploys the
model; the ModelService wins wherever both set a value. A package file is read only where the caller
names the roots it may come from (`package_roots`: the cluster file's model roots, the control plane's
--model-root): a spec's path never makes a component read a file elsewhere. The merged spec is what the
control plane stores and hands out, so node hosts, sidecars and workers never read a package again.

Every YAML text is read through sie.strict_yaml (safe types, no anchors or aliases, bounded size).

The source article's files say `apiVersion: sie.lmsys.org/v1`. A standalone cluster file may keep that
spelling: `parse_model_service(..., allow_legacy_api_version=True)` (only sie.cluster.load_cluster passes
it) reads such a document as `sie.io/v1alpha1`, and the caller warns (`legacy_api_version_warning`).
Every other path (the CRD, the admin API, the specs components hand each other) keeps refusing it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from sie import strict_json, strict_yaml
from sie.engine_settings import engine_settings_problems
from sie.errors import InputError, Problem, SpecError
from sie.spec import API_VERSION, KIND, MAX_SPEC_BYTES, ModelService, spec_size

MODEL_PACKAGE_SPEC = "model-spec.yaml"
# The source article's spelling of API_VERSION; the same spec, read as API_VERSION from cluster files only.
LEGACY_API_VERSION: Final = "sie.lmsys.org/v1"

# model-spec.yaml key -> path under ModelService.spec
_PACKAGE_KEYS: dict[str, tuple[str, ...]] = {
    "name": ("model", "name"),
    "version": ("model", "version"),
    "service_type": ("model", "service_type"),
    "priority_level": ("model", "priority_level"),
    "backend": ("backend", "type"),
    "min_gpu_memory_mb": ("resources", "min_gpu_memory_mb"),
    "max_concurrent_requests": ("resources", "max_concurrent_requests"),
    "input_schema": ("input_schema",),
    "output_schema": ("output_schema",),
    "slas": ("sla",),
    "sla": ("sla",),
    "requires": ("backend", "requires"),
}


def problems_from_validation(exc: ValidationError, prefix: str = "") -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = [str(part) for part in err["loc"] if not str(part).startswith("function-")]
        path = ".".join(p for p in [prefix, *loc] if p)
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            reason = "unknown field (check the spelling; see the spec reference in the README)"
        problems.append(Problem(path, reason))
    return problems


def parse_model_service(
    doc: Any,
    source: str = "ModelService",
    *,
    package_roots: Sequence[str | Path] = (),
    allow_legacy_api_version: bool = False,
    max_bytes: int | None = None,
) -> ModelService:
    """Validate one document. Raises SpecError naming every field that is wrong. A model package at the
    spec's path is merged in only when that path lies under one of `package_roots`. With
    `allow_legacy_api_version` (standalone cluster files only), `apiVersion: sie.lmsys.org/v1` is read
    as sie.io/v1alpha1; the caller says so (`legacy_api_version_warning`). An embedded engine's wrong
    backend.config settings are refused here too (sie.engine_settings), once the rest of the spec is
    valid: they are read from a spec that parsed. Where a spec enters the cluster for node hosts to run (a
    file, the admin API) `max_bytes` is sie.spec.MAX_SPEC_BYTES; a spec accepted before that bound
    (restored from the state file, recovered from a node, assigned) is read without it, and so is a
    Kubernetes ModelService (bounded by its pods' annotation instead: xds_server.k8s.reconcile)."""
    if not isinstance(doc, dict):
        raise SpecError(source, [Problem("", f"expected a mapping, got {type(doc).__name__}")])
    kind = doc.get("kind", KIND)
    if kind != KIND:
        raise SpecError(source, [Problem("kind", f"expected {KIND!r}, got {str(kind)[:64]!r}")])
    legacy = uses_legacy_api_version(doc)
    if legacy and allow_legacy_api_version:
        doc = {**doc, "apiVersion": API_VERSION}
    if package_roots:
        doc = _with_model_package(doc, package_roots)
    try:
        service = ModelService.model_validate(doc)
    except ValidationError as exc:
        name = _name_hint(doc)
        problems = problems_from_validation(exc)
        if legacy:
            problems = [_legacy_refusal() if p.path == "apiVersion" else p for p in problems]
        raise SpecError(f"{source}{name}", problems) from None
    if max_bytes is not None and (size := spec_size(service.to_dict())) > max_bytes:
        raise SpecError(
            f"{source} (ModelService {service.model_id!r})",
            [Problem("", f"the spec is {size:,} bytes as JSON; a spec may have at most {max_bytes:,}")],
        )
    # An embedded engine's settings are part of the spec: refused here, where every spelling of a spec
    # is read, rather than by a worker that exits when it starts.
    problems = engine_settings_problems(service)
    if problems:
        raise SpecError(f"{source} (ModelService {service.model_id!r})", problems)
    return service


def uses_legacy_api_version(doc: Any) -> bool:
    """Whether a document spells its apiVersion the source article's way (sie.lmsys.org/v1)."""
    return isinstance(doc, dict) and doc.get("apiVersion") == LEGACY_API_VERSION


def legacy_api_version_warning(source: str) -> str:
    """What to tell the user about a document that `allow_legacy_api_version` let through."""
    return (
        f"{source}: apiVersion {LEGACY_API_VERSION} is read as {API_VERSION} (the source article's spelling); "
        f"write {API_VERSION}"
    )


def _legacy_refusal() -> Problem:
    return Problem(
        "apiVersion",
        f"expected {API_VERSION!r}, got {LEGACY_API_VERSION!r} (the source article's spelling, accepted only "
        f"in a standalone cluster file); write apiVersion: {API_VERSION}",
    )


def load_documents(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Every document in a YAML/JSON file as (source label, mapping); empty documents are skipped."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise SpecError(str(path), [Problem("", f"cannot read the file: {reason}")]) from None
    try:
        if path.suffix == ".json":
            loaded = strict_json.loads(text, what=str(path))
            docs = loaded if isinstance(loaded, list) else [loaded]
        else:
            docs = strict_yaml.load_all(text, what=str(path))
    except InputError as exc:
        raise SpecError(str(path), [Problem("", str(exc))]) from None
    out = []
    for index, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        label = f"{path} document {index}"
        if not isinstance(doc, dict):
            raise SpecError(label, [Problem("", f"expected a mapping, got {type(doc).__name__}")])
        out.append((label, doc))
    return out


def raise_refusals(refused: Sequence[SpecError], source: str) -> None:
    """Raise what was wrong with the documents of one file, all at once: a single document's own
    SpecError, or one for the file whose problems each lead with their document (its label less the
    file's name, e.g. "document 2 (ModelService 'chat') spec.sla"). Returns when nothing was refused."""
    if len(refused) == 1:
        raise refused[0]
    if refused:
        problems = []
        for error in refused:
            document = error.source.removeprefix(source).strip() or error.source
            problems += [Problem(f"{document} {p.path}".strip(), p.reason) for p in error.problems]
        raise SpecError(source, problems)


def load_model_services(path: str | Path, package_roots: Sequence[str | Path] = ()) -> list[ModelService]:
    """All ModelService documents of a file, validated (every document's problems at once); duplicates
    of one model id are refused."""
    services, refused = [], []
    for label, doc in load_documents(path):
        if doc.get("kind", KIND) == KIND:
            try:
                services.append(parse_model_service(doc, label, package_roots=package_roots, max_bytes=MAX_SPEC_BYTES))
            except SpecError as exc:
                refused.append(exc)
    raise_refusals(refused, str(Path(path)))  # as load_documents spells it in each label
    ensure_unique(services, str(path))
    return services


def ensure_unique(services: Iterable[ModelService], source: str) -> None:
    seen: set[str] = set()
    for svc in services:
        if svc.model_id in seen:
            raise SpecError(source, [Problem("spec.model.name", f"model {svc.model_id!r} is defined twice")])
        seen.add(svc.model_id)


def package_spec_to_partial(package: dict[str, Any]) -> dict[str, Any]:
    """Turn a flat model-spec.yaml mapping into a partial ModelService `spec` mapping."""
    partial: dict[str, Any] = {}
    for key, value in package.items():
        target = _PACKAGE_KEYS.get(key)
        if target is None:
            raise SpecError(
                MODEL_PACKAGE_SPEC, [Problem(key, f"unknown field; expected one of {sorted(_PACKAGE_KEYS)}")]
            )
        node = partial
        for part in target[:-1]:
            node = node.setdefault(part, {})
        node[target[-1]] = copy.deepcopy(value)
    return partial


def merge_model_package_spec(service_doc: dict[str, Any], package: dict[str, Any]) -> dict[str, Any]:
    """The ModelService document with the package's values filled in where the ModelService is silent."""
    merged = copy.deepcopy(service_doc)
    spec = merged.setdefault("spec", {})
    merged["spec"] = _deep_merge(package_spec_to_partial(package), spec)
    return merged


def under_roots(path: str | Path, roots: Sequence[str | Path]) -> Path | None:
    """`path` with symlinks resolved, if it lies under one of `roots` (also resolved) and has no `..`."""
    if ".." in Path(path).parts:
        return None
    real = Path(os.path.realpath(path))
    for root in roots:
        base = Path(os.path.realpath(root))
        if real == base or base in real.parents:
            return real
    return None


def _with_model_package(doc: dict[str, Any], roots: Sequence[str | Path]) -> dict[str, Any]:
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return doc
    model = spec.get("model")
    path = model.get("path") if isinstance(model, dict) else None
    if not isinstance(path, str) or not path or len(path) > 4096:
        return doc
    package_dir = under_roots(path, roots)
    if package_dir is None:
        return doc
    package_file = package_dir / MODEL_PACKAGE_SPEC
    if not package_file.is_file():
        return doc
    try:
        package = strict_yaml.load(package_file.read_text(), what=str(package_file)) or {}
    except (InputError, OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(package_file), [Problem("", f"not valid YAML: {exc}")]) from None
    if not isinstance(package, dict):
        raise SpecError(str(package_file), [Problem("", "expected a mapping")])
    return merge_model_package_spec(doc, package)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _name_hint(doc: dict[str, Any]) -> str:
    spec = doc.get("spec")
    model = spec.get("model") if isinstance(spec, dict) else None
    name = (model or {}).get("name") if isinstance(model, dict) else None
    name = name or (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else name
    return f" (ModelService {name!r})" if name else ""
