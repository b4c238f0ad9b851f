"""Reading one engine's backend.config: typed fields with bounds, every wrong one collected as a Problem
that names its path (spec.backend.config.KEY), so a spec is refused once with all its mistakes.

Values come from outside (a spec file, the admin API, a custom resource): a wrong value is shown by its
repr cut to 64 characters, and nothing here raises on a value of the wrong type.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from sie.errors import Problem, SpecError
from sie.records import cut
from sie.spec import ModelService

T = TypeVar("T")

WHERE = "spec.backend.config."


def shown(value: Any) -> str:
    """A value as an error shows it: its repr, cut to 64 characters (it came from outside)."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more than 4,300 digits has no repr
        return f"a {type(value).__name__} too large to show"
    return cut(text, 64)


def _matches(value: str, name: str) -> bool:
    if name.endswith(":N"):
        return re.fullmatch(re.escape(name[:-1]) + r"[0-9]{1,3}", value) is not None
    return value == name


def checked(settings: T, problems: list[Problem], service: ModelService, backend: str, model_path: str) -> T:
    """An engine's `settings` as read, or SpecError naming every problem at once, a missing
    spec.model.path first (the engine needs `model_path`; the spec alone may go without one)."""
    if not service.spec.model.path:
        problems = [Problem("spec.model.path", f"the {backend} backend needs {model_path}"), *problems]
    if problems:
        raise SpecError(f"ModelService {service.model_id!r} ({backend} backend)", problems)
    return settings


class ConfigReader:
    """Typed reads of one backend.config's engine arguments. Each read returns the value, or the
    default when the value is wrong (and records a Problem): a caller builds its settings with what it
    gets and raises if `problems` is not empty."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = config
        self.problems: list[Problem] = []

    def refuse(self, key: str, reason: str) -> None:
        self.problems.append(Problem(WHERE + key, reason))

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            self.refuse(key, f"expected true or false, got {shown(value)}")
            return default
        return value

    def integer(self, key: str, default: int, *aliases: str, minimum: int = 1, maximum: int | None = None) -> int:
        """The first of `key` and its aliases that the config has; bool is not an integer here."""
        for name in (key, *aliases):
            if name not in self.config:
                continue
            value = self.config[name]
            if isinstance(value, int) and not isinstance(value, bool):
                if minimum <= value and (maximum is None or value <= maximum):
                    return value
            bounds = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            self.refuse(name, f"expected an integer {bounds}, got {shown(value)}")
            return default
        return default

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        """One of `allowed`, where a name ending in ":N" stands for that prefix and a number of 1 to 3
        digits (e.g. "cuda:N" for a device)."""
        value = self.config.get(key, default)
        if isinstance(value, str) and any(_matches(value, name) for name in allowed):
            return value
        self.refuse(key, f"expected one of {', '.join(allowed)}, got {shown(value)}")
        return default

    def names(self, key: str, *, max_items: int, max_length: int) -> tuple[str, ...]:
        """A list of at most `max_items` non-empty strings of at most `max_length` characters."""
        value = self.config.get(key, [])
        if (
            not isinstance(value, list)
            or len(value) > max_items
            or not all(isinstance(v, str) and 0 < len(v) <= max_length for v in value)
        ):
            self.refuse(
                key,
                f"expected a list of at most {max_items} names (each 1 to {max_length} characters), got {shown(value)}",
            )
            return ()
        return tuple(value)
