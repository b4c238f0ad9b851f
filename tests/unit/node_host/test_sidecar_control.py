"""The node host's calls to its sidecars and workers on loopback read at most MAX_ANSWER_BYTES of an
answer: a sidecar or worker that is not what it should be cannot make the node host hold a huge body."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from node_host.sidecar_control import MAX_ANSWER_BYTES, HttpSidecarControl
from sie.auth.http import TokenSource

RECORD = {"instance_id": "a", "in_flight": 0}
HUGE = b'{"pad": "' + b"x" * (MAX_ANSWER_BYTES + 10) + b'"}'


async def sized(_request: web.Request) -> web.Response:
    return web.Response(body=HUGE, content_type="application/json")


async def streamed(request: web.Request) -> web.StreamResponse:
    """The same body without a Content-Length: only counting what arrives bounds it."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    for start in range(0, len(HUGE), 8192):
        await resp.write(HUGE[start : start + 8192])
    await resp.write_eof()
    return resp


async def good_state(request: web.Request) -> web.Response:
    assert request.headers["Authorization"] == "Bearer node-token"
    return web.json_response(RECORD)


async def refused(_request: web.Request) -> web.Response:
    return web.json_response({"error": {"type": "not_idle", "message": "2 in flight"}}, status=409)


@pytest.fixture
async def control() -> AsyncIterator[tuple[HttpSidecarControl, str]]:
    app = web.Application()
    app.router.add_get("/ok/-/state", good_state)
    app.router.add_get("/sized/-/state", sized)
    app.router.add_get("/streamed/-/state", streamed)
    app.router.add_get("/sized/health", sized)
    app.router.add_get("/streamed/health", streamed)
    app.router.add_post("/sized/-/sleep", sized)
    app.router.add_post("/streamed/-/sleep", streamed)
    app.router.add_post("/busy/-/sleep", refused)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            # The address doubles as a path prefix here, so one server plays every kind of peer.
            yield HttpSidecarControl(session, TokenSource(token="node-token")), f"{host}:{port}"
    finally:
        await runner.cleanup()


async def test_a_state_record_within_the_bound_is_read(control):
    client, address = control
    assert await client.state(f"{address}/ok") == RECORD


@pytest.mark.parametrize("peer", ["sized", "streamed"])
async def test_an_answer_past_the_bound_is_no_answer(control, peer):
    client, address = control
    assert await client.state(f"{address}/{peer}") is None
    assert await client.health(f"{address}/{peer}") is None
    outcome = await client.sleep(f"{address}/{peer}", reason="eviction", timeout_s=1)
    assert not outcome.ok and outcome.status == 0 and f"more than {MAX_ANSWER_BYTES}" in outcome.error


async def test_a_refusal_keeps_its_status_and_message(control):
    client, address = control
    outcome = await client.sleep(f"{address}/busy", reason="eviction", timeout_s=1)
    assert (outcome.ok, outcome.status, outcome.error) == (False, 409, "2 in flight")
