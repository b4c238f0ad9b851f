"""bench/rawhttp.py's open loop against a real HTTP server on loopback: every scheduled request is sent,
in turn from a list when given one, and each answer is recorded with its scheduled time."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from bench import rawhttp
from sie_testing.ports import free_port


async def test_open_loop_sends_the_requests_in_turn_and_records_when_each_was_due():
    seen: list[int] = []

    async def infer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body["i"])
        return web.json_response({"ok": True}, status=200 if body["i"] != 2 else 422)

    app = web.Application()
    app.router.add_post("/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        requests = [rawhttp.post("/infer", json.dumps({"i": i}).encode()) for i in range(3)]
        schedule = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
        result = await asyncio.wait_for(rawhttp.open_loop("127.0.0.1", port, requests, schedule), 30)
    finally:
        await runner.cleanup()

    assert sorted(seen) == [0, 0, 0, 1, 1, 2, 2]  # the i-th scheduled request is requests[i % 3]
    assert sorted(result.scheduled_s) == schedule
    assert len(result.latencies_s) == len(result.statuses) == len(schedule)
    by_time = dict(zip(result.scheduled_s, result.statuses))
    assert [by_time[t] for t in schedule] == [200, 200, 422, 200, 200, 422, 200]
    assert all(lat >= 0 for lat in result.latencies_s)


async def test_one_request_for_all_still_works():
    async def infer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/infer", infer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        result = await asyncio.wait_for(
            rawhttp.open_loop("127.0.0.1", port, rawhttp.post("/infer", b"{}"), [0.0, 0.005, 0.01]), 30
        )
    finally:
        await runner.cleanup()
    assert result.statuses == [200, 200, 200] and result.ok == 3
