"""Command-line flags and cluster-file sections derived from a settings dataclass (DESIGN §9).

Each default is stated once, in the dataclass; each field's help is the docstring under it (the
attribute-docstring convention, read from the class source with `ast`). For a dataclass and a prefix
(`weights`), every field `queue_full` becomes the flag `--weights-queue-full` with the field's type, and
the cluster file's mapping `{queue_full: 32}` becomes the same flag, so both routes share one parser.
With the empty prefix the flag is `--queue-full`: a component's own settings keep their plain names.

    add_flags(parser, WeightSettings, "weights")         # --weights-<field> ... (default: not given)
    from_args(WeightSettings, args, "weights", base)     # base with only the given flags replaced
    from_mapping(WeightSettings, {...}, source, path)    # a cluster-file section, SpecError naming the key
    to_argv({...}, "weights")                            # that section as flags for a child process

A field's type is one of bool, int, float, str, Path, an Enum, a Literal of strings, or one of those
`| None`. A field whose type is a dataclass is a nested section and is not a flag here (add its own
flags, with its own prefix). A field with no default is a required flag. Field metadata adjusts one flag:

    flag: str         its name, where an existing command line fixes it ("--namespace")
    parse: callable   argparse's `type` (a HOST:PORT parser, say); its ValueError is argparse's message
    metavar: str      what the help shows for the value
    cli: bool         False: not a flag and not in a cluster-file section (set by the caller)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from sie.errors import Problem, SpecError

__all__ = ["add_flags", "field_docs", "flag_name", "from_args", "from_mapping", "mapping_problems", "to_argv"]

T = TypeVar("T")
_SCALARS = (bool, int, float, str, Path)


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


@dataclasses.dataclass(frozen=True)
class _Flag:
    """One field as a flag: its name, how its text is read, and what the help says about its values."""

    field: str
    name: str
    kind: Any  # the scalar type, the Enum class, or a tuple of Literal choices
    optional: bool
    required: bool
    default: Any
    parse: Callable[[str], Any] | None
    metavar: str | None

    def read(self, text: str) -> Any:
        if self.parse is not None:
            return self.parse(text)
        if self.kind is bool:
            return _parse_bool(text)
        if isinstance(self.kind, tuple):
            if text not in self.kind:
                raise argparse.ArgumentTypeError(f"expected one of {', '.join(self.kind)}, got {text!r}")
            return text
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            try:
                return self.kind(text)
            except ValueError:
                allowed = ", ".join(str(m.value) for m in self.kind)
                raise argparse.ArgumentTypeError(f"expected one of {allowed}, got {text!r}") from None
        return self.kind(text)

    def accepts(self, value: Any) -> bool:
        """Whether a cluster-file value (from YAML: no Path, no Enum) has this field's type."""
        if value is None:
            return self.optional
        kind = self.kind
        if isinstance(kind, tuple):
            return value in kind
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return value in {m.value for m in kind}
        if kind is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if kind is Path:
            return isinstance(value, str)
        return isinstance(value, kind)

    def convert(self, value: Any) -> Any:
        """A cluster-file value (accepted) as the field's own type."""
        if value is None or isinstance(self.kind, tuple):
            return value
        if self.kind is float:
            return float(value)
        if self.kind is Path or (isinstance(self.kind, type) and issubclass(self.kind, enum.Enum)):
            return self.kind(value)
        return value

    def wanted(self) -> str:
        kind = self.kind
        if isinstance(kind, tuple):
            text = "one of " + ", ".join(kind)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            text = "one of " + ", ".join(str(m.value) for m in kind)
        elif kind is float:
            text = "a number"
        elif kind is Path:
            text = "a path"
        else:
            text = f"a {kind.__name__}"
        return text + (" or null" if self.optional else "")


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _unwrap(cls: type, name: str, kind: Any) -> tuple[Any, bool]:
    """(the scalar type, Enum class or Literal choices, whether None is allowed)."""
    optional = False
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        optional = len(args) < len(typing.get_args(kind))
        if len(args) != 1:
            raise TypeError(f"{cls.__name__}.{name}: a union other than `T | None` cannot be a flag")
        kind = args[0]
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError(f"{cls.__name__}.{name}: only a Literal of strings can be a flag")
        return tuple(choices), optional
    if kind in _SCALARS or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        return kind, optional
    raise TypeError(
        f"{cls.__name__}.{name}: a flag is bool, int, float, str, Path, an Enum or a Literal (or one of "
        f"those | None), not {kind!r}; mark the field metadata={{'cli': False}} if it is set another way"
    )


