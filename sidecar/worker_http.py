"""The sidecar's calls to its own worker: keep-alive HTTP/1.1 connections on asyncio streams, with no
HTTP library. Both the data path (sidecar/proxy.py: one call per client request, its answer passed back
whole or, for SSE and other unsized bodies, piece by piece) and the Kafka connector (one call per fetched
batch, sidecar/kafka/) use it.

Why not aiohttp's client: for a 30-row /infer on loopback it cost 205-267 us of CPU a call here and
plain asyncio streams 91-110 us (2026-12-04). On the data path, the demo scorer at 1,500 requests/s
through the sidecar: the sidecar's CPU a request 270-302 us with this client against 342-486 us with
aiohttp's, 0.89-0.95 of the worker's against 1.12-1.44 (two alternating pairs of three 5-s runs, the
same day). The peer is one known server (the instance's worker, on the node), so the client speaks only
what that needs, and bounds what it reads:

- a request: `POST <target> HTTP/1.1` with Host, the client's fixed headers, the call's own headers and
  a Content-Length body;
- an answer: a status line and headers within `max_head_bytes` (each field name a token, no control
  character but HTAB in a value or the reason: the data path hands them on to its client); a body framed
  by Content-Length, by chunked transfer coding, or by the end of the connection (within
  `max_answer_bytes` when read whole); 1xx interim answers skipped; `Connection: close` and HTTP/1.0
  honoured (the connection is not reused).

Connections: an idle one is reused (last in, first out), else a new one is opened (with TLS for an
https worker); at most `max_idle` are kept, each for at most `max_idle_s` (well under the worker's
keep-alive timeout, so the worker is not closing it just as a call goes out: aiohttp's server, which
SIE's workers run, keeps an idle connection 3,630 s in aiohttp 3.14). One is reused only when its
answer was read to its end and left nothing unread, and is dropped when taken if the worker has closed
it or sent anything meanwhile. A request is written once: a connection that fails, times out or is
cancelled mid-call, or ends before its answer, is closed and the call fails (the worker may have
started on it); the caller decides what happens next.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

from sie.errors import SIEError

MAX_HEAD_BYTES = 64 * 1024
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_MAX_INTERIM = 8  # 1xx answers skipped before one call's final answer
_PIECE = 64 * 1024  # most bytes read_some returns of a body framed by length or by the connection's end
_MAX_TRAILER_LINES = 64
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
# A field name is a token (RFC 9110 5.1); a field value or reason phrase holds no control character but
# HTAB (RFC 9110 5.5, RFC 9112 4). A lone CR, LF or NUL passed on would break the answer to the client.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ConnectFailed(SIEError):
    """No connection to the worker (refused, unreachable, or not within the connect timeout): nothing
    was sent."""


class AnswerFailed(SIEError):
    """The connection failed mid-call, or the answer broke HTTP/1.1 or a bound: the worker may have
    started on the request."""


class BadAnswer(AnswerFailed):
    """The worker answered, with something the sidecar does not pass on: over a size bound, or not
    HTTP/1.1 as it must be. The worker is up and the same request would get the same answer from
    another instance, so this is not a lost worker to retry elsewhere."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class _Conn(NamedTuple):
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class Upstream:
    """An answer whose head has come: `status`, `reason`, `headers` (the header lines as sent, in order)
    and `fields` (lower-cased names, repeated ones joined). Read its body with `read_all` or `read_some`,
    then `release` it: the connection goes back to the pool only when the body was read to its end."""

    def __init__(
        self,
        client: WorkerHTTP,
        conn: _Conn,
        head: _Head,
        framing: str,
        length: int,
    ):
        self._client, self._conn = client, conn
        self.status, self.reason, self.headers, self.fields = head.status, head.reason, head.headers, head.fields
        self._framing = framing  # "none", "length", "chunked" or "eof"
        self._left = length  # bytes of a "length" body still to read
        self._done = framing == "none" or (framing == "length" and length == 0)
        self._keep = head.keep and framing != "eof"
        self._released = False

    async def read_all(self) -> bytes:
        """The whole body, within the client's `max_answer_bytes`. Raises AnswerFailed."""
        limit = self._client.max_answer
        if self._framing == "length" and not self._done:
            if self._left > limit:
                raise BadAnswer(f"the answer has {self._left} bytes, more than the {limit} allowed")
            body = await self._guarded(self._conn.reader.readexactly(self._left))
            self._left, self._done = 0, True
            return body
        parts: list[bytes] = []
        total = 0
        while piece := await self.read_some():
            total += len(piece)
            if total > limit:
                raise BadAnswer(f"the answer is over the {limit} bytes allowed")
            parts.append(piece)
        return b"".join(parts)

    async def read_some(self) -> bytes:
        """The next piece of the body as it arrives (a chunk of a chunked body, else what the socket has,
        up to 64 KiB); b"" at its end. Raises AnswerFailed."""
        if self._done:
            return b""
        reader = self._conn.reader
        if self._framing == "length":
            piece = await self._guarded(reader.read(min(self._left, _PIECE)))
            if not piece:
                raise AnswerFailed("the connection ended within the answer")
            self._left -= len(piece)
            self._done = self._left == 0
            return piece
        if self._framing == "chunked":
            piece = await self._guarded(self._chunk(reader))
            self._done = not piece
            return piece
        piece = await self._guarded(reader.read(_PIECE))  # to the connection's end
        self._done = not piece
        return piece

    def release(self) -> None:
        """Give the connection back (the body read to its end, nothing unread) or close it. Once."""
        if self._released:
            return
        self._released = True
        self._client._put_back(self._conn, self._keep and self._done)

    async def _chunk(self, reader: asyncio.StreamReader) -> bytes:
        """One chunk's data; b"" for the last chunk, once its trailer lines are read."""
        line = await reader.readuntil(b"\r\n")
        size_text = line.split(b";", 1)[0].strip()
        if not _HEX.fullmatch(size_text):
            raise BadAnswer(f"a chunk size {size_text[:40]!r} is not hexadecimal")
        size = int(size_text, 16)
        if size == 0:
            for _ in range(_MAX_TRAILER_LINES):
                if await reader.readuntil(b"\r\n") == b"\r\n":
                    return b""
            raise BadAnswer(f"more than {_MAX_TRAILER_LINES} trailer lines")
        if size > self._client.max_answer:
            raise BadAnswer(f"a chunk of {size} bytes is over the {self._client.max_answer} allowed")
        chunk = await reader.readexactly(size + 2)
        if chunk[-2:] != b"\r\n":
            raise BadAnswer("a chunk does not end with CRLF")
        return chunk[:-2]

    async def _guarded(self, read: Awaitable[bytes]) -> bytes:
        """`read`, with the stream's failures as AnswerFailed; on any failure, a timeout or a
        cancellation the connection is closed (its state is unknown)."""
        try:
            with _answer_errors(self._client.max_head):
                return await read
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        self._keep = False
        self.release()


