"""The sklearn worker as a real process on the demo scorer: typed /infer, single and batched."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.integration.worker_process import running_worker

pytestmark = pytest.mark.integration

MODEL = "review-scorer"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sklearn-worker")
    spec = {
        "spec": {
            "model": {"name": MODEL, "path": str(tmp / "scorer.skops"), "service_type": "scoring"},
            "backend": {"type": "sklearn", "config": {"demo": True}},
            "input_schema": {"fields": [{"name": "text", "type": "string", "max_length": 1000}]},
            "output_schema": {
                "fields": [
                    {"name": "score", "type": "float32", "range": [0.0, 1.0]},
                    {"name": "label", "type": "int32"},
                ]
            },
        }
    }
    with running_worker("node_host.backends.sklearn_engine", spec, tmp) as worker:
        yield worker


@pytest.fixture
async def http(base):
    url, headers = base
    async with aiohttp.ClientSession(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def test_infer_single_and_batch(http):
    async with http.post("/infer", json={"text": "great friendly service, love it"}) as resp:
        assert resp.status == 200
        good = await resp.json()
    assert set(good) == {"score", "label"} and good["score"] > 0.5 and good["label"] == 1
    rows = [{"text": "terrible rude staff"}, {"text": "excellent and fast"}, {"text": "awful slow refund"}]
    async with http.post("/infer", json={"instances": rows}) as resp:
        predictions = (await resp.json())["predictions"]
    assert [p["label"] for p in predictions] == [0, 1, 0]
    assert all(0.0 <= p["score"] <= 1.0 and isinstance(p["score"], float) for p in predictions)


async def test_infer_rejects_wrong_types_with_the_field(http):
    async with http.post("/infer", json={"instances": [{"text": "ok"}, {"text": 5}]}) as resp:
        assert resp.status == 400
        assert "instances[1].text" in (await resp.json())["error"]["message"]


async def test_scorer_reports_no_token_figures(http):
    async with http.get("/v1/loads") as resp:
        loads = await resp.json()
    assert loads["num_running_reqs"] == 0 and loads["token_usage"] is None
    async with http.get("/model_info") as resp:
        assert (await resp.json())["is_generation"] is False
    async with http.post("/generate", json={"text": "x"}) as resp:
        assert resp.status == 404  # a scorer does not generate
    async with http.post("/infer", json={"text": "fine"}) as resp:
        assert resp.status == 200
    async with http.get("/metrics") as resp:
        text = await resp.text()
    assert f'sglang:num_running_reqs{{model_name="{MODEL}"}} 0.0' in text
    assert "sglang:token_usage" not in text
    assert f'sglang:e2e_request_latency_seconds_count{{model_name="{MODEL}"}}' in text


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram in Prometheus text, 0 when absent."""
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_count{{"):
            count = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum{{"):
            total = float(line.rsplit(" ", 1)[1])
    return count, total


async def test_concurrent_requests_are_micro_batched_with_the_same_answers_as_alone(http):
    texts = [f"review {i}: {'great friendly service' if i % 2 else 'awful slow refund'}" for i in range(64)]
    alone = []
    for text in texts[:4]:  # one at a time: each is a batch of one
        async with http.post("/infer", json={"text": text}) as resp:
            alone.append(await resp.json())
    async with http.get("/metrics") as resp:
        calls_before, rows_before = _histogram(await resp.text(), "sie_worker_batch_size")

    async def one(text: str) -> dict:
        async with http.post("/infer", json={"text": text}) as resp:
            assert resp.status == 200
            return await resp.json()

    together = await asyncio.gather(*(one(t) for t in texts))
    assert together[:4] == alone, "a request's answer does not depend on what it was batched with"
    assert [p["label"] for p in together] == [i % 2 for i in range(64)]
    async with http.get("/metrics") as resp:
        text = await resp.text()
    calls, rows = _histogram(text, "sie_worker_batch_size")
    assert rows - rows_before == 64
    assert calls - calls_before < 64, "64 concurrent requests took as many engine calls: nothing was batched"
    assert _histogram(text, "sie_worker_batch_requests")[1] >= 64
