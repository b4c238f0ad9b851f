"""Errors shared by every SIE component, and the one shape of every HTTP error body SIE sends.

One base, split by what the caller does: fix the input (`SpecError`, `InputError`), present a credential
(`Unauthenticated`, 401) or one that may do this (`Forbidden`, 403), retry later (`RetryableError`), or
give up starting and do what the message says (`StartupError`: `sie up`, `sie join`).

Every HTTP error body, whichever component answers, is built by `error_body`:

    {"error": {"type": "<snake_case kind>", "message": "<what was wrong and how to fix it>", <context>}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def error_body(kind: str, message: str, **context: Any) -> dict[str, Any]:
    """The error JSON every SIE component answers with. `context` adds fields beside type and message."""
    return {"error": {"type": kind, **context, "message": message}}


def error_bytes(kind: str, message: str, **context: Any) -> bytes:
    """`error_body` serialised, for answers built once and sent many times."""
    return json.dumps(error_body(kind, message, **context)).encode()


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
    """An input (spec file, admin API body, CRD object, telemetry record) is invalid. Not retryable: fix it."""

    kind = "invalid_spec"

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} is invalid:\n{lines}")

    def to_json(self) -> dict[str, Any]:
        summary = "; ".join(str(p) for p in self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        return error_body(
            self.kind,
            f"{self.source} is invalid: {summary}{more}",
            source=self.source,
            problems=[{"path": p.path, "reason": p.reason} for p in self.problems],
        )


class InputError(SIEError, ValueError):
    """A request body that cannot be read at all (not JSON, too deep, too large, not UTF-8). Fix it: 400."""

    def __init__(self, kind: str, message: str, status: int = 400):
        self.kind = kind
        self.status = status
        super().__init__(message)

    def to_json(self) -> dict[str, Any]:
        return error_body(self.kind, str(self))


class AuthError(SIEError):
    """A caller that may not do what it asked. `status` is 401 or 403."""

    status = 401
    kind = "unauthenticated"

    def to_json(self) -> dict[str, Any]:
        return error_body(self.kind, str(self))


class Unauthenticated(AuthError):
    """No credential, or one that does not verify: 401. Send `Authorization: Bearer <token>`."""


class Forbidden(AuthError):
    """A valid credential whose identity may not do this: 403."""

    status = 403
    kind = "forbidden"


class RetryableError(SIEError):
    """A transient failure: the same call may succeed later."""


class StartupError(SIEError):
    """The stack could not come up (`sie up`), or the run directory could not be taken (`sie up`, `sie
    join`; sie.run_dir); the message says what to do."""
