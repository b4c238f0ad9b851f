"""Authentication on SIE's aiohttp servers, and credentials on its clients.

Server side: `middleware(authenticator, open_paths)` authenticates every request whose path is not
open (health probes are), with `Authorization: Bearer <token>`. No credential or a bad one is a 401 with
`WWW-Authenticate: Bearer`; handlers then call `require(request, ...)`, which raises Forbidden (a 403)
when the identity may not do this. Both answer the one error shape (sie.errors.error_body).

Client side: `TokenSource` reads a token from a file and re-reads it when the file changes (Kubernetes
rotates projected service-account tokens in place; a node host replaces its sidecars' token files as the
control plane renews them), so a long-running client never holds a stale one.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from sie.auth.identity import Identity, Role
from sie.auth.store import read_secret
from sie.auth.tokens import Verifier
from sie.errors import AuthError, Forbidden, Unauthenticated, error_body

IDENTITY_KEY = web.RequestKey("sie.identity", Identity)
_SCHEME = "bearer "


class Authenticator(Protocol):
    async def authenticate(self, token: str) -> Identity:
        """The identity a credential proves, or Unauthenticated naming why not."""
        ...


class TokenAuthenticator:
    """SIE's own signed tokens (sie.auth.tokens)."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    async def authenticate(self, token: str) -> Identity:
        return self.verifier.verify(token)


class ChainAuthenticator:
    """The first authenticator that accepts the token wins (SIE tokens, then e.g. Kubernetes TokenReview)."""

    def __init__(self, *chain: Authenticator):
        self.chain = chain

    async def authenticate(self, token: str) -> Identity:
        reasons = []
        for authenticator in self.chain:
            try:
                return await authenticator.authenticate(token)
            except Unauthenticated as exc:
                reasons.append(str(exc))
        raise Unauthenticated("; ".join(reasons) or "no authenticator configured")


def bearer(header: str | None) -> str | None:
    if not header or len(header) > 8192 or not header[: len(_SCHEME)].lower() == _SCHEME:
        return None
    token = header[len(_SCHEME) :].strip()
    return token or None


def _auth_error(exc: AuthError) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="sie"'} if exc.status == 401 else None
    return web.json_response(error_body(exc.kind, str(exc)), status=exc.status, headers=headers)


def middleware(authenticator: Authenticator, open_paths: Iterable[str] = ()) -> Middleware:
    """aiohttp middleware: authenticate every request outside `open_paths`; answer auth errors as JSON."""
    open_set = frozenset(open_paths)

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_set:
            return await handler(request)
        token = bearer(request.headers.get("Authorization"))
        try:
            if token is None:
                raise Unauthenticated(
                    f"{request.method} {request.path} needs a credential: send "
                    "`Authorization: Bearer <token>` (standalone: the files in <run-dir>/credentials)"
                )
            request[IDENTITY_KEY] = await authenticator.authenticate(token)
            return await handler(request)
        except AuthError as exc:
            return _auth_error(exc)

    return authenticate


def identity(request: web.Request) -> Identity:
    found = request.get(IDENTITY_KEY)
    if not isinstance(found, Identity):  # a route that forgot to sit behind the middleware: fail closed
        raise Unauthenticated("this route is not behind authentication")
    return found


def require(request: web.Request, *roles: Role) -> Identity:
    """The caller's identity, if its role is one of `roles`; else Forbidden (403) naming what is needed."""
    who = identity(request)
    if who.role not in roles:
        allowed = " or ".join(r.value for r in roles)
        raise Forbidden(f"{who.subject} may not {request.method} {request.path}: it needs the {allowed} role")
    return who


class Credential(Protocol):
    """What a client presents: `Authorization` headers for its next call."""

    def headers(self) -> dict[str, str]: ...


class TokenSource:
    """A bearer credential for outgoing calls: fixed, or read from a file and re-read when it changes."""

    def __init__(self, *, token: str | None = None, path: str | Path | None = None):
        if (token is None) == (path is None):
            raise ValueError("give exactly one of token and path")
        self._token = token
        self._path = Path(path) if path is not None else None
        self._stamp: tuple[int, int, int] | None = None
        if self._path is not None:
            self._reload()

    @property
    def path(self) -> Path | None:
        """The file the token is read from (None: a fixed token)."""
        return self._path

    def _reload(self) -> None:
        assert self._path is not None
        info = os.stat(self._path)
        # Writers replace the file (write a temporary one, rename it: sie.auth.store.write_private, and
        # Kubernetes' symlink swap), so a new token is a new inode; mtime and size alone can miss one (a
        # renewed token has the old one's length, and two writes may fall in one timestamp tick).
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        if stamp != self._stamp:
            self._token = read_secret(self._path, "token")
            self._stamp = stamp

    @property
    def token(self) -> str:
        if self._path is not None:
            try:
                self._reload()
            except OSError:
                pass  # keep the last good one; the file is being replaced
        assert self._token is not None
        return self._token

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


class IssuedToken:
    """A credential the control plane hands out and renews (a node's token in heartbeat replies); until
    the first one arrives, the caller's own credential stands in."""

    def __init__(self, fallback: TokenSource):
        self._fallback = fallback
        self._issued: str | None = None

    def update(self, token: str) -> None:
        if token:
            self._issued = token

    def forget(self) -> bool:
        """Drop the issued token (refused: signed by a key no longer trusted); the caller's own stands in
        again. Whether there was one to drop."""
        had, self._issued = self._issued is not None, None
        return had

    @property
    def token(self) -> str:
        return self._issued or self._fallback.token

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def same_secret(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented shared secret (the worker key) with the expected one. A
    header's bytes that are not UTF-8 reach here as surrogates (aiohttp decodes with surrogateescape);
    surrogatepass encodes any of them, so they never match, where a plain encode() raised (a 500)."""
    return given is not None and hmac.compare_digest(
        given.encode(errors="surrogatepass"), expected.encode(errors="surrogatepass")
    )
