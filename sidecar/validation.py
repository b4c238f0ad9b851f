"""Checking request bodies against a ModelService's input_schema (pure).

The schema is compiled once at start into a tuple of `_Field` checks, so a request costs one
strict JSON parse (sie.strict_json) and one pass over the declared fields. The first problem found is reported (field and
reason); a body that breaks the schema never reaches the worker.

Rules, per FieldSpec type:
  string           a JSON string; min_length/max_length count characters
  int32, int64     a JSON integer (not a bool, not 1.0) within the type's bounds and `range`
  float32, float64 a finite JSON number (integers accepted) within the type's bounds and `range`
  bool             true or false
  array            a JSON array; min_length/max_length count items
  object           a JSON object
A field whose value is null counts as absent. `enum` compares values of the same kind only, so
`true` never matches an enum entry `1`. Extra fields are allowed unless allow_extra_fields is false.

`sampling_problem` holds the generation endpoints' sampling parameters to the ranges SGLang and vLLM
accept, whatever the input_schema says: top_p in (0, 1] and temperature in [0, TEMPERATURE_MAX] (they
set no upper bound; past 100 the distribution is flat, and an input is bounded where it enters), where
each endpoint reads them (/generate: `sampling_params`, one object or a list of them; the OpenAI paths:
the top level). SIE's torch worker refuses the same (node_host/backends/runtime/bodies.py; a test holds
the two to agreement); the sidecar refuses first, so a request that can only fail never takes a slot.
"""

from __future__ import annotations

import builtins
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

from sie import strict_json
from sie.errors import InputError
from sie.records import json_kind
from sie.spec import INFERENCE_PATHS, FieldSpec, IOSchema, ServiceType

_INT_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_FLOAT32_MAX = 3.4028234663852886e38
_TYPE_NAMES = {
    "string": "a string",
    "int32": "an integer",
    "int64": "an integer",
    "float32": "a number",
    "float64": "a number",
    "bool": "true or false",
    "array": "an array",
    "object": "an object",
}


@dataclass(frozen=True)
class Violation:
    """Why a body was refused. `field` is "" when the body as a whole is wrong."""

    field: str
    reason: str


@dataclass(frozen=True)
class _Field:
    name: str
    type: str
    required: bool
    min_length: int | None
    max_length: int | None
    low: float | None
    high: float | None
    enum: tuple[str | int | float, ...] | None  # a tuple, not a set: a set would merge 1 and True
    # The common case decided in one comparison: a value whose exact type is in `plain` and that lies in
    # [plain_low, plain_high] passes every rule of this field (numbers without an enum). Anything else
    # takes `_check_value`, which also says why a value is refused. NaN fails both comparisons, and the
    # bounds are finite, so an infinity does too.
    plain: tuple[builtins.type, ...] = ()  # (the field `type` above hides the builtin here)
    plain_low: float = 0.0
    plain_high: float = 0.0


@dataclass(frozen=True)
class CompiledSchema:
    fields: tuple[_Field, ...]
    names: frozenset[str]
    allow_extra_fields: bool


def compile_schema(schema: IOSchema | None) -> CompiledSchema | None:
    """None when there is nothing to check (no schema), so the hot path can skip parsing."""
    if schema is None:
        return None
    fields = tuple(_compile_field(f) for f in schema.fields)
    if not fields and schema.allow_extra_fields:
        return None
    return CompiledSchema(fields, frozenset(f.name for f in fields), schema.allow_extra_fields)


def _compile_field(spec: FieldSpec) -> _Field:
    low: float | None = None
    high: float | None = None
    if spec.type in _INT_BOUNDS:
        low, high = _INT_BOUNDS[spec.type]
    elif spec.type == "float32":
        low, high = -_FLOAT32_MAX, _FLOAT32_MAX
    if spec.range is not None:
        low = spec.range[0] if low is None else max(low, spec.range[0])
        high = spec.range[1] if high is None else min(high, spec.range[1])
    enum = tuple(spec.enum) if spec.enum is not None else None
    plain: tuple[type, ...] = ()
    if enum is None and spec.type in _INT_BOUNDS:
        plain = (int,)  # not bool: type(True) is bool
    elif enum is None and spec.type in ("float32", "float64"):
        plain = (float, int)
    return _Field(
        spec.name,
        spec.type,
        spec.required,
        spec.min_length,
        spec.max_length,
        low,
        high,
        enum,
        plain,
        -sys.float_info.max if low is None else low,
        sys.float_info.max if high is None else high,
    )


def check_body(schema: CompiledSchema, body: bytes | None) -> Violation | None:
    """Parse `body` as JSON and check it; None when it is acceptable."""
    if not body:
        return Violation("", "the body is empty; this model expects a JSON object")
    try:
        doc = strict_json.loads(body)
    except InputError as exc:
        return Violation("", f"{exc}; send a JSON object with Content-Type: application/json")
    return check_document(schema, doc)


