"""A lean HTTP/1.1 load client for sub-millisecond services (asyncio protocols, no HTTP library).

bench/loadgen.py (aiohttp) costs the client about as much CPU per request as a scorer costs the
server, so on a 2-core machine it measures itself as much as the server. This client writes
pre-built request bytes on keep-alive connections and reads only the status line and Content-Length
of each answer (the servers measured here answer with a body of known length, never chunked), which
costs a few tens of microseconds per request.

Two ways to load:

    closed_loop(host, port, request, connections, duration_s)   the ceiling: each connection sends its
                                                                 next request when its answer arrives
    open_loop(host, port, request, schedule, max_connections)   Poisson arrivals fixed in advance;
                                                                 latency from the SCHEDULED send time
                                                                 (`request`: one for all, or a list that
                                                                 the requests take in turn)

Both return `Result` (latencies in seconds and statuses; transport errors are status 0).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def post(path: str, body: bytes, host: str = "127.0.0.1", headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one keep-alive POST with a JSON body."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)  # of answered requests, any status
    statuses: list[int] = field(default_factory=list)
    scheduled_s: list[float] = field(default_factory=list)  # open_loop: each one's scheduled send time
    instances: list[str] = field(default_factory=list)  # open_loop: each one's x-sie-instance ("" for none)
    span_s: float = 0.0  # first send to last answer

    @property
    def ok(self) -> int:
        return sum(1 for s in self.statuses if s == 200)

    @property
    def errors(self) -> int:
        return len(self.statuses) - self.ok

    @property
    def ok_latencies_ms(self) -> list[float]:
        return [lat * 1000 for lat, s in zip(self.latencies_s, self.statuses) if s == 200]


class _Conn(asyncio.Protocol):
    """One keep-alive connection; answers arrive in request order (no pipelining beyond what the caller
    queues). `on_answer(conn, status)` runs for each complete response, with `conn.instance` set to its
    x-sie-instance header (the SIE instance that answered; "" without one)."""

    def __init__(self, on_answer, on_lost):
        self._buf = bytearray()
        self._need: int | None = None  # body bytes still to read for the current answer
        self._status = 0
        self.instance = ""
        self._on_answer = on_answer
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # create_connection over TCP always hands a stream transport (write and close)
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_lost(self)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while True:
            if self._need is None:
                end = self._buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self._buf[:end]).decode("latin-1")
                del self._buf[: end + 4]
                first, _, rest = head.partition("\r\n")
                self._status = int(first.split(" ", 2)[1])
                length, self.instance = 0, ""
                for line in rest.split("\r\n"):
                    name, _, value = line.partition(":")
                    name = name.strip().lower()
                    if name == "content-length":
                        length = int(value.strip())
                    elif name == "x-sie-instance":
                        self.instance = value.strip()
                self._need = length
            if len(self._buf) < self._need:
                return
            del self._buf[: self._need]
            self._need = None
            self._on_answer(self, self._status)


async def closed_loop(host: str, port: int, request: bytes, connections: int, duration_s: float) -> Result:
    """Each connection keeps one request outstanding for `duration_s`; the ceiling is ok / span_s."""
    loop = asyncio.get_running_loop()
    result = Result()
    sent_at: dict[_Conn, float] = {}
    deadline = time.perf_counter() + duration_s
    done = loop.create_future()
    open_conns = set()

    def answer(conn: _Conn, status: int) -> None:
        now = time.perf_counter()
        result.latencies_s.append(now - sent_at[conn])
        result.statuses.append(status)
        assert conn.transport is not None  # an answer arrives only on a connected transport
        if now < deadline:
            sent_at[conn] = now
            conn.transport.write(request)
        else:
            conn.transport.close()

    def lost(conn: _Conn) -> None:
        open_conns.discard(conn)
        if not open_conns and not done.done():
            done.set_result(None)

    start = time.perf_counter()
    for _ in range(connections):
        _, conn = await loop.create_connection(lambda: _Conn(answer, lost), host, port)
        open_conns.add(conn)
    start = time.perf_counter()
    deadline = start + duration_s
    for conn in list(open_conns):
        sent_at[conn] = time.perf_counter()
        assert conn.transport is not None  # create_connection returns after connection_made
        conn.transport.write(request)
    await asyncio.wait_for(done, duration_s + 30)
    result.span_s = time.perf_counter() - start
    return result


async def open_loop(
    host: str,
    port: int,
    request: bytes | Sequence[bytes],
    schedule: list[float],
    max_connections: int = 64,
    timeout_s: float = 30.0,
) -> Result:
    """Send at the scheduled times (seconds from start) over up to `max_connections` keep-alive
    connections; a request with no idle connection waits for one, and that wait counts as latency.
    With a list of requests, the i-th scheduled one is `request[i % len(request)]`. The answers are
    recorded in the order they come, each with its scheduled time (`Result.scheduled_s`). A request on
    a connection that is lost, or still unanswered `timeout_s` after the last was due, counts as a
    transport error (status 0); so do the ones waiting when a lost connection cannot be replaced."""
    if isinstance(request, bytes | bytearray):
        requests = [bytes(request)]
    else:
        requests = list(request)
    if not requests:
        raise ValueError("open_loop needs at least one request to send")
    loop = asyncio.get_running_loop()
    result = Result()
    idle: deque[_Conn] = deque()
    waiting: deque[tuple[float, bytes]] = deque()  # requests with no connection yet, and when they were due
    busy: dict[_Conn, float] = {}
    everything = len(schedule)
    finished = loop.create_future()
    conns: set[_Conn] = set()
    replacing: set[asyncio.Task[None]] = set()
    start = 0.0

    def record(at: float, status: int, instance: str = "") -> None:
        result.latencies_s.append(time.perf_counter() - start - at)
        result.statuses.append(status)
        result.scheduled_s.append(at)
        result.instances.append(instance)
        if len(result.statuses) == everything and not finished.done():
            finished.set_result(None)

    def send(conn: _Conn, at: float, raw: bytes) -> None:
        busy[conn] = at
        assert conn.transport is not None
        conn.transport.write(raw)

    def answer(conn: _Conn, status: int) -> None:
        record(busy.pop(conn), status, conn.instance)
        if waiting:
            send(conn, *waiting.popleft())
        else:
            idle.append(conn)

    async def replace() -> None:
        """A connection in place of a lost one, for the requests waiting; if none can be opened, they fail."""
        try:
            _, conn = await loop.create_connection(lambda: _Conn(answer, lost), host, port)
        except OSError:
            while waiting:
                record(waiting.popleft()[0], 0)
            return
        conns.add(conn)
        if waiting:
            send(conn, *waiting.popleft())
        else:
            idle.append(conn)

    def lost(conn: _Conn) -> None:
        conns.discard(conn)
        if conn in busy:
            record(busy.pop(conn), 0)
        try:
            idle.remove(conn)
        except ValueError:
            pass
        if waiting and not finished.done():
            task = loop.create_task(replace())
            replacing.add(task)
            task.add_done_callback(replacing.discard)

    for _ in range(min(8, max_connections)):
        _, conn = await loop.create_connection(lambda: _Conn(answer, lost), host, port)
        conns.add(conn)
        idle.append(conn)
    start = time.perf_counter()
    for i, at in enumerate(schedule):
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        this = requests[i % len(requests)]
        if idle:
            send(idle.popleft(), at, this)
        elif len(conns) + len(replacing) < max_connections:
            _, conn = await loop.create_connection(lambda: _Conn(answer, lost), host, port)
            conns.add(conn)
            send(conn, at, this)
        else:
            waiting.append((at, this))
    if everything:
        await asyncio.wait([finished], timeout=timeout_s)
        if not finished.done():  # what is still out counts as failed, not lost from the figures
            for at in list(busy.values()) + [at for at, _ in waiting]:
                record(at, 0)
            busy.clear()
            waiting.clear()
    result.span_s = time.perf_counter() - start
    for task in list(replacing):
        task.cancel()
    for conn in list(conns):
        if conn.transport is not None:
            conn.transport.close()
    return result
