"""The sklearn worker as a real process on the demo scorer: typed /infer, single and batched."""

from __future__ import annotations

import asyncio
import json
import pickle
import zipfile
from pathlib import Path

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


class _Touch:
    """Unpickling this creates the marker file: what the pickle behind a hostile skops file does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def test_a_spec_trusting_a_function_is_refused_and_the_file_runs_nothing(tmp_path):
    """The review's file: a .skops whose root is joblib.load("weights.dat"), a pickle under an innocent
    name, with the spec listing joblib.load in trusted_types on a node that allows no unsafe formats."""
    marker = tmp_path / "PWNED"
    (tmp_path / "weights.dat").write_bytes(pickle.dumps(_Touch(str(marker))))
    arg = {"__class__": "str", "__module__": "builtins", "__loader__": "JsonNode", "is_json": True}
    schema = {
        "__class__": "load",
        "__module__": "joblib",
        "__loader__": "ConstructorFromReduceNode",
        "content": {
            "__class__": "tuple",
            "__module__": "builtins",
            "__loader__": "TupleNode",
            "content": [{**arg, "content": json.dumps(str(tmp_path / "weights.dat"))}],
        },
        "protocol": 2,
        "_skops_version": "0.16.0",
    }
    with zipfile.ZipFile(tmp_path / "model.skops", "w") as z:
        z.writestr("schema.json", json.dumps(schema))
    spec = {
        "spec": {
            "model": {"name": "scorer", "path": str(tmp_path / "model.skops")},
            "backend": {"type": "sklearn", "config": {"trusted_types": ["joblib.load"]}},
            "input_schema": {"fields": [{"name": "x", "type": "float32"}]},
        }
    }
    with pytest.raises(AssertionError, match="'joblib.load': not a scikit-learn class"):
        with running_worker("node_host.backends.sklearn_engine", spec, tmp_path, timeout_s=60):
            pass
    assert not marker.exists()


async def test_a_left_out_field_the_estimator_needs_is_that_requests_400(tmp_path):
    import numpy as np
    import skops.io as sio
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x = np.random.default_rng(0).normal(size=(100, 2))
    sio.dump(
        make_pipeline(StandardScaler(), LogisticRegression()).fit(x, (x[:, 0] > 0).astype(int)), tmp_path / "m.skops"
    )
    fields = [{"name": "a", "type": "float64"}, {"name": "b", "type": "float64", "required": False}]
    spec = {
        "spec": {
            "model": {"name": "scorer", "path": str(tmp_path / "m.skops")},
            "backend": {"type": "sklearn"},
            "input_schema": {"fields": fields},
        }
    }
    with running_worker("node_host.backends.sklearn_engine", spec, tmp_path, timeout_s=60) as (url, headers):
        async with aiohttp.ClientSession(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as http:

            async def post(body: dict) -> tuple[int, dict]:
                async with http.post("/infer", json=body) as resp:
                    return resp.status, await resp.json()

            # concurrent, so batched together: each request still gets its own answer
            answers = await asyncio.gather(*(post({"a": 1.0, "b": 2.0} if i % 2 else {"a": 1.0}) for i in range(8)))
    for i, (status, body) in enumerate(answers):
        if i % 2:
            assert status == 200 and 0.0 <= body["score"] <= 1.0, body
        else:
            assert status == 400 and body["error"]["type"] == "bad_request", body
            assert body["error"]["message"].startswith("instances[0].b: left out"), body
    assert "Traceback" not in (tmp_path / "worker.log").read_text()
