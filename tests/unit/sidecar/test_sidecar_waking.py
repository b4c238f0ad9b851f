"""The sidecar's Waker against a stand-in node host on loopback: requests held while the instance sleeps
share one wake, get through once it serves, and learn why when the wake fails or takes too long."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from sidecar import lifecycle
from sidecar.lifecycle import Lifecycle, Probe
from sidecar.status import Status
from sidecar.waking import Waker
from sie.telemetry import InstanceState


class Token:
    def headers(self) -> dict[str, str]:
        return {"Authorization": "Bearer sidecar-token"}


def asleep() -> Status:
    status = Status("m-0", Lifecycle())
    status.apply(lifecycle.on_probe, Probe.OK)
    status.apply(lifecycle.sleep)
    status.apply(lifecycle.released)
    assert status.state is InstanceState.SLEEPING
    return status


class NodeHost:
    """Answers POST /wake as a node host does: wakes the instance (the sidecar's /-/wake, here the
    status change itself) after `delay_s`, or refuses with `refuse` as the reason."""

    def __init__(self, status: Status, delay_s: float = 0.05, refuse: str | None = None):
        self.status, self.delay_s, self.refuse = status, delay_s, refuse
        self.calls: list[str] = []

    async def wake(self, request: web.Request) -> web.Response:
        self.calls.append(request.headers.get("Authorization", ""))
        await asyncio.sleep(self.delay_s)
        if self.refuse is not None:
            return web.json_response({"error": {"type": "wake_failed", "message": self.refuse}}, status=503)
        self.status.apply(lifecycle.wake)
        self.status.apply(lifecycle.on_probe, Probe.OK)
        return web.json_response({"state": "ready"})


@pytest.fixture
async def rig():
    made: list[tuple[web.AppRunner, aiohttp.ClientSession]] = []

    async def make(
        status: Status, timeout_s: float = 5.0, max_held: int = 64, **host: object
    ) -> tuple[Waker, NodeHost]:
        node = NodeHost(status, **host)  # type: ignore[arg-type]
        app = web.Application()
        app.router.add_post("/wake", node.wake)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        session = aiohttp.ClientSession()
        made.append((runner, session))
        url = f"http://127.0.0.1:{port}/wake"
        return Waker(status, session, url, Token(), timeout_s, time.monotonic, max_held=max_held), node

    yield make
    for runner, session in made:
        await session.close()
        await runner.cleanup()


async def test_twenty_held_requests_share_one_wake_and_all_get_through(rig):
    status = asleep()
    waker, node = await rig(status, delay_s=0.1)
    assert waker.holds()
    results = await asyncio.gather(*(waker.hold() for _ in range(20)))
    assert results == [None] * 20
    assert node.calls == ["Bearer sidecar-token"], "one wake, with the sidecar's own credential"
    assert waker.wakes == 1 and waker.held == 0 and status.serving


async def test_a_refused_wake_tells_every_held_request_why_and_the_next_one_tries_again(rig):
    status = asleep()
    waker, node = await rig(status, refuse="no room to wake it: GPU 0 is full")
    results = await asyncio.gather(*(waker.hold() for _ in range(3)))
    assert all(r is not None and "GPU 0 is full" in r for r in results), results
    assert len(node.calls) == 1 and status.state is InstanceState.SLEEPING
    assert (await waker.hold()) is not None and len(node.calls) == 2, "a later request starts a new wake"


async def test_a_wake_slower_than_wake_timeout_s_is_given_up_with_the_reason(rig):
    status = asleep()
    waker, _ = await rig(status, timeout_s=0.2, delay_s=2.0)
    started = time.monotonic()
    why = await waker.hold()
    assert why is not None and "wake_timeout_s=0.2" in why
    assert time.monotonic() - started < 1.5


async def test_an_unreachable_node_host_is_named(rig):
    status = asleep()
    waker, _ = await rig(status)
    waker._url = "http://127.0.0.1:9/wake"  # nothing listens on the discard port
    why = await waker.hold()
    assert why is not None and "did not answer the wake" in why


async def test_a_loading_instance_holds_without_a_wake_until_it_serves(rig):
    status = Status("m-0", Lifecycle())
    assert status.state is InstanceState.LOADING
    waker, node = await rig(status)
    held = asyncio.create_task(waker.hold())
    await asyncio.sleep(0.05)
    assert not held.done()
    status.apply(lifecycle.on_probe, Probe.OK)  # the first load finished
    assert await held is None and node.calls == []


async def test_no_more_than_max_held_requests_take_a_place(rig):
    """The proxy takes a place before it reads a body and gives it back after the hold: past max_held a
    request is refused at once (429), so held bodies never outnumber what the gate can take."""
    status = asleep()
    waker, node = await rig(status, max_held=2)
    assert waker.enter() and waker.enter()
    assert not waker.enter() and waker.held == 2
    waker.leave()
    assert waker.held == 1 and waker.enter() and not waker.enter()
    assert node.calls == [], "taking a place wakes nothing; a held request does"
    with pytest.raises(ValueError, match="max_held"):
        await rig(status, max_held=0)


async def test_a_serving_or_draining_instance_holds_nothing(rig):
    status = Status("m-0", Lifecycle())
    status.apply(lifecycle.on_probe, Probe.OK)
    waker, _ = await rig(status)
    assert await waker.hold() is None
    status.apply(lifecycle.drain)
    assert not waker.holds()


async def test_an_instance_that_served_and_now_reads_loading_refuses_instead_of_holding(rig):
    status = Status("m-0", Lifecycle())
    status.apply(lifecycle.on_probe, Probe.OK)
    for _ in range(2):  # two missed probes under load: taken out of service as loading
        status.apply(lifecycle.on_probe, Probe.NOT_READY)
    assert status.state is InstanceState.LOADING
    waker, node = await rig(status)
    assert not waker.holds(), "a retryable 503 at once, so Envoy retries elsewhere"
    assert node.calls == []


async def test_a_held_request_lets_go_when_the_instance_is_stopped_instead(rig):
    """A SIGTERM stops a sleeping instance (its drain finds the gate idle: held requests are not in it):
    nothing will wake it, so a held request stops waiting at once (the proxy then answers its retryable
    503) instead of being cut when the server shuts down."""
    status = asleep()
    waker, _ = await rig(status, timeout_s=30.0, delay_s=2.0)  # a wake that takes its time
    held = asyncio.create_task(waker.hold())
    await asyncio.sleep(0.05)
    assert not held.done()
    status.apply(lifecycle.drain)  # what the shutdown does first: a sleeping instance stays asleep
    status.apply(lifecycle.stop)  # and once its gate is idle
    assert status.state is InstanceState.STOPPED
    assert await asyncio.wait_for(held, 2.0) is None and not status.serving
