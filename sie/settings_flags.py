"""Command-line flags and cluster-file sections derived from a settings dataclass (DESIGN §9).

Each default is stated once, in the dataclass; each field's help is the docstring under it (the
attribute-docstring convention, read from the class source with `ast`). For a dataclass and a prefix
(`weights`), every field `queue_full` becomes the flag `--weights-queue-full` with the field's type, and
the cluster file's mapping `{queue_full: 32}` becomes the same flag, so both routes share one parser:

    add_flags(parser, WeightSettings, "weights")         # --weights-<field> ... (default: not given)
    from_args(WeightSettings, args, "weights", base)     # base with only the given flags replaced
    from_mapping(WeightSettings, {...}, source, path)    # a cluster-file section, SpecError naming the key
    to_argv({...}, "weights")                            # that section as flags for a child process

Only scalar fields (bool, int, float, str) are supported: a settings section is flat.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from sie.errors import Problem, SpecError

__all__ = ["add_flags", "field_docs", "flag_name", "from_args", "from_mapping", "mapping_problems", "to_argv"]

T = TypeVar("T")
_SCALARS = (bool, int, float, str)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right under its annotated assignment)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    types = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if kind not in _SCALARS:
            raise TypeError(
                f"{cls.__name__}.{f.name}: only {', '.join(t.__name__ for t in _SCALARS)} fields "
                f"can be flags, not {kind!r}"
            )
        types[f.name] = kind
    return types


def flag_name(prefix: str, field: str) -> str:
    return f"--{prefix}-{field.replace('_', '-')}"


def _dest(prefix: str, field: str) -> str:
    return f"{prefix}_{field}"


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str, title: str | None = None) -> None:
    """One flag per field of `cls`, in an argument group; a flag not given stays None (see from_args)."""
    docs = field_docs(cls)
    defaults = cls()
    group = parser.add_argument_group(title or f"{cls.__name__} ({flag_name(prefix, '<field>')})")
    for name, kind in _field_types(cls).items():
        default = getattr(defaults, name)
        # argparse %-formats help; the docstrings say "2% of ...".
        text = f"{docs.get(name, '')} (default {default!r})".strip().replace("%", "%%")
        group.add_argument(
            flag_name(prefix, name),
            dest=_dest(prefix, name),
            default=None,
            type=_parse_bool if kind is bool else kind,
            metavar=kind.__name__.upper(),
            help=text,
        )


def from_args(cls: type[T], args: argparse.Namespace, prefix: str, base: T | None = None) -> T:
    """`base` (default: cls()) with the fields whose flags were given replaced. The dataclass's own checks
    (ValueError from __post_init__) become a SystemExit naming the flags, as argparse's errors do."""
    given = {
        name: getattr(args, _dest(prefix, name))
        for name in _field_types(cls)
        if getattr(args, _dest(prefix, name), None) is not None
    }
    start = base if base is not None else cls()
    try:
        return dataclasses.replace(start, **given) if given else start  # type: ignore[type-var]
    except ValueError as exc:
        flags = ", ".join(flag_name(prefix, name) for name in given)
        raise SystemExit(f"{flags}: {exc}") from None


def _type_ok(kind: type, value: Any) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def mapping_problems(cls: type, mapping: Mapping[str, Any], path: str) -> list[Problem]:
    """Unknown keys and values of the wrong type in a settings section, each naming its key."""
    types = _field_types(cls)
    problems = []
    for key, value in mapping.items():
        kind = types.get(key)
        if kind is None:
            near = ", ".join(sorted(types))
            problems.append(Problem(f"{path}.{key}", f"unknown setting; the settings here are: {near}"))
        elif not _type_ok(kind, value):
            want = "a number" if kind is float else f"a {kind.__name__}"
            problems.append(Problem(f"{path}.{key}", f"expected {want}, got {str(value)[:64]!r}"))
    return problems


def from_mapping(cls: type[T], mapping: Mapping[str, Any], source: str, path: str, base: T | None = None) -> T:
    """`base` (default: cls()) with the section's keys replaced; SpecError(source) naming every bad key."""
    problems = mapping_problems(cls, mapping, path)
    if problems:
        raise SpecError(source, problems)
    types = _field_types(cls)
    values = {k: float(v) if types[k] is float else v for k, v in mapping.items()}
    start = base if base is not None else cls()
    try:
        return dataclasses.replace(start, **values) if values else start  # type: ignore[type-var]
    except ValueError as exc:
        raise SpecError(source, [Problem(path, str(exc))]) from None


def to_argv(mapping: Mapping[str, Any], prefix: str) -> list[str]:
    """A settings section as the flags add_flags derives, for the process that owns the dataclass. Keys are
    not checked here (that process refuses unknown flags); values are written so its parser reads them back."""
    argv: list[str] = []
    for key, value in mapping.items():
        text = (
            ("true" if value else "false")
            if isinstance(value, bool)
            else repr(value)
            if isinstance(value, float)
            else str(value)
        )
        argv.append(f"{flag_name(prefix, key)}={text}")  # one token: a negative value is not read as a flag
    return argv
