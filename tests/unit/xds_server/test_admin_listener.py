"""xds_server.admin_listener: the admin API's connections are bounded in number (handshakes included), a
TLS handshake in time, and asyncio's TLS read buffer in size."""

from __future__ import annotations

import asyncio
import socket
from asyncio import sslproto

import aiohttp
import pytest
from aiohttp import web

from sie.auth import CredentialDir
from sie.auth.store import TRUST, read_trust_bundle
from sie.auth.tls import server_context
from xds_server import admin_listener


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


class Served:
    def __init__(self, limit: int, tls=None, handshake_timeout_s: float = 10.0):
        self.limit, self.tls, self.handshake_timeout_s = limit, tls, handshake_timeout_s
        self.refused = 0

    async def __aenter__(self) -> Served:
        app = web.Application()
        app.router.add_get("/healthz", _ok)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.sock = admin_listener.listener("127.0.0.1", 0, self.limit, self._refused)
        self.port = self.sock.getsockname()[1]
        self.server = await admin_listener.serve(self.runner.server, self.sock, self.tls, self.handshake_timeout_s)
        return self

    def _refused(self) -> None:
        self.refused += 1

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.runner.cleanup()


async def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `within_s`, reading nothing else."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    try:
        data = await asyncio.wait_for(loop.sock_recv(sock, 1), within_s)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return data == b""


async def _wait(predicate, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_connection_past_the_limit_is_closed_at_once_and_a_freed_slot_serves_again():
    async with Served(limit=4) as served:
        held = [socket.create_connection(("127.0.0.1", served.port)) for _ in range(4)]
        await _wait(lambda: served.sock.open == 4)
        extra = socket.create_connection(("127.0.0.1", served.port))
        assert await _closed_by_peer(extra, 5.0)
        assert served.refused == 1 and served.sock.open == 4
        for sock in held[:2]:
            assert not await _closed_by_peer(sock, 0.05)  # the ones open are left alone
        held.pop().close()
        await _wait(lambda: served.sock.open == 3)  # counted out when the server closes its side
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{served.port}/healthz") as resp:
                assert resp.status == 200
        for sock in held + [extra]:
            sock.close()
        await _wait(lambda: served.sock.open == 0)


async def test_a_tls_handshake_that_never_comes_is_closed_at_its_timeout_and_frees_its_slot(tmp_path):
    creds = CredentialDir(tmp_path / "credentials").ensure()
    tls = server_context(creds.admin_certificate(["localhost"], ["127.0.0.1"]))
    async with Served(limit=2, tls=tls, handshake_timeout_s=0.5) as served:
        silent = socket.create_connection(("127.0.0.1", served.port))
        await _wait(lambda: served.sock.open == 1)
        assert await _closed_by_peer(silent, 5.0)  # asyncio's own default would hold it 60 s
        await _wait(lambda: served.sock.open == 0)
        silent.close()
        pinned = read_trust_bundle(creds.file(TRUST)).tls
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pinned)) as session:
            async with session.get(f"https://127.0.0.1:{served.port}/healthz") as resp:
                assert resp.status == 200


def test_the_tls_read_buffer_is_bounded(monkeypatch):
    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", 256 * 1024)
    admin_listener.bound_tls_buffers()
    assert sslproto.SSLProtocol.max_size == admin_listener.TLS_READ_BUFFER_BYTES <= 32 * 1024


@pytest.mark.parametrize("text", ["15", "1000001", "x"])
def test_the_connection_limit_is_bounded_where_it_enters(text):
    from sie.errors import SpecError
    from xds_server.settings import parse_args

    with pytest.raises((SpecError, SystemExit)):
        parse_args(["--admin-max-connections", text])
