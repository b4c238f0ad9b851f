"""The Kafka connector's calls to its own worker: POST over keep-alive HTTP/1.1 connections, on asyncio
streams, with no HTTP library.

The connector makes one call per fetched batch, hundreds a second at 10,000 messages/s. For a 30-row
/infer on loopback, aiohttp's client cost 205-267 us of CPU a call here and plain asyncio streams
91-110 us (2026-12-04), about 4 us a message of the sidecar's 40-57. The peer is one known server (the
instance's worker, on the node), so the client speaks only what that needs, and bounds what it reads:

- a request: `POST <path> HTTP/1.1` with Host, the given headers and a Content-Length body;
- an answer: a status line and headers within `max_head_bytes`; a body framed by Content-Length, by
  chunked transfer coding, or by the end of the connection, within `max_answer_bytes`; 1xx interim
  answers skipped; `Connection: close` and HTTP/1.0 honoured (the connection is not reused).

Connections: an idle one is reused (last in, first out), else a new one is opened; at most `max_idle`
are kept, each for at most `max_idle_s` (well under the worker's keep-alive timeout, so the worker is
not closing it just as a call goes out: aiohttp's server, which SIE's workers run, keeps an idle
connection 3,630 s in aiohttp 3.14). One is reused only when its answer left nothing unread, and is
dropped when taken if the worker has closed it or sent anything meanwhile. A request is written once:
a connection that fails, times out or is cancelled mid-call, or ends before its answer, is closed and
the call fails (the worker may have started on it); the handler's retries decide what happens next,
as with any failed call.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from sie.errors import SIEError

MAX_HEAD_BYTES = 64 * 1024
MAX_ANSWER_BYTES = 64 * 1024 * 1024
_MAX_INTERIM = 8  # 1xx answers skipped before one call's final answer
_MAX_TRAILER_LINES = 64
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


class ConnectFailed(SIEError):
    """No connection to the worker (refused, unreachable): nothing was sent."""


class AnswerFailed(SIEError):
    """The connection failed mid-call, or the answer broke HTTP/1.1 or a bound: the worker may have
    started on the request."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class _Conn(NamedTuple):
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class WorkerHTTP:
    """Keep-alive POSTs to one HTTP/1.1 server at `host:port`. Use from one event loop; `close()` at the end."""

    def __init__(
        self,
        host: str,
        port: int,
        headers: dict[str, str] | None = None,
        *,
        max_idle: int = 8,
        max_head_bytes: int = MAX_HEAD_BYTES,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        max_idle_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.host, self.port = host, port
        fixed = {"Host": f"[{host}]:{port}" if ":" in host else f"{host}:{port}", **(headers or {})}
        for name, value in fixed.items():
            if any(c in f"{name}{value}" for c in "\r\n\0") or ":" in name:
                raise ValueError(f"header {name!r} cannot be sent as it is")
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items()).encode("latin-1")
        self._max_idle = max_idle
        self._max_head = max_head_bytes
        self._max_answer = max_answer_bytes
        self._max_idle_s = max_idle_s
        self._clock = clock
        self._idle: list[tuple[_Conn, float]] = []  # with the time each went idle
        self._closed = False

    async def post(self, path: str, body: bytes, timeout_s: float) -> Answer:
        """The worker's answer (any status). Raises ConnectFailed, AnswerFailed or TimeoutError."""
        head = f"POST {path} HTTP/1.1\r\n".encode("latin-1") + self._fixed
        request = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        async with asyncio.timeout(timeout_s):
            conn = self._take_idle() or await self._open()
            try:
                answer, keep = await self._exchange(conn, request)
            except BaseException:  # a timeout or a cancellation included: the connection's state is unknown
                _shut(conn)
                raise
        if keep and not _unread(conn) and not self._closed and len(self._idle) < self._max_idle:
            self._idle.append((conn, self._clock()))
        else:
            _shut(conn)
        return answer

    async def close(self) -> None:
        """Close the idle connections; a call still in flight closes its own when it ends."""
        self._closed = True
        idle, self._idle = [conn for conn, _since in self._idle], []
        for conn in idle:
            _shut(conn)
        for conn in idle:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()

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
            reader, writer = await asyncio.open_connection(self.host, self.port, limit=self._max_head)
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return _Conn(reader, writer)

    async def _exchange(self, conn: _Conn, request: bytes) -> tuple[Answer, bool]:
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
            raise AnswerFailed(f"the answer's head is over {self._max_head} bytes") from None
        except OSError as exc:
            raise AnswerFailed(f"the connection failed: {exc}") from None
        try:
            for _ in range(_MAX_INTERIM):
                version, status, fields = _parse_head(data)
                if not 100 <= status < 200:
                    break
                data = await reader.readuntil(b"\r\n\r\n")
            else:
                raise AnswerFailed(f"more than {_MAX_INTERIM} interim (1xx) answers")
            body, framed = await self._body(reader, status, fields)
        except asyncio.IncompleteReadError:
            raise AnswerFailed("the connection ended within the answer") from None
        except asyncio.LimitOverrunError:
            raise AnswerFailed(f"a line of the answer is over {self._max_head} bytes") from None
        except OSError as exc:
            raise AnswerFailed(f"the connection failed: {exc}") from None
        except ValueError as exc:  # a safety net: every number read is checked before int() sees it
            raise AnswerFailed(f"the answer is not HTTP/1.1: {exc}") from None
        close = "close" in fields.get("connection", "").lower() or version != "HTTP/1.1"
        return Answer(status, body), framed and not close

    async def _body(self, reader: asyncio.StreamReader, status: int, fields: dict[str, str]) -> tuple[bytes, bool]:
        """The answer's body, and whether it was framed (else it ran to the end of the connection)."""
        if status in (204, 304):
            return b"", True
        if "chunked" in fields.get("transfer-encoding", "").lower():
            return await self._chunked(reader), True
        length = fields.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit() and len(length) <= 18):
                raise AnswerFailed(f"Content-Length {length[:40]!r} is not a length")
            size = int(length)
            if size > self._max_answer:
                raise AnswerFailed(f"the answer has {size} bytes, more than the {self._max_answer} allowed")
            return await reader.readexactly(size), True
        body = await reader.read(self._max_answer + 1)
        while len(body) <= self._max_answer and not reader.at_eof():
            body += await reader.read(self._max_answer + 1 - len(body))
        if len(body) > self._max_answer:
            raise AnswerFailed(f"the answer is over the {self._max_answer} bytes allowed")
        return body, False

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size_text):
                raise AnswerFailed(f"a chunk size {size_text[:40]!r} is not hexadecimal")
            size = int(size_text, 16)
            if size == 0:
                for _ in range(_MAX_TRAILER_LINES):
                    if await reader.readuntil(b"\r\n") == b"\r\n":
                        return b"".join(parts)
                raise AnswerFailed(f"more than {_MAX_TRAILER_LINES} trailer lines")
            total += size
            if total > self._max_answer:
                raise AnswerFailed(f"the answer is over the {self._max_answer} bytes allowed")
            chunk = await reader.readexactly(size + 2)
            if chunk[-2:] != b"\r\n":
                raise AnswerFailed("a chunk does not end with CRLF")
            parts.append(chunk[:-2])


def _parse_head(data: bytes) -> tuple[str, int, dict[str, str]]:
    """(version, status, lower-cased header fields) of an answer's head, ending in CRLF CRLF."""
    lines = data[:-4].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not (code.isascii() and code.isdigit() and "100" <= code <= "599"):
        raise AnswerFailed(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise AnswerFailed(f"not a header line: {line[:80]!r}")
        key, value = name.lower(), value.strip()
        if key not in fields:
            fields[key] = value
        elif key == "content-length":
            if fields[key] != value:
                raise AnswerFailed("two different Content-Length headers")
        else:
            fields[key] = f"{fields[key]}, {value}"
    return version, int(code), fields


def _unread(conn: _Conn) -> bool:
    """The connection is closed, failed, or holds bytes no answer accounted for: not to be reused. (The
    buffer is StreamReader's own attribute; without it, the connection counts as unfit.)"""
    reader = conn.reader
    return reader.at_eof() or reader.exception() is not None or bool(getattr(reader, "_buffer", b"x"))


def _shut(conn: _Conn) -> None:
    conn.writer.close()
