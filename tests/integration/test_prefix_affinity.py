"""Prefix affinity through the real Envoy (xds_server/prefix_key.py's Lua key, Maglev with a bounded load):
four `sim` instances behind their sidecars (bench/routing_stack.py). Requests that share a prompt's start
go to one instance; different prefixes spread; a burst of one prefix spills past the bound; a key the
client sends itself changes nothing; the instances' prefix-cache hit rate reaches the control plane."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import yaml

from bench.routing_stack import RoutingStack
from sie_testing.polling import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SPEC = {
    "apiVersion": "sie.io/v1alpha1",
    "kind": "ModelService",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"name": "chat", "service_type": "llm"},
        "backend": {
            "type": "sim",
            "config": {"prefix_cache": True, "page_size": 16, "decode_base_ms": 2.0, "prefill_ms_per_token": 0.01},
        },
        "resources": {"max_concurrent_requests": 64},
        "sla": {"min_replicas": 4},
        "routing": {"prefix_affinity": {"key_chars": 200, "balance_factor": 1.25}},
    },
}


def chat(group: int, question: str) -> dict:
    system = " ".join(f"g{group}w{k}" for k in range(80))  # ~400 characters: the key (200) lies inside it
    return {
        "model": "chat",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }


async def served_by(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> str:
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-sie-instance"]


@pytest.fixture
async def stack(tmp_path: Path):
    cluster = tmp_path / "chat.yaml"
    cluster.write_text(yaml.safe_dump(SPEC))
    async with RoutingStack(tmp_path / "stack", cluster, policy="sie", lb_policy="least_request") as s:
        yield s


async def test_a_shared_prefix_sticks_to_one_instance_and_prefixes_spread(stack):
    async with aiohttp.ClientSession() as session:
        for group in range(8):
            seen = {await served_by(session, stack.ingress_url, chat(group, f"question {n}")) for n in range(5)}
            assert len(seen) == 1, f"group {group}'s requests went to {seen}"
        homes = {await served_by(session, stack.ingress_url, chat(g, "again")) for g in range(8)}
        assert len(homes) >= 2, "eight prefixes all on one instance: the key does not spread"
        # The client's own x-sie-prefix-key is replaced by what Envoy computes from the body.
        home = await served_by(session, stack.ingress_url, chat(0, "x"))
        for forged in ("aaaa", "bbbb", "cccc"):
            assert await served_by(session, stack.ingress_url, chat(0, "x"), {"x-sie-prefix-key": forged}) == home

        # The hit rate the sim reports reaches the control plane's view of each instance.
        async def hit_rates():
            async with session.get(stack.admin_url + "/v1/endpoints", headers=stack.admin_headers()) as resp:
                rows = (await resp.json())["endpoints"]
            rates = [r["record"].get("cache_hit_rate") for r in rows]
            return all(r is not None for r in rates) and any(r > 0.5 for r in rates) and rates

        await eventually(hit_rates, 10, "cache hit rates in /v1/endpoints")
        async with session.get(stack.envoy_admin_url + "/stats?filter=lua.errors") as resp:
            stats = await resp.text()
        assert "http.ingress.lua.errors: 0" in stats, f"the prefix-key script failed in Envoy: {stats}"


async def test_a_burst_of_one_prefix_spills_past_the_bound(stack):
    for iid in stack.instance_ids:  # slow enough that a burst keeps requests in flight
        await stack.sim_config(iid, {"decode_base_ms": 200.0})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        home = await served_by(session, stack.ingress_url, chat(3, "warm"))

        async def later(n: int) -> str:
            # Arrivals 30 ms apart, as traffic comes: Envoy's bound counts requests active at an instance,
            # which a request becomes only once its connection is up (a burst in the same millisecond
            # finds every instance at zero).
            await asyncio.sleep(0.03 * n)
            return await served_by(session, stack.ingress_url, chat(3, f"q{n}"))

        burst = await asyncio.gather(*(later(n) for n in range(24)))
    counts = Counter(burst)
    assert len(counts) >= 2, f"24 concurrent requests of one prefix never left {home}: {counts}"
    assert counts[home] == max(counts.values()), f"its home should still take the most: {counts}"
