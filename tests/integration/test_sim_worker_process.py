"""The sim worker as a real process: it serves, slows down on command, and reports its queue."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
import pytest

from sie.auth import write_private

pytestmark = pytest.mark.integration

# 10 ms per decode step at batch 1, nothing else, so a 20-token request takes ~200 ms at normal speed.
CONFIG = {"prefill_ms_per_token": 0.0, "decode_base_ms": 10.0, "decode_ms_per_request": 0.0, "kv_tokens": 4096}


@pytest.fixture
async def worker(tmp_path):
    spec = {"spec": {"model": {"name": "sim-llm"}, "backend": {"type": "sim", "config": CONFIG}}}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    key_file = tmp_path / "worker.key"
    write_private(key_file, b"sim-key")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "node_host.backends.sim",
        "--spec-file",
        str(spec_file),
        "--port",
        "0",
        "--api-key-file",
        str(key_file),
        "--log-level",
        "WARNING",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
        assert line.startswith("listening on "), f"unexpected first line from the sim worker: {line!r}"
        base = f"http://127.0.0.1:{int(line.split()[-1])}"
        async with aiohttp.ClientSession(base) as anonymous:
            async with anonymous.post("/sim/config", json={"slowdown": 100.0}) as resp:
                assert resp.status == 401  # its controls answer only its sidecar and node host
        async with aiohttp.ClientSession(base, headers={"Authorization": "Bearer sim-key"}) as session:
            for _ in range(100):
                async with session.get("/health") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            yield session
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _latency(session: aiohttp.ClientSession) -> float:
    async with session.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 20}}) as resp:
        assert resp.status == 200 and resp.headers["x-sie-simulated"] == "true"
        body = await resp.json()
    assert body["simulated"] is True and body["meta_info"]["completion_tokens"] == 20
    return body["meta_info"]["e2e_latency"]


async def test_latency_grows_with_slowdown_and_loads_show_the_queue(worker):
    normal = await _latency(worker)
    async with worker.post("/sim/config", json={"slowdown": 3.0}) as resp:
        assert resp.status == 200 and (await resp.json())["slowdown"] == 3.0
    slow = await _latency(worker)
    # 3x the simulated cost; event-loop wake-up jitter adds the same small amount to both.
    assert slow > 2.0 * normal, (normal, slow)

    async with worker.post("/sim/config", json={"slowdown": 1.0, "max_running_requests": 1}) as resp:
        assert resp.status == 200
    calls = [asyncio.create_task(_latency(worker)) for _ in range(3)]
    seen = None
    for _ in range(100):
        async with worker.get("/v1/loads") as resp:
            loads = await resp.json()
        seen = (loads["num_running_reqs"], loads["num_waiting_reqs"])
        if seen == (1, 2):
            break
        await asyncio.sleep(0.01)
    assert seen == (1, 2)
    assert loads["simulated"] is True and loads["max_total_num_tokens"] == 4096 and loads["num_used_tokens"] > 0
    latencies = sorted(await asyncio.gather(*calls))
    assert latencies[-1] > 2.5 * latencies[0]  # the last waited for two others, one at a time

    async with worker.get("/metrics") as resp:
        text = await resp.text()
    assert 'sie_simulated{model_name="sim-llm"} 1.0' in text
    assert 'sglang:e2e_request_latency_seconds_count{model_name="sim-llm"} 5.0' in text
