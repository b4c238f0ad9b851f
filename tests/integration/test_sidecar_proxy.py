"""The sidecar's data path, as a real process in front of a fake worker: only the model's inference paths,
bodies checked where they enter, the worker's key instead of the client's credential, the control
endpoints on their own listener behind a token, and a worker that dies mid-request."""

import asyncio
import gzip
import io
import json

import aiohttp
import pytest
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from sie import metric_names as M
from sie.auth import Identity, Signer
from sie_testing.polling import eventually
from sie_testing.sidecar_harness import FakeWorker, sidecar_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TEXT_SCHEMA = [
    {"name": "text", "type": "string", "max_length": 16},
    {"name": "temperature", "type": "float32", "range": [0, 2], "required": False},
]


def _by_code(text):
    return {
        x.labels["code"]: x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
        if x.name == M.REQUESTS
    }


async def _metrics(s) -> str:
    async with s.http.get(s.control_url + "/-/metrics", headers=s.headers) as resp:
        assert resp.status == 200
        return await resp.text()


async def test_forwards_requests_with_the_workers_key_never_the_clients(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        headers = CIMultiDict(
            [
                ("x-request-id", "r-1"),
                ("Connection", "keep-alive, X-Hop"),
                ("X-Hop", "1"),
                ("Connection", "X-Hop-2"),  # a second Connection line names more
                ("X-Hop-2", "2"),
                ("Authorization", "Bearer sk-client-secret"),
            ]
        )
        async with s.http.post(s.url + "/generate?x=1", json={"text": "hi"}, headers=headers) as resp:
            assert resp.status == 200
            assert (await resp.json())["received"] == {"text": "hi"}
            assert resp.headers["x-sie-instance"] == "m1-0"  # which instance answered
        async with s.http.post(s.url + "/v1/chat/completions", json={"status": 418}) as resp:
            assert resp.status == 418  # the worker's own errors pass through untouched
            assert "x-sie-retryable" not in resp.headers
        assert [(m, p) for m, p, _ in s.worker.seen] == [("POST", "/generate?x=1"), ("POST", "/v1/chat/completions")]
        seen = s.worker.seen_headers[0]
        assert seen["x-request-id"] == "r-1"
        assert "X-Hop" not in seen and "X-Hop-2" not in seen  # named by Connection: hop-by-hop
        assert seen["Authorization"] == f"Bearer {s.worker.api_key}" and s.worker.refused == 0


async def test_a_compressed_body_reaches_the_worker_as_the_json_that_was_checked(tmp_path):
    """aiohttp's server inflates a gzip body before the sidecar reads it; the worker gets those bytes,
    so their Content-Encoding must not go with them."""
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        body = gzip.compress(b'{"text": "hi"}')
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        async with s.http.post(s.url + "/generate", data=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["received"] == {"text": "hi"}
        (_, _, seen), headers_seen = s.worker.seen[0], s.worker.seen_headers[0]
        assert seen == b'{"text": "hi"}' and "Content-Encoding" not in headers_seen


class WorkerByName(FakeWorker):
    @property
    def url(self) -> str:
        # A host name: aiohttp's cookie jar refuses cookies from IP addresses only.
        return super().url.replace("127.0.0.1", "localhost")


async def test_a_cookie_the_worker_set_for_one_client_never_reaches_the_worker_with_another(tmp_path):
    async with sidecar_stack(tmp_path, worker=WorkerByName()) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/generate", json={"set_cookie": "session=alice; Path=/"}) as resp:
            assert resp.status == 200
            assert resp.headers["Set-Cookie"] == "session=alice; Path=/"  # the client's to keep, not the sidecar's
        s.http.cookie_jar.clear()  # this test's client forgets it, as another client would never have had it
        async with s.http.post(s.url + "/generate", json={"text": "hi"}) as resp:
            assert resp.status == 200
        assert [h.get("Cookie") for h in s.worker.seen_headers] == [None, None]


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v1/models", 404),
        ("POST", "/release_memory_occupation", 404),
        ("POST", "/-/drain", 404),
        ("POST", "/-/sleep", 404),
        ("GET", "/metrics", 404),
        ("POST", "/infer", 404),
        ("GET", "/generate", 405),
        ("DELETE", "/v1/completions", 405),
        ("POST", "/generate/../release_memory_occupation", 404),
    ],
)
async def test_the_data_listener_serves_the_models_inference_paths_only(tmp_path, method, path, status):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        async with s.http.request(method, s.url + path, json={"text": "x"}) as resp:
            doc = await resp.json()
            assert resp.status == status, doc
            assert doc["error"]["type"] == ("not_found" if status == 404 else "method_not_allowed")
        assert s.worker.seen == [] and s.worker.releases == []  # a refused request never reaches the worker
        assert (await s.state())["state"] == "ready"


