"""The sklearn worker: a pickled estimator behind the worker protocol's /infer.

    python -m node_host.backends.sklearn_worker --spec-file SPEC.json --host 127.0.0.1 --port PORT

model.path is a joblib file (a fitted estimator or Pipeline with predict_proba, or at least predict).
backend.config.demo: true trains the demo text scorer there when the file is missing. The input and
output schemas of the spec decide the conversions (scorer_io.py); without them the scorer takes
{"text": str} and answers {"score": float in [0, 1]}.

Scoring runs on the event loop for small batches: it takes well under a millisecond, less than the hop
to a thread would cost. Larger batches go to a thread so they never stall other requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from node_host.backends import scorer_io
from node_host.backends.protocol import EngineState, Loads, run_worker
from sie.errors import Problem, SpecError
from sie.spec import ModelService

log = logging.getLogger(__name__)

INLINE_ROWS = 32  # batches up to this size score on the loop


class SklearnEngine:
    backend = "sklearn"
    simulated = False

    def __init__(self, service: ModelService, *, clock: Callable[[], float] = time.monotonic):
        spec = service.spec
        if not spec.model.path:
            raise SpecError(
                f"ModelService {service.model_id!r} (sklearn backend)",
                [Problem("spec.model.path", "the sklearn backend needs the path of a joblib file")],
            )
        self.served_model_name = service.model_id
        self.model_path = spec.model.path
        extra = spec.backend.config.model_extra or {}
        self._demo = extra.get("demo") is True
        self._seed = int(extra.get("seed", 0))
        self._inputs = tuple(spec.input_schema.fields) if spec.input_schema and spec.input_schema.fields else scorer_io.DEFAULT_INPUT
        self._outputs = tuple(spec.output_schema.fields) if spec.output_schema and spec.output_schema.fields else scorer_io.DEFAULT_OUTPUT
        self._clock = clock
        self._estimator: Any = None
        self._state = EngineState.LOADING
        self._running = 0

    @property
    def state(self) -> EngineState:
        return self._state

    def loads(self) -> Loads:
        return Loads(running=self._running, waiting=0)  # no KV cache: token fields stay None

    async def start(self) -> None:
        self._estimator = await asyncio.get_running_loop().run_in_executor(None, self._load)
        self._state = EngineState.READY

    async def close(self) -> None:
        self._estimator = None

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
                scores, labels = await asyncio.get_running_loop().run_in_executor(None, self._score, inputs)
        finally:
            self._running -= 1
        return scorer_io.outputs(scores, labels, self._outputs)

    def _load(self) -> Any:
        import joblib

        path = Path(self.model_path)
        if self._demo and not path.exists():
            from node_host.backends.demo_models import ensure_demo_scorer

            log.info("creating the demo scorer at %s", path)
            ensure_demo_scorer(path, seed=self._seed)
        if not path.is_file():
            raise FileNotFoundError(
                f"no estimator file at {path}; save a fitted estimator there with joblib.dump, or set "
                "backend.config.demo: true to create the demo scorer"
            )
        estimator = joblib.load(path)
        if not hasattr(estimator, "predict_proba") and not hasattr(estimator, "predict"):
            raise TypeError(f"{path} holds a {type(estimator).__name__}, which has neither predict_proba nor predict")
        log.info("loaded %s (%s) from %s", self.served_model_name, type(estimator).__name__, path)
        return estimator

    def _score(self, inputs: Any) -> tuple[list[float], list[Any]]:
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


def main(argv: Sequence[str] | None = None) -> int:
    return run_worker(SklearnEngine, argv, description="SIE sklearn scorer worker")


if __name__ == "__main__":
    raise SystemExit(main())
