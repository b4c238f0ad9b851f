"""SIE's Triton Python-backend model: a scikit-learn estimator from a .skops file behind Triton's /infer.

repository.py copies this file, as it is, to `<repository>/<model id>/1/model.py`; Triton's Python stub runs
it with the packages of the Triton venv, so it imports numpy, scikit-learn, skops and Triton's
`triton_python_backend_utils` only, never SIE. (It imports outside Triton too, for SIE's tests and the
wheel check: there `pb_utils` is None and only the pure helpers are used.)

The node host has checked the file before Triton ever loads it (repository.py: under a model root, the
archive's bounds, the types skops must trust) and passes, in config.pbtxt's `parameters`:

    sie_model_path      the file's real path
    sie_sha256          the SHA-256 of the bytes it checked: the bytes loaded here must be those bytes
    sie_max_bytes       the most bytes the file may have (read no further)
    sie_trusted_types   a JSON list: the types the node host let skops trust for this file

So a file changed after the check is refused, not loaded. skops then rebuilds only those types.

Rows and scores as SIE's sklearn engine has them (node_host/backends/sklearn_engine/scorer_io.py): one
string input is the estimator's texts; otherwise the numeric inputs (int*, fp*, bool) in config order
are a feature matrix (NaN where an optional float was left out). The first output gets the score (the
positive class's probability of a binary classifier, else the predicted class's), an output named
`label` the predicted class. All requests of one execute are scored in one predict.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton's stub (SIE's tests, the wheel's import check)
    pb_utils = None

LABEL = "label"
# config.pbtxt's data types as numpy's (TYPE_STRING holds bytes objects).
NUMPY_TYPES: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


class RowError(ValueError):
    """The request's rows cannot be scored as sent: the caller's to fix (Triton answers 400)."""


def parameters(config: dict[str, Any]) -> dict[str, str]:
    """config.pbtxt's parameters as {key: string_value}."""
    return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}


def read_checked(path: str, sha256: str, max_bytes: int) -> bytes:
    """The file's bytes, if they are the bytes the node host checked (at most max_bytes read)."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path} has more than {max_bytes} bytes")
    found = hashlib.sha256(data).hexdigest()
    if found != sha256:
        raise ValueError(
            f"{path} changed after SIE's node host checked it (SHA-256 {found}, checked {sha256}); refusing it"
        )
    return data


def load_estimator(data: bytes, trusted: list[str]) -> Any:
    import skops.io as sio

    needed = sio.get_untrusted_types(data=data)
    beyond = sorted(set(needed) - set(trusted))
    if beyond:
        raise ValueError(f"the file needs types the node host did not let skops trust: {', '.join(beyond[:10])}")
    estimator = sio.loads(data, trusted=needed or None)
    if not hasattr(estimator, "predict_proba") and not hasattr(estimator, "predict"):
        raise TypeError(f"the file holds a {type(estimator).__name__}, which has neither predict_proba nor predict")
    return estimator


def features(columns: list[tuple[str, str, np.ndarray]]) -> Any:
    """The estimator input from the inputs' columns (name, config data type, values of all rows)."""
    if len(columns) == 1 and columns[0][1] == "TYPE_STRING":
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in columns[0][2]]
    numeric = [values.astype(np.float64) for _, kind, values in columns if kind != "TYPE_STRING"]
    if not numeric:
        raise RowError("the inputs are neither one string field nor numeric fields")
    return np.column_stack(numeric)


def missing(columns: list[tuple[str, str, np.ndarray]], starts: list[int]) -> list[str]:
    """`instances[i].field` for each NaN of a numeric input, i counted within its own request."""
    out = []
    for name, kind, values in columns:
        if kind in ("TYPE_FP32", "TYPE_FP64"):
            for row in np.flatnonzero(np.isnan(values)):
                request = int(np.searchsorted(starts, row, side="right")) - 1
                out.append(f"instances[{row - starts[request]}].{name}")
    return out


