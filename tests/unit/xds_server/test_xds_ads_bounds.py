"""What one ADS client can make the control plane hold or write (DESIGN §10: every input bounded): unread
responses (random nonces, and a bound on the stream's queue), state and metric labels per type (only the
types SIE serves), and log lines (Envoy's text cut short, a few lines a minute per stream)."""

from __future__ import annotations

import asyncio
import itertools
import logging

import grpc
import pytest

from tests.unit.xds_server.test_xds_ads import Events, FakeContext, req, snapshot
from xds_server.ads import MAX_NACK_TEXT, MAX_QUEUED, AdsServer, AdsStream, LogBudget
from xds_server.metrics import ControlPlaneMetrics
from xds_server.resources import CLUSTER, ENDPOINT, ROUTE, TYPE_ORDER, ResourceCache
from xds_server.snapshots import SnapshotCache

ADS_LOG = "xds_server.ads"


class Aborted(Exception):
    pass


class AbortingContext(FakeContext):
    """grpc.aio's context.abort raises, ending the handler; this one records the status it was given."""

    def __init__(self):
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code, details):
        self.status = (code, details)
        raise Aborted(details)


def flipping_acks(count: int, guesses: itertools.count) -> list:
    """The review's slow client: it never reads, and answers responses it has not seen by guessing their
    nonces, flipping its subscription so that each pair of tiny requests asks for the whole routes again."""
    out = [req(ROUTE, ["ingress_routes"])]
    for _ in range(count):
        nonce = str(next(guesses))
        out += [req(ROUTE, ["x"], nonce=nonce), req(ROUTE, ["ingress_routes"], nonce=nonce)]
    return out


def test_nonces_cannot_be_guessed_so_a_client_answers_only_what_it_read():
    events = Events()
    stream = AdsStream(events=events, clock=lambda: 1.0)
    snap = snapshot({"a": 100})
    responses = [r for request in flipping_acks(500, itertools.count(1)) for r in stream.on_request(request, snap)]
    assert len(responses) == 1 and len(events.pushes) == 1
    assert len({stream.new_nonce() for _ in range(1000)}) == 1000


class Feed:
    """A client's request stream: it sends `requests`, then keeps the stream open, reading nothing."""

    def __init__(self, requests: list):
        self.requests = requests
        self.sent = 0

    async def __call__(self):
        for request in self.requests:
            yield request
            self.sent += 1
            await asyncio.sleep(0)
        await asyncio.Event().wait()

    async def settled(self) -> None:
        """Until the server has read every request, or stopped reading them."""
        while self.sent < len(self.requests):
            before = self.sent
            await asyncio.sleep(0.25)
            if self.sent == before:
                return


async def _feed(server: AdsServer, feed: Feed, context):
    """Start a stream and read its first response only (the whole routes)."""
    responses = server.StreamAggregatedResources(feed(), context)
    first = await asyncio.wait_for(anext(responses), 5)
    assert first.type_url == ROUTE
    return responses


async def test_a_client_that_never_reads_makes_the_server_hold_one_response_per_type():
    cache = SnapshotCache()
    cache.set_snapshot(snapshot({f"m{i}": 100 for i in range(20)}))
    events = Events()
    server = AdsServer(cache, events, clock=lambda: 1.0)
    feed = Feed(flipping_acks(2000, itertools.count(1)))
    responses = await _feed(server, feed, AbortingContext())
    try:
        await feed.settled()
        # Every request read, one response built; with counted nonces, one whole routes per guessed pair.
        assert feed.sent == len(feed.requests) and len(events.pushes) == 1
    finally:
        await responses.aclose()
    assert server.streams == {}


