"""Is a model's new version compatible with its clients? Its input and output schemas compared (pure).

Before an update starts, the new version's `input_schema` / `output_schema` are compared with the running
version's, field by field; every difference is a `SchemaChange` that says whether it breaks a client. The
model is Protobuf/Avro/JSON-Schema compatibility, read from the client's side:

- input (clients send): the new version must accept every request the old one accepted. A change that
  accepts less (a narrower type, range, length or enum, a field now required, extra fields now refused,
  a schema where there was none that requires a field or refuses extras) breaks. So does a removed input
  field, whatever `allow_extra_fields` says: a client that sends it is refused, or its value is no longer
  read. Accepting more, and new optional fields, are additive. Removing the whole schema is additive:
  nothing is checked any more, and no field is said to be gone.
- output (clients read): the new version must not return what the old never returned, and must still
  return what clients read. A change that returns more (a wider type, range, length or enum, a field now
  optional, extra fields now allowed, the schema removed) breaks, as does a removed output field.
  Returning less, and new fields, are additive.

A change's `kind` says what changed, the same code on both sides (`range_narrowed` breaks an input and
is additive on an output); `breaking` says what it means for the side. Every number is compared as the
sidecar checks it (sidecar/validation.py): int32 < int64 < float32 < float64 accept ever more values,
since a float field takes integers; string, bool, array and object are unrelated to each other and to
the numbers. Only explicit ranges are compared; a type's own bounds are the type's change.

Kinds: schema_added, schema_removed, extra_fields_refused, extra_fields_allowed, field_added,
required_field_added, field_removed, field_now_required, field_now_optional, type_widened,
type_narrowed, type_changed, range_widened, range_narrowed, range_changed, length_widened,
length_narrowed, length_changed, enum_widened, enum_narrowed, enum_changed. `*_changed` means neither
wider nor narrower (e.g. [0, 10] -> [5, 20]) and breaks on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from sie.spec import FieldSpec, IOSchema, ModelServiceSpec

Side = Literal["input", "output"]
# How the set of values a field (or schema) admits moved: the new set contains the old (wider), is
# contained in it (narrower), or neither (changed).
_Direction = Literal["widened", "narrowed", "changed"]

# Each numeric type accepts every value of those before it (sidecar/validation.py: floats take integers,
# float32's bound is far above int64's).
_NUMERIC_ORDER = ("int32", "int64", "float32", "float64")

_CONSEQUENCE = {
    ("input", True): "requests the old version accepted may now be refused",
    ("output", True): "clients may now get responses the old version never returned",
    ("input", False): "every request the old version accepted is still accepted",
    ("output", False): "every response stays within what the old version returned",
}


@dataclass(frozen=True)
class SchemaChange:
    """One difference between an old and a new schema. `field` is "" for a schema-wide change; `old` and
    `new` are JSON values (a type name, a [low, high] range, a field's or schema's JSON form, ...)."""

    side: Side
    field: str
    kind: str
    breaking: bool
    old: Any
    new: Any
    message: str

    def to_json(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "field": self.field,
            "kind": self.kind,
            "breaking": self.breaking,
            "old": self.old,
            "new": self.new,
            "message": self.message,
        }


def compare_specs(old: ModelServiceSpec, new: ModelServiceSpec) -> list[SchemaChange]:
    """The schema changes from the running spec `old` to the candidate `new`: input, then output."""
    return compare_schemas(old.input_schema, old.output_schema, new.input_schema, new.output_schema)


def compare_schemas(
    old_input: IOSchema | None,
    old_output: IOSchema | None,
    new_input: IOSchema | None,
    new_output: IOSchema | None,
) -> list[SchemaChange]:
    """Every change, input side first, then output; within a side the schema-wide changes ("" field)
    first, then by field name, and per field in a fixed order (presence, type, range, length, enum)."""
    return compare_side("input", old_input, new_input) + compare_side("output", old_output, new_output)


def compare_side(side: Side, old: IOSchema | None, new: IOSchema | None) -> list[SchemaChange]:
    """The changes of one side; None is "no schema": anything is accepted (input) or may be returned."""
    if old is None and new is None:
        return []
    if old is None:
        assert new is not None
        return [_schema_added(side, new)]
    if new is None:
        return [_schema_removed(side, old)]
    changes: list[SchemaChange] = []
    if old.allow_extra_fields != new.allow_extra_fields:
        direction: _Direction = "widened" if new.allow_extra_fields else "narrowed"
        breaks = _breaks(side, direction)
        changes.append(
            SchemaChange(
                side,
                "",
                "extra_fields_allowed" if new.allow_extra_fields else "extra_fields_refused",
                breaks,
                old.allow_extra_fields,
                new.allow_extra_fields,
                _sentence(
                    f"the {side} schema's allow_extra_fields changed from {_flag(old.allow_extra_fields)} to "
                    f"{_flag(new.allow_extra_fields)}",
                    side,
                    breaks,
                ),
            )
        )
    old_fields = {f.name: f for f in old.fields}
    new_fields = {f.name: f for f in new.fields}
    for name in sorted(old_fields.keys() | new_fields.keys()):
        before, after = old_fields.get(name), new_fields.get(name)
        if before is None:
            assert after is not None
            changes.append(_field_added(side, after))
        elif after is None:
            changes.append(_field_removed(side, before, new))
        else:
            changes.extend(_field_changes(side, before, after))
    return changes


def breaking(changes: Iterable[SchemaChange]) -> list[SchemaChange]:
    """The changes that break a client, in their order; empty when the update is compatible."""
    return [c for c in changes if c.breaking]


def _breaks(side: Side, direction: _Direction) -> bool:
    # Inputs must accept at least what they accepted; outputs must return at most what they returned.
    if direction == "changed":
        return True
    return direction == ("narrowed" if side == "input" else "widened")


def _schema_added(side: Side, new: IOSchema) -> SchemaChange:
    required = sorted(f.name for f in new.fields if f.required)
    if side == "input":
        # No schema accepted anything. The contract counts a new schema as breaking only when it requires
        # a field or refuses extras; typed optional fields are additive, as a new optional field is.
        breaks = bool(required) or not new.allow_extra_fields
        reasons = []
        if required:
            reasons.append("it requires " + ", ".join(repr(n) for n in required))
        if not new.allow_extra_fields:
            reasons.append("it refuses extra fields")
        detail = f" ({' and '.join(reasons)})" if reasons else " (all its fields optional, extra fields allowed)"
    else:
        breaks = False
        detail = ""
    return SchemaChange(
        side,
        "",
        "schema_added",
        breaks,
        None,
        _json(new),
        _sentence(
            f"an {side} schema of {len(new.fields)} field(s) was added where there was none{detail}", side, breaks
        ),
    )


def _schema_removed(side: Side, old: IOSchema) -> SchemaChange:
    breaks = side == "output"
    return SchemaChange(
        side,
        "",
        "schema_removed",
        breaks,
        _json(old),
        None,
        _sentence(f"the {side} schema of {len(old.fields)} field(s) was removed", side, breaks),
    )


def _field_added(side: Side, new: FieldSpec) -> SchemaChange:
    # Only a required input field breaks: old clients never send it. A new output field is never read
    # by an old client, so it is additive whether or not it is always present.
    breaks = side == "input" and new.required
    return SchemaChange(
        side,
        new.name,
        "required_field_added" if new.required else "field_added",
        breaks,
        None,
        _json(new),
        _sentence(f"{side} field {new.name!r} ({_describe(new)}) was added", side, breaks),
    )


def _field_removed(side: Side, old: FieldSpec, new_schema: IOSchema) -> SchemaChange:
    if side == "input":
        effect = (
            "requests that send it are refused, since extra fields are refused"
            if not new_schema.allow_extra_fields
            else "a request that sends it passes as an extra field that the new version no longer reads"
        )
    else:
        effect = "clients that read it no longer get it"
    return SchemaChange(
        side,
        old.name,
        "field_removed",
        True,
        _json(old),
        None,
        f"{side} field {old.name!r} ({_describe(old)}) was removed; {effect}.",
    )


def _field_changes(side: Side, old: FieldSpec, new: FieldSpec) -> list[SchemaChange]:
    name = old.name
    changes: list[SchemaChange] = []

    def add(kind: str, direction: _Direction, old_value: Any, new_value: Any, detail: str) -> None:
        breaks = _breaks(side, direction)
        changes.append(
            SchemaChange(
                side,
                name,
                kind,
                breaks,
                old_value,
                new_value,
                _sentence(f"{side} field {name!r} {detail}", side, breaks),
            )
        )

    if old.required != new.required:
        # Required is the narrower set: a body (or response) without the field is no longer valid.
        if new.required:
            add("field_now_required", "narrowed", old.required, new.required, "was optional and is now required")
        else:
            add("field_now_optional", "widened", old.required, new.required, "was required and is now optional")

    type_direction = _type_direction(old.type, new.type)
    if type_direction is not None:
        add(f"type_{type_direction}", type_direction, old.type, new.type, f"changed type from {old.type} to {new.type}")
        if type_direction == "changed":
            # Unrelated types: the old constraints say nothing about the new values.
            return changes

    range_direction = _interval_direction(_range_bounds(old), _range_bounds(new))
    if range_direction is not None:
        add(
            f"range_{range_direction}",
            range_direction,
            _json_range(old),
            _json_range(new),
            f"range changed from {_show_range(old)} to {_show_range(new)}",
        )

    length_direction = _interval_direction(_length_bounds(old), _length_bounds(new))
    if length_direction is not None:
        add(
            f"length_{length_direction}",
            length_direction,
            _json_length(old),
            _json_length(new),
            f"length changed from {_show_length(old)} to {_show_length(new)}",
        )

    enum_direction = _enum_direction(old.enum, new.enum)
    if enum_direction is not None:
        add(
            f"enum_{enum_direction}",
            enum_direction,
            _json_enum(old.enum),
            _json_enum(new.enum),
            f"allowed values changed from {_show_enum(old.enum)} to {_show_enum(new.enum)}{_enum_delta(old.enum, new.enum)}",
        )
    return changes


def _type_direction(old: str, new: str) -> _Direction | None:
    if old == new:
        return None
    if old in _NUMERIC_ORDER and new in _NUMERIC_ORDER:
        return "widened" if _NUMERIC_ORDER.index(new) > _NUMERIC_ORDER.index(old) else "narrowed"
    return "changed"


_Bounds = tuple[float, float]


def _interval_direction(old: _Bounds, new: _Bounds) -> _Direction | None:
    if old == new:
        return None
    if new[0] <= old[0] and new[1] >= old[1]:
        return "widened"
    if new[0] >= old[0] and new[1] <= old[1]:
        return "narrowed"
    return "changed"


def _range_bounds(f: FieldSpec) -> _Bounds:
    return f.range if f.range is not None else (-math.inf, math.inf)


def _length_bounds(f: FieldSpec) -> _Bounds:
    # No min_length is min_length 0: the same set of values.
    return (
        float(f.min_length or 0),
        float(f.max_length) if f.max_length is not None else math.inf,
    )


def _enum_key(value: str | int | float) -> tuple[bool, str | int | float]:
    # The sidecar compares enum values of the same kind only: true is not 1, but 1 is 1.0.
    return (isinstance(value, bool), value)


def _enum_direction(old: list[str | int | float] | None, new: list[str | int | float] | None) -> _Direction | None:
    # None admits every value.
    if old is None and new is None:
        return None
    if old is None:
        return "narrowed"
    if new is None:
        return "widened"
    before, after = {_enum_key(v) for v in old}, {_enum_key(v) for v in new}
    if before == after:
        return None
    if after > before:
        return "widened"
    if after < before:
        return "narrowed"
    return "changed"


def _enum_delta(old: list[str | int | float] | None, new: list[str | int | float] | None) -> str:
    if old is None or new is None:
        return ""
    before, after = {_enum_key(v) for v in old}, {_enum_key(v) for v in new}
    parts = []
    removed = [v for v in old if _enum_key(v) not in after]
    added = [v for v in new if _enum_key(v) not in before]
    if removed:
        parts.append("without " + ", ".join(_show_value(v) for v in removed))
    if added:
        parts.append("with " + ", ".join(_show_value(v) for v in added))
    return f" ({'; '.join(parts)})" if parts else ""


def _sentence(what: str, side: Side, breaks: bool) -> str:
    return f"{what}; {_CONSEQUENCE[(side, breaks)]}."


def _describe(f: FieldSpec) -> str:
    return f"{f.type}, {'required' if f.required else 'optional'}"


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _show_value(value: str | int | float) -> str:
    if isinstance(value, bool):
        return _flag(value)
    if isinstance(value, str):
        return repr(value)
    return _num(value)


def _show_range(f: FieldSpec) -> str:
    return "no range" if f.range is None else f"[{_num(f.range[0])}, {_num(f.range[1])}]"


def _show_length(f: FieldSpec) -> str:
    if f.min_length is None and f.max_length is None:
        return "no length bound"
    parts = []
    if f.min_length is not None:
        parts.append(f"min_length {f.min_length}")
    if f.max_length is not None:
        parts.append(f"max_length {f.max_length}")
    return ", ".join(parts)


def _show_enum(values: list[str | int | float] | None) -> str:
    return "any value" if values is None else "{" + ", ".join(_show_value(v) for v in values) + "}"


def _json(model: FieldSpec | IOSchema) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


def _json_range(f: FieldSpec) -> list[float] | None:
    return None if f.range is None else [f.range[0], f.range[1]]


def _json_length(f: FieldSpec) -> dict[str, int | None]:
    return {"min_length": f.min_length, "max_length": f.max_length}


def _json_enum(values: list[str | int | float] | None) -> list[str | int | float] | None:
    return None if values is None else list(values)
