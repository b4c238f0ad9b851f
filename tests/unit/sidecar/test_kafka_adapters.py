"""The connector's adapters to the sidecar: admission through the sidecar's Gate with a bounded share
(an HTTP burst is never starved by a topic's backlog), the worker call's error mapping, the schema
check, and following the instance's lifecycle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from sidecar import lifecycle
from sidecar.admission import Gate, Limits, Verdict
from sidecar.kafka.adapters import (
    AdmissionRefused,
    GateAdmission,
    follow_lifecycle,
    http_worker_caller,
    kafka_share,
    schema_validator,
    worker_call,
    worker_caller,
)
from sidecar.kafka.handler import CallWorker, WorkerFailed, WorkerRejected, WorkerUnavailable
from sidecar.status import Status
from sidecar.worker_http import WorkerHTTP
from sie.spec import FieldSpec, IOSchema, Priority
from sie_testing.tansu import free_port


@pytest.mark.parametrize(
    "max_concurrent, priority, share",
    [
        (1, Priority.P0, 1),
        (2, Priority.P0, 1),
        (8, Priority.P0, 4),
        (8, Priority.P1, 4),
        (8, Priority.P2, 2),
        (3, Priority.P2, 1),
        (64, Priority.P2, 16),
    ],
)
def test_kafka_share(max_concurrent, priority, share):
    assert kafka_share(max_concurrent, priority) == share


async def test_kafka_work_takes_at_most_its_share_so_http_requests_are_admitted_at_once():
    gate = Gate(Limits(max_concurrent=4, max_queue=8, max_wait_s=5.0), asyncio.get_running_loop())
    admission = GateAdmission(gate, share=2)
    release = asyncio.Event()
    entered: list[int] = []

    async def kafka_request(i: int) -> None:
        async with admission.slot(Priority.P2):
            entered.append(i)
            await release.wait()

    backlog = [asyncio.create_task(kafka_request(i)) for i in range(10)]  # a deep topic
    await asyncio.sleep(0.01)
    assert entered == [0, 1] and gate.core.in_flight == 2 and gate.core.queued == 0
    # An HTTP burst: the two other slots are free, and no Kafka request waits ahead of it in the queue.
    http = [gate.arrive()[0] for _ in range(2)]
    assert http == [Verdict.ADMITTED, Verdict.ADMITTED]
    verdict, waiter = gate.arrive()
    assert verdict is Verdict.QUEUED and gate.core.queued == 1  # the third waits only for a slot to free
    release.set()
    gate.release()  # the two HTTP requests finish
    gate.release()
    assert await gate.wait(waiter) is Verdict.ADMITTED
    gate.release()
    await asyncio.gather(*backlog)
    assert sorted(entered) == list(range(10)) and gate.core.idle
    gate.close()


async def test_a_refusal_by_the_gate_is_retryable():
    gate = Gate(Limits(max_concurrent=1, max_queue=0, max_wait_s=1.0), asyncio.get_running_loop())
    assert gate.arrive()[0] is Verdict.ADMITTED  # an HTTP request holds the only slot
    with pytest.raises(AdmissionRefused, match="queue_full"):
        async with GateAdmission(gate, share=1).slot(Priority.P1):
            pass
    gate.release()
    assert gate.core.idle
    gate.close()


@pytest.fixture
async def worker_url():
    async def infer(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer wk":
            return web.json_response({"error": {"type": "unauthenticated", "message": "no key"}}, status=401)
        text = (await request.json())["text"]
        if text == "slow":
            await asyncio.sleep(1.0)
        status = {"reject": 422, "boom": 500, "asleep": 503, "busy": 429}.get(text, 200)
        return web.json_response({"text": text}, status=status)

    app = web.Application()
    app.router.add_post("/infer", infer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


@pytest.mark.parametrize(
    "text, error",
    [
        ("reject", WorkerRejected),
        ("boom", WorkerFailed),
        ("asleep", WorkerUnavailable),
        ("busy", WorkerUnavailable),
        ("slow", WorkerFailed),
    ],
)
@pytest.mark.parametrize("client", ["aiohttp", "own"])
async def test_worker_answers_map_to_what_the_handler_does_next(worker_url, text, error, client):
    async with caller(client, worker_url, timeout_s=0.2) as call:
        with pytest.raises(error):
            await call(f'{{"text": "{text}"}}'.encode())


@pytest.mark.parametrize("client", ["aiohttp", "own"])
async def test_the_worker_answer_comes_back_as_bytes(worker_url, client):
    async with caller(client, worker_url + "/", 1.0) as call:
        assert await call(b'{"text": "ok"}') == b'{"text": "ok"}'
        assert await call(b'{"text": "again"}') == b'{"text": "again"}'


@pytest.mark.parametrize("client", ["aiohttp", "own"])
async def test_a_worker_that_is_not_listening_is_unavailable_not_failed(client):
    async with caller(client, f"http://127.0.0.1:{free_port()}", 1.0) as call:
        with pytest.raises(WorkerUnavailable, match="cannot connect"):
            await call(b"{}")


async def test_a_worker_that_dies_on_a_call_fails_it_and_it_is_written_once():
    """The worker read the batch and its connection ended without an answer (it crashed on it): a
    failed call (retried a bounded number of times by the handler), not an unavailable worker, and
    not sent again by the client."""
    requests = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await reader.readuntil(b"\r\n\r\n")
        requests += 1
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with caller("own", f"http://127.0.0.1:{port}", 1.0) as call:
        with pytest.raises(WorkerFailed, match="ended before the worker answered"):
            await call(b"{}")
    server.close()
    await server.wait_closed()
    assert requests == 1


@pytest.mark.parametrize(
    "url, own",
    [
        ("http://127.0.0.1:9", True),
        ("http://[::1]:9/", True),
        ("https://127.0.0.1:9", False),
        ("http://127.0.0.1:9/prefix", False),
    ],
)
async def test_a_plain_http_worker_gets_the_connectors_own_connections(url, own):
    async with aiohttp.ClientSession() as session:
        _call, on_close = worker_call(session, url, 1.0, "wk", max_idle=2)
        assert (on_close is not None) == own
        if on_close is not None:
            await on_close()


@asynccontextmanager
async def caller(client: str, url: str, timeout_s: float) -> AsyncIterator[CallWorker]:
    """The worker call on aiohttp (an https worker) or on the connector's own connections (http)."""
    if client == "aiohttp":
        async with aiohttp.ClientSession() as session:
            yield worker_caller(session, url, timeout_s, "wk")
        return
    target = urlsplit(url)
    worker = WorkerHTTP(target.hostname or "", target.port or 80, {"Authorization": "Bearer wk"})
    try:
        yield http_worker_caller(worker, timeout_s)
    finally:
        await worker.close()


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"text": "hi"}, None),
        ({}, "field 'text' required field is missing"),
        ({"text": 1}, "field 'text' must be a string"),
    ],
)
def test_schema_validator_uses_the_sidecars_check(body, reason):
    validate = schema_validator(IOSchema(fields=[FieldSpec(name="text", type="string")]))
    got = validate(body)
    assert got == reason if reason is None else got.startswith(reason)


def test_without_a_schema_everything_passes():
    assert schema_validator(None)({"anything": 1}) is None


class RecordingConnector:
    def __init__(self):
        self.calls: list[str] = []

    async def start(self):
        self.calls.append("start")

    async def drain(self):
        self.calls.append("drain")


async def test_the_connector_consumes_exactly_while_the_instance_serves():
    status = Status("a")
    connector = RecordingConnector()
    task = asyncio.create_task(follow_lifecycle(connector, status))

    async def settle():
        for _ in range(5):
            await asyncio.sleep(0)

    await settle()
    assert connector.calls == ["drain"]  # loading: not consuming
    status.apply(lifecycle.on_probe, lifecycle.Probe.OK)
    await settle()
    assert connector.calls[-1] == "start"
    status.apply(lifecycle.sleep)  # draining for sleep
    await settle()
    assert connector.calls[-1] == "drain"
    status.apply(lifecycle.released)  # sleeping: still not consuming, no extra call
    await settle()
    assert connector.calls == ["drain", "start", "drain"]
    status.apply(lifecycle.wake)
    status.apply(lifecycle.on_probe, lifecycle.Probe.OK)  # woken and healthy: rejoin
    await settle()
    assert connector.calls == ["drain", "start", "drain", "start"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
