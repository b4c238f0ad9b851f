"""Typed rows to estimator features and scores back to typed rows, for the sklearn scorer (pure).

Input: when the input schema has exactly one string field, the estimator gets the list of those
strings (a text pipeline such as HashingVectorizer + LogisticRegression). Otherwise it gets a 2D array
of the numeric input fields (int*, float*, bool) in schema order; other fields are not features.

Output: the first output field gets the score (the positive-class probability of a binary classifier),
converted to its type and clamped to its range; a field named `label` gets the predicted class. Other
output fields are not produced.

The sidecar has validated the input schema already; these checks are the worker's own guard, with
errors that name the row and the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from node_host.backends.protocol import BadRequest
from sie.spec import FieldSpec

NUMERIC = ("int32", "int64", "float32", "float64", "bool")
DEFAULT_INPUT = (FieldSpec(name="text", type="string"),)
DEFAULT_OUTPUT = (FieldSpec(name="score", type="float32", range=(0.0, 1.0)),)


def is_text_input(fields: Sequence[FieldSpec]) -> bool:
    return len(fields) == 1 and fields[0].type == "string"


def features(rows: Sequence[dict[str, Any]], fields: Sequence[FieldSpec]) -> list[str] | list[list[float]]:
    """The estimator input for these rows. Raises BadRequest naming `instances[i].field`."""
    if is_text_input(fields):
        name = fields[0].name
        texts = []
        for i, row in enumerate(rows):
            value = row.get(name)
            if not isinstance(value, str):
                raise BadRequest(f"instances[{i}].{name}: expected a string, got {_kind(value)}")
            texts.append(value)
        return texts
    numeric = [f for f in fields if f.type in NUMERIC]
    if not numeric:
        raise BadRequest(
            "the input schema has no numeric field and is not a single string field; the sklearn scorer "
            "takes one string field (text pipelines) or numeric fields (a feature vector)"
        )
    matrix = []
    for i, row in enumerate(rows):
        vector = []
        for spec in numeric:
            value = row.get(spec.name)
            if value is None:
                if spec.required:
                    raise BadRequest(f"instances[{i}].{spec.name}: required")
                vector.append(math.nan)  # optional and absent: the estimator must handle missing values
            elif isinstance(value, bool) or isinstance(value, (int, float)):
                vector.append(float(value))
            else:
                raise BadRequest(f"instances[{i}].{spec.name}: expected a number, got {_kind(value)}")
        matrix.append(vector)
    return matrix


def absent_fields(rows: Sequence[dict[str, Any]], fields: Sequence[FieldSpec]) -> list[str]:
    """`instances[i].field` for every optional numeric field a row leaves out (it reached the estimator as
    NaN), in row order; empty for a text scorer."""
    if is_text_input(fields):
        return []
    optional = [f.name for f in fields if f.type in NUMERIC and not f.required]
    return [f"instances[{i}].{name}" for i, row in enumerate(rows) for name in optional if row.get(name) is None]


def absent_message(absent: Sequence[str]) -> str:
    """What a client is told when the estimator refused the missing values of `absent` (not empty)."""
    more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
    return (
        f"{', '.join(absent[:5])}{more}: left out, and this model cannot score missing values; send "
        "every input field (the schema has them optional, but this estimator needs them)"
    )


def convert(value: Any, spec: FieldSpec) -> Any:
    """One output value in the field's type, clamped to its range."""
    if spec.type == "bool":
        return bool(float(value) >= 0.5) if isinstance(value, (int, float)) else bool(value)
    if spec.type in ("float32", "float64"):
        number = float(value)
        return _clamp(number, spec)
    if spec.type in ("int32", "int64"):
        return int(_clamp(float(round(float(value))), spec))
    if spec.type == "string":
        return str(value)
    raise BadRequest(f"output field {spec.name!r} has type {spec.type}, which a scorer cannot produce")


def _clamp(number: float, spec: FieldSpec) -> float:
    if spec.range is not None:
        low, high = spec.range
        number = min(max(number, low), high)
    return number


def outputs(scores: Sequence[float], labels: Sequence[Any] | None, fields: Sequence[FieldSpec]) -> list[dict[str, Any]]:
    first = fields[0]
    label_field = next((f for f in fields[1:] if f.name == "label"), None)
    rows = []
    for i, score in enumerate(scores):
        row = {first.name: convert(score, first)}
        if label_field is not None and labels is not None:
            row[label_field.name] = convert(_plain(labels[i]), label_field)
        rows.append(row)
    return rows


def _plain(value: Any) -> Any:
    """numpy scalars to Python values (json cannot encode numpy.int64)."""
    return value.item() if hasattr(value, "item") else value


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__
