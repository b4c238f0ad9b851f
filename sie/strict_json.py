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

Most bodies take a fast path: orjson parses them, 4-5x faster than the stdlib with the hooks above, which
ran once per number and object and were a tenth of the Kafka connector's CPU and of a scorer worker's.
Its answer is used only where it must equal the strict parser's:
- orjson refuses what the hooks refuse except two things, which the fast path checks for itself. It reads
  integers past 64 bits as floats, so a body with a run of 19 or more digits takes the strict path (18
  digits always fit). And it keeps the last of duplicate keys. Every key is followed by a colon outside
  any string, and orjson writes the document back with one colon per key plus the colons of its
  strings; so, unless a string spells a character as `\\u003_` (a colon is `\\u003a`: then the strict path), the
  document written back has as many colons as the body exactly when no key was dropped.
- Whatever orjson refuses takes the strict path, which accepts it or says precisely why not.
`tests/unit/sie/test_strict_input.py` holds the two paths to the same answers.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from sie.errors import InputError

MAX_DEPTH = 64
MAX_INT = 2**63 - 1
MIN_INT = -(2**63)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_BOM = "\ufeff".encode()
# Digits to b"1", everything else to b"0": a run of 19 digits is then a plain substring search (a regex
# like [0-9]{19} tries every position and cost more than orjson's whole parse).
_DIGITS = bytes(ord("1") if i in b"0123456789" else ord("0") for i in range(256))
_NINETEEN_DIGITS = b"1" * 19


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
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node)
            if type(child) is dict or type(child) is list
        ]
    return deepest


def _fast(data: bytes) -> tuple[bool, Any]:
    """(True, document) when orjson's reading of `data` is the strict parser's; (False, None) when the
    strict path must decide (see the module's docstring)."""
    if _NINETEEN_DIGITS in data.translate(_DIGITS) or b"\\u003" in data:
        return False, None
    try:
        doc = orjson.loads(data)  # refuses lone surrogates, NaN, infinities and invalid UTF-8 itself
    except orjson.JSONDecodeError:
        return False, None
    colons = data.count(b":")
    if colons and orjson.dumps(doc).count(b":") != colons:
        return False, None  # a duplicate key, most likely: the strict path names it
    return True, doc


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


def _too_deep(doc: Any, text: bytes | str, max_depth: int) -> bool:
    if isinstance(text, bytes):
        brackets = text.count(b"[") + text.count(b"{")
    else:
        brackets = text.count("[") + text.count("{")
    return brackets > max_depth and _depth(doc, max_depth) > max_depth


def loads(
    data: bytes | str, *, max_depth: int = MAX_DEPTH, max_bytes: int | None = None, what: str = "the body"
) -> Any:
    """Parse untrusted JSON. Raises InputError naming the problem (type `invalid_json` or `body_too_large`)."""
    if max_bytes is not None and len(data) > max_bytes:
        raise InputError("body_too_large", f"{what} has {len(data)} bytes, more than the {max_bytes} allowed", 413)
    body = _as_utf8(data)
    if body is not None:
        done, doc = _fast(body[3:] if body.startswith(_BOM) else body)
        if done:
            if _too_deep(doc, body, max_depth):
                raise InputError("invalid_json", f"{what} is nested deeper than {max_depth} levels")
            return doc
    return _strict_loads(data, max_depth, what)


def _as_utf8(data: bytes | str) -> bytes | None:
    if isinstance(data, bytes):
        return data
    try:
        return data.encode("utf-8") if isinstance(data, str) else None
    except UnicodeEncodeError:  # a lone surrogate: the strict path says so
        return None


def _strict_loads(data: bytes | str, max_depth: int, what: str) -> Any:
    """The strict path: the stdlib's parser with the hooks above. It decides every body the fast path
    does not take, and says why it refuses one."""
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
    if _too_deep(doc, text, max_depth):
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
