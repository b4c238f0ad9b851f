"""State-of-the-World ADS: the per-stream protocol state machine (pure) and its grpc.aio shell.

The rules (xDS protocol, as go-control-plane and Envoy 1.40 apply them):

- Watches. Per resource type a stream has one watch. A request opens it; a response closes it; the
  client's next request for that type (its ACK or NACK of the response) opens it again. While it is
  closed, changes accumulate, so a burst of snapshots becomes one response.
- Nonces. Every response carries a fresh, random nonce. A request whose `response_nonce` is not the last
  nonce sent for its type is stale (it answers a response that has since been superseded): it gets no
  response and changes nothing; the client will answer the newer response. On a stream that has sent
  nothing for the type yet, any nonce is accepted as a first request (a client reconnecting after the
  control plane restarted may still carry one). Random, so that no client can answer a response it has
  not read: with counted nonces a client that never read could ACK ahead and have a full response built
  and queued per two tiny requests. So a stream holds at most one unread response per type.
- Types. Only the four SIE serves (TYPE_ORDER). A request for any other type is ignored before it makes
  state, a metric label or more than a rate-bounded log line.
- ACK/NACK. A request with `error_detail` set is a NACK: Envoy rejected the response and kept its last
  accepted config (`version_info` names it). It is counted and logged (Envoy's text cut short, and at
  most a few lines a minute per stream). The same rejected config is never re-sent (it would loop):
  - Cluster and Listener: nothing is re-sent until the type's version changes. Envoy applies every
    cluster or listener of a rejected response it can and rejects only the bad ones (CdsApiHelper,
    LdsApiImpl), and SotW requires every resource in every response, so there is nothing to isolate.
  - Endpoint and Route: Envoy hands a response's resources to their watches one after another and stops
    at the first that fails (GrpcMuxImpl::processDiscoveryResources), so a rejected response is applied
    in part: the resources before the bad one are applied, the bad one partly, the ones after not at all.
    What it carried is therefore forgotten as sent and delivered again by bisection: a NACKed response
    of several resources is split in two halves, each sent as its own response, until every half is
    ACKed or is one resource Envoy rejects alone. That one is held back until its version changes; every
    other resource reaches Envoy, a few round trips later, without waiting for a new snapshot.
- What is sent. Cluster and Listener responses carry every resource (SotW). Endpoint and Route responses
  carry only the subscribed resources whose version differs from what this stream last sent, plus new
  subscriptions. A changed cluster forces its CLA to be re-sent even if unchanged, because Envoy re-warms
  an updated cluster and waits for a fresh EDS response for it (FACTS.md).
- Order. On a snapshot change types are answered in the order clusters, endpoints, listeners, routes. A
  RouteConfiguration is held until every cluster it names has been sent with its CLA on this stream, so
  Envoy never routes to a cluster that is still warming (new model: CDS, then Envoy asks for its CLA,
  then the routes follow). A CLA Envoy rejected counts as sent: Envoy ends the cluster's warming on a
  rejected EDS response too (EdsClusterImpl::onConfigUpdateFailed), and one model's bad CLA must not hold
  every model's routes.
- Nothing before the first snapshot. Until the control plane publishes one (the end of its startup sync
  window) requests only open watches; Envoy keeps its last config meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sie.errors import AuthError
from sie.records import cut
from xds_server.metrics import short_type
from xds_server.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_ORDER, Resource
from xds_server.snapshots import Snapshot, SnapshotCache

log = logging.getLogger(__name__)

_WILDCARD_TYPES = frozenset({CLUSTER, LISTENER})
_CHILD_TYPE = {CLUSTER: ENDPOINT, LISTENER: ROUTE}
CONTROL_PLANE_ID = "sie-xds_server"
# What a client sends, as far as it reaches a log line, /v1/status or the metrics: Envoy's own NACK text
# is a few hundred bytes, its node ids and our versions far shorter; a request may carry megabytes.
MAX_NACK_TEXT = 512
MAX_NODE_ID = 256
_MAX_ECHO = 80  # a type URL, nonce or version quoted back in a log line
# Unread responses one stream may hold: one per type (see Nonces). More means a bug, and the stream is
# closed rather than left to grow.
MAX_QUEUED = len(TYPE_ORDER)


def random_nonce() -> str:
    return secrets.token_urlsafe(12)


class StreamEvents(Protocol):
    def pushed(self, type_url: str, count: int, latency_s: float | None) -> None: ...
    def nacked(self, node_id: str, type_url: str, version: str, message: str) -> None: ...


class LogBudget:
    """Log lines one stream may write: `burst` at once, then one per `every_s`; it counts the lines it
    held back, so the next line written can say how many. One client cannot fill the log."""

    def __init__(self, burst: int = 5, every_s: float = 12.0):
        self.burst, self.every_s = burst, every_s
        self._tokens = float(burst)
        self._at: float | None = None
        self.held = 0

    def take(self, now: float) -> int | None:
        """None: write nothing; else write the line, noting this many held back since the last one."""
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) / self.every_s)
        self._at = now
        if self._tokens < 1:
            self.held += 1
            return None
        self._tokens -= 1
        held, self.held = self.held, 0
        return held


@dataclass
class _TypeState:
    names: frozenset[str] = frozenset()  # subscribed names; empty = wildcard
    watch_open: bool = False
    nonce: str = ""  # the last nonce sent for this type; "" until the first response
    unanswered: bool = False  # no ACK or NACK has named `nonce` yet
    sent_type_version: str | None = None
    # name -> version last sent on this stream; a NACK takes back what the rejected response carried
    sent: dict[str, str] = field(default_factory=dict)
    force: set[str] = field(default_factory=set)  # names to re-send even if unchanged
    acked_version: str = ""
    # Endpoint and Route only (see ACK/NACK in the module's docstring):
    in_flight: dict[str, str] = field(default_factory=dict)  # name -> version the unanswered response carries
    rejected: dict[str, str] = field(default_factory=dict)  # name -> version Envoy rejected alone: held back
    suspects: list[tuple[str, ...]] = field(default_factory=list)  # halves of NACKed responses, each sent alone


@dataclass
class AdsStream:
    """One ADS stream's protocol state. Synchronous and I/O free: requests and snapshots in, responses out."""

    events: StreamEvents
    clock: Callable[[], float]
    new_nonce: Callable[[], str] = random_nonce
    node_id: str = ""
    types: dict[str, _TypeState] = field(default_factory=dict)
    logs: LogBudget = field(default_factory=LogBudget)

    def on_request(
        self, req: discovery_pb2.DiscoveryRequest, snapshot: Snapshot | None
    ) -> list[discovery_pb2.DiscoveryResponse]:
        if not self.node_id and req.node.id:
            self.node_id = cut(req.node.id, MAX_NODE_ID)
        type_url = req.type_url
        if type_url not in TYPE_ORDER:
            self._log(logging.INFO, "asked for %r, a type SIE does not serve; ignored", cut(type_url, _MAX_ECHO))
            return []
        st = self.types.setdefault(type_url, _TypeState())
        if st.nonce and req.response_nonce != st.nonce:
            return []  # stale: the client has not seen our latest response for this type yet
        if st.unanswered:  # the client's first word on our last response: later ones repeat it
            if req.HasField("error_detail"):
                self._nacked(type_url, st, req)
            else:
                st.acked_version = cut(req.version_info, _MAX_ECHO)
            st.unanswered = False
            st.in_flight = {}
        names = frozenset(n for n in req.resource_names if n != "*")
        for gone in st.names - names:
            st.sent.pop(gone, None)
            st.rejected.pop(gone, None)
        for new in names - st.names:
            # A new subscription is answered even if its version did not change, or Envoy rejected it.
            st.sent.pop(new, None)
            st.rejected.pop(new, None)
        st.names = names
        st.watch_open = True
        return self.on_snapshot(snapshot)

    def _nacked(self, type_url: str, st: _TypeState, req: discovery_pb2.DiscoveryRequest) -> None:
        message = cut(req.error_detail.message, MAX_NACK_TEXT)
        kept = cut(req.version_info, _MAX_ECHO)
        self._log(
            logging.WARNING,
            "rejected %s (nonce %s); it keeps version %r: %s",
            short_type(type_url),
            cut(req.response_nonce, _MAX_ECHO),
            kept,
            message,
        )
        self.events.nacked(self.node_id, type_url, kept, message)
        # Envoy applied the response in part, so what it carried is no longer known to be delivered.
        for name in st.in_flight:
            st.sent.pop(name, None)
        if len(st.in_flight) == 1:
            st.rejected.update(st.in_flight)  # the culprit: held back until its version changes
        elif st.in_flight:
            ordered = sorted(st.in_flight)
            half = len(ordered) // 2
            st.suspects[:0] = [tuple(ordered[:half]), tuple(ordered[half:])]

    def _log(self, level: int, what: str, *args: object) -> None:
        held = self.logs.take(self.clock())
        if held is not None:
            note = f" ({held} more such lines on this stream held back)" if held else ""
            log.log(level, "Envoy %s " + what + "%s", self.node_id or "?", *args, note)

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
            owed = [
                available[n]
                for n in sorted(wanted)
                if n in available
                and (n in st.force or available[n].version not in (st.sent.get(n), st.rejected.get(n)))
            ]
            if type_url == ROUTE:
                owed = [r for r in owed if self._clusters_delivered(r, snap)]
            st.force.intersection_update(available)  # a removed resource is never owed
            for gone in [n for n in st.rejected if n not in available]:
                del st.rejected[gone]
            chosen = _next_batch(st, owed)
            if not chosen:
                return None
            st.force.difference_update(r.name for r in chosen)
            st.in_flight = {r.name: r.version for r in chosen}
            for r in chosen:
                st.rejected.pop(r.name, None)
        st.sent.update((r.name, r.version) for r in chosen)
        st.sent_type_version = snap.version(type_url)
        st.nonce = self.new_nonce()
        st.unanswered = True
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
        """Whether every cluster the route names, and that cluster's CLA, were sent on this stream (a CLA
        Envoy rejected counts: see Order in the module's docstring)."""
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
                if child_type == ENDPOINT and (cla in eds.force or (cla not in eds.sent and cla not in eds.rejected)):
                    return False
        return True