def score(estimator: Any, inputs: Any) -> tuple[np.ndarray, list[Any]]:
    if hasattr(estimator, "predict_proba"):
        proba = estimator.predict_proba(inputs)
        classes = list(getattr(estimator, "classes_", range(proba.shape[1])))
        labels = [classes[i] for i in proba.argmax(axis=1)]
        # Binary: the positive class's probability. More classes: the predicted class's.
        scores = proba[:, 1] if proba.shape[1] == 2 else proba.max(axis=1)
        return np.asarray(scores, dtype=np.float64), labels
    predicted = estimator.predict(inputs)
    return np.asarray(predicted, dtype=np.float64), list(predicted)


def column(values: Any, kind: str, is_score: bool) -> np.ndarray:
    """One output column of shape [rows, 1] in its config data type (scores converted as SIE's
    scorer_io.convert does: bool at 0.5, integers rounded, strings as text)."""
    if kind == "TYPE_STRING":
        return np.array([[str(_plain(v)).encode("utf-8")] for v in values], dtype=np.object_)
    if kind == "TYPE_BOOL":
        flags = [float(v) >= 0.5 if is_score else bool(_plain(v)) for v in values]
        return np.array(flags, dtype=np.bool_).reshape(-1, 1)
    if kind in ("TYPE_INT32", "TYPE_INT64"):
        return np.array([round(float(_plain(v))) for v in values], dtype=NUMPY_TYPES[kind]).reshape(-1, 1)
    return np.array([float(_plain(v)) for v in values], dtype=NUMPY_TYPES[kind]).reshape(-1, 1)


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import sklearn

        config = json.loads(args["model_config"])
        given = parameters(config)
        data = read_checked(given["sie_model_path"], given["sie_sha256"], int(given["sie_max_bytes"]))
        self.estimator = load_estimator(data, json.loads(given["sie_trusted_types"]))
        # The estimator's hyper-parameters were checked when it was fitted; its inputs are checked by SIE's
        # sidecar and here. Input checks (finite values, shapes) stay on.
        sklearn.set_config(skip_parameter_validation=True)
        self.inputs = [(i["name"], i["data_type"]) for i in config["input"]]
        outputs = [(o["name"], o["data_type"]) for o in config["output"]]
        self.first = outputs[0]
        self.label = next((o for o in outputs[1:] if o[0] == LABEL), None)

    def execute(self, requests: list[Any]) -> list[Any]:
        columns: list[tuple[str, str, np.ndarray]] = []
        sizes: list[int] = []
        try:
            for name, kind in self.inputs:
                parts = [pb_utils.get_input_tensor_by_name(r, name).as_numpy().reshape(-1) for r in requests]
                if not sizes:
                    sizes = [len(p) for p in parts]
                columns.append((name, kind, np.concatenate(parts)))
        except Exception as exc:  # a tensor missing or of another shape: the request's to fix
            return [self._error(f"inputs: {exc}", invalid=True) for _ in requests]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        try:
            scores, labels = score(self.estimator, features(columns))
        except RowError as exc:
            return [self._error(str(exc), invalid=True) for _ in requests]
        except ValueError as exc:
            # sklearn refuses NaN (an optional float left out): the request's to fix, naming the fields.
            absent = missing(columns, starts)
            if not absent:
                return [self._error(f"the estimator failed: {exc}") for _ in requests]
            more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
            message = (
                f"{', '.join(absent[:5])}{more}: left out, and this model cannot score missing values; "
                "send every input field"
            )
            return [self._error(message, invalid=True) for _ in requests]
        responses = []
        for start, size in zip(starts, sizes):
            end = start + size
            tensors = [pb_utils.Tensor(self.first[0], column(scores[start:end], self.first[1], True))]
            if self.label is not None:
                tensors.append(pb_utils.Tensor(self.label[0], column(labels[start:end], self.label[1], False)))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def _error(self, message: str, invalid: bool = False) -> Any:
        code = pb_utils.TritonError.INVALID_ARG if invalid else pb_utils.TritonError.INTERNAL
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))

    def finalize(self) -> None:
        self.estimator = None