def check_document(schema: CompiledSchema, doc: Any) -> Violation | None:
    if not isinstance(doc, dict):
        return Violation("", f"the body must be a JSON object, got {json_kind(doc)}")
    for field in schema.fields:
        value = doc.get(field.name)
        if value is None:
            if field.required:
                return Violation(field.name, "required field is missing")
            continue
        if type(value) in field.plain and field.plain_low <= value <= field.plain_high:
            continue
        problem = _check_value(field, value)
        if problem is not None:
            return Violation(field.name, problem)
    if not schema.allow_extra_fields and not schema.names.issuperset(doc):
        for key in doc:
            if key not in schema.names:
                allowed = ", ".join(sorted(schema.names)) or "none"
                return Violation(key, f"unknown field; this model accepts only: {allowed}")
    return None


def _check_value(field: _Field, value: Any) -> str | None:
    kind = field.type
    if kind == "string":
        if not isinstance(value, str):
            return _wrong_type(field, value)
        return _check_size(field, len(value), "characters") or _check_enum(field, value)
    if kind == "array":
        if not isinstance(value, list):
            return _wrong_type(field, value)
        return _check_size(field, len(value), "items")
    if kind == "bool":
        if not isinstance(value, bool):
            return _wrong_type(field, value)
        return _check_enum(field, value)
    if kind == "object":
        return None if isinstance(value, dict) else _wrong_type(field, value)
    # Numbers. bool is a subclass of int in Python but not a number in JSON.
    if isinstance(value, bool):
        return _wrong_type(field, value)
    if kind in _INT_BOUNDS:
        if not isinstance(value, int):
            return _wrong_type(field, value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            return f"must be a finite number, got {value}"
    elif not isinstance(value, int):
        return _wrong_type(field, value)
    if (field.low is not None and value < field.low) or (field.high is not None and value > field.high):
        return f"{value} is outside the allowed range [{_num(field.low)}, {_num(field.high)}]"
    return _check_enum(field, value)


def _check_size(field: _Field, size: int, unit: str) -> str | None:
    if field.max_length is not None and size > field.max_length:
        return f"has {size} {unit}, more than max_length {field.max_length}"
    if field.min_length is not None and size < field.min_length:
        return f"has {size} {unit}, fewer than min_length {field.min_length}"
    return None


def _check_enum(field: _Field, value: Any) -> str | None:
    if field.enum is None:
        return None
    # Same-kind comparison: 1 == True in Python, but a JSON true is not the number 1.
    if any(value == item and isinstance(item, bool) == isinstance(value, bool) for item in field.enum):
        return None
    allowed = ", ".join(json.dumps(item) for item in sorted(field.enum, key=str))
    return f"{json.dumps(value)} is not one of the allowed values: {allowed}"


def _wrong_type(field: _Field, value: Any) -> str:
    precise = "" if field.type in ("string", "array", "object") else f" ({field.type})"  # int32 vs int64 etc.
    return f"must be {_TYPE_NAMES[field.type]}{precise}, got {json_kind(value)}"


def _num(value: float | None) -> str:
    if value is None:
        return "-inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else f"{value:g}"


# ---- sampling parameters of the generation endpoints ----------------------------------------------

TEMPERATURE_MAX = 100.0  # the worker's bound too (runtime/bodies.py): past it the distribution is flat
_GENERATION_PATHS = frozenset(INFERENCE_PATHS[ServiceType.LLM])


def sampling_problem(path: str, doc: dict[str, Any]) -> Violation | None:
    """The first sampling parameter of a generation request outside its range; None for other paths.

    top_p 0 keeps no token to sample from (SGLang and vLLM refuse it; for greedy decoding send
    temperature 0); a temperature near 0 is accepted and means greedy."""
    if path not in _GENERATION_PATHS:
        return None
    if path != "/generate":
        return _sampling_values(doc, "")
    params = doc.get("sampling_params")
    if isinstance(params, dict):
        return _sampling_values(params, "sampling_params.")
    if isinstance(params, list):
        for i, each in enumerate(params):
            problem = _sampling_values(each, f"sampling_params[{i}].") if isinstance(each, dict) else None
            if problem is not None:
                return problem
    return None  # other shapes are token_problem's to refuse (sidecar/proxy.py)


def _sampling_values(params: dict[str, Any], where: str) -> Violation | None:
    for key, low, high, open_low in (("temperature", 0.0, TEMPERATURE_MAX, False), ("top_p", 0.0, 1.0, True)):
        value = params.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return Violation(where + key, f"must be a number, got {json_kind(value)}")
        # NaN and the infinities fail these comparisons too.
        if not ((low < value) if open_low else (low <= value)) or not value <= high:
            interval = f"({_num(low)}, {_num(high)}]" if open_low else f"[{_num(low)}, {_num(high)}]"
            hint = "; for greedy decoding send temperature 0" if key == "top_p" else ""
            return Violation(where + key, f"{value} is outside {interval}{hint}")
    return None