def _flags(cls: type, prefix: str) -> list[_Flag]:
    hints = typing.get_type_hints(cls)
    flags = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True) or _is_section(hints[f.name]):
            continue
        kind, optional = _unwrap(cls, f.name, hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        flags.append(
            _Flag(
                field=f.name,
                name=f.metadata.get("flag") or flag_name(prefix, f.name),
                kind=kind,
                optional=optional,
                required=default is dataclasses.MISSING,
                default=default,
                parse=f.metadata.get("parse"),
                metavar=f.metadata.get("metavar"),
            )
        )
    return flags


def flag_name(prefix: str, field: str) -> str:
    stem = field.replace("_", "-")
    return f"--{prefix}-{stem}" if prefix else f"--{stem}"


def _dest(prefix: str, field: str) -> str:
    return f"{prefix}_{field}" if prefix else field


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _typed(flag: _Flag) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return flag.read(text)
        except ValueError as exc:  # argparse shows an ArgumentTypeError's text, and only a bare "invalid" else
            raise argparse.ArgumentTypeError(str(exc) or f"invalid value {text!r}") from None

    read.__name__ = flag.field  # argparse names the type in its fallback message
    return read


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, prefix: str, title: str | None = None
) -> None:
    """One flag per field of `cls`, in an argument group (or in `parser` itself if it is a group, or when
    title is ""); a flag not given stays None (see from_args). A bool flag alone means true."""
    docs = field_docs(cls)
    if isinstance(parser, argparse._ArgumentGroup) or title == "":
        group = parser
    else:
        group = parser.add_argument_group(title or f"{cls.__name__} ({flag_name(prefix, '<field>')})")
    for flag in _flags(cls, prefix):
        doc = docs.get(flag.field, "")
        if flag.required:
            text = f"{doc} (required)".strip()
        elif flag.default is None or flag.default == "":
            text = doc
        else:
            shown = flag.default.value if isinstance(flag.default, enum.Enum) else flag.default
            text = f"{doc} (default {shown!r})".strip()
        extra: dict[str, Any] = {}
        if flag.kind is bool and flag.parse is None:
            extra = {"nargs": "?", "const": True}
        if isinstance(flag.kind, tuple):
            metavar = "{" + ",".join(flag.kind) + "}"
        elif isinstance(flag.kind, type) and issubclass(flag.kind, enum.Enum):
            metavar = "{" + ",".join(str(m.value) for m in flag.kind) + "}"
        else:
            metavar = "PATH" if flag.kind is Path else flag.kind.__name__.upper()
        group.add_argument(
            flag.name,
            dest=_dest(prefix, flag.field),
            default=None,
            required=flag.required,
            type=_typed(flag),
            metavar=flag.metavar or metavar,
            help=text.replace("%", "%%"),  # argparse %-formats help; the docstrings say "2% of ..."
            **extra,
        )


def given(cls: type, args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The fields of `cls` whose flags were given, with their values."""
    return {
        flag.field: getattr(args, _dest(prefix, flag.field))
        for flag in _flags(cls, prefix)
        if getattr(args, _dest(prefix, flag.field), None) is not None
    }


def from_args(cls: type[T], args: argparse.Namespace, prefix: str, base: T | None = None, **nested: Any) -> T:
    """`base` (default: cls()) with the fields whose flags were given replaced, and `nested` sections set.
    The dataclass's own checks (ValueError from __post_init__) become a SystemExit naming the flags, as
    argparse's errors do."""
    values = {**given(cls, args, prefix), **nested}
    try:
        if base is None:
            return cls(**values)
        return dataclasses.replace(base, **values) if values else base  # type: ignore[type-var]
    except ValueError as exc:
        flags = ", ".join(flag.name for flag in _flags(cls, prefix) if flag.field in values)
        raise SystemExit(f"{flags or cls.__name__}: {exc}") from None


def mapping_problems(cls: type, mapping: Mapping[str, Any], path: str) -> list[Problem]:
    """Unknown keys and values of the wrong type in a settings section, each naming its key."""
    flags = {flag.field: flag for flag in _flags(cls, "")}
    problems = []
    for key, value in mapping.items():
        flag = flags.get(key)
        if flag is None:
            near = ", ".join(sorted(flags))
            problems.append(Problem(f"{path}.{key}", f"unknown setting; the settings here are: {near}"))
        elif not flag.accepts(value):
            problems.append(Problem(f"{path}.{key}", f"expected {flag.wanted()}, got {str(value)[:64]!r}"))
    return problems


def from_mapping(cls: type[T], mapping: Mapping[str, Any], source: str, path: str, base: T | None = None) -> T:
    """`base` (default: cls()) with the section's keys replaced; SpecError(source) naming every bad key."""
    problems = mapping_problems(cls, mapping, path)
    if problems:
        raise SpecError(source, problems)
    flags = {flag.field: flag for flag in _flags(cls, "")}
    values = {k: flags[k].convert(v) for k, v in mapping.items()}
    start = base if base is not None else cls()
    try:
        return dataclasses.replace(start, **values) if values else start  # type: ignore[type-var]
    except ValueError as exc:
        raise SpecError(source, [Problem(path, str(exc))]) from None


def to_argv(mapping: Mapping[str, Any], prefix: str) -> list[str]:
    """A settings section as the flags add_flags derives, for the process that owns the dataclass. Keys are
    not checked here (that process refuses unknown flags); values are written so its parser reads them back.
    A None value is left out: not giving a flag leaves its default."""
    argv: list[str] = []
    for key, value in mapping.items():
        if value is None:
            continue
        text = (
            ("true" if value else "false")
            if isinstance(value, bool)
            else repr(value)
            if isinstance(value, float)
            else str(value.value)
            if isinstance(value, enum.Enum)
            else str(value)
        )
        argv.append(f"{flag_name(prefix, key)}={text}")  # one token: a negative value is not read as a flag
    return argv
