"""The sglang adapter's launch path against a STAND-IN for `python -m sglang.launch_server`.

Real SGLang needs a CUDA GPU, so these tests run sie_testing/sglang_standin.py, which parses SGLang's
launch arguments (rejecting unknown ones as SGLang does) and serves its protocol with echo text. What
they prove: the command launch_command builds is accepted, the server it starts reports the budgeted
mem fraction, ports and flags, and release/resume go through only when the instance is drained.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from node_host.backends.sglang_server.launch import launch_command, memory_call
from sie.spec import ModelService
from sie.worker_loads import parse_loads
from sie.worker_loads import parse_metrics_text as parse_metrics
from sie_testing.ports import free_port

pytestmark = pytest.mark.integration

STANDIN = str(Path(__file__).resolve().parents[2] / "sie_testing" / "sglang_standin.py")


def standin_command(spec: ModelService, port: int, nccl_port: int, **kw) -> list[str]:
    args = launch_command(spec, "127.0.0.1", port, None, nccl_port=nccl_port, **kw)
    assert args[1:3] == ["-m", "sglang.launch_server"]
    return [sys.executable, STANDIN, *args[3:]]  # the stand-in in place of the real module


SPEC = ModelService.model_validate(
    {
        "spec": {
            "model": {"name": "qwen-standin", "path": "/models/Qwen2-7B"},
            "backend": {
                "type": "sglang",
                "config": {"max_seq_len": 8192, "max_total_tokens": 65536, "chunked_prefill_size": 4096},
            },
            "resources": {"max_concurrent_requests": 32},
        }
    }
)


async def start(command: list[str], env_extra: dict[str, str] | None = None):
    env = {**os.environ, **(env_extra or {})}
    return await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env
    )


async def stop(proc) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def wait_healthy(session: aiohttp.ClientSession, proc, timeout_s: float = 30.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if proc.returncode is not None:
            raise AssertionError(
                f"the stand-in exited with {proc.returncode}: {(await proc.stderr.read()).decode()[-2000:]}"
            )
        try:
            async with session.get("/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("the stand-in did not become healthy")


@pytest.fixture
async def server():
    port, nccl = free_port(), free_port()
    proc = await start(
        standin_command(SPEC, port, nccl, budget_mb=24_000, free_mb=80_000), {"STANDIN_STARTUP_DELAY_S": "0.3"}
    )
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            await wait_healthy(session, proc)
            yield session, proc, port, nccl
    finally:
        await stop(proc)


async def test_launch_arguments_reach_the_server(server):
    session, _, port, nccl = server
    async with session.get("/server_info") as resp:
        info = await resp.json()
    assert info["standin"] is True  # this is the stand-in, not SGLang
    assert info["mem_fraction_static"] == 0.3  # 24000 MiB of 80000 MiB free
    assert (info["port"], info["nccl_port"]) == (port, nccl)
    assert (info["max_total_tokens"], info["max_running_requests"], info["context_length"]) == (65536, 32, 8192)
    assert info["served_model_name"] == "qwen-standin" and info["chunked_prefill_size"] == 4096
    assert info["enable_metrics"] and info["enable_memory_saver"] and info["enable_weights_cpu_backup"]
    assert info["skip_server_warmup"]


async def test_it_serves_the_worker_protocol(server):
    session, *_ = server
    async with session.post(
        "/generate", json={"text": "hello world", "sampling_params": {"max_new_tokens": 3}}
    ) as resp:
        body = await resp.json()
    assert body["text"] == "hello world hello" and body["meta_info"]["completion_tokens"] == 3
    async with session.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ) as resp:
        assert (await resp.json())["choices"][0]["message"]["content"] == "hi hi"
    async with session.get("/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "qwen-standin"
    async with session.get("/v1/loads") as resp:
        load = parse_loads(await resp.json())
    assert (load.running, load.waiting, load.max_tokens) == (0, 0, 65536)
    async with session.get("/metrics") as resp:
        gauges = parse_metrics(await resp.text())
    assert (gauges.running, gauges.max_tokens) == (0, 65536)


async def test_release_and_resume_round_trip(server):
    session, proc, *_ = server
    path, body = memory_call("release", in_flight=0)
    async with session.post(path, json=body) as resp:
        assert resp.status == 200 and (await resp.json())["success"]
    async with session.get("/server_info") as resp:
        assert (await resp.json())["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    path, body = memory_call("resume", in_flight=0)
    async with session.post(path, json=body) as resp:
        assert resp.status == 200
    async with session.get("/server_info") as resp:
        info = await resp.json()
    assert info["released_tags"] == [] and info["weights_lost"] is False  # weights came back from the CPU copy
    async with session.post("/generate", json={"text": "back", "sampling_params": {"max_new_tokens": 1}}) as resp:
        assert resp.status == 200
    assert proc.returncode is None


async def test_release_while_busy_takes_the_server_down_like_sglang():
    port = free_port()
    proc = await start(
        standin_command(SPEC, port, free_port(), budget_mb=8000, free_mb=80_000), {"STANDIN_TOKEN_DELAY_S": "0.05"}
    )
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            await wait_healthy(session, proc)
            busy = asyncio.create_task(
                session.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 40}})
            )
            for _ in range(100):  # until the request is in flight
                async with session.get("/v1/loads") as resp:
                    if parse_loads(await resp.json()).running:
                        break
                await asyncio.sleep(0.02)
            with pytest.raises(aiohttp.ClientError):
                async with session.post("/release_memory_occupation", json={}) as resp:
                    await resp.read()
            assert await asyncio.wait_for(proc.wait(), timeout=10) == 3
            with pytest.raises(aiohttp.ClientError):
                await busy
    finally:
        await stop(proc)


async def test_unknown_arguments_are_rejected_like_sglang_does():
    proc = await start([sys.executable, STANDIN, "--model-path", "/m", "--no-such-flag", "1"])
    try:
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 2
        assert "unrecognized arguments: --no-such-flag" in (await proc.stderr.read()).decode()
    finally:
        await stop(proc)
