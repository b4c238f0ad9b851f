"""The admin API's listening socket: a bounded number of connections, and TLS handshakes bounded in time
and memory.

Anyone who can reach the admin port (on Kubernetes, every pod: it is the node hosts' and sidecars' control
URL) may open connections before presenting any credential, and each costs the control plane memory until
it is closed: a plain one a few KiB, a TLS one the buffers of asyncio's TLS layer, whose read buffer is
256 KiB per connection from the moment it is accepted (2,000 idle sockets took the control plane from 82
to 679 MiB; sie-xds's limit is 1 GiB). So here (with both: 82 KiB a TLS connection, 5 KiB a plain one):

- at most `max_connections` are open at once, TLS handshakes included: one past them is closed as it is
  accepted, before any byte is read (`CappedListener`, counted as refused), and the ones open are left
  alone. A flood keeps new callers out while it lasts (as a full accept queue would) but cannot take
  the control plane's memory, and ADS (Envoy's routes) is another port.
- a TLS handshake must finish within `handshake_timeout_s` (asyncio's default is 60 s).
- asyncio's TLS read buffer is TLS_READ_BUFFER_BYTES (32 KiB: two of TLS's largest records) in this
  process. asyncio has no per-server setting for it: it is the class attribute `max_size` of
  asyncio.sslproto.SSLProtocol (Python 3.11 to 3.13), set once by `bound_tls_buffers`.

The server is asyncio's own (`loop.create_server` on the capped socket, serving the aiohttp runner's
protocol factory): aiohttp's sites take no handshake timeout.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import weakref
from asyncio import sslproto
from collections.abc import Callable

TLS_READ_BUFFER_BYTES = 32 * 1024
BACKLOG = 1024


def bound_tls_buffers() -> None:
    """Make asyncio's TLS layer allocate TLS_READ_BUFFER_BYTES per connection in this process (see above)."""
    if getattr(sslproto.SSLProtocol, "max_size", 0) > TLS_READ_BUFFER_BYTES:
        sslproto.SSLProtocol.max_size = TLS_READ_BUFFER_BYTES


class _Counted(socket.socket):
    """An accepted connection that counts itself out of its listener once, when closed (asyncio's transport
    closes it) or, failing that, when it is collected."""

    _release: Callable[[], object]

    def close(self) -> None:
        self._release()
        super().close()


class CappedListener(socket.socket):
    """A listening socket whose accept() hands out at most `limit` open connections at once; one accepted
    past that is closed there and then, and `on_refused` is called."""

    def __init__(self, family: socket.AddressFamily, limit: int, on_refused: Callable[[], None]):
        super().__init__(family, socket.SOCK_STREAM)
        self.limit = limit
        self.open = 0
        self._on_refused = on_refused

    def accept(self) -> tuple[socket.socket, object]:
        # asyncio calls this while the listener is readable; BlockingIOError from _accept (no connection
        # waiting) ends its round, as for a plain socket.
        while True:
            fd, address = self._accept()  # type: ignore[attr-defined]
            if self.open < self.limit:
                break
            socket.close(fd)
            self._on_refused()
        conn = _Counted(self.family, self.type, self.proto, fileno=fd)
        self.open += 1
        conn._release = weakref.finalize(conn, self._count_out)  # runs once, whichever comes first
        return conn, address

    def _count_out(self) -> None:
        self.open -= 1


def listener(host: str, port: int, limit: int, on_refused: Callable[[], None]) -> CappedListener:
    """A CappedListener bound to host:port (0: a free port) and listening."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = CappedListener(info[0], limit, on_refused)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        sock.bind(info[4])
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(
    protocol_factory: Callable[[], asyncio.BaseProtocol],
    sock: CappedListener,
    tls: ssl.SSLContext | None,
    handshake_timeout_s: float,
) -> asyncio.Server:
    """Serve `protocol_factory` (an aiohttp runner's `server`) on `sock`, with TLS when `tls` is given."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        protocol_factory,
        sock=sock,
        ssl=tls,
        backlog=BACKLOG,
        ssl_handshake_timeout=handshake_timeout_s if tls is not None else None,
    )
