"""The sim backend's injected errors (SimParams.error_rate): how often, reproducibly, refused when out of
range, and answered through the worker protocol as a 500 before any simulated work."""

from __future__ import annotations

import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from node_host.backends.sim.core import ErrorDraws, SimParams
from node_host.backends.sim.engine import SimEngine
from node_host.backends.sim.worker import SimWorkerEngine, build_app, sim_params_from_spec
from sie.errors import SpecError
from sie.spec_loader import parse_model_service
from sie_testing import error_shape

N = 2000


def _failures(rate: float, seed: int | str = 7, n: int = N) -> list[bool]:
    draws = ErrorDraws(seed)
    return [draws.fails(rate) for _ in range(n)]


@pytest.mark.parametrize(
    "rate, low, high",
    [
        (0.0, 0, 0),
        (1.0, N, N),
        (0.05, 60, 140),  # expected 100, sd ~10: a wide bound, and the seed makes it the same every run
    ],
)
def test_the_fraction_of_failed_requests_follows_the_rate(rate, low, high):
    assert low <= sum(_failures(rate)) <= high


def test_draws_are_reproducible_per_seed_and_monotone_in_the_rate():
    assert _failures(0.3, seed=11) == _failures(0.3, seed=11)
    assert _failures(0.3, seed="sim-llm") == _failures(0.3, seed="sim-llm")
    assert _failures(0.3, seed=11) != _failures(0.3, seed=12)
    # One draw per request whatever the rate: every request failed at 0.05 also fails at 0.2.
    low, high = _failures(0.05), _failures(0.2)
    assert all(h for lo, h in zip(low, high, strict=True) if lo) and sum(high) > sum(low)


@pytest.mark.parametrize(
    "changes, problem",
    [
        ({"error_rate": -0.01}, "error_rate: must be a fraction from 0 to 1"),
        ({"error_rate": 1.5}, "error_rate: must be a fraction from 0 to 1"),
        ({"error_rate": "5%"}, "error_rate: must be a number"),
        ({"error_rate": True}, "error_rate: must be a number"),
        ({"error_rate": float("nan")}, "error_rate: must be a number"),
        ({"error_rate": None}, "error_rate: must be a number"),
        ({"seed": 1.5}, "seed: must be an integer"),
        ({"seed": "abc"}, "seed: must be an integer"),
        ({"kv_tokens": float("inf")}, "kv_tokens: must be an integer"),
    ],
)
def test_bad_values_are_refused(changes, problem):
    with pytest.raises(SpecError, match=problem):
        SimParams().changed(changes)


def test_a_wrong_value_is_shown_cut():
    # Values come from a spec (up to 4,096 characters each); a refusal is reported in the node's heartbeat.
    with pytest.raises(SpecError) as caught:
        SimParams().changed({"kv_tokens": "x" * 4000, "fail_resume": "y" * 4000})
    assert len(str(caught.value)) < 400 and "xxx..." in str(caught.value)


def test_good_values_apply():
    got = SimParams().changed({"error_rate": 1, "seed": 3})
    assert (got.error_rate, got.seed) == (1.0, 3) and isinstance(got.error_rate, float)
    assert got.changed({"seed": None}).seed is None
    assert SimParams(error_rate=2.0).problems()[0].path == "error_rate"


def _spec(config: dict):
    return parse_model_service({"spec": {"model": {"name": "sim-llm"}, "backend": {"type": "sim", "config": config}}})


def test_error_rate_and_seed_come_from_the_spec():
    params = sim_params_from_spec(_spec({"error_rate": 0.05, "seed": 9}))
    assert (params.error_rate, params.seed) == (0.05, 9)
    with pytest.raises(SpecError, match="error_rate: must be a fraction") as info:
        sim_params_from_spec(_spec({"error_rate": 5}))
    assert "sim-llm" in str(info.value)


def test_the_engine_seeds_from_the_seed_else_the_name_and_reseeds_when_seed_is_set():
    def run(engine: SimEngine) -> list[bool]:
        return [engine.injects_error() for _ in range(200)]

    by_name = run(SimEngine(SimParams(error_rate=0.3), name="sim-llm"))
    assert by_name == _failures(0.3, seed="sim-llm", n=200)
    assert run(SimEngine(SimParams(error_rate=0.3, seed=5), name="sim-llm")) == _failures(0.3, seed=5, n=200)
    engine = SimEngine(SimParams(error_rate=0.3), name="other")
    run(engine)
    engine.set_params({"seed": 5})  # setting the seed restarts the draws
    assert run(engine) == _failures(0.3, seed=5, n=200)
    engine.set_params({"error_rate": 0.0})  # a rate change alone keeps the sequence going
    assert not any(run(engine))


FAST = {"prefill_ms_per_token": 0.0, "decode_base_ms": 0.2, "decode_ms_per_request": 0.0}


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


GENERATE = {"text": "one two", "sampling_params": {"max_new_tokens": 4}}


@pytest.mark.parametrize("stream", [False, True])
async def test_an_injected_error_is_a_500_in_the_one_error_shape(client, stream):
    resp = await client.post("/sim/config", json={"error_rate": 1.0})
    assert resp.status == 200 and (await resp.json())["error_rate"] == 1.0
    resp = await client.post("/generate", json={**GENERATE, "stream": stream})
    assert resp.status == 500  # >= 500: the sidecar counts it in the instance's error_rate
    assert resp.headers["x-sie-simulated"] == "true"
    body = await resp.json()
    error_shape.check(resp.status, body)
    assert body["error"]["type"] == "worker_error" and body["error"]["simulated"] is True
    assert "injected failure" in body["error"]["message"] and "error_rate" in body["error"]["message"]


async def test_an_errored_request_costs_no_simulated_time(client):
    # A decode step of 5 s: a request that did any work would take 20 s.
    await client.post("/sim/config", json={"decode_base_ms": 5000.0, "error_rate": 1.0})
    start = time.monotonic()
    resp = await client.post("/generate", json=GENERATE)
    assert resp.status == 500 and time.monotonic() - start < 2.0


async def test_rate_zero_never_fails_and_the_seeded_rate_is_reproducible(client):
    for _ in range(20):
        assert (await client.post("/generate", json=GENERATE)).status == 200
    await client.post("/sim/config", json={"error_rate": 0.3, "seed": 4})
    statuses = [(await client.post("/generate", json=GENERATE)).status for _ in range(40)]
    assert set(statuses) == {200, 500}
    assert [s == 500 for s in statuses] == _failures(0.3, seed=4, n=40)


async def test_sim_config_refuses_a_bad_error_rate_and_keeps_the_old_one(client):
    resp = await client.post("/sim/config", json={"error_rate": 1.2})
    body = await resp.json()
    assert resp.status == 400 and body["error"]["problems"][0]["path"] == "error_rate"
    assert (await (await client.get("/sim/config")).json())["error_rate"] == 0.0
