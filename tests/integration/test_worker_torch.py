"""The torch worker as a real process on the tiny demo model: every endpoint of the worker protocol,
batching and queueing under its limits, and memory release/resume."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.integration.worker_process import running_worker

pytestmark = pytest.mark.integration

MODEL = "tiny-llm"
LIMITS = {"max_running_requests": 2, "max_total_tokens": 2048}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch-worker")
    spec = {
        "spec": {
            # demo: the worker creates the tiny random Qwen2 at model.path, as on a fresh machine
            "model": {"name": MODEL, "path": str(tmp / "models" / "tiny")},
            "backend": {"type": "torch", "config": {"demo": True, **LIMITS}},
        }
    }
    with running_worker("node_host.backends.torch_engine", spec, tmp) as worker:
        yield worker


@pytest.fixture
async def http(base):
    url, headers = base
    async with aiohttp.ClientSession(url, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def greedy(text: str, n: int, **extra) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **extra}


def sse(raw: str) -> list[dict]:
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_info_endpoints(http):
    async with http.get("/health") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
    async with http.get("/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
    async with http.get("/model_info") as resp:
        info = await resp.json()
    assert info["backend"] == "torch" and info["served_model_name"] == MODEL and info["is_generation"] is True


async def test_generate_stream_and_non_stream_agree(http):
    async with http.post("/generate", json=greedy("Hello there", 12, rid="r-1")) as resp:
        assert resp.status == 200
        body = await resp.json()
    meta = body["meta_info"]
    assert meta["id"] == "r-1" and meta["completion_tokens"] == 12 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    async with http.post("/generate", json=greedy("Hello there", 12, stream=True)) as resp:
        chunks = sse(await resp.text())
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # SGLang streams the text so far
    assert texts[-1] == body["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_chat_completions(http):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    ) as resp:
        out = await resp.json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["choices"][0]["message"]["role"] == "assistant"
    usage = out["usage"]
    assert 0 < usage["completion_tokens"] <= 5
    assert usage["prompt_tokens"] > 10  # the chat template wrapped the two messages
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post("/v1/chat/completions", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = sse(await resp.text())
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == out["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == usage


async def test_completions(http):
    async with http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "The quick", "max_tokens": 4, "temperature": 0}
    ) as resp:
        out = await resp.json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] <= 4


async def test_batches_up_to_the_limit_and_queues_the_rest(http):
    """Four long requests with max_running_requests=2: two run together, the others wait."""
    seen_running, seen_waiting, seen_usage = set(), set(), 0.0

    async def watch(stop: asyncio.Event) -> None:
        nonlocal seen_usage
        while not stop.is_set():
            async with http.get("/v1/loads") as resp:
                loads = await resp.json()
            seen_running.add(loads["num_running_reqs"])
            seen_waiting.add(loads["num_waiting_reqs"])
            seen_usage = max(seen_usage, loads["token_usage"])
            await asyncio.sleep(0.005)

    async def one(i: int) -> dict:
        async with http.post("/generate", json=greedy(f"request {i}", 150)) as resp:
            return await resp.json()

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(stop))
    results = await asyncio.gather(*(one(i) for i in range(4)))
    stop.set()
    await watcher
    assert [r["meta_info"]["completion_tokens"] for r in results] == [150] * 4
    assert max(seen_running) == 2, seen_running  # batched, and never over the limit
    assert max(seen_waiting) >= 1, seen_waiting
    assert 0 < seen_usage <= 1
    async with http.get("/v1/loads") as resp:
        idle = await resp.json()
    assert idle["num_running_reqs"] == 0 and idle["num_used_tokens"] == 0
    assert idle["max_total_num_tokens"] == LIMITS["max_total_tokens"]


async def test_metrics_have_sglang_names(http):
    async with http.post("/generate", json=greedy("x", 2)) as resp:
        assert resp.status == 200
    async with http.get("/metrics") as resp:
        text = await resp.text()
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
        "sglang:gen_throughput",
    ):
        assert f'{name}{{model_name="{MODEL}"}}' in text, name
    for name in (
        "sglang:e2e_request_latency_seconds",
        "sglang:time_to_first_token_seconds",
        "sglang:queue_time_seconds",
    ):
        assert f"{name}_bucket" in text, name


async def test_bad_request_names_the_problem(http):
    async with http.post("/generate", json=greedy("x", 100_000)) as resp:
        assert resp.status == 400
        assert "context length" in (await resp.json())["error"]["message"]


async def test_release_needs_idle_then_sleeps_and_resumes_with_the_same_weights(http):
    async with http.post("/generate", json=greedy("Memory test", 8)) as resp:
        before = (await resp.json())["text"]

    busy = asyncio.create_task(http.post("/generate", json=greedy("long one", 400)))
    for _ in range(400):
        async with http.get("/v1/loads") as resp:
            if (await resp.json())["num_running_reqs"]:
                break
        await asyncio.sleep(0.005)
    async with http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}) as resp:
        assert resp.status == 409
        assert "drain" in (await resp.json())["error"]["message"]
    (await busy).release()

    async with http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache"]}) as resp:
        assert resp.status == 200
    async with http.get("/health") as resp:
        assert resp.status == 503 and (await resp.json())["status"] == "sleeping"
    async with http.post("/generate", json=greedy("Memory test", 8)) as resp:
        assert resp.status == 503
    async with http.post("/resume_memory_occupation", json={}) as resp:
        assert resp.status == 200
    async with http.get("/health") as resp:
        assert resp.status == 200
    async with http.post("/generate", json=greedy("Memory test", 8)) as resp:
        assert (await resp.json())["text"] == before
