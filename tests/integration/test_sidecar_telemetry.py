"""Telemetry to a fake control plane: periodic records with live figures, state changes at once."""

import asyncio
import time

import pytest

from sie.telemetry import TelemetryRecord
from sie_testing.sidecar_harness import FakeWorker, sidecar_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# With this period, a record that arrives within a few seconds of a state change can only have been
# sent because of the change: that is how these tests tell "at once" from "on the next tick".
SLOW = ("--telemetry-interval-s", "60")


async def test_periodic_records_carry_live_figures(tmp_path):
    worker = FakeWorker(token_usage=0.6)
    worker.hold = asyncio.Event()
    async with sidecar_stack(tmp_path, worker=worker, max_concurrent=1, max_queue_time_ms=30000) as s:
        await s.control.wait_for(lambda r: r["state"] == "ready")
        tasks = [asyncio.create_task(s.http.post(s.url + "/generate", json={"text": "a"})) for _ in range(3)]
        busy = await s.control.wait_for(
            lambda r: r["in_flight"] == 1 and r["queued"] == 2 and r["engine_running"] == 1, timeout_s=10
        )
        assert busy["kv_cache_usage"] == 0.6 and busy["max_concurrent"] == 1
        assert busy["gpu_utilization"] is None and busy["gpu_memory_used_mb"] is None  # no GPU here: absent
        TelemetryRecord.from_json(busy)  # the control plane's own parser accepts every field

        # Nothing changes state while the requests wait, yet records keep coming: they are periodic.
        start = len(s.control.records)
        await asyncio.sleep(2.0)
        periodic = [r for _, r in s.control.records[start:]]
        assert len(periodic) >= 2
        # No answer yet, but the request at the worker joins the fast signal at its age (>= 2 s now):
        # a stalled worker looks slow, not idle. The queued two are not at the worker: not counted.
        held = periodic[-1]
        assert (held["recent_requests"], held["recent_running"]) == (1, 1)
        assert held["recent_latency_mean_ms"] >= 2000.0 and held["latency_p50_ms"] is None
        assert held["oldest_running_ms"] >= 2000.0 and held["latency_max_ms"] is None and held["window_requests"] == 0
        seqs = [r["seq"] for _, r in s.control.records]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        worker.hold.set()
        for task in tasks:
            async with await task as resp:
                assert resp.status == 200
        done = await s.control.wait_for(lambda r: r["requests_total"] == 3 and r["in_flight"] == 0, timeout_s=10)
        assert done["latency_p50_ms"] > 0 and done["latency_p99_ms"] >= done["latency_p50_ms"]
        assert done["queue_time_ms"] > 0 and done["error_rate"] == 0.0
        # All three answers are from the last 2 s, which the overdue baseline leaves out.
        assert done["window_requests"] == 3 and done["latency_max_ms"] is None
        assert done["oldest_running_ms"] is None
        assert done["address"] == s.sidecar.address and done["node"] == "node-a" and done["simulated"] is True


async def test_worker_death_is_reported_at_once_and_recovery_too(tmp_path):
    worker = FakeWorker()
    async with sidecar_stack(tmp_path, *SLOW, worker=worker) as s:
        await s.control.wait_for(lambda r: r["state"] == "ready", timeout_s=10)
        n = len(s.control.records)
        await worker.stop()  # like a killed process: connections are refused
        failed = await s.control.wait_for(lambda r: r["state"] == "failed", timeout_s=5, after=n)
        async with s.http.get(s.control_url + "/-/ready") as resp:
            assert resp.status == 503
        async with s.http.post(s.url + "/generate", json={}) as resp:
            assert resp.status == 503 and resp.headers["x-sie-retryable"] == "true"

        await worker.start()  # same port, as a restarted worker would be
        ready = await s.control.wait_for(lambda r: r["state"] == "ready", timeout_s=5, after=n + 1)
        assert ready["seq"] > failed["seq"]
        async with s.http.post(s.url + "/generate", json={}) as resp:
            assert resp.status == 200


async def test_worker_answering_503_is_loading_not_ready(tmp_path):
    worker = FakeWorker()
    worker.health_status = 503
    async with sidecar_stack(tmp_path, worker=worker) as s:
        await asyncio.sleep(0.6)
        assert (await s.state())["state"] == "loading"
        async with s.http.post(s.url + "/generate", json={}) as resp:
            assert resp.status == 503 and (await resp.json())["error"]["state"] == "loading"
        worker.health_status = 200
        await s.wait_state("ready")


async def test_loads_fallback_to_metrics_and_dp_lists(tmp_path):
    for shape, usage in (("missing", 0.75), ("dp", 0.5)):
        worker = FakeWorker(token_usage=usage, loads_shape=shape)
        async with sidecar_stack(tmp_path, worker=worker) as s:
            record = await s.control.wait_for(lambda r: r["kv_cache_usage"] is not None, timeout_s=10)
            assert record["kv_cache_usage"] == usage and record["engine_running"] == 0, shape


async def test_keeps_serving_while_the_control_plane_is_down(tmp_path):
    async with sidecar_stack(tmp_path) as s:
        await s.control.wait_for(lambda r: r["state"] == "ready")
        await s.control.stop()
        async with s.http.post(s.url + "/generate", json={}) as resp:
            assert resp.status == 200
        down_at = time.time()
        await asyncio.sleep(2.0)
        await s.control.start()  # back on the same port
        n = len(s.control.records)
        # The first record after the outage is the current picture (the request above included),
        # not the oldest of a backlog built while the control plane was away.
        record = await s.control.wait_for(lambda r: True, timeout_s=5, after=n)
        assert record["requests_total"] == 1 and record["state"] == "ready"
        assert record["timestamp"] > down_at + 1.0
