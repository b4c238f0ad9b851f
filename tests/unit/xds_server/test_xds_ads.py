"""The SotW ADS state machine (nonces, ACK/NACK, watches, what is re-sent, push order) and its grpc shell."""

from __future__ import annotations

import asyncio

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from sie.spec_loader import parse_model_service
from xds_server.ads import AdsServer, AdsStream
from xds_server.ingress import IngressConfig
from xds_server.policy.decisions import EndpointDecision, ModelDecision
from xds_server.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, ModelInputs, Resource, ResourceCache
from xds_server.snapshots import Snapshot, SnapshotCache

SPECS = {}


def svc(name: str, timeout_ms: float = 30000):
    key = (name, timeout_ms)
    if key not in SPECS:  # the same object for the same inputs, as the registry keeps it
        SPECS[key] = parse_model_service(
            {"spec": {"model": {"name": name}, "backend": {"type": "sim"}, "sla": {"request_timeout_ms": timeout_ms}}}
        )
    return SPECS[key]


def snapshot(weights: dict[str, int], cache: ResourceCache | None = None, timeouts: dict | None = None) -> Snapshot:
    timeouts = timeouts or {}
    models = {
        m: ModelInputs(
            svc(m, timeouts.get(m, 30000)), ModelDecision(m, {f"{m}-0": EndpointDecision("127.0.0.1:9000", w)})
        )
        for m, w in weights.items()
    }
    return Snapshot.build((cache or ResourceCache()).build(models, IngressConfig()), changed_at=0.0)


class Events:
    def __init__(self):
        self.pushes: list[tuple[str, int]] = []
        self.nacks: list[tuple[str, str, str, str]] = []

    def pushed(self, type_url, count, latency_s):
        self.pushes.append((type_url, count))

    def nacked(self, node_id, type_url, version, message):
        self.nacks.append((node_id, type_url, version, message))


def req(type_url, names=(), nonce="", version="", nack: str | None = None, node="envoy-1"):
    r = discovery_pb2.DiscoveryRequest(
        type_url=type_url, resource_names=list(names), response_nonce=nonce, version_info=version
    )
    r.node.id = node
    if nack is not None:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message=nack))
    return r


def names(response) -> list[str]:
    out = []
    for res in response.resources:
        if response.type_url == ENDPOINT:
            cla = endpoint_pb2.ClusterLoadAssignment()
            res.Unpack(cla)
            out.append(cla.cluster_name)
        else:
            out.append(res.type_url)
    return out


@pytest.fixture
def events():
    return Events()


@pytest.fixture
def stream(events):
    return AdsStream(events=events, clock=lambda: 1.0)


def connect(stream, snap, eds_names=("model.a",)):
    """Envoy's start-up: CDS and LDS, then the ACKs with EDS and RDS subscriptions. Returns the last nonces."""
    cds = stream.on_request(req(CLUSTER), snap)[0]
    lds = stream.on_request(req(LISTENER), snap)[0]
    eds = stream.on_request(req(ENDPOINT, eds_names), snap)
    stream.on_request(req(CLUSTER, nonce=cds.nonce, version=cds.version_info), snap)
    rds = stream.on_request(req(ROUTE, ["ingress_routes"]), snap)
    stream.on_request(req(LISTENER, nonce=lds.nonce, version=lds.version_info), snap)
    acks = {}
    for r in eds + rds:
        acks[r.type_url] = r
        stream.on_request(
            req(
                r.type_url,
                eds_names if r.type_url == ENDPOINT else ["ingress_routes"],
                nonce=r.nonce,
                version=r.version_info,
            ),
            snap,
        )
    return {CLUSTER: cds, LISTENER: lds, **acks}


def test_nothing_is_answered_before_the_first_snapshot_then_every_open_watch_is(stream):
    assert stream.on_request(req(CLUSTER), None) == []
    assert stream.on_request(req(LISTENER), None) == []
    responses = stream.on_snapshot(snapshot({"a": 100}))
    assert [r.type_url for r in responses] == [CLUSTER, LISTENER]
    assert responses[0].nonce != responses[1].nonce


def test_a_response_carries_the_type_version_and_a_fresh_nonce(stream):
    snap = snapshot({"a": 100, "b": 100})
    response = stream.on_request(req(CLUSTER), snap)[0]
    assert response.version_info == snap.version(CLUSTER) and response.nonce
    assert len(response.resources) == 2


