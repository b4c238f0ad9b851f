"""The sklearn worker: a fitted estimator behind the worker protocol's /infer.

    python -m node_host.backends.sklearn_engine --spec-file SPEC.json --host 127.0.0.1 --port PORT ...

model.path is a file under one of the node's model roots holding a fitted estimator or Pipeline (with
predict_proba, or at least predict). It loads in the safe skops format by default: skops rebuilds only
the types it trusts (its defaults: scikit-learn, NumPy, SciPy) plus those the spec lists in
backend.config.trusted_types, and refuses a file that needs any other. skops calls a trusted type with
arguments from the file, so a listed type that does not resolve to a class defined in scikit-learn loads
only as a pickle does (sie.model_files.spec_may_trust). A pickle or joblib file runs code when loaded, so
it loads only when the operator allowed unsafe formats on the node and the spec pins its SHA-256
(sie.model_files); the bytes hashed are the bytes unpickled. Before skops reads a member, the archive is
bounded (skops_archive.py): a small file cannot make the loader hold gigabytes.

An optional numeric input field left out reaches the estimator as NaN; an estimator that refuses missing
values makes that request a 400 naming the fields left out, not a 500.

backend.config.demo: true trains the demo text scorer there (in skops format) when the file is missing.
The input and output schemas of the spec decide the conversions (scorer_io.py); without them the scorer
takes {"text": str} and answers {"score": float in [0, 1]}.

A binary LogisticRegression, alone or behind a StandardScaler or a HashingVectorizer (the demo
scorer), is scored by fast_linear.py: the same operations as sklearn's, without its per-call input
checks (about 0.35 ms per predict, whatever the batch size); the probabilities are equal. Other
estimators go through predict_proba, and so does every estimator with backend.config.fast_path: false
(the estimator's own code on every call; bench.scorer's "before issue 16" baseline uses it).

Concurrent requests reach `infer` together, as one batch (the worker runtime's micro-batcher, spec
`batching`). Scoring runs on the event loop for batches up to INLINE_ROWS rows: the demo scorer takes
about 3 ms for 256 rows, less than handing the batch to a thread and back costs the loop in wake-ups
and GIL hand-overs at a few thousand batches a second. Larger batches (one request with thousands of
instances) go to a thread so they never stall other requests for long.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import logging
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from node_host.backends.protocol import BadRequest, EngineState, Loads
from node_host.backends.runtime.main import run_worker
from node_host.backends.sklearn_engine import fast_linear, scorer_io, skops_archive
from sie import model_files
from sie.engine_settings import SklearnSettings
from sie.errors import Problem, SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService

log = logging.getLogger(__name__)

INLINE_ROWS = 256  # batches up to this size score on the loop


class SklearnEngine:
    backend = "sklearn"
    simulated = False

    def __init__(self, service: ModelService, files: ModelFilePolicy, *, clock: Callable[[], float] = time.monotonic):
        spec = service.spec
        self.settings = SklearnSettings.from_spec(service)
        model_files.check_spec(service, files)
        self.served_model_name = self.settings.served_model_name
        self.model_path = self.settings.model_path
        self._files = files
        self._sha256 = spec.model.sha256
        self._inputs = (
            tuple(spec.input_schema.fields)
            if spec.input_schema and spec.input_schema.fields
            else scorer_io.DEFAULT_INPUT
        )
        self._outputs = (
            tuple(spec.output_schema.fields)
            if spec.output_schema and spec.output_schema.fields
            else scorer_io.DEFAULT_OUTPUT
        )
        self._clock = clock
        self._estimator: Any = None
        self._fast: fast_linear.FastScorer | None = None  # set at start for the estimators it covers
        self._state = EngineState.LOADING
        self._running = 0

    @property
    def state(self) -> EngineState:
        return self._state

    def loads(self) -> Loads:
        return Loads(running=self._running, waiting=0)  # no KV cache: token fields stay None

    async def start(self) -> None:
        import sklearn

        # The estimator's hyper-parameters were checked when it was fitted and its inputs are checked
        # here (scorer_io) and at the sidecar; re-validating them on every predict costs ~0.15 ms a call.
        # Input checks (finite values, shapes) stay on. sklearn's config is per thread: this sets it for
        # the event loop's, and _score_in_thread for the executor's (batches over INLINE_ROWS).
        sklearn.set_config(skip_parameter_validation=True)
        self._estimator = await asyncio.get_running_loop().run_in_executor(None, self._load)
        self._fast = fast_linear.compile_scorer(self._estimator) if self.settings.fast_path else None
        if self._fast is not None:
            log.info(
                "%s: a binary logistic regression (%s); scoring it without sklearn's per-call checks (fast_linear.py)",
                self.served_model_name,
                type(self._fast).__name__,
            )
        self._state = EngineState.READY

    async def close(self) -> None:
        self._estimator = None
        self._fast = None

    async def release(self, tags: Sequence[str]) -> None:
        # A scorer holds no accelerator memory; sleeping only stops it serving until resume.
        self._state = EngineState.SLEEPING

    async def resume(self, tags: Sequence[str]) -> None:
        self._state = EngineState.READY

    async def infer(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        inputs = scorer_io.features(rows, self._inputs)
        self._running += 1
        try:
            if len(rows) <= INLINE_ROWS:
                scores, labels = self._score(inputs)
            else:
                scores, labels = await asyncio.get_running_loop().run_in_executor(None, self._score_in_thread, inputs)
        except BadRequest:
            raise
        except ValueError as exc:
            # sklearn refuses NaN with a ValueError ("Input X contains NaN"); with fields left out, that is
            # the request's to fix. The batcher reruns each request of a failed batch alone, so each gets
            # its own answer. Without missing fields it is the model's failure: a 500, logged.
            absent = scorer_io.absent_fields(rows, self._inputs)
            if not absent:
                raise
            raise BadRequest(scorer_io.absent_message(absent)) from exc
        finally:
            self._running -= 1
        return scorer_io.outputs(scores, labels, self._outputs)

    def _load(self) -> Any:
        path = model_files.resolve(self.model_path, self._files)
        if self.settings.demo and not path.exists():
            from node_host.backends.sklearn_engine.demo_scorer import ensure_demo_scorer

            log.info("creating the demo scorer at %s", path)
            ensure_demo_scorer(path, seed=self.settings.seed)
        model_files.check_model_dir(path, self._files)  # the check every model path gets; resolve checked a file
        if not path.is_file():
            raise FileNotFoundError(
                f"no estimator file at {path}; save a fitted estimator there with skops.io.dump, or set "
                "backend.config.demo: true to create the demo scorer"
            )
        data = model_files.read_pinned(path, self._sha256)
        estimator = self._deserialise(path, data)
        if not hasattr(estimator, "predict_proba") and not hasattr(estimator, "predict"):
            raise TypeError(f"{path} holds a {type(estimator).__name__}, which has neither predict_proba nor predict")
        log.info("loaded %s (%s) from %s", self.served_model_name, type(estimator).__name__, path)
        return estimator

    def _deserialise(self, path: Path, data: bytes) -> Any:
        if zipfile.is_zipfile(io.BytesIO(data)):
            node_types = skops_archive.inspect(data, path.name)  # bounded before skops reads a member
            import skops.io as sio

            trusted = self.settings.trusted_types
            needed = sio.get_untrusted_types(data=data)
            untrusted = [t for t in needed if t not in trusted]
            if untrusted:
                raise self._refusal(
                    "spec.backend.config.trusted_types",
                    f"{path.name} needs types skops does not trust by default: "
                    f"{', '.join(untrusted[:10])}; list them in backend.config.trusted_types if you trust them",
                )
            code = _code_types(needed, node_types)
            if code and (not self._files.allow_unsafe_formats or self._sha256 is None):
                raise self._refusal(
                    "spec.backend.config.trusted_types",
                    f"{path.name} needs {', '.join(code[:10])}, which is not a class defined in scikit-learn: "
                    "skops would call it with arguments from the file, which runs code. It loads only as a "
                    "pickle does: with --allow-unsafe-model-formats on the node and spec.model.sha256 pinned",
                )
            if code:
                log.warning("trusting %s in %s (unsafe formats allowed, SHA-256 pinned)", ", ".join(code[:10]), path)
            return sio.loads(data, trusted=needed or None)
        # Not a skops archive: a pickle or joblib file, which runs code when loaded.
        if not self._files.allow_unsafe_formats or self._sha256 is None:
            raise self._refusal(
                "spec.model.path",
                f"{path.name} is not a skops file; pickle/joblib files run code when loaded and "
                "load only with --allow-unsafe-model-formats on the node and spec.model.sha256 pinned",
            )
        import joblib

        log.warning("loading %s as a pickle/joblib file (unsafe formats allowed, SHA-256 pinned)", path)
        return joblib.load(io.BytesIO(data))

    def _refusal(self, field: str, reason: str) -> SpecError:
        return SpecError(f"ModelService {self.served_model_name!r}", [Problem(field, reason)])

    def _score_in_thread(self, inputs: Any) -> tuple[list[float], list[Any]]:
        import sklearn

        with sklearn.config_context(skip_parameter_validation=True):
            return self._score(inputs)

    def _score(self, inputs: Any) -> tuple[list[float], list[Any]]:
        fast = self._fast
        if fast is not None:
            positive = fast.positive_proba(inputs)
            if positive is not None:  # else input the fast form leaves to sklearn, which answers or refuses it
                return positive.tolist(), fast.labels(positive)
        estimator = self._estimator
        if hasattr(estimator, "predict_proba"):
            proba = estimator.predict_proba(inputs)
            classes = list(getattr(estimator, "classes_", range(proba.shape[1])))
            best = proba.argmax(axis=1)
            labels = [classes[i] for i in best]
            # Binary: the positive class's probability. More classes: the predicted class's.
            scores = proba[:, 1] if proba.shape[1] == 2 else proba.max(axis=1)
            return [float(s) for s in scores], labels
        predicted = estimator.predict(inputs)
        return [float(p) for p in predicted], list(predicted)


def _code_types(needed: Sequence[str], node_types: frozenset[tuple[str, str]]) -> list[str]:
    """The types of `needed` (skops' untrusted names) that a spec alone may not trust: all but those that
    every node naming them resolves to a class defined in scikit-learn. A name no node spells as
    (module, class), such as a method's (`MethodNode`), is one of them."""
    spelled: dict[str, list[tuple[str, str]]] = {}
    for module, cls in node_types:
        spelled.setdefault(f"{module}.{cls}", []).append((module, cls))
    return sorted(t for t in needed if not spelled.get(t) or not all(_sklearn_class(m, c) for m, c in spelled[t]))


def _sklearn_class(module: str, name: str) -> bool:
    """Whether skops' lookup of (module, name), `getattr(import_module(module), name)`, gives a class
    defined in scikit-learn. The names are checked first, so only scikit-learn's own modules are imported;
    a function, or a class scikit-learn imports from elsewhere, is not one."""
    if not model_files.trustable_module(module) or not name.isidentifier():
        return False
    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:  # whatever stops the import stops skops too: the type is not one a spec may trust
        return False
    owner = getattr(found, "__module__", None)
    return isinstance(found, type) and isinstance(owner, str) and model_files.trustable_module(owner)


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(SklearnEngine, argv, description="SIE sklearn scorer worker")
