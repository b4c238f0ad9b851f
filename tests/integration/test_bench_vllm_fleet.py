"""bench's real vLLM workers (bench/vllm_fleet.py) and RoutingStack over them: one server started as SIE's
node host starts it, its prefix-cache counters, the flush that empties its cache, the CPU cap that slows
it, and a chat through Envoy and a sidecar that read vLLM's dialect from the spec. One server for the
module: each takes 20-40 s to start here."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from bench import prefix_vllm
from bench.routing_stack import RoutingStack
from bench.vllm_fleet import VllmFleet, tiny_model
from sie.cluster import load_cluster
from sie_testing import engines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def _complete(session: aiohttp.ClientSession, url: str, key: str, prompt: list[int] | str) -> dict:
    body = {"model": "chat", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    async with session.post(
        url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=aiohttp.ClientTimeout(60),
    ) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def test_a_fleet_serves_counts_flushes_caps_and_stops(tmp_path_factory):
    engines.require("vllm")
    work = tmp_path_factory.mktemp("fleet")
    model = tiny_model(work)
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(prefix_vllm.cluster_doc(model)))
    service = load_cluster(cluster).services[0]

    async def scenario() -> list[int]:
        async with VllmFleet(work / "vllm", service, ["chat-0"]) as fleet:
            url, key = fleet.urls["chat-0"], fleet.keys["chat-0"]
            assert oct(fleet.key_files["chat-0"].stat().st_mode & 0o777) == "0o600"
            assert key not in " ".join(Path(f"/proc/{fleet.pids()['vllm-chat-0']}/cmdline").read_text().split("\0"))
            prompt = list(range(20, 20 + 3 * 128 + 5))  # three whole blocks and a bit
            async with aiohttp.ClientSession() as session:
                before = (await fleet.counters())["chat-0"]
                await _complete(session, url, key, prompt)
                await _complete(session, url, key, prompt)
                hits, queries = (await fleet.counters())["chat-0"]
                assert queries - before[1] == 2 * len(prompt)
                assert hits - before[0] == 3 * 128  # the second found the first's whole blocks

                await fleet.flush(seed=1)
                h0, _ = (await fleet.counters())["chat-0"]
                await _complete(session, url, key, prompt)
                h1, _ = (await fleet.counters())["chat-0"]
                assert h1 == h0  # evicted: nothing of it was left to hit

                engine = fleet.engine_pids("chat-0")
                assert engine and fleet.cap("chat-0", 1 / 3) == engine
                deadline = time.monotonic() + 5
                states: list[str] = []
                while time.monotonic() < deadline and "T" not in states:
                    states += [_state(pid) for pid in engine]
                    await asyncio.sleep(0.003)
                assert "T" in states  # held stopped part of the time
                await _complete(session, url, key, "slowed but served")  # /v1 still answers through the cap
                fleet.uncap("chat-0")
                assert all(_state(pid) != "T" for pid in engine)
                await _complete(session, url, key, "and after")
            return [fleet.pids()["vllm-chat-0"], *engine]

    pids = asyncio.run(scenario())
    time.sleep(0.5)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"], pids


def test_a_routing_stack_serves_chat_through_envoy_from_its_own_vllm(tmp_path_factory):
    engines.require("vllm")
    work = tmp_path_factory.mktemp("stack")
    model = tiny_model(work)
    cluster = work / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(prefix_vllm.cluster_doc(model)))

    async def scenario() -> list[int]:
        async with RoutingStack(
            work / "stack", cluster, policy="sie", lb_policy="least_request", instances=1, engine="vllm"
        ) as stack:
            assert stack.fleet is not None and stack.worker_urls["chat-0"] == stack.fleet.urls["chat-0"]
            body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            async with aiohttp.ClientSession() as session:
                async with session.post(stack.ingress_url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-sie-instance"] == "chat-0"
                    assert (await resp.json())["id"].startswith("chatcmpl-")  # vLLM's own answer
            return list(stack.fleet.pids().values())

    pids = asyncio.run(scenario())
    time.sleep(0.5)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"], pids
