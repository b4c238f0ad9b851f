"""The sidecar's keep-alive HTTP/1.1 client for its worker (sidecar/worker_http.py), against a scripted
worker on loopback (sie_testing.scripted_worker): reuse, the worker closing idle connections, framing,
bounds, failures; and what the data path needs besides: the call's own headers, the answer's header
lines, a body read piece by piece as it arrives, a connection given back before its body was read, the
connect timeout, worker URLs; and answer heads held to RFC 9110's field rules, so what passes can be
handed on to the client."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.worker_http import Answer, AnswerFailed, ConnectFailed, WorkerHTTP, _parse_head
from sie_testing.ports import free_port
from sie_testing.scripted_worker import ScriptedWorker

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": 42}\n'


async def test_calls_reuse_one_connection_and_carry_the_headers_and_body():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port, {"Authorization": "Bearer wk"})
        for i in range(3):
            answer = await worker.post("/infer", b'{"i": %d}' % i, 1.0)
            assert (answer.status, answer.body) == (200, b'{"ok": 42}\n')
        await worker.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /infer HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in first
    assert b"\r\nAuthorization: Bearer wk\r\n" in first
    assert first.endswith(b"Content-Length: 8\r\n\r\n" + b'{"i": 0}')


async def test_an_idle_connection_the_worker_closed_is_replaced_and_the_call_is_sent_once():
    async with ScriptedWorker(lambda n: OK, keep_alive=False) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        for _ in range(3):
            await worker.post("/infer", b"{}", 1.0)
            await asyncio.sleep(0.05)  # the worker's close reaches the client while the connection is idle
        await worker.close()
    assert len(server.requests) == 3, "no request was sent twice"
    assert server.connections == 3


async def test_a_reused_connection_the_worker_closes_after_reading_the_request_fails_the_call_once():
    """The worker read the request and closed without answering (it crashed on it): the worker may have
    started on it, so the call fails and is not sent again (the handler's retries decide)."""
    async with ScriptedWorker(lambda n: OK if n == 1 else None) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        await worker.post("/infer", b"{}", 1.0)
        with pytest.raises(AnswerFailed, match="ended before the worker answered"):
            await worker.post("/infer", b"{}", 1.0)
        await worker.close()
    assert len(server.requests) == 2, "the second request was written once"


async def test_an_idle_connection_past_its_age_is_not_used():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port, max_idle_s=0.05)
        await worker.post("/infer", b"{}", 1.0)
        await asyncio.sleep(0.1)
        await worker.post("/infer", b"{}", 1.0)
        await worker.close()
    assert (server.connections, len(server.requests)) == (2, 2)


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["at-once", "while-idle"])
async def test_bytes_beyond_an_answer_keep_the_connection_from_being_reused(pause):
    """A stray answer after the framed one (in the same write, or while the connection is idle) must
    never be read as the next call's answer."""
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE"
    async with ScriptedWorker(lambda n: OK + stray if n == 1 else OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        assert (await worker.post("/infer", b"{}", 1.0)).body == b'{"ok": 42}\n'
        await asyncio.sleep(pause)
        assert (await worker.post("/infer", b"{}", 1.0)).body == b'{"ok": 42}\n'
        await worker.close()
    assert server.connections == 2


@pytest.mark.parametrize(
    "answer, body, reused",
    [
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4;x=1\r\nabcd\r\n2\r\nef\r\n0\r\nT: 1\r\n\r\n",
            b"abcdef",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi", b"hi", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi", b"hi", False),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", b"hi", True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
        (b"HTTP/1.1 422 Unprocessable\r\ncontent-length: 3\r\n\r\nbad", b"bad", True),
    ],
    ids=["chunked", "connection-close", "http-1.0", "interim-100", "no-content", "an-error-status"],
)
async def test_answer_framing(answer, body, reused):
    async with ScriptedWorker(lambda n: answer) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        got = await worker.post("/infer", b"{}", 1.0)
        assert got.body == body
        await worker.post("/infer", b"{}", 1.0)
        await worker.close()
    assert server.connections == (1 if reused else 2)


