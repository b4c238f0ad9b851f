"""SIE's weights on the real stack, as Envoy sees them.

1. Four `sim` instances (real worker processes behind real sidecars), xds_server with --policy sie and a
   real Envoy (bench/routing_stack.py, the benchmark's stack). Under light load one instance is made 3x
   slower through /sim/config: its weight in Envoy's /clusters falls to the floor within seconds (the
   sidecars' fast signal); once the slowdown ends it climbs back to full weight. The sidecars run with
   --window-s 10 so that the recovery, which waits for the slow samples to leave the sliding window or
   for the unknown slowness to fade, fits a test (the default window is 30 s).
2. Overload: the control plane in this process with the real policy and a real Envoy; stand-in sidecars
   of a P0, a P1 and a P2 model report overload. P2 is shed first, then P1 under a deeper overload, P0
   never; a shed request gets a JSON 503 from Envoy with Retry-After; shedding ends with the overload.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from bench.routing_stack import RoutingStack
from sie.telemetry import TelemetryRecord
from sie_testing import polling
from sie_testing.control_plane_harness import FakeNodeHost, FakeSidecar
from sie_testing.credentials import Credentials
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyProcess, admin_socket_in
from xds_server.main import XdsServer
from xds_server.policy.decisions import MAX_WEIGHT, MIN_WEIGHT
from xds_server.settings import ControlLoopSettings, Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLUSTER_FILE = Path(__file__).resolve().parents[2] / "examples" / "routing.yaml"


# Envoy and the control loop move on 0.5 s telemetry steps: a 0.1 s poll is fine enough.
eventually = functools.partial(polling.eventually, interval=0.1)


async def _light_load(url: str, stop: asyncio.Event, rate: float = 16.0) -> list[int]:
    """Poisson arrivals of short generations until `stop`; returns the statuses."""
    rng, statuses, tasks = random.Random(3), [], set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> None:
            body = {
                "model": "chat",
                # words of its own: no two requests share a prefix (the model has prefix affinity on)
                "text": " ".join(f"{rng.random():.6f}" for _ in range(rng.randint(32, 128))),
                "sampling_params": {"max_new_tokens": rng.randint(16, 48)},
            }
            try:
                async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
                    statuses.append(r.status)
            except (TimeoutError, aiohttp.ClientError):
                statuses.append(0)

        while not stop.is_set():
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return statuses


async def test_a_slowed_instance_loses_its_weight_in_envoy_and_gets_it_back(tmp_path):
    async with RoutingStack(
        tmp_path,
        CLUSTER_FILE,
        policy="sie",
        lb_policy="least_request",
        sidecar_flags=("--window-s", "10"),
        picker=True,  # SIE as shipped: this LLM model has prefix affinity
    ) as stack:
        slowed = stack.instance_ids[1]

        async def weights() -> dict[str, int]:
            return {iid: h["weight"] for iid, h in (await stack.envoy_hosts()).items()}

        assert set((await weights()).values()) == {MAX_WEIGHT}
        stop = asyncio.Event()
        load = asyncio.create_task(_light_load(stack.ingress_url, stop))
        try:
            # Long enough for every instance to have answered the policy's min_requests (50), so its
            # sliding-window p50/p99 count too, as they do for any instance that has served a while.
            await asyncio.sleep(15.0)
            assert set((await weights()).values()) == {MAX_WEIGHT}, "an equal fleet must keep equal weights"
            await stack.sim_config(slowed, {"slowdown": 3.0})
            began = time.monotonic()

            async def sidelined():
                w = await weights()
                return w if w.get(slowed) == MIN_WEIGHT else None

            w = await eventually(sidelined, 20.0, f"{slowed} at the floor in Envoy")
            fell_after = time.monotonic() - began
            assert all(w[i] == MAX_WEIGHT for i in stack.instance_ids if i != slowed), w

            await stack.sim_config(slowed, {"slowdown": 1.0})
            ended = time.monotonic()

            async def recovered():
                w = await weights()
                return w if set(w.values()) == {MAX_WEIGHT} else None

            await eventually(recovered, 90.0, f"{slowed} back at full weight", interval=0.25)
            print(
                f"\n{slowed}: at the floor {fell_after:.1f} s after the slowdown, "
                f"full weight again {time.monotonic() - ended:.1f} s after it ended"
            )
        finally:
            stop.set()
            statuses = await load
        assert statuses.count(200) == len(statuses), {s: statuses.count(s) for s in set(statuses)}


# ---- shedding -------------------------------------------------------------------------------------

SHED_CLUSTER = textwrap.dedent("""
    kind: ModelService
    spec: {model: {name: gold, priority_level: P0}, backend: {type: sim}, resources: {max_concurrent_requests: 8}}
    ---
    kind: ModelService
    spec: {model: {name: silver, priority_level: P1}, backend: {type: sim}, resources: {max_concurrent_requests: 8}}
    ---
    kind: ModelService
    spec: {model: {name: bronze, priority_level: P2}, backend: {type: sim}, resources: {max_concurrent_requests: 8}}
