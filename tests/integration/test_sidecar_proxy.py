"""The sidecar's data path, as a real process in front of a fake worker."""

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.testing import FakeWorker, sidecar_stack
from sie import metric_names as M
from tests.integration.polling import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TEXT_SCHEMA = [{"name": "text", "type": "string", "max_length": 16}, {"name": "temperature", "type": "float32", "range": [0, 2], "required": False}]


def _by_code(text):
    return {x.labels["code"]: x.value for f in text_string_to_metric_families(text) for x in f.samples if x.name == M.REQUESTS}


async def test_forwards_requests_and_headers(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/generate?x=1", json={"text": "hi"}, headers={"x-request-id": "r-1", "Connection": "keep-alive, X-Hop", "X-Hop": "1"}) as resp:
            assert resp.status == 200
            assert (await resp.json())["received"] == {"text": "hi"}
            assert resp.headers["x-sie-instance"] == "m1-0"  # which instance answered
        async with s.http.get(s.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["path"] == "/v1/models"
        async with s.http.get(s.url + "/status?code=418") as resp:
            assert resp.status == 418  # the worker's own errors pass through untouched
            assert "x-sie-retryable" not in resp.headers
        assert [(m, p) for m, p, _ in s.worker.seen] == [("POST", "/generate?x=1"), ("GET", "/v1/models"), ("GET", "/status?code=418")]
        assert s.worker.seen_headers[0]["x-request-id"] == "r-1"
        assert "X-Hop" not in s.worker.seen_headers[0]  # named by Connection: hop-by-hop


async def test_sse_is_streamed_chunk_by_chunk(tmp_path):
    worker = FakeWorker()
    worker.stream_hold = asyncio.Event()
    async with sidecar_stack(tmp_path, worker=worker) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/v1/chat/completions", json={"stream": True, "chunks": 3, "chunk_delay_s": 0}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert resp.headers["x-sie-instance"] == "m1-0"
            # The worker holds the stream after its first chunk: we can only read that chunk now if
            # the sidecar passed it on without waiting for the rest.
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            assert json.loads(first.removeprefix(b"data: ")) == {"index": 0}
            worker.stream_hold.set()
            rest = await resp.content.read()
        assert rest.count(b"data: ") == 3 and rest.endswith(b"data: [DONE]\n\n")


async def test_a_stream_broken_by_the_worker_is_broken_for_the_client(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/generate", json={"stream": True, "chunks": 5, "chunk_delay_s": 0, "break_after": 2}) as resp:
            assert resp.status == 200
            # Not a clean end of stream: the client must be able to tell it got half an answer.
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.content.read()
        async with s.http.get(s.url + "/-/metrics") as resp:
            assert _by_code(await resp.text()) == {"502": 1.0}
        async with s.http.post(s.url + "/generate", json={"text": "next"}) as resp:
            assert resp.status == 200  # the sidecar itself is fine


async def test_large_bodies_pass_both_ways(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.wait_state("ready")
        blob = b"x" * (3 << 20)  # above the read-whole limit: streamed to the worker
        async with s.http.post(s.url + "/upload", data=blob, headers={"Content-Type": "application/octet-stream"}) as resp:
            assert resp.status == 200 and (await resp.json())["size"] == len(blob)
        assert s.worker.seen[-1][2] == blob


async def test_bad_bodies_get_400_and_never_reach_the_worker(tmp_path):
    async with sidecar_stack(tmp_path, input_fields=TEXT_SCHEMA) as s:
        await s.wait_state("ready")
        cases = [
            ({"text": "x" * 17}, "text", "max_length 16"),
            ({"temperature": 1.0}, "text", "required"),
            ({"text": "ok", "temperature": 3}, "temperature", "outside"),
            (b"not json", "", "not valid JSON"),
        ]
        for body, field, words in cases:
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with s.http.post(s.url + "/generate", **kwargs) as resp:
                doc = await resp.json()
                assert resp.status == 400, doc
                assert doc["error"]["type"] == "invalid_schema" and doc["error"]["model"] == "m1"
                assert doc["error"]["field"] == field and words in doc["error"]["reason"]
                assert "x-sie-retryable" not in resp.headers  # retrying elsewhere cannot help
        assert s.worker.seen == []
        async with s.http.post(s.url + "/generate", json={"text": "fine", "extra": [1]}) as resp:
            assert resp.status == 200
        assert len(s.worker.seen) == 1
        async with s.http.get(s.url + "/-/metrics") as resp:
            text = await resp.text()
        invalid = [x for f in text_string_to_metric_families(text) for x in f.samples if x.name == M.INVALID_SCHEMA]
        assert [x.value for x in invalid] == [4.0]


async def test_metrics_use_the_unified_names_labels_and_counts(tmp_path):
    async with sidecar_stack(tmp_path, name="scorer-a", service_type="scoring", priority_level="P0", version="3.1.0") as s:
        await s.wait_state("ready")
        for _ in range(3):
            async with s.http.post(s.url + "/infer", json={"text": "a"}) as resp:
                assert resp.status == 200
        async with s.http.get(s.url + "/status?code=500") as resp:
            assert resp.status == 500
        async with s.http.get(s.url + "/-/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}
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


async def test_sidecar_endpoints(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        async with s.http.get(s.url + "/-/healthz") as resp:
            assert resp.status == 200
        await s.wait_state("ready")
        async with s.http.get(s.url + "/-/ready") as resp:
            assert resp.status == 200
        async with s.http.get(s.url + "/-/nope") as resp:
            assert resp.status == 404 and "known" in (await resp.json())["error"]["message"]
        async with s.http.post(s.url + "/-/drain?timeout_s=abc") as resp:
            assert resp.status == 400 and "timeout_s" in (await resp.json())["error"]["message"]
        assert s.worker.seen == []  # /-/ is never forwarded


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
        async with s.http.get(s.url + "/-/metrics") as resp:
            assert _by_code(await resp.text()) == {"499": 1.0, "200": 1.0}


async def test_a_worker_that_never_answers_gets_a_504_at_the_route_timeout(tmp_path):
    worker = FakeWorker()
    worker.hold = asyncio.Event()
    async with sidecar_stack(tmp_path, worker=worker, max_concurrent=1, request_timeout_ms=400) as s:
        await s.wait_state("ready")
        async with s.http.post(s.url + "/generate", json={"text": "a"}, timeout=aiohttp.ClientTimeout(total=10)) as resp:
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
            async with s.http.post(s.url + "/-/sleep?timeout_s=10", timeout=aiohttp.ClientTimeout(total=0.3)):
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
        async with s.http.get(s.url + "/-/metrics") as resp:
            assert _by_code(await resp.text()) == {"504": 1.0}
        assert (await s.state())["in_flight"] == 0