def _next_batch(st: _TypeState, owed: list[Resource]) -> list[Resource]:
    """What the next response carries: the first half of a NACKed response still owed, alone, while there
    is one (bisection, see ACK/NACK); otherwise everything owed."""
    by_name = {r.name: r for r in owed}
    while st.suspects:
        group = [by_name[n] for n in st.suspects.pop(0) if n in by_name]
        if group:
            return group
    return owed


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
        new_nonce: Callable[[], str] = random_nonce,
    ):
        self._authenticate = authenticate  # (metadata, auth context) -> identity, or raises AuthError
        self._max_streams = max_streams
        self._cache = cache
        self._events = events
        self._clock = clock
        self._new_nonce = new_nonce
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
        stream = AdsStream(events=self._events, clock=self._clock, new_nonce=self._new_nonce)
        queue: asyncio.Queue[discovery_pb2.DiscoveryResponse | None] = asyncio.Queue()
        overflowed = False

        def emit(responses) -> None:
            # The state machine lets a stream hold one unread response per type (random nonces): past
            # that, something is wrong, and the stream ends rather than hold responses without bound.
            nonlocal overflowed
            if overflowed or not responses:
                return
            if queue.qsize() + len(responses) > MAX_QUEUED:
                overflowed = True
                queue.put_nowait(None)
                return
            for response in responses:
                queue.put_nowait(response)

        async def read() -> None:
            try:
                async for req in request_iterator:
                    node = stream.node_id or cut(req.node.id, MAX_NODE_ID)
                    if not stream.node_id and node:
                        self.streams[sid] = (StreamInfo(sid, node, context.peer(), self._clock()), stream)
                    emit(stream.on_request(req, self._cache.get(node or None)))
                    if overflowed:
                        return
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
            if overflowed:
                log.warning(
                    "ADS stream %d (%s) closed: more than %d responses waited for it to read them",
                    sid,
                    stream.node_id or "?",
                    MAX_QUEUED,
                )
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"more than {MAX_QUEUED} xDS responses were waiting for this client to read them",
                )
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
