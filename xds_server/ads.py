"""State-of-the-World ADS: the per-stream protocol state machine (pure) and its grpc.aio shell.

The rules (xDS protocol, as go-control-plane and Envoy 1.40 apply them):

- Watches. Per resource type a stream has one watch. A request opens it; a response closes it; the
  client's next request for that type (its ACK or NACK of the response) opens it again. While it is
  closed, changes accumulate, so a burst of snapshots becomes one response.
- Nonces. Every response carries a fresh nonce. A request whose `response_nonce` is not the last nonce
  sent for its type is stale (it answers a response that has since been superseded): it gets no
  response and changes nothing; the client will answer the newer response. On a stream that has sent
  nothing for the type yet, any nonce is accepted as a first request (a client reconnecting after the
  control plane restarted may still carry one).
- ACK/NACK. A request with `error_detail` set is a NACK: Envoy rejected the response and kept its last
  accepted config (`version_info` names it). It is logged with Envoy's error text and counted; nothing is
  re-sent until the snapshot changes again (re-sending the same rejected config would loop).
- What is sent. Cluster and Listener responses carry every resource (SotW). Endpoint and Route responses
  carry only the subscribed resources whose version differs from what this stream last sent, plus new
  subscriptions. A changed cluster forces its CLA to be re-sent even if unchanged, because Envoy re-warms
  an updated cluster and waits for a fresh EDS response for it (FACTS.md).
- Order. On a snapshot change types are answered in the order clusters, endpoints, listeners, routes. A
  RouteConfiguration is held until every cluster it names has been sent with its CLA on this stream, so
  Envoy never routes to a cluster that is still warming (new model: CDS, then Envoy asks for its CLA,
  then the routes follow).
- Nothing before the first snapshot. Until the control plane publishes one (the end of its startup sync
  window) requests only open watches; Envoy keeps its last config meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sie.errors import AuthError
from xds_server.metrics import short_type
from xds_server.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_ORDER
from xds_server.snapshots import Snapshot, SnapshotCache

log = logging.getLogger(__name__)

_WILDCARD_TYPES = frozenset({CLUSTER, LISTENER})
_CHILD_TYPE = {CLUSTER: ENDPOINT, LISTENER: ROUTE}
CONTROL_PLANE_ID = "sie-xds_server"


class StreamEvents(Protocol):
    def pushed(self, type_url: str, count: int, latency_s: float | None) -> None: ...
    def nacked(self, node_id: str, type_url: str, version: str, message: str) -> None: ...


@dataclass
class _TypeState:
    names: frozenset[str] = frozenset()  # subscribed names; empty = wildcard
    watch_open: bool = False
    nonce: str = ""  # the last nonce sent for this type; "" until the first response
    sent_type_version: str | None = None
    sent: dict[str, str] = field(default_factory=dict)  # name -> version last sent on this stream
    force: set[str] = field(default_factory=set)  # names to re-send even if unchanged
    acked_version: str = ""


@dataclass
class AdsStream:
    """One ADS stream's protocol state. Synchronous and I/O free: requests and snapshots in, responses out."""

    events: StreamEvents
    clock: Callable[[], float]
    node_id: str = ""
    types: dict[str, _TypeState] = field(default_factory=dict)
    _nonces: itertools.count = field(default_factory=lambda: itertools.count(1))

    def on_request(
        self, req: discovery_pb2.DiscoveryRequest, snapshot: Snapshot | None
    ) -> list[discovery_pb2.DiscoveryResponse]:
        if not self.node_id and req.node.id:
            self.node_id = req.node.id
        type_url = req.type_url
        st = self.types.setdefault(type_url, _TypeState())
        nack = req.HasField("error_detail")
        if nack:
            log.warning(
                "Envoy %s rejected %s (nonce %s); it keeps version %r: %s",
                self.node_id or "?",
                short_type(type_url),
                req.response_nonce,
                req.version_info,
                req.error_detail.message,
            )
            self.events.nacked(self.node_id, type_url, req.version_info, req.error_detail.message)
        if st.nonce and req.response_nonce != st.nonce:
            return []  # stale: the client has not seen our latest response for this type yet
        if not nack and req.response_nonce:
            st.acked_version = req.version_info
        names = frozenset(n for n in req.resource_names if n != "*")
        for gone in st.names - names:
            st.sent.pop(gone, None)
        for new in names - st.names:
            st.sent.pop(new, None)  # a new subscription is answered even if its version did not change
        st.names = names
        st.watch_open = True
        return self.on_snapshot(snapshot)

    def on_snapshot(self, snapshot: Snapshot | None) -> list[discovery_pb2.DiscoveryResponse]:
        """Answer every open watch that the snapshot has news for, in push order."""
        if snapshot is None:
            return []
        out = []
        for type_url in TYPE_ORDER:
            response = self._respond(type_url, snapshot)
            if response is not None:
                out.append(response)
        return out

    def _respond(self, type_url: str, snap: Snapshot) -> discovery_pb2.DiscoveryResponse | None:
        st = self.types.get(type_url)
        if st is None or not st.watch_open:
            return None
        available = snap.get(type_url)
        if type_url in _WILDCARD_TYPES:
            if st.sent_type_version == snap.version(type_url):
                return None
            chosen = [available[n] for n in sorted(available) if not st.names or n in st.names]
            child = self.types.get(_CHILD_TYPE[type_url])
            for res in chosen:
                if child is not None and st.sent.get(res.name) != res.version:
                    child.force.update(name for t, name in res.refs if t == _CHILD_TYPE[type_url])
            st.sent = {}
        else:
            wanted = st.names or frozenset(available)
            chosen = [
                available[n]
                for n in sorted(wanted)
                if n in available and (st.sent.get(n) != available[n].version or n in st.force)
            ]
            if type_url == ROUTE:
                chosen = [r for r in chosen if self._clusters_delivered(r, snap)]
            st.force.intersection_update(available)  # a removed resource is never owed
            if not chosen:
                return None
            st.force.difference_update(r.name for r in chosen)
        st.sent.update((r.name, r.version) for r in chosen)
        st.sent_type_version = snap.version(type_url)
        st.nonce = str(next(self._nonces))
        st.watch_open = False
        latency = self.clock() - snap.changed_at if snap.changed_at is not None else None
        self.events.pushed(type_url, len(chosen), latency)
        return discovery_pb2.DiscoveryResponse(
            version_info=snap.version(type_url),
            resources=[r.packed for r in chosen],
            type_url=type_url,
            nonce=st.nonce,
            control_plane={"identifier": CONTROL_PLANE_ID},
        )

    def _clusters_delivered(self, route, snap: Snapshot) -> bool:
        """Whether every cluster the route names, and that cluster's CLA, were sent on this stream."""
        cds, eds = self.types.get(CLUSTER), self.types.get(ENDPOINT)
        if cds is None:
            return True  # a client that does not take clusters from us: nothing to wait for
        for t, name in route.refs:
            if t != CLUSTER:
                continue
            cluster = snap.get(CLUSTER).get(name)
            if cluster is None or cds.sent.get(name) != cluster.version:
                return False
            if eds is None:
                continue  # Envoy asks for endpoints only after its first clusters: nothing sent yet to wait on
            for child_type, cla in cluster.refs:
                if child_type == ENDPOINT and (cla not in eds.sent or cla in eds.force):
                    return False
        return True