def test_an_ack_without_news_opens_the_watch_and_the_next_change_is_sent(stream):
    cache = ResourceCache()
    snap = snapshot({"a": 100}, cache)
    first = stream.on_request(req(ENDPOINT, ["model.a"]), snap)[0]
    assert stream.on_request(req(ENDPOINT, ["model.a"], nonce=first.nonce, version=first.version_info), snap) == []
    changed = snapshot({"a": 40}, cache)
    second = stream.on_snapshot(changed)
    assert [r.type_url for r in second] == [ENDPOINT] and second[0].version_info == changed.version(ENDPOINT)


def test_a_stale_nonce_gets_no_response_and_changes_nothing(stream):
    cache = ResourceCache()
    snap = snapshot({"a": 100}, cache)
    first = stream.on_request(req(ENDPOINT, ["model.a"]), snap)[0]
    newer = snapshot({"a": 50}, cache)
    assert stream.on_snapshot(newer) == []  # watch closed: the client has not answered `first` yet
    assert stream.on_request(req(ENDPOINT, ["model.a"], nonce="not-" + first.nonce), newer) == []
    after_ack = stream.on_request(req(ENDPOINT, ["model.a"], nonce=first.nonce, version=first.version_info), newer)
    assert [r.version_info for r in after_ack] == [newer.version(ENDPOINT)]


def test_a_burst_of_snapshots_while_the_watch_is_closed_becomes_one_response(stream):
    cache = ResourceCache()
    first = stream.on_request(req(ENDPOINT, ["model.a"]), snapshot({"a": 100}, cache))[0]
    for w in (90, 80, 70):
        latest = snapshot({"a": w}, cache)
        assert stream.on_snapshot(latest) == []
    responses = stream.on_request(req(ENDPOINT, ["model.a"], nonce=first.nonce, version=first.version_info), latest)
    assert len(responses) == 1 and responses[0].version_info == latest.version(ENDPOINT)


def test_a_nack_is_reported_with_envoys_text_and_the_rejected_config_is_not_resent(stream, events):
    snap = snapshot({"a": 100})
    first = stream.on_request(req(CLUSTER), snap)[0]
    again = stream.on_request(
        req(CLUSTER, nonce=first.nonce, version="v0", nack="Proto constraint validation failed"), snap
    )
    assert again == []
    assert events.nacks == [("envoy-1", CLUSTER, "v0", "Proto constraint validation failed")]
    fixed = snapshot({"a": 100, "b": 100})
    assert [r.type_url for r in stream.on_snapshot(fixed)] == [CLUSTER]


def test_eds_sends_only_the_cla_that_changed(stream):
    cache = ResourceCache()
    snap = snapshot({"a": 100, "b": 100}, cache)
    last = connect(stream, snap, eds_names=("model.a", "model.b"))
    assert sorted(names(last[ENDPOINT])) == ["model.a", "model.b"]
    responses = stream.on_snapshot(snapshot({"a": 100, "b": 30}, cache))
    assert [(r.type_url, names(r)) for r in responses] == [(ENDPOINT, ["model.b"])]


def test_a_changed_cluster_is_followed_by_its_cla_even_if_the_cla_did_not_change(stream):
    cache = ResourceCache()
    snap = snapshot({"a": 100}, cache)
    connect(stream, snap)
    assert stream.on_snapshot(snapshot({"a": 100}, cache)) == []  # same content: nothing to send
    # A spec change that alters the cluster (capacity) but not the endpoints.
    bigger = parse_model_service(
        {
            "spec": {
                "model": {"name": "a"},
                "backend": {"type": "sim"},
                "resources": {"max_concurrent_requests": 7},
                "sla": {"request_timeout_ms": 30000},
            }
        }
    )
    decision = ModelDecision("a", {"a-0": EndpointDecision("127.0.0.1:9000", 100)})
    updated = Snapshot.build(cache.build({"a": ModelInputs(bigger, decision)}, IngressConfig()))
    assert updated.version(ENDPOINT) == snap.version(ENDPOINT)
    responses = stream.on_snapshot(updated)
    assert [(r.type_url, names(r) if r.type_url == ENDPOINT else None) for r in responses] == [
        (CLUSTER, None),
        (ENDPOINT, ["model.a"]),
    ]