""")


class OverloadedSidecar(FakeSidecar):
    """A stand-in sidecar whose telemetry reports `queued` requests (8 queued = saturation 1)."""

    queued = 0

    def record(self) -> TelemetryRecord:
        return dataclasses.replace(super().record(), queued=self.queued)


async def _statuses(
    session: aiohttp.ClientSession, ingress: str, model: str, n: int = 40
) -> list[tuple[int, dict, dict]]:
    out = []
    for _ in range(n):
        async with session.post(ingress + "/generate", json={"model": model}) as resp:
            out.append((resp.status, dict(resp.headers), json.loads(await resp.text())))
    return out


async def test_overload_sheds_p2_then_p1_with_a_clear_503_and_never_p0(tmp_path):
    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(SHED_CLUSTER)
    creds = Credentials.create(tmp_path)
    settings = Settings(
        cluster_file=cluster_file,
        credentials_dir=creds.path,
        admin_port=0,
        xds_port=0,
        listener_port=0,
        loop=ControlLoopSettings(startup_sync_s=0.3, debounce_ms=20, policy="sie"),
    )
    server = XdsServer(settings, signer=creds.signer)
    session = aiohttp.ClientSession()
    sidecars: list[OverloadedSidecar] = []
    envoy = node = None
    try:
        await server.start()
        admin = f"http://127.0.0.1:{server.admin_port}"
        for model in ("gold", "silver", "bronze"):
            for i in range(2):
                sidecars.append(
                    await OverloadedSidecar(f"{model}-{i}", model, admin, session, signer=creds.signer).start()
                )
        specs = {mid: e.spec_dict for mid, e in server.registry.models.items()}
        node = FakeNodeHost.for_sidecars(
            "test-node", admin, session, lambda: sidecars, specs, signer=creds.signer
        ).start()
        envoy = EnvoyProcess(
            envoy_bootstrap(
                "shed-test",
                "sie-test",
                "127.0.0.1",
                server.xds_port,
                admin_socket_in(tmp_path),
                token=creds.envoy_token,
            ),
            tmp_path,
        )
        envoy.start()
        await envoy.wait_ready(20)

        async def ingress():
            doc = await envoy.admin_json("/listeners?format=json")
            statuses = doc.get("listener_statuses", [])
            return statuses and f"http://127.0.0.1:{statuses[0]['local_address']['socket_address']['port_value']}"

        url = await eventually(ingress, 20.0, "the ingress listener")

        async def served(model: str) -> bool:
            return all(s == 200 for s, _, _ in await _statuses(session, url, model, 5))

        for model in ("gold", "silver", "bronze"):
            await eventually(lambda m=model: served(m), 20.0, f"{model} served")

        def overload(level: float) -> None:
            for sidecar in sidecars:
                sidecar.queued = round(8 * level)
                sidecar.state = sidecar.state  # report at once

        async def shed(model: str) -> list | None:
            answers = await _statuses(session, url, model)
            return [a for a in answers if a[0] == 503] or None

        # Overload 1.25: over P2's threshold (1.0), under P1's (1.5). After 2 s, P2 sheds.
        overload(1.25)
        refused = await eventually(lambda: shed("bronze"), 20.0, "bronze (P2) shed")
        status, headers, body = refused[0]
        assert headers.get("Retry-After") == "1" and headers["Content-Type"] == "application/json"
        assert body["error"]["type"] == "overloaded" and body["error"]["model"] == "bronze"
        assert "retry later" in body["error"]["message"]
        assert await served("silver") and await served("gold")

        # Overload 2: over P1's threshold as well. P0 is never shed.
        overload(2.0)
        refused = await eventually(lambda: shed("silver"), 20.0, "silver (P1) shed")
        assert refused[0][2]["error"]["model"] == "silver"
        for _ in range(3):
            assert await served("gold")
            await asyncio.sleep(1.0)

        overload(0.0)
        for model in ("bronze", "silver"):
            await eventually(lambda m=model: served(m), 30.0, f"{model} served again once the overload ended")
    finally:
        if node is not None:
            await node.stop()
        for sidecar in sidecars:
            await sidecar.stop()
        if envoy is not None:
            await envoy.stop_async()
        await server.stop()
        await session.close()
