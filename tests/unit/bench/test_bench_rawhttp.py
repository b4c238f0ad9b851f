"""bench/rawhttp.py's open loop against real HTTP servers on loopback: every scheduled request is sent,
in turn from a list when given one, and each answer is recorded with its scheduled time, also when
requests wait for a connection, and a lost connection fails its request instead of hanging the run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from bench import rawhttp
from sie_testing.ports import free_port


@contextlib.asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_post("/infer", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_open_loop_sends_the_requests_in_turn_and_records_when_each_was_due():
    seen: list[int] = []

    async def infer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body["i"])
        return web.json_response({"ok": True}, status=200 if body["i"] != 2 else 422)

    async with serving(infer) as port:
        requests = [rawhttp.post("/infer", json.dumps({"i": i}).encode()) for i in range(3)]
        schedule = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
        result = await asyncio.wait_for(rawhttp.open_loop("127.0.0.1", port, requests, schedule), 30)

    assert sorted(seen) == [0, 0, 0, 1, 1, 2, 2]  # the i-th scheduled request is requests[i % 3]
    assert sorted(result.scheduled_s) == schedule
    assert len(result.latencies_s) == len(result.statuses) == len(schedule)
    by_time = dict(zip(result.scheduled_s, result.statuses))
    assert [by_time[t] for t in schedule] == [200, 200, 422, 200, 200, 422, 200]


async def test_one_request_for_all_still_works():
    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    async with serving(infer) as port:
        result = await asyncio.wait_for(
            rawhttp.open_loop("127.0.0.1", port, rawhttp.post("/infer", b"{}"), [0.0, 0.005, 0.01]), 30
        )
    assert result.statuses == [200, 200, 200] and result.ok == 3


async def test_requests_that_wait_for_the_one_connection_keep_their_own_body_and_time():
    seen: list[int] = []

    async def slow(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body["i"])
        await asyncio.sleep(0.02)  # longer than the gaps below: the next requests queue
        return web.json_response({}, status=200 + body["i"], headers={"x-sie-instance": f"inst-{body['i']}"})

    async with serving(slow) as port:
        requests = [rawhttp.post("/infer", json.dumps({"i": i}).encode()) for i in range(4)]
        schedule = [0.0, 0.001, 0.002, 0.003, 0.004, 0.005]
        result = await asyncio.wait_for(rawhttp.open_loop("127.0.0.1", port, requests, schedule, max_connections=1), 30)

    assert seen == [0, 1, 2, 3, 0, 1]  # one connection: sent in schedule order, each its own body
    assert result.scheduled_s == schedule
    assert result.statuses == [200, 201, 202, 203, 200, 201]
    assert result.instances == ["inst-0", "inst-1", "inst-2", "inst-3", "inst-0", "inst-1"]
    # the wait for the connection counts: the last one waited for the five before it
    assert result.latencies_s[-1] >= 5 * 0.02


async def test_a_lost_connection_fails_its_request_and_the_waiting_ones_go_on_a_new_one():
    async def drop_the_first(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["i"] == 0:
            await asyncio.sleep(0.02)
            assert request.transport is not None
            request.transport.close()  # no answer: the client sees the connection lost
            return web.Response()
        return web.json_response({})

    async with serving(drop_the_first) as port:
        requests = [rawhttp.post("/infer", json.dumps({"i": i}).encode()) for i in range(3)]
        result = await asyncio.wait_for(
            rawhttp.open_loop("127.0.0.1", port, requests, [0.0, 0.001, 0.002], max_connections=1), 30
        )

    assert sorted(zip(result.scheduled_s, result.statuses)) == [(0.0, 0), (0.001, 200), (0.002, 200)]


async def test_an_unanswered_request_counts_as_failed_after_the_timeout():
    async def never(request: web.Request) -> web.Response:
        await asyncio.sleep(2)  # far past the timeout below (and short, for the server's cleanup)
        return web.json_response({})

    async with serving(never) as port:
        result = await asyncio.wait_for(
            rawhttp.open_loop("127.0.0.1", port, rawhttp.post("/infer", b"{}"), [0.0, 0.001], timeout_s=0.2), 30
        )
    assert result.statuses == [0, 0] and sorted(result.scheduled_s) == [0.0, 0.001]
