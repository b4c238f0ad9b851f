"""Drain, sleep (eviction), wake and SIGTERM with requests in flight."""

import asyncio
import signal

import pytest

from sie_testing.polling import eventually
from sie_testing.sidecar_harness import FakeWorker, sidecar_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SLOW = ("--telemetry-interval-s", "60")  # records that arrive at all were sent because of a change


async def _post(s):
    async with s.http.post(s.url + "/generate", json={"text": "a"}) as resp:
        return resp.status, resp.headers.get("x-sie-retryable"), await resp.json()


async def _admin(s, path):
    async with s.http.post(s.control_url + path, headers=s.headers) as resp:
        return resp.status, await resp.json()


@pytest.fixture
def held():
    worker = FakeWorker()
    worker.hold = asyncio.Event()
    return worker


async def test_drain_finishes_in_flight_and_refuses_new_work(tmp_path, held):
    async with sidecar_stack(tmp_path, *SLOW, worker=held, max_concurrent=2, max_queue_time_ms=30000) as s:
        await s.wait_state("ready")
        accepted = [asyncio.create_task(_post(s)) for _ in range(3)]  # 2 in flight, 1 queued
        await eventually(lambda: held.running == 2)
        n = len(s.control.records)
        drain = asyncio.create_task(_admin(s, "/-/drain?timeout_s=20"))
        await s.control.wait_for(lambda r: r["state"] == "draining", timeout_s=5, after=n)  # reported at once

        status, retryable, doc = await _post(s)
        assert (status, retryable, doc["error"]["type"]) == (503, "true", "unavailable")
        async with s.http.get(s.control_url + "/-/ready") as resp:
            assert resp.status == 503
        assert not drain.done()

        held.hold.set()
        assert [r[0] for r in await asyncio.gather(*accepted)] == [200, 200, 200]  # nothing accepted is lost
        status, report = await drain
        assert status == 200
        assert report == {
            "state": "draining",
            "finished": 3,
            "handed_back": 0,
            "in_flight": 0,
            "idle": True,
            "waited_s": report["waited_s"],
        }
        assert len(held.seen) == 3


async def test_drain_bound_hands_queued_requests_back(tmp_path, held):
    async with sidecar_stack(tmp_path, worker=held, max_concurrent=1, max_queue_time_ms=30000) as s:
        await s.wait_state("ready")
        first = asyncio.create_task(_post(s))
        await eventually(lambda: held.running == 1)
        queued = [asyncio.create_task(_post(s)) for _ in range(2)]
        for _ in range(500):
            if (await s.state())["queued"] == 2:
                break
            await asyncio.sleep(0.02)
        status, report = await _admin(s, "/-/drain?timeout_s=0.3")
        assert status == 200 and report["handed_back"] == 2 and report["in_flight"] == 1 and not report["idle"]
        for status, retryable, doc in await asyncio.gather(*queued):
            assert (status, retryable, doc["error"]["type"]) == (503, "true", "draining")
        held.hold.set()
        assert (await first)[0] == 200  # the one at the worker still gets its answer
        assert len(held.seen) == 1


async def test_eviction_releases_memory_only_when_idle_then_wakes(tmp_path, held):
    async with sidecar_stack(tmp_path, worker=held, max_concurrent=2) as s:
        await s.wait_state("ready")
        accepted = [asyncio.create_task(_post(s)) for _ in range(2)]
        await eventually(lambda: held.running == 2)
        sleep = asyncio.create_task(_admin(s, "/-/sleep?reason=eviction&timeout_s=20"))
        await s.wait_state("draining")
        await asyncio.sleep(0.3)
        assert held.releases == []  # never released with requests in flight

        held.hold.set()
        assert [r[0] for r in await asyncio.gather(*accepted)] == [200, 200]
        status, doc = await sleep
        assert status == 200 and doc["state"] == "sleeping" and doc["drain"]["finished"] == 2
        assert held.releases == [0]  # released once, with nothing running at the worker
        await s.control.wait_for(lambda r: r["state"] == "sleeping")
        async with s.http.get(s.control_url + "/-/metrics", headers=s.headers) as resp:
            assert (
                'inference_evictions_total{model_id="m1",priority_level="P1",service_type="llm",version="1.0.0"} 1.0'
                in await resp.text()
            )
        status, retryable, _ = await _post(s)
        assert (status, retryable) == (503, "true")
        assert await _admin(s, "/-/sleep") == (
            200,
            {"state": "sleeping", "reason": "manual", "already": True, "drain": None},
        )

        status, doc = await _admin(s, "/-/wake?timeout_s=10")
        assert (status, doc["state"], held.resumes) == (200, "ready", 1)
        assert (await _post(s))[0] == 200


async def test_sleep_is_refused_while_work_is_stuck(tmp_path, held):
    async with sidecar_stack(tmp_path, worker=held) as s:
        await s.wait_state("ready")
        stuck = asyncio.create_task(_post(s))
        await eventually(lambda: held.running == 1)
        status, doc = await _admin(s, "/-/sleep?timeout_s=0.3")
        assert status == 409 and doc["error"]["type"] == "not_idle" and doc["error"]["state"] == "draining"
        assert held.releases == []  # a real SGLang would crash on this release
        held.hold.set()
        assert (await stuck)[0] == 200
        status, doc = await _admin(s, "/-/wake")  # never released: serving again needs no resume
        assert status == 200 and doc["state"] == "ready" and held.resumes == 0


async def test_sigterm_drains_reports_stopped_and_exits_zero(tmp_path, held):
    async with sidecar_stack(tmp_path, *SLOW, worker=held) as s:
        await s.wait_state("ready")
        in_flight = asyncio.create_task(_post(s))
        await eventually(lambda: held.running == 1)
        n = len(s.control.records)
        s.sidecar.signal(signal.SIGTERM)
        await s.control.wait_for(lambda r: r["state"] == "draining", timeout_s=5, after=n)
        await asyncio.sleep(0.2)
        assert s.sidecar.proc.poll() is None  # still waiting for the request at the worker
        held.hold.set()
        assert (await in_flight)[0] == 200
        assert await s.sidecar.wait(15) == 0
        last = s.control.records[-1][1]
        assert last["state"] == "stopped" and last["requests_total"] == 1


async def test_sigterm_drain_is_bounded(tmp_path, held):
    async with sidecar_stack(tmp_path, "--drain-timeout-s", "0.3", worker=held) as s:
        await s.wait_state("ready")
        stuck = asyncio.create_task(_post(s))
        await eventually(lambda: held.running == 1)
        s.sidecar.signal(signal.SIGTERM)
        assert await s.sidecar.wait(15) == 0
        assert s.control.records[-1][1]["state"] == "stopped"
        held.hold.set()
        await asyncio.gather(stuck, return_exceptions=True)
