"""The sim worker's HTTP layer in process: the worker protocol, the simulator labels, /sim/config."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node_host.backends.protocol import GenerateRequest, SamplingParams
from node_host.backends.sim.worker import SimWorkerEngine, build_app, count_prompt_tokens, sim_params_from_spec
from sie.errors import SpecError
from sie.spec_loader import parse_model_service

FAST = {"prefill_ms_per_token": 0.0, "decode_base_ms": 0.2, "decode_ms_per_request": 0.0}


def _spec(config: dict | None = None):
    return parse_model_service(
        {"spec": {"model": {"name": "sim-llm"}, "backend": {"type": "sim", "config": config or {}}}}
    )


@pytest.fixture
async def client():
    engine = SimWorkerEngine(_spec({**FAST, "max_total_tokens": 2000}))
    client = TestClient(TestServer(build_app(engine)))
    await client.start_server()
    await engine.start()
    try:
        yield client
    finally:
        await client.close()
        await engine.close()


async def _json(resp):
    assert resp.headers.get("x-sie-simulated") == "true", f"{resp.url} is not labelled simulated"
    return await resp.json()


@pytest.mark.parametrize(
    "path, body, check",
    [
        (
            "/generate",
            {"text": "one two three", "sampling_params": {"max_new_tokens": 5}},
            lambda b: (
                b["text"] == "sim sim sim sim sim"
                and b["meta_info"]["prompt_tokens"] == 3
                and b["meta_info"]["completion_tokens"] == 5
                and b["meta_info"]["e2e_latency"] > 0
                and b["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
            ),
        ),
        (
            "/v1/completions",
            {"model": "sim-llm", "prompt": "a b", "max_tokens": 2},
            lambda b: (
                b["choices"][0]["text"] == "sim sim"
                and b["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
            ),
        ),
        (
            "/v1/chat/completions",
            {"model": "sim-llm", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 1},
            lambda b: b["choices"][0]["message"]["content"] == "sim" and b["usage"]["prompt_tokens"] == 3,
        ),
    ],
)
async def test_generation_endpoints_answer_and_say_simulated(client, path, body, check):
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    got = await _json(resp)
    assert got["simulated"] is True
    assert check(got), got


@pytest.mark.parametrize(
    "path, expect",
    [
        ("/health", lambda b: b["status"] == "ok"),
        ("/v1/models", lambda b: b["data"][0]["id"] == "sim-llm"),
        ("/model_info", lambda b: b["backend"] == "sim"),
        (
            "/v1/loads",
            lambda b: b["max_total_num_tokens"] == 2000 and b["num_running_reqs"] == 0 and b["token_usage"] == 0.0,
        ),
        ("/sim/config", lambda b: b["kv_tokens"] == 2000 and b["slowdown"] == 1.0 and b["loads"]["running"] == 0),
    ],
)
async def test_read_endpoints_say_simulated(client, path, expect):
    resp = await client.get(path)
    assert resp.status == 200
    got = await _json(resp)
    assert got["simulated"] is True and expect(got), got


async def test_errors_are_labelled_and_explain(client):
    resp = await client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 5000}})
    assert resp.status == 400
    got = await _json(resp)
    assert got["error"]["simulated"] is True and "above the budget of 2000" in got["error"]["message"]


async def test_metrics_use_sglang_names_and_flag_the_simulator(client):
    await client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
    resp = await client.get("/metrics")
    assert resp.headers["x-sie-simulated"] == "true"
    text = await resp.text()
    for line in (
        'sie_simulated{model_name="sim-llm"} 1.0',
        'sglang:max_total_num_tokens{model_name="sim-llm"} 2000.0',
        'sglang:num_running_reqs{model_name="sim-llm"} 0.0',
        'sglang:e2e_request_latency_seconds_count{model_name="sim-llm"} 1.0',
        'sglang:queue_time_seconds_count{model_name="sim-llm"} 1.0',
        'sie_sim_slowdown{model_name="sim-llm"} 1.0',
    ):
        assert line in text, line


async def test_the_prefix_cache_hit_rate_is_in_loads_and_metrics(client):
    loads = await (await client.get("/v1/loads")).json()
    assert loads["cache_hit_rate"] is None, "no prefix cache: absent, not zero"
    assert (await client.post("/sim/config", json={"prefix_cache": True, "page_size": 4})).status == 200
    system = " ".join(f"w{i}" for i in range(40))
    for question in ("first question here", "second question here"):
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        assert (await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})).status == 200
    loads = await (await client.get("/v1/loads")).json()
    # 41 shared tokens (role marker and 40 words) of 45 per prompt: 10 whole pages hit on the second
    assert loads["cache_hit_rate"] == pytest.approx(40 / 90)
    text = await (await client.get("/metrics")).text()
    assert f'sglang:cache_hit_rate{{model_name="sim-llm"}} {40 / 90}' in text


async def test_sim_config_changes_at_run_time_and_refuses_bad_values(client):
    resp = await client.post("/sim/config", json={"slowdown": 3, "kv_tokens": 500})
    got = await _json(resp)
    assert resp.status == 200 and got["slowdown"] == 3.0 and got["kv_tokens"] == 500
    assert (await (await client.get("/v1/loads")).json())["max_total_num_tokens"] == 500
    resp = await client.post("/sim/config", json={"slowdown": -1, "warp": 9})
    got = await _json(resp)
    assert resp.status == 400
    assert {p["path"] for p in got["error"]["problems"]} == {"warp"}  # unknown keys are reported before values
    resp = await client.post("/sim/config", json={"slowdown": -1})
    assert resp.status == 400 and "slowdown: must be above 0" in (await resp.json())["error"]["message"]
    assert (await (await client.get("/sim/config")).json())["slowdown"] == 3.0  # a refused change changes nothing


async def test_loads_show_running_and_release_waits_for_idle(client):
    await client.post("/sim/config", json={"decode_base_ms": 3.0, "max_running_requests": 1})
    body = {"text": "x", "sampling_params": {"max_new_tokens": 20}}  # 60 ms each, one at a time
    calls = [asyncio.create_task(client.post("/generate", json=body)) for _ in range(3)]
    for _ in range(100):
        loads = await (await client.get("/v1/loads")).json()
        if loads["num_running_reqs"] == 1 and loads["num_waiting_reqs"] == 2:
            break
        await asyncio.sleep(0.01)
    assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (1, 2)
    resp = await client.post("/release_memory_occupation", json={})
    assert resp.status == 409 and (await resp.json())["error"]["simulated"] is True
    for call in calls:
        assert (await call).status == 200
    resp = await client.post("/release_memory_occupation", json={})
    assert resp.status == 200
    assert (await client.post("/generate", json=body)).status == 503
    assert (await client.post("/resume_memory_occupation", json={})).status == 200


async def test_streaming_generate_sends_the_first_token_first(client):
    await client.post("/sim/config", json={"decode_base_ms": 5.0})  # the last token comes 10 ms after the first
    resp = await client.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    assert resp.headers["x-sie-simulated"] == "true"
    events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 3]
    assert chunks[-1]["text"] == "sim sim sim"


@pytest.mark.parametrize(
    "request_kwargs, expected",
    [
        ({"text": "the quick  brown fox"}, 4),
        ({"text": ""}, 1),
        ({"input_ids": (1, 2, 3)}, 3),
        ({"messages": ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})}, 5),
    ],
)
def test_prompt_tokens_are_whitespace_words(request_kwargs, expected):
    assert count_prompt_tokens(GenerateRequest(rid="r", params=SamplingParams(), **request_kwargs)) == expected


@pytest.mark.parametrize(
    "config, expected, error",
    [
        ({}, {"kv_tokens": 16384, "slowdown": 1.0}, None),
        ({"max_total_tokens": 4096, "slowdown": 2, "demo": True}, {"kv_tokens": 4096, "slowdown": 2.0}, None),
        ({"decode_base_ms": 8, "max_running_requests": 4}, {"decode_base_ms": 8.0, "max_running_requests": 4}, None),
        ({"slowdown": 0}, None, "backend.config is invalid:\n  - slowdown: must be above 0"),
        ({"kv_tokens": "lots"}, None, "kv_tokens: must be an integer"),
    ],
)
def test_params_come_from_the_spec(config, expected, error):
    if error:
        with pytest.raises(SpecError) as info:
            sim_params_from_spec(_spec(config))
        assert error in str(info.value) and "sim-llm" in str(info.value)
        return
    params = sim_params_from_spec(_spec(config)).to_json()
    assert {k: params[k] for k in expected} == expected
