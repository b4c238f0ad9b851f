"""Wire records (frozen dataclasses) from untrusted JSON, every field's type and bound checked.

`decode(cls, data, source)` builds `cls` from a parsed JSON value or raises SpecError listing every field
that is wrong (unknown, missing, wrong type, out of bounds), so a bad telemetry record or heartbeat is a
400 naming the field, and never a stored value that breaks a later status call.

Types understood: bool, int, float (ints accepted), str, None in unions, Enum subclasses (by value),
list[X], tuple[X, ...], dict[str, X], nested dataclasses, and Any (kept as parsed; its depth is already
bounded by sie.strict_json). Bounds come from each field's metadata, else the defaults below:

    field(default=0, metadata=bounds(low=0, high=10_000))
    field(default="", metadata=bounds(max_len=253))
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar

from sie.errors import Problem, SpecError

T = TypeVar("T")

MAX_STR = 1024
MAX_ITEMS = 10_000
MAX_NUMBER = 1e18  # any finite figure a record carries is far below this
_MAX_PROBLEMS = 20


def bounds(*, low: float | None = None, high: float | None = None, max_len: int | None = None,
           max_items: int | None = None) -> dict[str, Any]:
    """Field metadata: numeric range, string length, list size."""
    return {"sie_bounds": {"low": low, "high": high, "max_len": max_len, "max_items": max_items}}


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _not_plain_json(value: Any) -> str | None:
    """Why a value kept as parsed (an `Any` field) could not be written back as JSON, if it could not."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return "holds a number that is not finite"
        if isinstance(node, dict):
            if any(not isinstance(k, str) for k in node):
                return "holds an object key that is not a string"
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif not (node is None or isinstance(node, (str, int, float, bool))):
            return f"holds a {type(node).__name__}, which is not JSON"
    return None


class _Bad(Exception):
    def __init__(self, path: str, reason: str):
        self.problem = Problem(path, reason)


def _convert(hint: Any, value: Any, path: str, limits: dict[str, Any], problems: list[Problem]) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        problem = _not_plain_json(value)
        if problem:
            raise _Bad(path, problem)
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise _Bad(path, "must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path, limits, problems)
            except _Bad as exc:
                errors.append(exc)
        raise errors[0] if errors else _Bad(path, f"unexpected {_kind(value)}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Bad(path, f"must be true or false, got {_kind(value)}")
    if hint is int or hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad(path, f"must be {'an integer' if hint is int else 'a number'}, got {_kind(value)}")
        if hint is int and not isinstance(value, int):
            if not (isinstance(value, float) and value.is_integer()):
                raise _Bad(path, f"must be an integer, got {value!r}")
            value = int(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise _Bad(path, "must be a finite number")
        low, high = limits.get("low"), limits.get("high")
        low = -MAX_NUMBER if low is None else low
        high = MAX_NUMBER if high is None else high
        if not low <= value <= high:
            raise _Bad(path, f"{value!r} is outside [{low:g}, {high:g}]")
        return float(value) if hint is float else value
    if hint is str:
        if not isinstance(value, str):
            raise _Bad(path, f"must be a string, got {_kind(value)}")
        limit = limits.get("max_len") or MAX_STR
        if len(value) > limit:
            raise _Bad(path, f"has {len(value)} characters, more than {limit}")
        return value
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            allowed = ", ".join(str(m.value) for m in hint)
            raise _Bad(path, f"must be one of {allowed}, got {value!r}") from None
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _Bad(path, f"must be an array, got {_kind(value)}")
        limit = limits.get("max_items") or MAX_ITEMS
        if len(value) > limit:
            raise _Bad(path, f"has {len(value)} items, more than {limit}")
        item = typing.get_args(hint)[0] if typing.get_args(hint) else Any
        items = [_convert(item, v, f"{path}[{i}]", {}, problems) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(path, f"must be an object, got {_kind(value)}")
        limit = limits.get("max_items") or MAX_ITEMS
        if len(value) > limit:
            raise _Bad(path, f"has {len(value)} entries, more than {limit}")
        _, item = typing.get_args(hint) or (str, Any)
        out = {}
        for key, v in value.items():
            if len(key) > MAX_STR:
                raise _Bad(path, f"has a key of {len(key)} characters, more than {MAX_STR}")
            out[key] = _convert(item, v, f"{path}.{key}", {}, problems)
        return out
    if dataclasses.is_dataclass(hint):
        return _decode(hint, value, path, problems)
    raise TypeError(f"sie.records cannot decode type {hint!r} ({path})")  # a bug in a record, not in the input


def _decode(cls: Any, data: Any, prefix: str, problems: list[Problem]) -> Any:
    if not isinstance(data, dict):
        raise _Bad(prefix, f"must be an object, got {_kind(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            problems.append(Problem(f"{prefix}.{key}" if prefix else str(key)[:64], "unknown field"))
    kwargs = {}
    for name, f in fields.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(Problem(path, "required"))
            continue
        try:
            kwargs[name] = _convert(hints[name], data[name], path, f.metadata.get("sie_bounds", {}), problems)
        except _Bad as exc:
            problems.append(exc.problem)
        if len(problems) >= _MAX_PROBLEMS:
            break
    if problems:
        return None
    return cls(**kwargs)


def decode(cls: type[T], data: Any, source: str) -> T:
    """`cls` from JSON, or SpecError naming every field that is wrong."""
    problems: list[Problem] = []
    try:
        out = _decode(cls, data, "", problems)
    except _Bad as exc:
        problems.append(exc.problem)
        out = None
    if problems or out is None:
        raise SpecError(source, problems[:_MAX_PROBLEMS] or [Problem("", "invalid")])
    return out