def test_a_new_model_is_pushed_in_order_and_its_routes_wait_for_its_endpoints(stream):
    cache = ResourceCache()
    snap = snapshot({"a": 100}, cache)
    last = connect(stream, snap)
    grown = snapshot({"a": 100, "b": 100}, cache)
    responses = stream.on_snapshot(grown)
    # The routes naming model.b are held: Envoy has not asked for model.b's endpoints yet.
    assert [r.type_url for r in responses] == [CLUSTER]
    cds = responses[0]
    stream.on_request(req(CLUSTER, nonce=cds.nonce, version=cds.version_info), grown)
    # Envoy warms model.b and subscribes to its CLA (with the nonce of its last EDS response).
    responses = stream.on_request(
        req(ENDPOINT, ["model.a", "model.b"], nonce=last[ENDPOINT].nonce, version=last[ENDPOINT].version_info), grown
    )
    assert [(r.type_url, names(r) if r.type_url == ENDPOINT else None) for r in responses] == [
        (ENDPOINT, ["model.b"]),
        (ROUTE, None),
    ]


def test_a_snapshot_change_answers_types_in_push_order(stream):
    connect(stream, snapshot({"a": 100}))
    # Every type changes at once: a's cluster (capacity), its endpoints, the listener port, the route timeout.
    changed = parse_model_service(
        {
            "spec": {
                "model": {"name": "a"},
                "backend": {"type": "sim"},
                "resources": {"max_concurrent_requests": 7},
                "sla": {"request_timeout_ms": 1234},
            }
        }
    )
    decision = ModelDecision("a", {"a-0": EndpointDecision("127.0.0.1:9000", 10)})
    snap = Snapshot.build(ResourceCache().build({"a": ModelInputs(changed, decision)}, IngressConfig(port=9999)))
    responses = stream.on_snapshot(snap)
    assert [r.type_url for r in responses] == [CLUSTER, ENDPOINT, LISTENER, ROUTE]


def test_a_first_request_carrying_an_unknown_nonce_is_answered(stream):
    # Envoy reconnecting to a restarted control plane may still carry the old server's nonce.
    snap = snapshot({"a": 100})
    responses = stream.on_request(req(CLUSTER, nonce="41", version="old"), snap)
    assert [r.type_url for r in responses] == [CLUSTER]


def test_unsubscribed_names_are_forgotten_and_resubscribing_resends(stream):
    snap = snapshot({"a": 100, "b": 100})
    r1 = stream.on_request(req(ENDPOINT, ["model.a", "model.b"]), snap)[0]
    assert stream.on_request(req(ENDPOINT, ["model.a"], nonce=r1.nonce, version=r1.version_info), snap) == []
    r2 = stream.on_request(req(ENDPOINT, ["model.a", "model.b"], nonce=r1.nonce, version=r1.version_info), snap)
    assert [names(r) for r in r2] == [["model.b"]]


def test_forced_bad_resource_then_fix_is_resent(stream):
    snap = snapshot({"a": 100})
    last = connect(stream, snap)
    good = snap.get(CLUSTER)["model.a"]
    bad = snap.with_resource(Resource("model.a", CLUSTER, "bad", good.packed, good.refs))
    sent = stream.on_snapshot(bad)
    assert [r.type_url for r in sent] == [CLUSTER, ENDPOINT]  # a changed cluster is followed by its CLA
    stream.on_request(req(CLUSTER, nonce=sent[0].nonce, version=last[CLUSTER].version_info, nack="invalid"), bad)
    stream.on_request(req(ENDPOINT, ["model.a"], nonce=sent[1].nonce, version=sent[1].version_info), bad)
    # Restoring the good snapshot re-sends the cluster (the client holds the rejected version's predecessor,
    # we recorded the rejected one) and again its CLA.
    assert [r.type_url for r in stream.on_snapshot(snap)] == [CLUSTER, ENDPOINT]


# ---- the grpc shell, driven by a fake request stream ---------------------------------------------


class FakeContext:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


async def test_servicer_holds_requests_until_a_snapshot_then_answers_and_closes_cleanly(events):
    cache = SnapshotCache()
    server = AdsServer(cache, events, clock=lambda: 1.0)
    requests: asyncio.Queue = asyncio.Queue()

    async def request_stream():
        while (item := await requests.get()) is not None:
            yield item

    responses = server.StreamAggregatedResources(request_stream(), FakeContext())
    await requests.put(req(CLUSTER))
    pending = asyncio.ensure_future(anext(responses))
    await asyncio.sleep(0.01)
    assert not pending.done()  # held: no snapshot yet
    assert [info.node_id for info, _ in server.streams.values()] == ["envoy-1"]
    snap = snapshot({"a": 100})
    cache.set_snapshot(snap)
    first = await asyncio.wait_for(pending, 1)
    assert first.type_url == CLUSTER and first.version_info == snap.version(CLUSTER)
    await requests.put(req(CLUSTER, nonce=first.nonce, version=first.version_info))
    await requests.put(None)  # Envoy hangs up
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(responses), 1)
    assert server.streams == {}
