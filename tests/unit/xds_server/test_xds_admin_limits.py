"""The admin API's bounds per route, over real HTTP (aiohttp's test server on loopback): each body within
what its route's contract holds (413 naming the limit otherwise, before it is read whole), a heartbeat's
specs and addresses checked, one heartbeat of a node at a time, large beats parsed off the event loop."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

import pytest

import xds_server.admin as admin
from sie.wire import MAX_HEARTBEAT_BYTES, MAX_SPEC_BYTES_PER_BEAT
from tests.unit.xds_server import test_xds_admin
from tests.unit.xds_server.test_xds_admin import SPEC, record, report

pytestmark = pytest.mark.timeout(60)

# The admin API over a real registry and control loop, built as test_xds_admin builds it.
world = test_xds_admin.world


def _beat(node: str = "n1", *reports: dict) -> bytes:
    return json.dumps({"node": node, "address": "http://127.0.0.1:1", "instances": list(reports)}).encode()


async def _chunks(body: bytes, size: int = 16 * 1024, gate: asyncio.Event | None = None):
    """`body` as a chunked upload (no Content-Length), waiting at `gate` after its first chunk."""
    for at in range(0, len(body), size):
        yield body[at : at + size]
        if gate is not None:
            await gate.wait()


def test_each_route_reads_what_its_contract_holds():
    assert admin.MAX_HEARTBEAT_BODY_BYTES == MAX_HEARTBEAT_BYTES  # the node host's own cap (NodeAgent._encoded)
    assert admin.MAX_TELEMETRY_BYTES == 64 * 1024
    assert admin.MAX_BODY_BYTES == MAX_HEARTBEAT_BYTES


def test_the_largest_valid_telemetry_record_fits_its_limit():
    """Every text at its bound, each character one that JSON escapes to 12 bytes (a surrogate pair)."""
    texts = {"instance_id": 253, "model_id": 63, "version": 64, "node": 253, "priority": 2, "service_type": 32}
    rec = record(**{name: "\U0001f600" * size for name, size in texts.items()}, reporter="\U0001f600" * 64)
    assert len(json.dumps(rec).encode()) < admin.MAX_TELEMETRY_BYTES


async def test_a_telemetry_body_over_its_limit_is_413_unread(world):
    body = json.dumps(record() | {"pad": "x" * admin.MAX_TELEMETRY_BYTES}).encode()
    started = time.perf_counter()
    resp = await world.client.post(
        "/v1/telemetry", data=body, headers={**world.sidecar(), "Content-Type": "application/json"}
    )
    error = (await resp.json())["error"]
    assert resp.status == 413 and error["type"] == "body_too_large"
    assert f"{len(body)} bytes" in error["message"] and str(admin.MAX_TELEMETRY_BYTES) in error["message"]
    assert time.perf_counter() - started < 5
    assert (await world.post_record()).status == 200  # the route still takes a record


async def test_a_chunked_body_is_refused_once_it_passes_the_limit(world):
    """No Content-Length to refuse it by: the bytes are counted as they come, and the answer is sent while
    the client still has most of its body to send."""
    body = json.dumps(record() | {"pad": "x" * (1 << 20)}).encode()
    resp = await world.client.post(
        "/v1/telemetry", data=_chunks(body), headers={**world.sidecar(), "Content-Type": "application/json"}
    )
    error = (await resp.json())["error"]
    assert resp.status == 413 and f"over {admin.MAX_TELEMETRY_BYTES} bytes" in error["message"], error


async def test_a_heartbeat_over_the_node_hosts_cap_is_413(world):
    resp = await world.client.post(
        "/v1/nodes/heartbeat", data=io.BytesIO(b" " * (MAX_HEARTBEAT_BYTES + 1)), headers=world.node()
    )
    error = (await resp.json())["error"]
    assert resp.status == 413 and str(MAX_HEARTBEAT_BYTES) in error["message"]


async def test_a_heartbeat_with_more_specs_than_a_node_sends_is_400_and_stores_nothing(world):
    half = SPEC | {"pad": "x" * (MAX_SPEC_BYTES_PER_BEAT // 2 + 1)}  # one fits a beat, two do not
    second = report("scorer-1", spec=half | {"n": 2})
    resp = await world.client.post(
        "/v1/nodes/heartbeat",
        data=io.BytesIO(_beat("n1", report(spec=half), second)),
        headers={**world.node(), "Content-Type": "application/json"},
    )
    body = await resp.json()
    assert resp.status == 400, body
    assert [p["path"] for p in body["error"]["problems"]] == ["instances[1].spec"]
    assert "n1" not in world.registry.nodes


async def test_a_heartbeat_with_a_bad_address_is_400_naming_it(world):
    resp = await world.beat(instances=[report(address="127.0.0.1:\u00b2")])
    body = await resp.json()
    assert resp.status == 400 and [p["path"] for p in body["error"]["problems"]] == ["instances[0].sidecar_address"]
    assert "n1" not in world.registry.nodes


async def test_one_heartbeat_of_a_node_at_a_time(world):
    """A second beat of a node whose beat is still coming is a 429 to retry; other nodes are not held."""
    gate = asyncio.Event()
    headers = {**world.node("n1"), "Content-Type": "application/json"}
    first = asyncio.create_task(
        world.client.post("/v1/nodes/heartbeat", data=_chunks(_beat("n1", report()), 64, gate), headers=headers)
    )
    try:
        for _ in range(200):  # until the first is in flight
            second = await world.client.post("/v1/nodes/heartbeat", data=_beat("n1"), headers=headers)
            if second.status == 429:
                break
            await asyncio.sleep(0.01)
        body = await second.json()
        assert second.status == 429 and body["error"]["type"] == "heartbeat_in_flight"
        assert second.headers["Retry-After"] == "1"
        assert (await world.beat("n2")).status == 200
    finally:
        gate.set()
    assert (await first).status == 200
    assert "scorer-0" in world.registry.nodes["n1"].reports
    assert (await world.beat("n1")).status == 200  # the next one is taken


async def test_a_large_heartbeat_is_parsed_off_the_event_loop(world, monkeypatch):
    threads: list[str] = []
    parse = admin._heartbeat

    def spy(body: bytes):
        threads.append(threading.current_thread().name)
        return parse(body)

    monkeypatch.setattr(admin, "_heartbeat", spy)
    small = _beat("n1", report())
    many = [report(f"scorer-{i}") | {"detail": "x" * 4096} for i in range(80)]
    large = _beat("n1", *many)
    assert len(large) > admin.HeartbeatBodies.INLINE_BYTES
    for body in (small, large):
        resp = await world.client.post(
            "/v1/nodes/heartbeat", data=body, headers={**world.node(), "Content-Type": "application/json"}
        )
        assert resp.status == 200, await resp.text()
    assert threads[0] == threading.current_thread().name
    assert threads[1].startswith("heartbeat-decoder")