class WorkerHTTP:
    """Keep-alive HTTP/1.1 calls to one server at `host:port` (TLS with `ssl_context`). Use from one event
    loop; `close()` at the end."""

    def __init__(
        self,
        host: str,
        port: int,
        headers: dict[str, str] | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
        base_path: str = "",
        max_idle: int = 8,
        max_head_bytes: int = MAX_HEAD_BYTES,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        max_idle_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.host, self.port = host, port
        fixed = {"Host": f"[{host}]:{port}" if ":" in host else f"{host}:{port}", **(headers or {})}
        self._fixed = _header_lines(fixed.items())
        self._ssl = ssl_context
        self._base_path = base_path.rstrip("/")  # before every target: a worker served under a path
        self._max_idle = max_idle
        self.max_head = max_head_bytes
        self.max_answer = max_answer_bytes
        self._max_idle_s = max_idle_s
        self._clock = clock
        self._idle: list[tuple[_Conn, float]] = []  # with the time each went idle
        self._closed = False

    @classmethod
    def from_url(cls, url: str, headers: dict[str, str] | None = None, *, max_idle: int = 8) -> WorkerHTTP:
        """A client for the worker at `url` (http or https, with an optional base path; https verifies the
        worker's certificate against the system's CAs). ValueError for any other URL."""
        try:
            target = urlsplit(url)
            port = target.port  # ValueError for a port that is not a number in range
        except ValueError:  # that, or a broken [IPv6] literal
            target, port = None, None
        if (
            not target
            or target.scheme not in ("http", "https")
            or not target.hostname
            or target.query
            or target.fragment
        ):
            raise ValueError(f"a worker URL is http(s)://host[:port][/path], not {url[:120]!r}")
        tls = ssl.create_default_context() if target.scheme == "https" else None
        port = port or (443 if tls else 80)
        return cls(target.hostname, port, headers, ssl_context=tls, base_path=target.path, max_idle=max_idle)

    async def post(self, path: str, body: bytes, timeout_s: float) -> Answer:
        """The worker's whole answer (any status). Raises ConnectFailed, AnswerFailed or TimeoutError."""
        async with asyncio.timeout(timeout_s):
            upstream = await self.open(path, body)
            try:
                return Answer(upstream.status, await upstream.read_all())
            finally:
                upstream.release()

    async def open(
        self,
        target: str,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
        connect_timeout_s: float | None = None,
    ) -> Upstream:
        """POST `body` to `target` (a path, with its query) with `headers` besides the fixed ones, and
        read the answer's head. Making a connection takes at most `connect_timeout_s` (ConnectFailed
        past it). Raises ConnectFailed, AnswerFailed, or ValueError for a header or target that cannot
        be sent as it is."""
        if any(c in target for c in " \r\n\0") or not target.startswith("/"):
            raise ValueError(f"the target {target[:80]!r} cannot be sent as it is")
        head = (
            f"POST {self._base_path}{target} HTTP/1.1\r\n".encode("utf-8", "surrogateescape")
            + self._fixed
            + _header_lines(headers)
        )
        request = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        conn = self._take_idle()
        if conn is None:
            try:
                async with asyncio.timeout(connect_timeout_s):
                    conn = await self._open()
            except TimeoutError:
                raise ConnectFailed(
                    f"no connection to {self.host}:{self.port} within {connect_timeout_s:g} s"
                ) from None
        try:
            answer, framing, length = await self._exchange(conn, request)
        except BaseException:  # a timeout or a cancellation included: the connection's state is unknown
            _shut(conn)
            raise
        return Upstream(self, conn, answer, framing, length)

    async def close(self) -> None:
        """Close the idle connections; a call still in flight closes its own when it ends."""
        self._closed = True
        idle, self._idle = [conn for conn, _since in self._idle], []
        for conn in idle:
            _shut(conn)
        for conn in idle:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()

    def _put_back(self, conn: _Conn, reusable: bool) -> None:
        if reusable and not _unread(conn) and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append((conn, self._clock()))
        else:
            _shut(conn)

    def _take_idle(self) -> _Conn | None:
        """The most recently used idle connection that is still fit to carry a request, or None."""
        now = self._clock()
        while self._idle:
            conn, since = self._idle.pop()
            if now - since <= self._max_idle_s and not _unread(conn):
                return conn
            _shut(conn)  # too old, closed by the worker, or holding bytes nobody asked for
        return None

    async def _open(self) -> _Conn:
        try:
            reader, writer = await asyncio.open_connection(
                self.host,
                self.port,
                limit=self.max_head,
                ssl=self._ssl,
                server_hostname=self.host if self._ssl else None,
            )
        except OSError as exc:  # ssl.SSLError included
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return _Conn(reader, writer)

    async def _exchange(self, conn: _Conn, request: bytes) -> tuple[_Head, str, int]:
        """Send `request` and read the answer's head: (the head, its body's framing, its length)."""
        reader, writer = conn
        try:
            writer.write(request)
            await writer.drain()
            data = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise AnswerFailed("the connection ended before the worker answered") from None
            raise AnswerFailed(f"the connection ended within the answer's head ({len(exc.partial)} bytes)") from None
        except asyncio.LimitOverrunError:
            raise BadAnswer(f"the answer's head is over {self.max_head} bytes") from None
        except OSError as exc:
            raise AnswerFailed(f"the connection failed: {exc}") from None
        try:
            with _answer_errors(self.max_head):
                for _ in range(_MAX_INTERIM):
                    head = _parse_head(data)
                    if not 100 <= head.status < 200:
                        break
                    data = await reader.readuntil(b"\r\n\r\n")
                else:
                    raise BadAnswer(f"more than {_MAX_INTERIM} interim (1xx) answers")
        except ValueError as exc:  # a safety net: every number read is checked before int() sees it
            raise BadAnswer(f"the answer is not HTTP/1.1: {exc}") from None
        fields = head.fields
        if head.status in (204, 304):
            return head, "none", 0
        if "chunked" in fields.get("transfer-encoding", "").lower():
            return head, "chunked", 0
        length = fields.get("content-length")
        if length is None:
            return head, "eof", 0
        if not (length.isascii() and length.isdigit() and len(length) <= 18):
            raise BadAnswer(f"Content-Length {length[:40]!r} is not a length")
        return head, "length", int(length)


class _Head(NamedTuple):
    status: int
    reason: str
    headers: list[tuple[str, str]]  # as sent, in order
    fields: dict[str, str]  # lower-cased names, repeated ones joined with ", "
    keep: bool  # HTTP/1.1 without Connection: close


def _parse_head(data: bytes) -> _Head:
    """An answer's head, ending in CRLF CRLF."""
    lines = data[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if (
        version not in ("HTTP/1.1", "HTTP/1.0")
        or not (len(code) == 3 and code.isascii() and code.isdigit() and "100" <= code <= "599")
        or _CONTROL.search(reason)
    ):
        raise BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: list[tuple[str, str]] = []
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            raise BadAnswer(f"not a header line: {line[:80]!r}")
        value = value.strip(" \t")  # optional whitespace (RFC 9110 5.6.3): SP and HTAB only
        headers.append((name, value))
        key = name.lower()
        if key not in fields:
            fields[key] = value
        elif key == "content-length":
            if fields[key] != value:
                raise BadAnswer("two different Content-Length headers")
        else:
            fields[key] = f"{fields[key]}, {value}"
    keep = version == "HTTP/1.1" and "close" not in fields.get("connection", "").lower()
    return _Head(int(code), reason, headers, fields, keep)


def _header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """`Name: value` CRLF lines; ValueError for a header that cannot be sent as it is."""
    out = []
    for name, value in headers:
        if any(c in f"{name}{value}" for c in "\r\n\0") or ":" in name or not name:
            raise ValueError(f"header {name[:80]!r} cannot be sent as it is")
        out.append(f"{name}: {value}\r\n")
    # The bytes the client sent: aiohttp's server reads header values as UTF-8 with surrogateescape.
    return "".join(out).encode("utf-8", "surrogateescape")


@contextlib.contextmanager
def _answer_errors(max_head: int) -> Iterator[None]:
    """The stream's failures while an answer is read, as AnswerFailed."""
    try:
        yield
    except asyncio.IncompleteReadError:
        raise AnswerFailed("the connection ended within the answer") from None
    except asyncio.LimitOverrunError:
        raise BadAnswer(f"a line of the answer is over {max_head} bytes") from None
    except OSError as exc:
        raise AnswerFailed(f"the connection failed: {exc}") from None


def _unread(conn: _Conn) -> bool:
    """The connection is closed, failed, or holds bytes no answer accounted for: not to be reused. (The
    buffer is StreamReader's own attribute; without it, the connection counts as unfit.)"""
    reader = conn.reader
    return reader.at_eof() or reader.exception() is not None or bool(getattr(reader, "_buffer", b"x"))


def _shut(conn: _Conn) -> None:
    conn.writer.close()