async def test_a_body_that_runs_to_the_end_of_the_connection():
    async with ScriptedWorker(
        lambda n: None if n > 1 else b"HTTP/1.1 200 OK\r\n\r\nuntil the end", keep_alive=False
    ) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        assert (await worker.post("/infer", b"{}", 1.0)).body == b"until the end"
        await worker.close()


@pytest.mark.parametrize(
    "answer, words",
    [
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", "head is over"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + b"a" * 2000, "more than the 1000 allowed"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n" + b"a" * 2048 + b"\r\n0\r\n\r\n",
            "over the 1000",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not hexadecimal"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n", "not hexadecimal"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "two different Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "not a length"),
        ("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode(), "not a length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", "not a length"),
        (b"HTTP/1.1 000 Zero\r\n\r\n", "not an HTTP/1.x status line"),
        ("HTTP/1.1 \u00b200 X\r\n\r\n".encode(), "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x1\r\na\r\n0\r\n\r\n", "not hexadecimal"),
        (b"SMTP 220 hello\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "not a header line"),
        # a control character (but HTAB) in a field value, a name or the reason phrase: passed on, a lone
        # CR or LF would break the answer to the client (RFC 9110 5.5, RFC 9112 2.2)
        (b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\nb\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nX-A: a\x7f\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nX\rA: a\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nX A: a\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\n X-Folded: a\r\nContent-Length: 0\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\rX-Evil: 1\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 O\x00K\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "ended within the answer's head"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "ended within the answer"),
    ],
    ids=[
        "head-too-long",
        "body-too-long",
        "chunks-too-long",
        "chunk-size-not-hex",
        "chunk-size-negative",
        "two-lengths",
        "length-not-a-number",
        "length-not-ascii",
        "length-too-many-digits",
        "status-000",
        "status-not-ascii",
        "chunk-size-0x",
        "not-http",
        "not-a-header",
        "cr-in-a-value",
        "lf-in-a-value",
        "nul-in-a-value",
        "del-in-a-value",
        "cr-in-a-name",
        "space-in-a-name",
        "folded-line",
        "cr-in-the-reason",
        "nul-in-the-reason",
        "lost-in-the-head",
        "lost-in-the-body",
    ],
)
async def test_a_broken_or_oversized_answer_fails_the_call_and_is_not_sent_again(answer, words):
    async with ScriptedWorker(lambda n: answer, keep_alive=False) as server:
        worker = WorkerHTTP("127.0.0.1", server.port, max_answer_bytes=1000)
        with pytest.raises(AnswerFailed, match=words):
            await worker.post("/infer", b"{}", 1.0)
        await worker.close()
    assert len(server.requests) == 1


async def test_close_with_a_call_in_flight_leaves_no_connection_open():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        call = asyncio.create_task(worker.post("/infer", b"{}", 2.0))
        await asyncio.sleep(0)
        await worker.close()  # the call is under way
        assert (await call).status == 200
        assert worker._idle == [], "the connection of a call that ended after close() is closed, not kept"
        await asyncio.wait_for(server.closed.wait(), 2.0)


async def test_a_new_connection_closed_without_an_answer_fails():
    async with ScriptedWorker(lambda n: None) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        with pytest.raises(AnswerFailed, match="ended before the worker answered"):
            await worker.post("/infer", b"{}", 1.0)
        await worker.close()
    assert len(server.requests) == 1


async def test_a_timeout_leaves_no_connection_to_reuse():
    answers = {1: b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"}  # the rest never comes
    async with ScriptedWorker(lambda n: answers.get(n, OK)) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        with pytest.raises(TimeoutError):
            await worker.post("/infer", b"{}", 0.2)
        assert (await worker.post("/infer", b"{}", 1.0)).status == 200
        await worker.close()
    assert server.connections == 2, "the timed-out connection, with its answer half read, was not reused"


async def test_a_cancelled_call_leaves_no_connection_to_reuse():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        await worker.post("/infer", b"{}", 1.0)
        server.answer = lambda n: b"" if n == 2 else OK  # the second call gets nothing back: it waits
        call = asyncio.create_task(worker.post("/infer", b"{}", 5.0))
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await worker.post("/infer", b"{}", 1.0)).status == 200
        await worker.close()
    assert server.connections == 2


async def test_nothing_listening_is_a_failed_connect():
    worker = WorkerHTTP("127.0.0.1", free_port())
    with pytest.raises(ConnectFailed, match="cannot connect"):
        await worker.post("/infer", b"{}", 1.0)


async def test_close_closes_the_idle_connections():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        await worker.post("/infer", b"{}", 1.0)
        await worker.close()
        await asyncio.wait_for(server.closed.wait(), 2.0)


async def test_at_most_max_idle_connections_are_kept():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port, max_idle=2)
        await asyncio.gather(*(worker.post("/infer", b"{}", 2.0) for _ in range(5)))
        assert len(worker._idle) == 2
        await worker.close()


@pytest.mark.parametrize("name, value", [("X-Ok", "a\r\nInjected: 1"), ("Bad:Name", "v"), ("X", "nul\0")])
def test_a_header_that_would_break_the_request_is_refused(name, value):
    with pytest.raises(ValueError, match="cannot be sent"):
        WorkerHTTP("127.0.0.1", 1, {name: value})


async def test_open_sends_the_calls_headers_and_reads_the_head_before_the_body():
    head = b"HTTP/1.1 201 Made It\r\nContent-Type: text/plain\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Length: 5\r\n\r\n"
    async with ScriptedWorker.paced([head, b"hello"]) as server:
        worker = WorkerHTTP("127.0.0.1", server.port, {"Authorization": "Bearer wk"}, base_path="/under/")
        server.go.put_nowait(None)  # the head only
        upstream = await asyncio.wait_for(worker.open("/infer?x=1", b"{}", [("X-Trace", "t1"), ("Accept", "a/b")]), 5)
        assert (upstream.status, upstream.reason) == (201, "Made It")
        assert upstream.headers == [
            ("Content-Type", "text/plain"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("Content-Length", "5"),
        ]
        assert upstream.fields["set-cookie"] == "a=1, b=2"
        server.go.put_nowait(None)
        assert await asyncio.wait_for(upstream.read_all(), 5) == b"hello"
        upstream.release()
        await worker.close()
    request = server.requests[0]
    assert request.startswith(b"POST /under/infer?x=1 HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer wk\r\nX-Trace: t1\r\nAccept: a/b\r\nContent-Length: 2\r\n\r\n{}" in request


async def test_read_some_hands_over_each_chunk_as_it_arrives_and_the_connection_is_reused():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    parts = [head, b"7\r\ndata: 1\r\n", b"7\r\ndata: 2\r\n", b"0\r\n\r\n"]
    async with ScriptedWorker.paced(parts) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        for _ in range(2):  # the second call on the same connection
            server.go.put_nowait(None)
            upstream = await asyncio.wait_for(worker.open("/generate", b"{}"), 5)
            server.go.put_nowait(None)
            assert await asyncio.wait_for(upstream.read_some(), 5) == b"data: 1"
            nothing = asyncio.ensure_future(upstream.read_some())
            await asyncio.sleep(0.05)
            assert not nothing.done()  # the second chunk is not there yet, and nothing is made up
            server.go.put_nowait(None)
            assert await asyncio.wait_for(nothing, 5) == b"data: 2"
            server.go.put_nowait(None)
            assert await asyncio.wait_for(upstream.read_some(), 5) == b""
            upstream.release()
        await worker.close()
    assert server.connections == 1


async def test_a_body_to_the_connections_end_is_read_in_pieces_and_the_connection_not_kept():
    async with ScriptedWorker(
        lambda n: b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", keep_alive=False
    ) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        upstream = await asyncio.wait_for(worker.open("/infer", b"{}"), 5)
        pieces = []
        while piece := await asyncio.wait_for(upstream.read_some(), 5):
            pieces.append(piece)
        upstream.release()
        assert b"".join(pieces) == b"all of it"
        assert await worker.post("/infer", b"{}", 5.0) == Answer(200, b"all of it")
        await worker.close()
    assert server.connections == 2


async def test_a_connection_given_back_before_its_body_was_read_is_closed_not_reused():
    async with ScriptedWorker(lambda n: OK) as server:
        worker = WorkerHTTP("127.0.0.1", server.port)
        upstream = await asyncio.wait_for(worker.open("/infer", b"{}"), 5)
        upstream.release()  # the caller gave up on the body (its client went away)
        assert (await worker.post("/infer", b"{}", 5.0)).body == b'{"ok": 42}\n'
        await worker.close()
    assert server.connections == 2


async def test_a_connection_not_made_within_the_connect_timeout_is_a_failed_connect(monkeypatch):
    worker = WorkerHTTP("127.0.0.1", free_port())

    async def never(*_args: object, **_kwargs: object) -> None:
        await asyncio.sleep(60)

    monkeypatch.setattr(asyncio, "open_connection", never)
    with pytest.raises(ConnectFailed, match="within 0.05 s"):
        await worker.open("/infer", b"{}", connect_timeout_s=0.05)


@pytest.mark.parametrize("target", ["infer", "/in fer", "/infer\r\nX: 1"])
async def test_a_target_that_would_break_the_request_line_is_refused(target):
    with pytest.raises(ValueError, match="cannot be sent"):
        await WorkerHTTP("127.0.0.1", free_port()).open(target, b"{}")


def test_worker_urls():
    plain = WorkerHTTP.from_url("http://127.0.0.1:8081")
    assert (plain.host, plain.port, plain._ssl, plain._base_path) == ("127.0.0.1", 8081, None, "")
    tls = WorkerHTTP.from_url("https://worker.example/api/")
    assert (tls.host, tls.port, tls._base_path) == ("worker.example", 443, "/api")
    assert tls._ssl is not None and tls._ssl.verify_mode == ssl.CERT_REQUIRED
    for bad in ("ftp://h:1", "http://:80", "http://h:1/?q=1", "h:1", "http://h:99999", "http://[::1:9"):
        with pytest.raises(ValueError, match="http"):
            WorkerHTTP.from_url(bad)


# Any byte the worker may send, as _parse_head reads it (latin-1: one character a byte).
_ANY = st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=12)
_TCHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_VALUE_CHARS = "\t" + "".join(chr(c) for c in range(0x20, 0x100) if c != 0x7F)


def _head(reason: str, fields: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 200 {reason}", *(f"{name}:{value}" for name, value in fields)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@settings(max_examples=300, deadline=None)
@given(_ANY, st.lists(st.tuples(_ANY, _ANY), max_size=4))
def test_an_answer_head_that_parses_can_be_passed_on_as_it_is(reason, fields):
    """Whatever _parse_head lets through, the proxy can hand to aiohttp: names are tokens, and no value
    nor the reason holds a control character but HTAB."""
    try:
        head = _parse_head(_head(reason, fields))
    except AnswerFailed:
        return
    assert all(c in _VALUE_CHARS for c in head.reason)
    for name, value in head.headers:
        assert name and all(c in _TCHARS for c in name)
        assert all(c in _VALUE_CHARS for c in value)


@settings(max_examples=300, deadline=None)
@given(
    st.text(st.sampled_from(_VALUE_CHARS), max_size=12),
    st.lists(
        st.tuples(
            st.text(st.sampled_from(_TCHARS), min_size=1, max_size=8),
            st.text(st.sampled_from(_VALUE_CHARS), max_size=12),
        ),
        max_size=4,
    ),
)
def test_every_well_formed_answer_head_parses(reason, fields):
    head = _parse_head(_head(reason, fields))
    assert head.reason == reason
    assert head.headers == [(name, value.strip(" \t")) for name, value in fields]
