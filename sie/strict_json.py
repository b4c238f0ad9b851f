"""JSON from outside a component's boundary, parsed with bounds (DESIGN §10: input is bounded where it enters).

`loads` refuses, with an `InputError` (400) that says what was wrong:
- bytes that are not UTF-8, and lone surrogates (`"\\ud800"`), which Python's json accepts but no
  encoder can write back, so they would fail later as a 500;
- nesting deeper than `max_depth` (Python's own limit is a RecursionError near 1000);
- integers beyond 64 bits, numbers that overflow to infinity, and NaN/Infinity, which JSON does not
  have (Python's json accepts them by default);
- duplicate keys in one object: parsers disagree on which one wins (Envoy routes on one `model`, a
  worker could read the other), so an ambiguous body is refused instead of interpreted;
- bodies over `max_bytes` (413).

The checks beyond `json.loads` cost a scan only when the body could break them: the depth walk runs only
when the body has more brackets than `max_depth`, the surrogate walk only when it has a surrogate escape.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from sie.errors import InputError

MAX_DEPTH = 64
MAX_INT = 2**63 - 1
MIN_INT = -(2**63)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON; send a finite number")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise ValueError(f"integer {text[:24]}... has more digits than a 64-bit integer holds")
    value = int(text)
    if not MIN_INT <= value <= MAX_INT:
        raise ValueError(f"integer {text} does not fit in 64 bits")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} overflows a 64-bit float")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key[:64]!r} appears twice in one object")
            seen.add(key)
    return out


# One decoder for every call: `json.loads` with hooks builds a new JSONDecoder each time, which cost
# more than the parse itself for the small bodies a scorer gets (3 of 4.7 us for a 90-byte object).
_DECODER = json.JSONDecoder(
    parse_constant=_refuse_constant,
    parse_int=_bounded_int,
    parse_float=_finite_float,
    object_pairs_hook=_no_duplicates,
)


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed document (a top-level container is 1), stopping as soon as it passes
    `limit`. Level by level and containers only: no recursion, and no work for the scalars' sake."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, level = 0, [value]
    while level:
        deepest += 1
        if deepest > limit:
            return deepest
        below = []
        for node in level:
            for child in node.values() if isinstance(node, dict) else node:
                if isinstance(child, (dict, list)):
                    below.append(child)
        level = below
    return deepest


def _lone_surrogate(value: Any) -> str | None:
    """A string (value or key) of the document that is not encodable as UTF-8, if any."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return node
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def loads(
    data: bytes | str, *, max_depth: int = MAX_DEPTH, max_bytes: int | None = None, what: str = "the body"
) -> Any:
    """Parse untrusted JSON. Raises InputError naming the problem (type `invalid_json` or `body_too_large`)."""
    if max_bytes is not None and len(data) > max_bytes:
        raise InputError("body_too_large", f"{what} has {len(data)} bytes, more than the {max_bytes} allowed", 413)
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError("invalid_json", f"{what} is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    else:
        text = data
    if text.startswith("\ufeff"):
        text = text[1:]  # a UTF-8 byte order mark is allowed before JSON text (RFC 8259 says ignore it)
    try:
        doc = _DECODER.decode(text)
    except RecursionError:
        raise InputError("invalid_json", f"{what} is nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            "invalid_json", f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ValueError as exc:  # from the hooks above
        raise InputError("invalid_json", f"{what} is not acceptable JSON: {exc}") from None
    if text.count("[") + text.count("{") > max_depth and _depth(doc, max_depth) > max_depth:
        raise InputError("invalid_json", f"{what} is nested deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text) is not None:
        bad = _lone_surrogate(doc)
        if bad is not None:
            raise InputError(
                "invalid_json",
                f"{what} holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), "
                "which is not a character; send valid Unicode",
            )
    return doc


def loads_object(data: bytes | str, **kwargs: Any) -> dict[str, Any]:
    """`loads`, and the document must be a JSON object."""
    doc = loads(data, **kwargs)
    if not isinstance(doc, dict):
        what = kwargs.get("what", "the body")
        raise InputError("invalid_json", f"{what} must be a JSON object, got {type(doc).__name__}")
    return doc
