"""Admission in the real process: the concurrency limit, queue timeout (503) and full queue (429)."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sie import metric_names as M
from sie_testing.polling import eventually
from sie_testing.sidecar_harness import FakeWorker, sidecar_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _post(s, body=None):
    async with s.http.post(s.url + "/generate", json=body or {"text": "a"}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def test_limit_queue_timeout_and_full_queue(tmp_path):
    worker = FakeWorker()
    worker.hold = asyncio.Event()
    async with sidecar_stack(tmp_path, "--max-queue", "2", worker=worker, max_concurrent=2, max_queue_time_ms=400) as s:
        await s.wait_state("ready")
        in_flight = [asyncio.create_task(_post(s)) for _ in range(2)]
        await eventually(lambda: worker.running == 2)
        queued = [asyncio.create_task(_post(s)) for _ in range(2)]
        await eventually(lambda: _queued(s, 2))

        # The queue is full: refused at once, retryable, and the body names the limit.
        status, headers, doc = await _post(s)
        assert status == 429
        assert headers["Retry-After"] == "1" and headers["x-sie-retryable"] == "true"
        assert headers["x-sie-instance"] == "m1-0"
        assert doc["error"]["type"] == "queue_full" and doc["error"]["model"] == "m1"
        assert doc["error"]["max_queue"] == 2 and doc["error"]["max_concurrent_requests"] == 2

        # The queued ones give up after max_queue_time_ms with 503.
        for status, headers, doc in await asyncio.gather(*queued):
            assert status == 503
            assert headers["Retry-After"] == "1" and headers["x-sie-retryable"] == "true"
            assert doc["error"]["type"] == "queue_timeout" and doc["error"]["model"] == "m1"
            assert doc["error"]["max_queue_time_ms"] == 400
            assert "400" in doc["error"]["message"]

        worker.hold.set()
        assert [r[0] for r in await asyncio.gather(*in_flight)] == [200, 200]
        assert worker.max_running == 2 and len(worker.seen) == 2  # refused ones never reached it
        async with s.http.get(s.control_url + "/-/metrics", headers=s.headers) as resp:
            text = await resp.text()
        by_code = {
            x.labels["code"]: x.value
            for f in text_string_to_metric_families(text)
            for x in f.samples
            if x.name == M.REQUESTS
        }
        assert by_code == {"429": 1.0, "503": 2.0, "200": 2.0}


async def _queued(s, n):
    return (await s.state())["queued"] == n


async def test_queued_requests_are_served_in_turn_within_the_limit(tmp_path):
    worker = FakeWorker(delay_s=0.02)
    async with sidecar_stack(tmp_path, worker=worker, max_concurrent=2, max_queue_time_ms=20000) as s:
        await s.wait_state("ready")
        results = await asyncio.gather(*(_post(s) for _ in range(10)))  # 2 in flight + 8 queued (4 x max_concurrent)
        assert [r[0] for r in results] == [200] * 10
        assert worker.max_running == 2  # never more than max_concurrent_requests at the worker
        state = await s.state()
        assert state["requests_total"] == 10 and state["in_flight"] == 0 and state["queued"] == 0
        assert state["queue_time_ms"] > 0  # some waited, and the p99 says so