async def test_sse_is_streamed_chunk_by_chunk(tmp_path):
    worker = FakeWorker()
    worker.stream_hold = asyncio.Event()
    async with sidecar_stack(tmp_path, worker=worker) as s:
        await s.wait_state("ready")
        async with s.http.post(
            s.url + "/v1/chat/completions", json={"stream": True, "chunks": 3, "chunk_delay_s": 0}
        ) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert resp.headers["x-sie-instance"] == "m1-0"
            # The worker holds the stream after its first chunk: we can only read that chunk now if
            # the sidecar passed it on without waiting for the rest.
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            assert json.loads(first.removeprefix(b"data: ")) == {"index": 0}
            worker.stream_hold.set()
            rest = await resp.content.read()
        assert rest.count(b"data: ") == 3 and rest.endswith(b"data: [DONE]\n\n")


async def test_a_stream_broken_by_the_worker_ends_with_an_error_event_then_a_cut(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        async with s.http.post(
            s.url + "/generate", json={"stream": True, "chunks": 5, "chunk_delay_s": 0, "break_after": 2}
        ) as resp:
            assert resp.status == 200
            got = b""
            # Not a clean end of stream: the client gets an event naming the cause, then a broken stream.
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    got += chunk
        events = [
            json.loads(line.removeprefix(b"data: ")) for line in got.split(b"\n\n") if line.startswith(b"data: {")
        ]
        assert events[-1]["error"]["type"] == "worker_lost" and "broke off" in events[-1]["error"]["message"]
        assert _by_code(await _metrics(s)) == {"502": 1.0}
        async with s.http.post(s.url + "/generate", json={"text": "next"}) as resp:
            assert resp.status == 200  # the sidecar itself is fine


@pytest.mark.parametrize("retry_on_worker_loss, status, retryable", [(True, 503, "true"), (False, 502, None)])
async def test_a_worker_that_dies_before_answering_is_retryable_unless_the_model_says_not(
    tmp_path, retry_on_worker_loss, status, retryable
):
    async with sidecar_stack(tmp_path, routing={"retry_on_worker_loss": retry_on_worker_loss}) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/generate", json={"die": True}) as resp:
            doc = await resp.json()
            assert resp.status == status and resp.headers.get("x-sie-retryable") == retryable
            assert doc["error"]["type"] == ("worker_lost" if retry_on_worker_loss else "worker_error")


async def test_bodies_are_bounded_where_they_enter(tmp_path):
    async with sidecar_stack(tmp_path, limits={"max_body_bytes": 1 << 20}) as s:
        await s.wait_state("ready")
        fits = json.dumps({"text": "x" * (900 << 10)}).encode()
        async with s.http.post(s.url + "/generate", data=fits, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200 and (await resp.json())["size"] == len(fits)
        too_big = json.dumps({"text": "x" * (1100 << 10)}).encode()
        # BytesIO: aiohttp warns (an error here) that a raw body over 1 MiB may block the event loop
        async with s.http.post(s.url + "/generate", data=io.BytesIO(too_big)) as resp:
            assert resp.status == 413 and (await resp.json())["error"]["type"] == "body_too_large"

        async def chunks():
            for _ in range(12):
                yield b"x" * (100 << 10)

        async with s.http.post(s.url + "/generate", data=chunks()) as resp:  # chunked: no length to check up front
            assert resp.status == 413
        cases = [
            b'{"text": "\\ud800"}',  # a lone surrogate
            b'{"text": "a", "text": "b"}',  # an ambiguous body
            b'{"n": ' + b"9" * 40 + b"}",  # an integer no engine can hold
            b"[" * 200 + b"]" * 200,  # nested past any real body
            b"\xff\xfe not utf-8",
            b"[1, 2, 3]",  # not an object
        ]
        for body in cases:
            async with s.http.post(s.url + "/generate", data=body) as resp:
                doc = await resp.json()
                assert resp.status == 400 and doc["error"]["type"] == "invalid_json", (body[:30], doc)
        assert len(s.worker.seen) == 1


async def test_the_token_limit_holds_for_every_spelling(tmp_path):
    schema = [{"name": "max_tokens", "type": "int32", "range": [1, 64], "required": False}]
    async with sidecar_stack(tmp_path, input_fields=schema, limits={"max_new_tokens": 100}) as s:
        await s.wait_state("ready")
        for body in (
            {"max_tokens": 65},
            {"max_completion_tokens": 65},
            {"sampling_params": {"max_new_tokens": 65}},
            {"sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 65}]},  # SGLang: one per prompt
            {"sampling_params": [{"max_new_tokens": 1}, "max_new_tokens=65"]},
            {"sampling_params": "max_new_tokens=65"},
            {"max_completion_tokens": -1},
            {"max_tokens": True},
        ):
            async with s.http.post(s.url + "/v1/chat/completions", json=body) as resp:
                doc = await resp.json()
                assert resp.status == 400, (body, doc)
                assert doc["error"]["type"] in ("token_limit", "invalid_schema")
        async with s.http.post(s.url + "/v1/completions", json={"max_completion_tokens": 64}) as resp:
            assert resp.status == 200
        async with s.http.post(s.url + "/generate", json={"sampling_params": [{"max_new_tokens": 64}, {}]}) as resp:
            assert resp.status == 200
        assert len(s.worker.seen) == 2


async def test_bad_bodies_get_400_and_never_reach_the_worker(tmp_path):
    async with sidecar_stack(tmp_path, input_fields=TEXT_SCHEMA) as s:
        await s.wait_state("ready")
        cases = [
            ({"text": "x" * 17}, "text", "max_length 16"),
            ({"temperature": 1.0}, "text", "required"),
            ({"text": "ok", "temperature": 3}, "temperature", "outside"),
        ]
        for body, field, words in cases:
            async with s.http.post(s.url + "/generate", json=body) as resp:
                doc = await resp.json()
                assert resp.status == 400, doc
                assert doc["error"]["type"] == "invalid_schema" and doc["error"]["model"] == "m1"
                assert doc["error"]["field"] == field and words in doc["error"]["reason"]
                assert "x-sie-retryable" not in resp.headers  # retrying elsewhere cannot help
        async with s.http.post(s.url + "/generate", data=b"not json") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_json"
        assert s.worker.seen == []
        async with s.http.post(s.url + "/generate", json={"text": "fine", "extra": [1]}) as resp:
            assert resp.status == 200
        assert len(s.worker.seen) == 1
        invalid = [
            x
            for f in text_string_to_metric_families(await _metrics(s))
            for x in f.samples
            if x.name == M.INVALID_SCHEMA
        ]
        assert [x.value for x in invalid] == [3.0]


async def test_client_errors_never_count_against_the_instance(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        for _ in range(5):
            async with s.http.post(s.url + "/generate", json={"status": 400}) as resp:  # the worker refuses the body
                assert resp.status == 400
        state = await s.state()
        assert state["error_rate"] == 0.0 and state["window_requests"] == 0  # neither errors nor (fast) latencies
        async with s.http.post(s.url + "/generate", json={"status": 500}) as resp:
            assert resp.status == 500
        state = await s.state()
        assert state["error_rate"] == 1.0 and state["window_requests"] == 1


async def test_metrics_use_the_unified_names_labels_and_counts(tmp_path):
    async with sidecar_stack(
        tmp_path, name="scorer-a", service_type="scoring", priority_level="P0", version="3.1.0"
    ) as s:
        await s.wait_state("ready")
        for _ in range(3):
            async with s.http.post(s.url + "/infer", json={"text": "a"}) as resp:
                assert resp.status == 200
        async with s.http.post(s.url + "/infer", json={"status": 500}) as resp:
            assert resp.status == 500
        text = await _metrics(s)
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    base = (("model_id", "scorer-a"), ("priority_level", "P0"), ("service_type", "scoring"), ("version", "3.1.0"))
    assert samples[(M.REQUESTS, tuple(sorted((*base, ("code", "200")))))] == 3.0
    assert samples[(M.REQUESTS, tuple(sorted((*base, ("code", "500")))))] == 1.0
    assert samples[(M.LATENCY + "_count", base)] == 4.0
    assert samples[(M.QUEUE_TIME + "_count", base)] == 4.0
    assert samples[(M.IN_FLIGHT, base)] == 0.0 and samples[(M.QUEUED, base)] == 0.0
    assert samples[(M.KV_CACHE_USAGE, base)] == 0.25
    assert samples[(M.EVICTIONS, base)] == 0.0 and samples[(M.INVALID_SCHEMA, base)] == 0.0
    names = {name for name, _ in samples}
    assert not any(n.endswith("_created") for n in names)
    assert all(dict(labels).keys() - {"code", "le"} == set(M.LABELS) for _, labels in samples)


async def test_unreachable_worker_is_a_retryable_503(tmp_path):
    async with sidecar_stack(tmp_path, "--probe-interval-s", "5") as s:
        await s.wait_state("ready")
        await s.worker.stop()
        async with s.http.post(s.url + "/generate", json={"text": "a"}) as resp:
            assert resp.status == 503 and resp.headers["x-sie-retryable"] == "true"
            assert (await resp.json())["error"]["type"] in ("worker_unreachable", "unavailable")
        # The failed connection triggers a probe at once, long before the 5 s probe period.
        await s.wait_state("failed", timeout_s=3)


async def test_the_control_listener_answers_only_who_may_ask(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        control = s.control_url
        async with s.http.get(control + "/-/healthz") as resp:  # probes need no credential
            assert resp.status == 200
        await s.wait_state("ready")
        async with s.http.get(control + "/-/ready") as resp:
            assert resp.status == 200
        another_key = {"Authorization": f"Bearer {Signer.generate().issue(Identity.for_node('node-a'))}"}
        for path, method in (
            ("/-/state", "GET"),
            ("/-/metrics", "GET"),
            ("/-/drain", "POST"),
            ("/-/sleep", "POST"),
            ("/-/wake", "POST"),
        ):
            for headers in ({}, {"Authorization": "Bearer junk"}, another_key):
                async with s.http.request(method, control + path, headers=headers) as resp:
                    assert resp.status == 401 and (await resp.json())["error"]["type"] == "unauthenticated"
        node_host = s.headers  # this node's node host, with a token the control plane signed
        async with s.http.get(control + "/-/state", headers=node_host) as resp:
            assert resp.status == 200
        assert s.sidecar.control_address != s.sidecar.address  # two listeners
        async with s.http.get(control + "/-/nope", headers=node_host) as resp:
            assert resp.status == 404 and "known" in (await resp.json())["error"]["message"]
        async with s.http.post(control + "/-/drain?timeout_s=abc", headers=node_host) as resp:
            assert resp.status == 400 and "timeout_s" in (await resp.json())["error"]["message"]
        assert s.worker.seen == []  # /-/ is never forwarded
        assert (await s.state())["state"] == "ready"


async def test_other_identities_may_not_drain_sleep_or_wake(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        creds = s.creds
        for who in (
            Identity.for_node("node-b"),
            Identity.reader(),
            Identity.for_sidecar("m1-0", "m1", "node-a"),
            Identity.envoy(),
        ):
            for path in ("/-/drain", "/-/sleep", "/-/wake"):
                async with s.http.post(s.control_url + path, headers=creds.headers(who)) as resp:
                    assert resp.status == 403 and (await resp.json())["error"]["type"] == "forbidden"
        async with s.http.get(s.control_url + "/-/metrics", headers=creds.headers(Identity.reader())) as resp:
            assert resp.status == 200  # Prometheus' reader token may scrape
        assert (await s.state())["state"] == "ready" and s.worker.releases == []


async def test_a_client_that_hangs_up_frees_its_slot_and_the_workers_request(tmp_path):
    worker = FakeWorker()
    worker.hold = asyncio.Event()  # the worker never answers on its own
    async with sidecar_stack(tmp_path, worker=worker, max_concurrent=1) as s:
        await s.wait_state("ready")
        with pytest.raises(asyncio.TimeoutError):
            async with s.http.post(s.url + "/generate", json={"text": "a"}, timeout=aiohttp.ClientTimeout(total=0.5)):
                pass
        # Envoy hangs up like this at its route timeout: the sidecar abandons the call, the worker's
        # handler is cancelled, and the only slot is free for the next request.
        await eventually(lambda: worker.cancelled == 1 and worker.running == 0, timeout=5.0)
        state = await s.state()
        assert state["in_flight"] == 0 and state["oldest_running_ms"] is None
        worker.hold.set()
        async with s.http.post(s.url + "/generate", json={"text": "b"}) as resp:
            assert resp.status == 200
        assert _by_code(await _metrics(s)) == {"499": 1.0, "200": 1.0}


async def test_a_worker_that_never_answers_gets_a_504_at_the_route_timeout(tmp_path):
    worker = FakeWorker()
    worker.hold = asyncio.Event()
    async with sidecar_stack(tmp_path, worker=worker, max_concurrent=1, request_timeout_ms=400) as s:
        await s.wait_state("ready")
        async with s.http.post(
            s.url + "/generate", json={"text": "a"}, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            assert resp.status == 504 and resp.headers["x-sie-instance"] == "m1-0"
            assert "x-sie-retryable" not in resp.headers  # the worker had the request: not safe to resend
            error = (await resp.json())["error"]
            assert error["type"] == "worker_timeout" and "0.4s" in error["message"]
        await eventually(lambda: worker.cancelled == 1, timeout=5.0)
        assert (await s.state())["in_flight"] == 0


async def test_a_sleep_whose_caller_hangs_up_still_runs_to_its_end(tmp_path):
    worker = FakeWorker()
    worker.hold = asyncio.Event()
    async with sidecar_stack(tmp_path, worker=worker) as s:
        await s.wait_state("ready")
        held = asyncio.create_task(s.http.post(s.url + "/generate", json={"text": "a"}))
        await eventually(lambda: worker.running == 1, timeout=5.0)
        with pytest.raises(asyncio.TimeoutError):
            async with s.http.post(
                s.control_url + "/-/sleep?timeout_s=10", headers=s.headers, timeout=aiohttp.ClientTimeout(total=0.3)
            ):
                pass
        worker.hold.set()  # the drain can finish now; the sleep goes on without its caller
        (await held).release()
        await s.wait_state("sleeping", timeout_s=5)
        assert worker.releases == [0]


async def test_a_stream_that_outlives_the_route_timeout_is_cut_and_counted_504(tmp_path):
    worker = FakeWorker()
    worker.stream_hold = asyncio.Event()  # the stream stops after its first chunk
    async with sidecar_stack(tmp_path, worker=worker, request_timeout_ms=400) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/generate", json={"stream": True, "chunks": 3}) as resp:
            assert resp.status == 200  # the headers were out before the deadline
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()  # then the connection is cut: a broken stream, never a clean short one
        assert _by_code(await _metrics(s)) == {"504": 1.0}
        assert (await s.state())["in_flight"] == 0
