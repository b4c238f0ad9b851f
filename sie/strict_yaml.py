"""YAML from outside a component's boundary: safe types only, no anchors or aliases, bounded size and depth.

Aliases are what turn a 621-byte file into a 58 MB document ("billion laughs"); SIE's files never need
them, so any anchor (`&a`) or alias (`*a`, and so the merge key `<<: *a`) is refused at the event that
names it, before anything is expanded. Every YAML entry point (cluster files, the admin API, spec files,
model packages) reads through `load_all`/`load`.
"""

from __future__ import annotations

from typing import Any

import yaml

from sie.errors import InputError
from sie.strict_json import MAX_DEPTH, _depth

MAX_BYTES = 4 * 1024 * 1024


# The pure-Python loader on purpose: libyaml's CSafeLoader composes nodes in C, where this hook never runs.
class _NoAliasLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]  # types-PyYAML leaves Parser.peek_event unannotated
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            mark = event.start_mark
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise yaml.YAMLError(f"YAML anchors and aliases are not accepted{where}: write the values out")
        return super().compose_node(parent, index)


def _check(doc: Any, what: str) -> Any:
    if _depth(doc, MAX_DEPTH) > MAX_DEPTH:
        raise InputError("invalid_yaml", f"{what} is nested deeper than {MAX_DEPTH} levels")
    return doc


def load_all(text: str | bytes, what: str = "the document", max_bytes: int = MAX_BYTES) -> list[Any]:
    """Every document of a YAML stream. Raises InputError (`invalid_yaml`) naming the problem."""
    if len(text) > max_bytes:
        raise InputError("body_too_large", f"{what} has {len(text)} bytes, more than the {max_bytes} allowed", 413)
    try:
        return [_check(doc, what) for doc in yaml.load_all(text, Loader=_NoAliasLoader)]
    except yaml.YAMLError as exc:
        raise InputError("invalid_yaml", f"{what} is not valid YAML: {exc}") from None
    except RecursionError:
        raise InputError("invalid_yaml", f"{what} is nested deeper than {MAX_DEPTH} levels") from None


def load(text: str | bytes, what: str = "the document", max_bytes: int = MAX_BYTES) -> Any:
    """The single document of a YAML text (None when empty)."""
    docs = load_all(text, what, max_bytes)
    if len(docs) > 1:
        raise InputError("invalid_yaml", f"{what} holds {len(docs)} YAML documents; expected one")
    return docs[0] if docs else None
