"""The one error shape on every aiohttp server SIE runs (admin API, node host API, sidecar, worker, webhook).

aiohttp answers on its own for a path no route has (404), a method a route does not take (405), a body
over `client_max_size` (413) and any `web.HTTPException` a handler raises, each with a plain-text body.
`json_errors()`, the outermost middleware of every app, turns those answers into `sie.errors.error_body`:

    {"error": {"type": "not_found", "message": "no route for GET /v1/nope", "path": "/v1/nope"}}

keeping the status and headers (`Allow` on a 405). A handler that already answers JSON is left alone;
an exception SIE did not expect becomes a 500 `internal_error` whose message names no internals (the
traceback goes to the log), so no component ever answers an HTML or text error page.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from sie.errors import error_body

log = logging.getLogger("sie.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The error `type` for each status aiohttp produces by itself.
KINDS = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "body_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    431: "headers_too_large",
}


def _message(exc: web.HTTPException, request: web.Request) -> str:
    if exc.status == 404:
        return f"no route for {request.method} {request.path[:128]}"
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        return f"{request.path[:128]} does not take {request.method}" + (f"; it takes {allowed}" if allowed else "")
    if exc.status == 413:
        return f"the request body is larger than this server takes ({exc.text or exc.reason})"
    return exc.text or exc.reason or "error"


def _is_json(exc: web.HTTPException) -> bool:
    if exc.content_type != "application/json" or not exc.text:
        return False
    try:
        return isinstance(json.loads(exc.text).get("error"), dict)
    except (ValueError, AttributeError):
        return False


def as_json(exc: web.HTTPException, request: web.Request) -> web.HTTPException:
    """`exc` with its body in the one error shape (unchanged if it already is)."""
    if exc.status < 400 or _is_json(exc):
        return exc
    kind = KINDS.get(exc.status, "bad_request" if exc.status < 500 else "internal_error")
    exc.text = json.dumps(error_body(kind, _message(exc, request), path=request.path[:128]))
    exc.content_type = "application/json"
    return exc


def internal_error(request: web.Request) -> web.Response:
    """The answer to an exception nobody expected: a 500 in the one shape, naming no internals (the
    traceback goes to the log)."""
    log.exception("%s %s failed", request.method, request.path[:128])
    return web.json_response(
        error_body("internal_error", f"{request.method} {request.path[:128]} failed inside SIE; see its log"),
        status=500,
    )


def json_errors() -> Callable[..., Awaitable[web.StreamResponse]]:
    """aiohttp middleware: every error answer in the one shape. Put it first in `middlewares`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            raise as_json(exc, request) from None
        except Exception:  # noqa: BLE001 - one request must never take a server down
            return internal_error(request)

    return middleware
