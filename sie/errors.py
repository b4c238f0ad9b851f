"""Errors shared by every SIE component.

One base, split by what the caller does: fix the input (`SpecError`), or retry later (`RetryableError`).
"""

from __future__ import annotations

from dataclasses import dataclass


class SIEError(Exception):
    """Base of every error SIE raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where (a dotted field path) and why."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


class SpecError(SIEError, ValueError):
    """An input (spec file, admin API body, CRD object) is invalid. Not retryable: fix the input."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} is invalid:\n{lines}")

    def to_json(self) -> dict:
        return {
            "error": "invalid_spec",
            "source": self.source,
            "problems": [{"path": p.path, "reason": p.reason} for p in self.problems],
        }


class RetryableError(SIEError):
    """A transient failure: the same call may succeed later."""
