"""The one error shape (sie.errors.error_body), checked where tests and benchmarks read answers.

    {"error": {"type": "<snake_case>", "message": "<non-empty>", <context>}}

`check(status, body)` raises AssertionError naming what is off; every HTTP helper in the tests calls
it on each answer with a status >= 400 from an SIE component, so any error the suite meets that is not
in the shape fails the test that met it. Envoy's own admin interface is not SIE's and is not checked.
"""

from __future__ import annotations

import re
from typing import Any

KIND = re.compile(r"^[a-z][a-z0-9_]*$")


def problems(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return [f"the body is not a JSON object: {str(body)[:200]!r}"]
    if set(body) != {"error"}:
        return [f"the body's keys are {sorted(body)}, not ['error']"]
    err = body["error"]
    if not isinstance(err, dict):
        return [f"error is a {type(err).__name__}, not an object"]
    out = []
    if not isinstance(err.get("type"), str) or not KIND.match(err["type"]):
        out.append(f"error.type {err.get('type')!r} is not a snake_case string")
    if not isinstance(err.get("message"), str) or not err["message"]:
        out.append(f"error.message {err.get('message')!r} is not a non-empty string")
    return out


def check(status: int, body: Any) -> None:
    found = problems(body)
    assert not found, f"an HTTP {status} answer is not in SIE's one error shape: {'; '.join(found)}"
