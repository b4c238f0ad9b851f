"""json_errors(): aiohttp's own answers (no route, wrong method, body too large, a raised HTTPException)
and unexpected handler errors all come out in the one error shape, with their status and headers."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sie.http import json_errors


def _app() -> web.Application:
    app = web.Application(middlewares=[json_errors()], client_max_size=64)

    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    async def teapot(_: web.Request) -> web.Response:
        raise web.HTTPBadRequest(text="plain words")

    async def already(_: web.Request) -> web.Response:
        raise web.HTTPConflict(
            text=json.dumps({"error": {"type": "exists", "message": "m1 exists"}}), content_type="application/json"
        )

    async def broken(_: web.Request) -> web.Response:
        raise RuntimeError("secret internals")

    app.router.add_post("/ok", ok)
    app.router.add_get("/bad", teapot)
    app.router.add_get("/already", already)
    app.router.add_get("/broken", broken)
    return app


@pytest.fixture
async def client():
    async with TestClient(TestServer(_app())) as c:
        yield c


def _shape(body: dict, kind: str) -> None:
    assert set(body) == {"error"} and body["error"]["type"] == kind and body["error"]["message"]


@pytest.mark.parametrize(
    "method,path,data,status,kind",
    [
        ("GET", "/nope", None, 404, "not_found"),
        ("GET", "/ok", None, 405, "method_not_allowed"),
        ("POST", "/ok", b"x" * 1000, 413, "body_too_large"),
        ("GET", "/bad", None, 400, "bad_request"),
        ("GET", "/broken", None, 500, "internal_error"),
    ],
)
async def test_every_error_is_the_one_shape(client, method, path, data, status, kind):
    resp = await client.request(method, path, data=data)
    assert resp.status == status
    assert resp.content_type == "application/json"
    body = await resp.json()
    _shape(body, kind)
    if status == 405:
        assert "POST" in resp.headers["Allow"] and "POST" in body["error"]["message"]
    if status == 500:
        assert "secret internals" not in json.dumps(body)


async def test_a_json_error_a_handler_raises_is_kept(client):
    resp = await client.get("/already")
    assert resp.status == 409
    assert await resp.json() == {"error": {"type": "exists", "message": "m1 exists"}}


async def test_success_is_untouched(client):
    resp = await client.post("/ok", data=b"{}")
    assert resp.status == 200 and await resp.json() == {"ok": True}
