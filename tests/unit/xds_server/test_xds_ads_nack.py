"""What a NACK does to the SotW ADS state machine (xds_server.ads): Envoy applies a rejected EDS response in
part, so the resources it carried are delivered again one half at a time until the one Envoy rejects is
alone; that one waits for a new version, and nothing else waits for it."""

from __future__ import annotations

import pytest
from envoy.service.discovery.v3 import discovery_pb2

from tests.unit.xds_server.test_xds_ads import Events, connect, names, req, snapshot
from xds_server.ads import AdsStream
from xds_server.resources import CLUSTER, ENDPOINT, ROUTE, Resource, ResourceCache
from xds_server.snapshots import Snapshot

MODELS = "abcdefgh"
CLAS = [f"model.{m}" for m in MODELS]


@pytest.fixture
def stream(events):
    return AdsStream(events=events, clock=lambda: 1.0)


@pytest.fixture
def events():
    return Events()


def broken(snap: Snapshot, name: str, version: str = "bad") -> Snapshot:
    """`snap` with one CLA at a version the fake Envoy below rejects (a CLA past the builder, as a bug would)."""
    good = snap.get(ENDPOINT)[name]
    return snap.with_resource(Resource(name, ENDPOINT, version, good.packed, good.refs))


def play_envoy(
    stream: AdsStream,
    snap: Snapshot,
    responses: list[discovery_pb2.DiscoveryResponse],
    eds_names: list[str],
    rejects: Snapshot,
) -> list[tuple[list[str], bool]]:
    """Answer responses as Envoy does until the stream sends nothing more: NACK an EDS response carrying a
    CLA at the version `rejects` holds for it (keeping the last accepted version), ACK every other. Returns
    each EDS response's CLAs and whether it was accepted."""
    bad = {name for name, res in rejects.get(ENDPOINT).items() if res.version == "bad"}
    seen: list[tuple[list[str], bool]] = []
    accepted = {ENDPOINT: "", CLUSTER: "", ROUTE: ""}
    queue = list(responses)
    for _ in range(100):
        if not queue:
            return seen
        r = queue.pop(0)
        wanted = eds_names if r.type_url == ENDPOINT else ["ingress_routes"] if r.type_url == ROUTE else []
        carried = names(r) if r.type_url == ENDPOINT else []
        rejected = bool(bad & set(carried))
        if r.type_url == ENDPOINT:
            seen.append((carried, not rejected))
        if rejected:
            answer = req(r.type_url, wanted, nonce=r.nonce, version=accepted[r.type_url], nack="malformed IP address")
        else:
            accepted[r.type_url] = r.version_info
            answer = req(r.type_url, wanted, nonce=r.nonce, version=r.version_info)
        queue += stream.on_request(answer, snap)
    raise AssertionError(f"the stream never stopped sending: {seen[-10:]}")


def test_a_nacked_eds_response_is_bisected_until_the_bad_cla_is_alone(stream, events):
    cache = ResourceCache()
    connect(stream, snapshot(dict.fromkeys(MODELS, 100), cache), eds_names=CLAS)
    # One build changes every model's weights; model.c's CLA is one Envoy rejects.
    snap = broken(snapshot(dict.fromkeys(MODELS, 50), cache), "model.c")
    responses = stream.on_snapshot(snap)
    assert [names(r) for r in responses] == [CLAS]
    seen = play_envoy(stream, snap, responses, CLAS, rejects=snap)
    assert (
        seen
        == [
            (CLAS, False),  # Envoy applied part of it: the CLAs before model.c's, model.c's in part, none after
            (CLAS[:4], False),
            (CLAS[:2], True),
            (CLAS[2:4], False),
            (["model.c"], False),  # alone: the culprit, held back from now on
            (["model.d"], True),
            (CLAS[4:], True),
        ]
    )
    assert len(events.nacks) == 4
    # A later build that changes model.a sends model.a only: model.c's rejected version is not sent again.
    later = broken(snapshot({**dict.fromkeys(MODELS, 50), "a": 40}, cache), "model.c")
    assert [names(r) for r in stream.on_snapshot(later)] == [["model.a"]]


def test_a_rejected_cla_is_sent_again_once_its_version_changes(stream):
    cache = ResourceCache()
    connect(stream, snapshot({"a": 100, "b": 100}, cache), eds_names=["model.a", "model.b"])
    snap = broken(snapshot({"a": 50, "b": 50}, cache), "model.b")
    responses = stream.on_snapshot(snap)
    seen = play_envoy(stream, snap, responses, ["model.a", "model.b"], rejects=snap)
    assert seen == [(["model.a", "model.b"], False), (["model.a"], True), (["model.b"], False)]
    # The same bad version again (another type changed, or a rebuild): nothing; a fixed one: sent.
    assert stream.on_snapshot(broken(snapshot({"a": 50, "b": 50}, cache), "model.b")) == []
    fixed = snapshot({"a": 50, "b": 50}, cache)
    assert [names(r) for r in stream.on_snapshot(fixed)] == [["model.b"]]


def test_a_cla_rejected_alone_is_not_resent_by_the_nack_itself(stream, events):
    cache = ResourceCache()
    connect(stream, snapshot({"a": 100}, cache))
    snap = broken(snapshot({"a": 50}, cache), "model.a")
    [sent] = stream.on_snapshot(snap)
    nack = req(ENDPOINT, ["model.a"], nonce=sent.nonce, version="v0", nack="malformed IP address")
    assert stream.on_request(nack, snap) == []  # re-sending the same rejected config would loop
    assert len(events.nacks) == 1


def test_a_rejected_cla_does_not_hold_back_the_routes(stream):
    """Envoy ends a cluster's warming on a rejected EDS response too; the routes (one resource for every
    model) must not wait for a CLA that may not be fixed for a long time."""
    cache = ResourceCache()
    connect(stream, snapshot({"a": 100, "b": 100}, cache), eds_names=["model.a", "model.b"])
    snap = broken(snapshot({"a": 100, "b": 50}, cache), "model.b")
    play_envoy(stream, snap, stream.on_snapshot(snap), ["model.a", "model.b"], rejects=snap)
    grown = broken(snapshot({"a": 100, "b": 50, "n": 100}, cache), "model.b")
    eds_names = ["model.a", "model.b", "model.n"]
    play_envoy(stream, grown, stream.on_snapshot(grown), eds_names, rejects=grown)
    # Envoy warms model.n and asks for its CLA; then the routes that name a, b and n follow.
    eds = stream.types[ENDPOINT]
    follow = stream.on_request(req(ENDPOINT, eds_names, nonce=eds.nonce, version="v"), grown)
    assert [(r.type_url, names(r) if r.type_url == ENDPOINT else None) for r in follow] == [
        (ENDPOINT, ["model.n"]),
        (ROUTE, None),
    ]


def test_a_stale_nack_changes_nothing(stream, events):
    cache = ResourceCache()
    connect(stream, snapshot({"a": 100, "b": 100}, cache), eds_names=["model.a", "model.b"])
    snap = snapshot({"a": 50, "b": 50}, cache)
    [sent] = stream.on_snapshot(snap)
    stale = req(ENDPOINT, ["model.a", "model.b"], nonce="not-" + sent.nonce, version="v0", nack="old news")
    assert stream.on_request(stale, snap) == [] and events.nacks == []
    ack = req(ENDPOINT, ["model.a", "model.b"], nonce=sent.nonce, version=sent.version_info)
    assert stream.on_request(ack, snap) == []  # both delivered: nothing owed
