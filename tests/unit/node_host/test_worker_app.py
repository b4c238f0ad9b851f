"""The worker protocol's HTTP side over a fake engine: bodies, SSE, the memory gate, metrics."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node_host.backends.protocol import (
    BadRequest,
    Delta,
    EngineState,
    GenerateRequest,
    Loads,
    Unavailable,
)
from node_host.backends.runtime.app import WorkerApp


class FakeEngine:
    """Answers every request with the words of `reply`, one Delta per word; `hold` parks generations."""

    backend = "fake"
    simulated = False
    served_model_name = "m1"
    model_path = "/models/m1"

    def __init__(self, reply: str = "a b c"):
        self.state = EngineState.READY
        self.reply = reply.split()
        self.running = 0
        self.requests: list[GenerateRequest] = []
        self.hold: asyncio.Event | None = None
        self.closed_early = 0
        self.released_tags: list[list[str]] = []
        self.stall_after_first = False  # park forever after the first Delta (a client must go away)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def loads(self) -> Loads:
        return Loads(running=self.running, waiting=0, used_tokens=10 * self.running, max_total_tokens=100)

    async def release(self, tags):
        self.released_tags.append(list(tags))
        self.state = EngineState.SLEEPING

    async def resume(self, tags):
        self.state = EngineState.READY

    async def generate(self, request: GenerateRequest):
        if request.text == "too long":
            raise BadRequest("prompt is longer than the context")
        self.requests.append(request)
        self.running += 1
        finished = False
        try:
            if self.hold is not None:
                await self.hold.wait()
            words = self.reply[: request.params.max_new_tokens]
            for i, word in enumerate(words):
                last = i == len(words) - 1
                yield Delta(
                    text=(" " if i else "") + word,
                    prompt_tokens=3,
                    completion_tokens=i + 1,
                    finish_reason="length" if last else None,
                    queue_time_s=0.01 if i == 0 else None,
                )
                if self.stall_after_first:
                    await asyncio.Event().wait()
                if "fail midway" in (request.text or str(request.messages)):
                    raise Unavailable("engine lost its batch")
            finished = True
        finally:
            self.running -= 1
            if not finished:
                self.closed_early += 1


@pytest.fixture
async def client():
    engine = FakeEngine()
    async with TestClient(TestServer(WorkerApp(engine).build())) as c:
        c.engine = engine
        yield c


def _sse(raw: str) -> list:
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_generate_non_stream(client):
    resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, "rid": "r1"})
    assert resp.status == 200
    body = await resp.json()
    assert body["text"] == "a b"
    assert body["meta_info"]["id"] == "r1"
    assert body["meta_info"]["completion_tokens"] == 2
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert client.engine.requests[0].params.max_new_tokens == 2


async def test_generate_stream_sends_text_so_far(client):
    resp = await client.post("/generate", json={"text": "hi", "stream": True})
    chunks = _sse(await resp.text())
    assert [c["text"] for c in chunks] == ["a", "a b", "a b c"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_chat_non_stream_and_stream(client):
    body = {"model": "m1", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    resp = await client.post("/v1/chat/completions", json=body)
    out = await resp.json()
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "a b c"}
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert client.engine.requests[0].messages == ({"role": "user", "content": "hi"},)

    resp = await client.post(
        "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = _sse(await resp.text())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == "a b c"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6


async def test_completions(client):
    resp = await client.post("/v1/completions", json={"prompt": ["x"], "max_tokens": 1})
    out = await resp.json()
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == "a"


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/generate", {"sampling_params": {}}, "exactly one of 'text'"),
        ("/generate", {"text": ["a", "b"]}, "one string"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ("/generate", {"text": "x", "sampling_params": {"top_p": 2}}, "outside"),
        # top_p 0 keeps no token to sample from: refused as SGLang and vLLM refuse it, naming the field
        ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, "sampling_params.top_p: 0 is outside (0.0, 1.0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0.0}, "top_p: 0.0 is"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": -1e-9}}, "temperature: -1e-09 is outside"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ("/generate", {"text": "too long"}, "longer than the context"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=1"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ],
)
async def test_bad_requests_name_the_field(client, path, body, needle):
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert needle in (await resp.json())["error"]["message"]


async def test_invalid_json_is_400(client):
    resp = await client.post("/generate", data=b"{nope", headers={"Content-Type": "application/json"})
    assert resp.status == 400


async def test_info_endpoints(client):
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "m1"
    info = await (await client.get("/model_info")).json()
    assert info == {
        "model_path": "/models/m1",
        "served_model_name": "m1",
        "backend": "fake",
        "is_generation": True,
        "simulated": False,
    }
    loads = await (await client.get("/v1/loads")).json()
    assert loads["num_running_reqs"] == 0 and loads["token_usage"] == 0.0 and loads["max_total_num_tokens"] == 100


async def test_health_follows_engine_state(client):
    assert (await client.get("/health")).status == 200
    client.engine.state = EngineState.LOADING
    resp = await client.get("/health")
    assert resp.status == 503 and (await resp.json()) == {"status": "loading"}
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 503


async def test_release_refused_while_busy_then_gates_traffic(client):
    client.engine.hold = asyncio.Event()
    pending = asyncio.create_task(client.post("/generate", json={"text": "x"}))
    while client.engine.running == 0:
        await asyncio.sleep(0.001)
    resp = await client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert resp.status == 409
    assert "drain" in (await resp.json())["error"]["message"]
    client.engine.hold.set()
    assert (await pending).status == 200

    resp = await client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert resp.status == 200
    assert client.engine.released_tags == [["weights"]]
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "sleeping"
    assert (await client.post("/generate", json={"text": "x"})).status == 503
    assert (await client.post("/resume_memory_occupation")).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.post("/generate", json={"text": "x"})).status == 200


async def test_metrics_use_sglang_names(client):
    await client.post("/generate", json={"text": "x"})
    text = await (await client.get("/metrics")).text()
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
        "sglang:gen_throughput",
    ):
        assert f'{name}{{model_name="m1"}}' in text, name
    assert 'sglang:e2e_request_latency_seconds_count{model_name="m1"} 1.0' in text
    assert 'sglang:time_to_first_token_seconds_count{model_name="m1"} 1.0' in text
    assert 'sglang:queue_time_seconds_count{model_name="m1"} 1.0' in text


async def test_client_gone_mid_stream_closes_the_engine_generator():
    engine = FakeEngine()
    engine.stall_after_first = True
    server = TestServer(WorkerApp(engine).build())
    async with TestClient(server) as c:
        resp = await c.post("/generate", json={"text": "x", "stream": True})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()
        for _ in range(500):
            if engine.running == 0:
                break
            await asyncio.sleep(0.002)
        assert engine.running == 0 and engine.closed_early == 1


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"text": "too long", "stream": True}),
        ("/v1/completions", {"prompt": "too long", "stream": True}),
    ],
)
async def test_stream_errors_before_the_first_token_keep_their_status(client, path, body):
    resp = await client.post(path, json=body)
    assert resp.status == 400 and resp.content_type == "application/json"


async def test_stream_error_midway_becomes_an_error_event(client):
    resp = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "fail midway"}], "stream": True}
    )
    assert resp.status == 200
    raw = await resp.text()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "lost its batch" in error["message"]


@pytest.mark.parametrize("size, status", [(1024, 400), (1025, 413)])
async def test_bodies_are_capped_at_the_limit_the_worker_is_given(size, status):
    """run_worker passes the spec's limits.max_body_bytes; a body the sidecar would refuse is refused here
    too (it used to take up to 64 MiB from anyone holding the worker key)."""
    async with TestClient(TestServer(WorkerApp(FakeEngine(), max_body_bytes=1024).build())) as c:
        body = b"[" + b" " * (size - 2) + b"]"
        resp = await c.post("/generate", data=body, headers={"Content-Type": "application/json"})
        assert resp.status == status
        error = (await resp.json())["error"]
        assert ("1024" in error["message"]) if status == 413 else ("JSON object" in error["message"])


def test_worker_options_carry_the_body_limit_to_the_app():
    from node_host.backends.runtime.main import WorkerOptions

    assert WorkerOptions(max_body_bytes=4096).app_options()["max_body_bytes"] == 4096
    assert WorkerOptions().app_options()["max_body_bytes"] == 64 * 1024 * 1024  # without a spec: the spec's maximum
