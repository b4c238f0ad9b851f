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
from collections.abc import Callable
from enum import Enum
from functools import cache
from typing import Any, TypeVar

from sie.errors import Problem, SIEError, SpecError

T = TypeVar("T")

MAX_STR = 1024
MAX_ITEMS = 10_000
MAX_NUMBER = 1e18  # any finite figure a record carries is far below this
_MAX_PROBLEMS = 20


def bounds(
    *, low: float | None = None, high: float | None = None, max_len: int | None = None, max_items: int | None = None
) -> dict[str, Any]:
    """Field metadata: numeric range, string length, list size."""
    return {"sie_bounds": {"low": low, "high": high, "max_len": max_len, "max_items": max_items}}


def cut(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, "..." marking the cut: how a sender fits a text to a
    bounded field, or an error message shows a value that came from outside."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in the words an error message uses ("an integer", "null")."""
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


class _Bad(SIEError):  # internal: becomes one Problem of a SpecError
    def __init__(self, path: str, reason: str):
        self.problem = Problem(path, reason)


# A converter checks one value against one field's type and bounds: (value, path, problems) -> value,
# raising _Bad for the value itself; nested records add their own problems to `problems`. Converters are
# built once per record class (`_fields`), so decoding costs no type introspection.
Converter = Callable[[Any, str, list[Problem]], Any]


def _converter(hint: Any, limits: dict[str, Any]) -> Converter:
    origin = typing.get_origin(hint)
    if hint is Any:

        def plain(value: Any, path: str, problems: list[Problem]) -> Any:
            problem = _not_plain_json(value)
            if problem:
                raise _Bad(path, problem)
            return value

        return plain
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        nullable = type(None) in args
        options = [_converter(option, limits) for option in args if option is not type(None)]

        def union(value: Any, path: str, problems: list[Problem]) -> Any:
            if value is None:
                if nullable:
                    return None
                raise _Bad(path, "must not be null")
            first: _Bad | None = None
            for option in options:
                try:
                    return option(value, path, problems)
                except _Bad as exc:
                    first = first or exc
            raise first or _Bad(path, f"unexpected {json_kind(value)}")

        return union
    if hint is bool:

        def boolean(value: Any, path: str, problems: list[Problem]) -> Any:
            if isinstance(value, bool):
                return value
            raise _Bad(path, f"must be true or false, got {json_kind(value)}")

        return boolean
    if hint is int or hint is float:
        low = -MAX_NUMBER if limits.get("low") is None else limits["low"]
        high = MAX_NUMBER if limits.get("high") is None else limits["high"]
        integer = hint is int

        def number(value: Any, path: str, problems: list[Problem]) -> Any:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _Bad(path, f"must be {'an integer' if integer else 'a number'}, got {json_kind(value)}")
            if isinstance(value, float):
                if not math.isfinite(value):
                    raise _Bad(path, "must be a finite number")
                if integer:
                    if not value.is_integer():
                        raise _Bad(path, f"must be an integer, got {value!r}")
                    value = int(value)
            if not low <= value <= high:
                raise _Bad(path, f"{value!r} is outside [{low:g}, {high:g}]")
            return value if integer or isinstance(value, float) else float(value)

        return number
    if hint is str:
        longest = limits.get("max_len") or MAX_STR

        def string(value: Any, path: str, problems: list[Problem]) -> Any:
            if not isinstance(value, str):
                raise _Bad(path, f"must be a string, got {json_kind(value)}")
            if len(value) > longest:
                raise _Bad(path, f"has {len(value)} characters, more than {longest}")
            return value

        return string
    if isinstance(hint, type) and issubclass(hint, Enum):
        members = {m.value: m for m in hint}
        allowed = ", ".join(str(m.value) for m in hint)

        def enum(value: Any, path: str, problems: list[Problem]) -> Any:
            try:
                return members[value]
            except (KeyError, TypeError):
                raise _Bad(path, f"must be one of {allowed}, got {value!r}"[:300]) from None

        return enum
    if origin in (list, tuple):
        item = _converter(typing.get_args(hint)[0] if typing.get_args(hint) else Any, {})
        most = limits.get("max_items") or MAX_ITEMS
        as_tuple = origin is tuple

        def array(value: Any, path: str, problems: list[Problem]) -> Any:
            if not isinstance(value, list):
                raise _Bad(path, f"must be an array, got {json_kind(value)}")
            if len(value) > most:
                raise _Bad(path, f"has {len(value)} items, more than {most}")
            items = [item(v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
            return tuple(items) if as_tuple else items

        return array
    if origin is dict:
        _, value_hint = typing.get_args(hint) or (str, Any)
        item = _converter(value_hint, {})
        most = limits.get("max_items") or MAX_ITEMS

        def mapping(value: Any, path: str, problems: list[Problem]) -> Any:
            if not isinstance(value, dict):
                raise _Bad(path, f"must be an object, got {json_kind(value)}")
            if len(value) > most:
                raise _Bad(path, f"has {len(value)} entries, more than {most}")
            out = {}
            for key, v in value.items():
                if len(key) > MAX_STR:
                    raise _Bad(path, f"has a key of {len(key)} characters, more than {MAX_STR}")
                out[key] = item(v, f"{path}.{key}", problems)
            return out

        return mapping
    if dataclasses.is_dataclass(hint):

        def record(value: Any, path: str, problems: list[Problem]) -> Any:
            return _decode(hint, value, path, problems)

        return record
    raise TypeError(f"sie.records cannot decode type {hint!r}")  # a bug in a record, not in the input


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    convert: Converter
    required: bool


@cache
def _fields(cls: type) -> dict[str, _Field]:
    hints = typing.get_type_hints(cls)
    return {
        f.name: _Field(
            f.name,
            _converter(hints[f.name], f.metadata.get("sie_bounds", {})),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    }


def _decode(cls: Any, data: Any, prefix: str, problems: list[Problem]) -> Any:
    if not isinstance(data, dict):
        raise _Bad(prefix, f"must be an object, got {json_kind(data)}")
    fields = _fields(cls)
    for key in data:
        if key not in fields:
            problems.append(Problem(f"{prefix}.{key}" if prefix else str(key)[:64], "unknown field"))
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.required:
                problems.append(Problem(f"{prefix}.{name}" if prefix else name, "required"))
            continue
        try:
            kwargs[name] = f.convert(data[name], f"{prefix}.{name}" if prefix else name, problems)
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
    out: T | None
    try:
        out = _decode(cls, data, "", problems)
    except _Bad as exc:
        problems.append(exc.problem)
        out = None
    if problems or out is None:
        raise SpecError(source, problems[:_MAX_PROBLEMS] or [Problem("", "invalid")])
    return out
