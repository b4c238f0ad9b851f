"""The connector's adapters to the sidecar: admission through the sidecar's Gate with a bounded share
(an HTTP burst is never starved by a topic's backlog), the worker call's error mapping, the schema
check, and following the instance's lifecycle."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from sidecar import lifecycle
from sidecar.admission import Gate, Limits, Verdict
from sidecar.kafka import standalone
from sidecar.kafka.adapters import (
    AdmissionRefused,
    GateAdmission,
    follow_lifecycle,
    kafka_share,
    schema_validator,
    worker_caller,
)
from sidecar.kafka.handler import CallWorker, WorkerFailed, WorkerRejected, WorkerUnavailable
from sidecar.kafka.settings import ConnectorSettings
from sidecar.status import Status
from sidecar.worker_http import WorkerHTTP
from sie.spec import FieldSpec, IOSchema, Priority
from sie_testing.credentials import Credentials
from sie_testing.scripted_worker import ScriptedWorker
from sie_testing.tansu import free_port

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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

    async with serving("/infer", infer) as url:
        yield url


@asynccontextmanager
async def serving(path: str, handler: Handler) -> AsyncIterator[str]:
    """A worker on loopback answering POST `path` with `handler`; yields its base URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
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
async def test_worker_answers_map_to_what_the_handler_does_next(worker_url, text, error):
    async with caller(worker_url, timeout_s=0.2) as call:
        with pytest.raises(error):
            await call(f'{{"text": "{text}"}}'.encode())


async def test_the_worker_answer_comes_back_as_bytes(worker_url):
    async with caller(worker_url + "/", 1.0) as call:
        assert await call(b'{"text": "ok"}') == b'{"text": "ok"}'
        assert await call(b'{"text": "again"}') == b'{"text": "again"}'


async def test_a_worker_that_is_not_listening_is_unavailable_not_failed():
    async with caller(f"http://127.0.0.1:{free_port()}", 1.0) as call:
        with pytest.raises(WorkerUnavailable, match="cannot connect"):
            await call(b"{}")


async def test_a_worker_that_dies_on_a_call_fails_it_and_it_is_written_once():
    """The worker read the batch and its connection ended without an answer (it crashed on it): a
    failed call (retried a bounded number of times by the handler), not an unavailable worker, and
    not sent again by the client."""
    async with ScriptedWorker(lambda n: None) as worker, caller(f"http://127.0.0.1:{worker.port}", 1.0) as call:
        with pytest.raises(WorkerFailed, match="ended before the worker answered"):
            await call(b"{}")
    assert len(worker.requests) == 1


async def test_a_worker_served_under_a_path_is_called_there():
    paths: list[str] = []

    async def infer(request: web.Request) -> web.Response:
        paths.append(request.path)
        return web.json_response({"ok": True})

    async with serving("/prefix/infer", infer) as url, caller(url + "/prefix/", 1.0) as call:
        assert await call(b"{}") == b'{"ok": true}'
    assert paths == ["/prefix/infer"]


@asynccontextmanager
async def caller(url: str, timeout_s: float) -> AsyncIterator[CallWorker]:
    """The worker call as connector_for builds it, on the connector's own connections."""
    worker = WorkerHTTP.from_url(url, {"Authorization": "Bearer wk"})
    try:
        yield worker_caller(worker, url.rstrip("/") + "/infer", timeout_s)
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


@pytest.fixture
def standalone_args(tmp_path):
    """The standalone connector's arguments for a valid spec and credentials; a test changes one."""
    spec = {
        "spec": {
            "model": {"name": "scorer", "service_type": "scoring", "priority_level": "P2"},
            "backend": {"type": "sklearn"},
            "kafka_input": {"bootstrap_servers": "127.0.0.1:9", "topic": "in", "output_topic": "out", "group_id": "g"},
        }
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    creds = Credentials.create(tmp_path)
    _, key_file = creds.worker_key(tmp_path / "secrets")
    return {
        "--spec-file": str(tmp_path / "spec.json"),
        "--worker-url": "http://127.0.0.1:9",
        "--worker-key-file": str(key_file),
        "--trust-file": str(creds.trust_file),
    }


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--worker-url", "ftp://127.0.0.1:9", "a worker URL is http(s)://host[:port][/path]"),
        ("--worker-url", "http://127.0.0.1:9/?q=1", "a worker URL is http(s)://host[:port][/path]"),
        ("--worker-url", "127.0.0.1:9", "a worker URL is http(s)://host[:port][/path]"),
        ("--worker-key-file", "/nonexistent/key", "cannot read the worker key"),
        ("--trust-file", "/etc/hostname", ""),
        ("--spec-file", "/nonexistent/spec.json", "cannot read the spec file"),
        ("--max-record-bytes", "1000", "max_record_bytes is 1000; it must be at least 4096"),
        ("--heartbeat-interval-ms", "10000", "must be under session_timeout_ms"),
        ("--commit-interval-s", "-1", "commit_interval_s is -1.0"),
    ],
)
def test_the_standalone_connector_refuses_what_it_cannot_use_in_one_line(standalone_args, capsys, flag, value, says):
    """Exit 2 and one line that says why, before it listens or joins a group: no traceback."""
    argv = [item for pair in {**standalone_args, flag: value}.items() for item in pair]
    assert standalone.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cannot start the connector: ") and says in err and "Traceback" not in err


def test_the_standalone_connector_has_a_flag_for_each_tunable_and_passes_what_is_given(standalone_args, monkeypatch):
    """Each ConnectorSettings field that is not the spec's or the instance's is a flag, named after it; a
    flag given reaches the connector's settings, one not given leaves the field's default."""
    tunables = [f.name for f in dataclasses.fields(ConnectorSettings) if f.metadata.get("cli", True)]
    help_text = standalone.build_parser().format_help()
    assert tunables and all(f"--{name.replace('_', '-')}" in help_text for name in tunables)

    built: list[ConnectorSettings] = []

    def capture(spec, instance_id, **kwargs):
        built.append(
            ConnectorSettings.from_spec(
                spec,
                instance_id,
                **{k: v for k, v in kwargs.items() if k not in ("worker_url", "worker_key", "gate", "registry")},
            )
        )
        raise ValueError("stop here")

    monkeypatch.setattr(standalone, "connector_for", capture)
    argv = [item for pair in standalone_args.items() for item in pair]
    assert standalone.main([*argv, "--max-record-bytes", "65536", "--commit-interval-s", "0"]) == 2
    (settings,) = built
    assert settings.max_record_bytes == 65536 and settings.commit_interval_s == 0.0
    assert settings.session_timeout_ms == 10_000, "a flag not given leaves the default"