@dataclass(frozen=True)
class StreamInfo:
    stream_id: int
    node_id: str
    peer: str
    opened_at: float


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """The grpc.aio shell: one AdsStream per Envoy connection, fed by its requests and by the cache."""

    def __init__(
        self,
        cache: SnapshotCache,
        events: StreamEvents,
        clock: Callable[[], float],
        on_streams_changed: Callable[[int], None] = lambda n: None,
        *,
        authenticate: Callable[[Any, dict], Awaitable[Any]] | None = None,
        max_streams: int = 256,
    ):
        self._authenticate = authenticate  # (metadata, auth context) -> identity, or raises AuthError
        self._max_streams = max_streams
        self._cache = cache
        self._events = events
        self._clock = clock
        self._on_streams_changed = on_streams_changed
        self._ids = itertools.count(1)
        self.streams: dict[int, tuple[StreamInfo, AdsStream]] = {}

    async def StreamAggregatedResources(self, request_iterator: AsyncIterator, context) -> AsyncIterator:
        if self._authenticate is not None:
            try:
                await self._authenticate(context.invocation_metadata(), context.auth_context())
            except AuthError as exc:
                log.warning("ADS stream from %s refused: %s", context.peer(), exc)
                code = grpc.StatusCode.UNAUTHENTICATED if exc.status == 401 else grpc.StatusCode.PERMISSION_DENIED
                await context.abort(code, str(exc))
                return
        if len(self.streams) >= self._max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"this control plane serves at most {self._max_streams} ADS streams"
            )
            return
        sid = next(self._ids)
        stream = AdsStream(events=self._events, clock=self._clock)
        queue: asyncio.Queue[discovery_pb2.DiscoveryResponse | None] = asyncio.Queue()

        def emit(responses) -> None:
            for response in responses:
                queue.put_nowait(response)

        async def read() -> None:
            try:
                async for req in request_iterator:
                    if not stream.node_id and req.node.id:
                        self.streams[sid] = (StreamInfo(sid, req.node.id, context.peer(), self._clock()), stream)
                    emit(stream.on_request(req, self._cache.get(stream.node_id or req.node.id or None)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the client went away mid-read, or sent garbage
                log.info("ADS stream %d (%s) ended: %r", sid, stream.node_id or "?", exc)
            finally:
                queue.put_nowait(None)

        unsubscribe = self._cache.subscribe(lambda: emit(stream.on_snapshot(self._cache.get(stream.node_id or None))))
        self.streams[sid] = (StreamInfo(sid, "", context.peer(), self._clock()), stream)
        self._on_streams_changed(len(self.streams))
        reader = asyncio.create_task(read(), name=f"ads-stream-{sid}-reader")
        log.info("ADS stream %d opened from %s", sid, context.peer())
        try:
            while (response := await queue.get()) is not None:
                yield response
        finally:
            unsubscribe()
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            self.streams.pop(sid, None)
            self._on_streams_changed(len(self.streams))
            log.info("ADS stream %d (%s) closed", sid, stream.node_id or "?")

    async def DeltaAggregatedResources(self, request_iterator, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "SIE's control plane serves State-of-the-World ADS only: use api_type GRPC, not DELTA_GRPC, in ads_config",
        )
