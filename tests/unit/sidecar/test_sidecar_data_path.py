"""The data path (sidecar/proxy.py) in this process, in front of a scripted worker on loopback: the token
limit under every shape of sampling_params, the worker's answer head, the requests a sleeping instance
holds, and a client that hangs up as a stream's head goes out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from sidecar import lifecycle
from sidecar.admission import Gate, Limits
from sidecar.lifecycle import Lifecycle, Probe
from sidecar.metrics import Metrics, metric_labels
from sidecar.proxy import Proxy, token_problem
from sidecar.status import Status
from sidecar.waking import Waker
from sidecar.window import SlidingWindow
from sidecar.worker_http import MAX_ANSWER_BYTES, WorkerHTTP
from sie import metric_names as M
from sie.http import json_errors
from sie_testing.polling import eventually
from sie_testing.scripted_worker import ScriptedWorker

pytestmark = pytest.mark.timeout(30)

LIMIT = 100
TOO_MANY = f"is 101, more than this model allows ({LIMIT})"


@pytest.mark.parametrize(
    "doc, problem",
    [
        ({"sampling_params": {"max_new_tokens": 101}}, ("sampling_params.max_new_tokens", TOO_MANY)),
        ({"sampling_params": {"max_new_tokens": 100}}, None),
        # SGLang's /generate takes one sampling_params per prompt: each is held to the limit
        (
            {"sampling_params": [{"max_new_tokens": 10}, {"max_new_tokens": 101}]},
            ("sampling_params[1].max_new_tokens", TOO_MANY),
        ),
        ({"sampling_params": [{"max_new_tokens": 100}, {}, {"max_new_tokens": None}]}, None),
        ({"sampling_params": []}, None),
        (
            {"sampling_params": [{"max_new_tokens": True}]},
            ("sampling_params[0].max_new_tokens", "must be a non-negative integer"),
        ),
        ({"sampling_params": [{}, None]}, ("sampling_params[1]", "must be an object")),
        ({"sampling_params": [[{"max_new_tokens": 101}]]}, ("sampling_params[0]", "must be an object")),
        ({"sampling_params": "max_new_tokens=101"}, ("sampling_params", "must be an object or a list of objects")),
        ({"sampling_params": 101}, ("sampling_params", "must be an object or a list of objects")),
        ({"sampling_params": None}, None),
        ({"max_tokens": 101, "sampling_params": [{}]}, ("max_tokens", TOO_MANY)),
    ],
)
def test_the_token_limit_holds_under_every_shape_of_sampling_params(doc, problem):
    assert token_problem(doc, LIMIT) == problem
    assert token_problem(doc, None) is None  # a model without a limit leaves the body to its worker


@dataclass
class Rig:
    proxy: Proxy
    url: str
    port: int
    http: aiohttp.ClientSession
    metrics: Metrics
    waker: Waker | None

    def by_code(self) -> dict[str, float]:
        return {
            x.labels["code"]: x.value
            for f in text_string_to_metric_families(self.metrics.exposition().decode())
            for x in f.samples
            if x.name == M.REQUESTS
        }


class Token:
    def headers(self) -> dict[str, str]:
        return {}


def ready() -> Status:
    status = Status("m-0", Lifecycle())
    status.apply(lifecycle.on_probe, Probe.OK)
    return status


@pytest.fixture
async def rig() -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    """Builds a Proxy as sidecar.main does, on a port of its own, in front of the worker on `worker_port`."""
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def make(
            worker_port: int,
            *,
            status: Status | None = None,
            wake_url: str | None = None,
            max_concurrent: int = 1,
            max_queue: int = 1,
            handler_cancellation: bool = True,
        ) -> Rig:
            loop = asyncio.get_running_loop()
            status = status or ready()
            gate = Gate(Limits(max_concurrent, max_queue, 5.0), loop)
            stack.callback(gate.close)
            metrics = Metrics(metric_labels("m", "llm", "P1", "1"), live=lambda: (0, 0, None, None))
            # As sidecar.main builds it: it holds no more requests than the gate can take.
            waker = (
                Waker(status, http, wake_url, Token(), 10.0, loop.time, max_held=max_concurrent + max_queue)
                if wake_url is not None
                else None
            )
            worker = WorkerHTTP("127.0.0.1", worker_port)
            stack.push_async_callback(worker.close)
            proxy = Proxy(
                worker=worker,
                instance_id="m-0",
                model_id="m",
                schema=None,
                paths=frozenset({"/generate"}),
                max_body_bytes=1 << 20,
                max_new_tokens=LIMIT,
                retry_on_worker_loss=True,
                gate=gate,
                status=status,
                metrics=metrics,
                window=SlidingWindow(),
                clock=loop.time,
                on_worker_unreachable=lambda: None,
                worker_timeout_s=5.0,
                connect_timeout_s=1.0,
                waker=waker,
            )
            app = web.Application(middlewares=[json_errors()])
            app.router.add_route("*", "/{path:.*}", proxy.handle)
            runner = web.AppRunner(
                app, access_log=None, handle_signals=False, handler_cancellation=handler_cancellation
            )
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
            return Rig(proxy, f"http://127.0.0.1:{port}/generate", port, http, metrics, waker)

        yield make


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Type: text/event-stream\r\n\r\n",
        b"HTTP/1.1 200 OK\rX-Evil: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: " + str(MAX_ANSWER_BYTES + 1).encode() + b"\r\n\r\n",
    ],
    ids=["cr-in-a-value", "cr-in-a-streams-value", "cr-in-the-reason", "nul-in-a-value", "bad-length", "too-large"],
)
async def test_a_worker_answer_head_with_a_control_character_is_the_workers_error_not_a_broken_reply(rig, head):
    """Not passed on (aiohttp would send the client an empty or mis-framed reply), and not retried either:
    the worker answered, and another instance would answer the same."""
    async with ScriptedWorker(lambda n: head + b"{}", keep_alive=False) as worker:
        r = await rig(worker.port)
        async with r.http.post(r.url, json={"text": "a"}) as resp:
            doc = await resp.json()
            assert resp.status == 502 and "x-sie-retryable" not in resp.headers, doc
            assert doc["error"]["type"] == "worker_error" and "cannot be passed on" in doc["error"]["message"]
        assert r.by_code() == {"502": 1.0}


async def test_headers_named_by_a_second_connection_header_of_the_worker_stop_here(rig):
    answer = (
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nConnection: X-Secret\r\nX-Secret: s\r\nX-End: e\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    async with ScriptedWorker(lambda n: answer, keep_alive=False) as worker:
        r = await rig(worker.port)
        async with r.http.post(r.url, json={"text": "a"}) as resp:
            assert resp.status == 200 and await resp.read() == b"{}"
            assert "X-Secret" not in resp.headers and resp.headers["X-End"] == "e"


async def test_a_list_of_sampling_params_over_the_limit_never_reaches_the_worker(rig):
    async with ScriptedWorker(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", keep_alive=False) as worker:
        r = await rig(worker.port)
        body = {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 10**6}]}
        async with r.http.post(r.url, json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["type"] == "token_limit"
            assert error["field"] == "sampling_params[1].max_new_tokens" and error["max_new_tokens"] == LIMIT
        assert worker.requests == []


async def test_a_sleeping_instance_holds_no_more_than_the_gate_can_take_and_refuses_the_rest_before_the_body(rig):
    status = ready()
    status.apply(lifecycle.sleep)
    status.apply(lifecycle.released)
    go = asyncio.Event()

    async def wake(request: web.Request) -> web.Response:  # the node host: wakes the instance when told
        await go.wait()
        status.apply(lifecycle.wake)
        status.apply(lifecycle.on_probe, Probe.OK)
        return web.json_response({"state": "ready"})

    node_app = web.Application()
    node_app.router.add_post("/wake", wake)
    node = web.AppRunner(node_app, access_log=None)
    await node.setup()
    held: list[asyncio.Task[int]] = []
    try:
        await web.TCPSite(node, "127.0.0.1", 0).start()
        async with ScriptedWorker(
            lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", keep_alive=False
        ) as worker:
            wake_url = f"http://127.0.0.1:{node.addresses[0][1]}/wake"
            r = await rig(worker.port, status=status, wake_url=wake_url, max_concurrent=1, max_queue=1)
            assert r.waker is not None

            async def post() -> int:
                async with r.http.post(r.url, json={"text": "a"}) as resp:
                    return resp.status

            held = [asyncio.create_task(post()) for _ in range(2)]
            await eventually(lambda: r.waker.held == 2, timeout=5.0, what="two held requests")
            # One more, whose body never comes: refused at once with the Gate's 429, its body never awaited.
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
                assert head.startswith(b"HTTP/1.1 429 "), head
                length = next(int(x[15:]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:"))
                error = json.loads(await reader.readexactly(length))["error"]
                assert error["type"] == "queue_full" and error["max_queue"] == 1
            finally:
                writer.close()
            assert r.waker.held == 2 and worker.requests == []
            go.set()
            assert await asyncio.gather(*held) == [200, 200]
            assert r.waker.held == 0 and r.waker.wakes == 1 and len(worker.requests) == 2
            assert r.by_code() == {"429": 1.0, "200": 2.0}
    finally:
        go.set()
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await node.cleanup()


async def test_a_client_gone_before_a_streams_head_goes_out_is_counted_as_its_hang_up(rig):
    asked, client_gone = asyncio.Event(), asyncio.Event()

    async def stream(n: int) -> AsyncIterator[bytes]:
        asked.set()
        await client_gone.wait()
        yield b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n"

    async with ScriptedWorker(stream, keep_alive=False) as worker:
        # The server cancels a handler once it learns that its client left; a write to the closed connection
        # can come first (the same loop turn), and raises instead. Without cancellation that order is sure.
        r = await rig(worker.port, handler_cancellation=False)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", r.port)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            await asyncio.wait_for(asked.wait(), 5.0)
            writer.close()
            await writer.wait_closed()
            await asyncio.sleep(0.1)  # the server sees the connection end
        finally:
            client_gone.set()
        await eventually(lambda: r.proxy.answered_total == 1, timeout=5.0, what="the request counted")
        assert r.by_code() == {"499": 1.0}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "a", "sampling_params": {"top_p": 0, "temperature": 1.0}}, "sampling_params.top_p"),
        ({"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1}]}, "sampling_params[1].temperature"),
    ],
)
async def test_sampling_parameters_out_of_range_never_reach_the_worker(rig, body, field):
    """The sidecar is the first boundary: a top_p of 0 failed every generation in the torch worker's batch."""
    async with ScriptedWorker(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", keep_alive=False) as worker:
        r = await rig(worker.port)
        async with r.http.post(r.url, json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and "x-sie-retryable" not in resp.headers
            assert error["type"] == "invalid_sampling_params" and error["field"] == field
            assert "outside" in error["message"] and field in error["message"]
        async with r.http.post(r.url, json={"text": "a", "sampling_params": {"temperature": 1e-40}}) as resp:
            assert resp.status == 200  # greedy, as vLLM treats it
        assert worker.connections == 1 and r.by_code() == {"400": 1.0, "200": 1.0}