async def test_a_stream_whose_unread_responses_pass_the_bound_is_closed():
    """Were nonces guessable again (here they are), the queue's own bound ends the stream."""
    cache = SnapshotCache()
    cache.set_snapshot(snapshot({f"m{i}": 100 for i in range(20)}))
    events = Events()
    counted = itertools.count(1)
    server = AdsServer(cache, events, clock=lambda: 1.0, new_nonce=lambda: str(next(counted)))
    context = AbortingContext()
    feed = Feed(flipping_acks(2000, itertools.count(1)))
    responses = await _feed(server, feed, context)
    await feed.settled()
    try:
        assert len(events.pushes) <= MAX_QUEUED + 2  # without the bound: 2001, every one held for the client
        read = 1
        with pytest.raises(Aborted):
            async for _ in responses:
                read += 1
    finally:
        await responses.aclose()
    assert context.status is not None and context.status[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert read <= MAX_QUEUED + 1 and server.streams == {}


def test_made_up_types_make_no_state_no_metric_label_and_few_log_lines(caplog):
    metrics = ControlPlaneMetrics()
    clock = itertools.count()  # a second per request: 5000 s, so the budget refills now and then
    stream = AdsStream(events=metrics, clock=lambda: float(next(clock)))
    snap = snapshot({"a": 100})
    with caplog.at_level(logging.INFO, logger=ADS_LOG):
        for k in range(5000):
            assert stream.on_request(req(f"x.T{k}", nack="E" * 100_000), snap) == []
    assert stream.types == {} and metrics.nack_count() == 0
    text = metrics.exposition().decode()
    assert not [line for line in text.splitlines() if "nack" in line and 'type="' in line]
    lines = [r for r in caplog.records if r.name == ADS_LOG]
    assert 5 <= len(lines) <= 5 + 5000 // 12 + 1
    assert max(len(r.getMessage()) for r in lines) < 300
    assert "held back" in lines[-1].getMessage()


def test_envoys_nack_text_is_cut_where_it_is_logged_and_kept(caplog):
    events = Events()
    stream = AdsStream(events=events, clock=lambda: 1.0)
    snap = snapshot({"a": 100})
    [first] = stream.on_request(req(CLUSTER), snap)
    with caplog.at_level(logging.WARNING, logger=ADS_LOG):
        stream.on_request(req(CLUSTER, nonce=first.nonce, version="v0" * 10_000, nack="E" * 1_000_000), snap)
    [(_, type_url, kept, message)] = events.nacks
    assert type_url == CLUSTER and len(message) == MAX_NACK_TEXT and len(kept) < 100
    [record] = [r for r in caplog.records if r.name == ADS_LOG]
    assert len(record.getMessage()) < MAX_NACK_TEXT + 300


def test_nack_log_lines_are_bounded_per_stream(caplog):
    """Every NACK is counted; a stream writes a few lines at once and one per 12 s after, each saying how
    many it held back."""
    now = [0.0]
    events = Events()
    stream = AdsStream(events=events, clock=lambda: now[0])
    cache = ResourceCache()
    snaps = [snapshot({"a": 100}, cache), snapshot({"a": 50}, cache)]
    stream.on_request(req(ENDPOINT, ["model.a"]), snaps[0])
    with caplog.at_level(logging.WARNING, logger=ADS_LOG):
        for k in range(50):  # each NACK answers a fresh response: model.a at the other version
            nonce = stream.types[ENDPOINT].nonce
            nack = req(ENDPOINT, ["model.a"], nonce=nonce, version="", nack="rejected")
            assert len(stream.on_request(nack, snaps[(k + 1) % 2])) == 1
            now[0] += 1.0
        # The same NACK again (a client repeating itself) is no new rejection.
        stream.on_request(req(ENDPOINT, ["model.a"], nonce=nonce, version="", nack="rejected"), snaps[0])
    assert len(events.nacks) == 50
    lines = [r.getMessage() for r in caplog.records if r.name == ADS_LOG]
    assert len(lines) == 9  # five at once (t = 0..4 s), then one at t = 12, 24, 36 and 48 s
    assert "held back" in lines[-1]


@pytest.mark.parametrize(
    ("takes", "expected"),
    [
        ([0.0] * 7, [0, 0, 0, 0, 0, None, None]),
        ([0.0] * 6 + [12.0], [0, 0, 0, 0, 0, None, 1]),
        ([0.0, 100.0, 200.0], [0, 0, 0]),
    ],
)
def test_the_log_budget(takes, expected):
    budget = LogBudget(burst=5, every_s=12.0)
    assert [budget.take(t) for t in takes] == expected


def test_only_the_served_types_have_state():
    stream = AdsStream(events=Events(), clock=lambda: 1.0)
    snap = snapshot({"a": 100})
    for type_url in (*TYPE_ORDER, "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"):
        stream.on_request(req(type_url), snap)
    assert set(stream.types) == set(TYPE_ORDER)
