"""Registry view + per-model decisions -> Envoy resources (pure, with an explicit memo).

Per model: one Cluster `model.<id>` (EDS over ADS) and one ClusterLoadAssignment of the same name; during
a rollout (and while its new build's instances drain after one) also `model.<id>.canary` with its own
CLA, and the routes split the model's traffic between the two by share (weighted clusters).
Shared: the `ingress` Listener and the `ingress_routes` RouteConfiguration (ingress.py).

Every resource carries a content version (a hash of its deterministic serialisation), so the ADS
server can tell which resources a client already holds. `ResourceCache.build` rebuilds only what changed:
a model's cluster when its spec or capacity changes, its CLA when its decision changes, the routes when
the set of routed specs changes; the rest is reused as is, already serialised.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, extension_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2 as ec
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as upstream_http
from envoy.type.v3 import percent_pb2
from google.protobuf import any_pb2, duration_pb2

from sie.errors import Problem
from sie.spec import ModelService
from sie.telemetry import split_address
from xds_server.ingress import (
    LISTENER_NAME,
    METADATA_KEY,
    METADATA_NAMESPACE,
    ROUTE_CONFIG_NAME,
    IngressConfig,
    ads_config_source,
    build_listener,
    build_routes,
    canary_cluster_name,
    cluster_name,
    routed_clusters,
    typed,
)
from xds_server.picker import protocol as picker
from xds_server.policy.decisions import MIN_WEIGHT, Health, ModelDecision

log = logging.getLogger(__name__)

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# The order a push must follow so nothing is referenced before it exists (FACTS.md).
TYPE_ORDER = (CLUSTER, ENDPOINT, LISTENER, ROUTE)

# Envoy may hold this many requests per instance beyond max_concurrent_requests: the sidecar queues the
# excess itself (and answers 429/503 when its queue is full), so Envoy's breaker is the last resort.
QUEUE_HEADROOM = 2
CONNECT_TIMEOUT_S = 1
DROP_CATEGORY = "sie_overload"
# Envoy's balancer per --lb-policy. LEAST_REQUEST scores a host weight / (active + 1) (FACTS.md), so the
# pushed weights and Envoy's live in-flight counts combine; ROUND_ROBIN is a benchmark baseline only.
LB_POLICIES = {"least_request": cluster_pb2.Cluster.LEAST_REQUEST, "round_robin": cluster_pb2.Cluster.ROUND_ROBIN}
_HEALTH = {
    Health.HEALTHY: health_check_pb2.HealthStatus.HEALTHY,
    Health.DRAINING: health_check_pb2.HealthStatus.DRAINING,
}


@dataclass(frozen=True)
class Resource:
    """One xDS resource, serialised once; `version` is a hash of exactly the bytes that are sent."""

    name: str
    type_url: str
    version: str
    packed: any_pb2.Any = field(compare=False, repr=False)
    # What this resource names, as (type_url, name): a cluster its CLA, the listener its routes, the
    # routes their clusters. Used to check a snapshot's consistency and to re-send a CLA after its
    # cluster changed (Envoy re-warms an updated cluster and waits for a fresh EDS response).
    refs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, name: str, type_url: str, message, refs: tuple[tuple[str, str], ...] = ()) -> Resource:
        raw = message.SerializeToString(deterministic=True)
        version = hashlib.blake2b(raw, digest_size=8).hexdigest()
        return cls(name, type_url, version, any_pb2.Any(type_url=type_url, value=raw), refs)


def parse_endpoint_address(address: str) -> tuple[str, int]:
    """`ip:port` or `[ipv6]:port` -> (ip, port); ValueError otherwise. EDS endpoints must be IP literals
    as Envoy parses them (no DNS in EDS, no IPv6 zone id); the check is sie.telemetry's, the one
    registered addresses pass, so a CLA never carries an address Envoy would NACK."""
    try:
        return split_address(address)
    except ValueError as exc:
        raise ValueError(f"address {exc}") from None


def breaker_capacity(svc: ModelService, live_instances: int) -> int:
    """Requests Envoy lets through to one model at once: capacity of the instances it may have."""
    instances = max(svc.spec.sla.max_replicas, svc.spec.desired_replicas, live_instances, 1)
    return svc.spec.resources.max_concurrent_requests * instances * QUEUE_HEADROOM


def connection_capacity(svc: ModelService, live_instances: int) -> int:
    """Connections Envoy may hold to one model's instances: one per request it lets through (HTTP/1.1)
    and as many again, kept idle. Envoy counts idle connections against max_connections ("all
    connections, whether active or draining", its circuit-breaking docs), and an instance keeps the
    connections a burst opened to it until the idle timeout. With the limit at the request capacity, the
    instances that had taken a burst held every connection, the ones woken for it got one per Envoy
    worker thread, and their requests waited in Envoy's pending queue, which LEAST_REQUEST does not
    count, for up to 10 s (bench/autoscale: upstream_cx_overflow climbing, every request at 1x)."""
    return 2 * breaker_capacity(svc, live_instances)


def build_cluster(
    svc: ModelService,
    live_instances: int,
    lb_policy: str = "least_request",
    name: str | None = None,
    affinity: bool = True,
) -> cluster_pb2.Cluster:
    """The model's cluster. Its balancer is `lb_policy`, or, for a model with prefix affinity when an
    endpoint picker runs (`affinity`), the picker's choice with least request over SIE's weights as the
    fallback (`_pick_by_picker`). Either way DRAINING hosts take no new request."""
    if lb_policy not in LB_POLICIES:
        raise ValueError(f"lb_policy {lb_policy!r} is not one of {sorted(LB_POLICIES)}")
    cap = breaker_capacity(svc, live_instances)
    http = upstream_http.HttpProtocolOptions(
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(idle_timeout=duration_pb2.Duration(seconds=60)),
        explicit_http_config=upstream_http.HttpProtocolOptions.ExplicitHttpConfig(
            http_protocol_options=protocol_pb2.Http1ProtocolOptions()
        ),
    )
    cluster = cluster_pb2.Cluster(
        name=name or cluster_name(svc.model_id),
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(eds_config=ads_config_source()),
        connect_timeout=duration_pb2.Duration(seconds=CONNECT_TIMEOUT_S),
        lb_policy=LB_POLICIES[lb_policy],
        # 0: never spread traffic over draining hosts because too few are healthy (Envoy's default is 50%).
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(healthy_panic_threshold=percent_pb2.Percent(value=0)),
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=base_pb2.RoutingPriority.DEFAULT,
                    max_connections={"value": connection_capacity(svc, live_instances)},
                    max_pending_requests={"value": cap},
                    max_requests={"value": cap},
                    retry_budget=circuit_breaker_pb2.CircuitBreakers.Thresholds.RetryBudget(
                        budget_percent=percent_pb2.Percent(value=25.0), min_retry_concurrency={"value": 10}
                    ),
                )
            ]
        ),
        # Eject an instance that refuses connections or answers 502/503/504 repeatedly; a model's own
        # 500s (consecutive_5xx) do not eject, and at most half the hosts are ever ejected.
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx={"value": 5},
            enforcing_consecutive_5xx={"value": 0},
            consecutive_gateway_failure={"value": 5},
            enforcing_consecutive_gateway_failure={"value": 100},
            split_external_local_origin_errors=True,
            consecutive_local_origin_failure={"value": 3},
            enforcing_consecutive_local_origin_failure={"value": 100},
            enforcing_success_rate={"value": 0},
            interval=duration_pb2.Duration(seconds=2),
            base_ejection_time=duration_pb2.Duration(seconds=5),
            max_ejection_percent={"value": 50},
        ),
        upstream_connection_options=cluster_pb2.UpstreamConnectionOptions(
            tcp_keepalive=address_pb2.TcpKeepalive(keepalive_time={"value": 60}, keepalive_interval={"value": 10})
        ),
        typed_extension_protocol_options={"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(http)},
    )
    if affinity and svc.spec.prefix_affinity and lb_policy == "least_request":
        _pick_by_picker(cluster)
    # The model id, for Envoy's own answers about this cluster: the local reply for shed requests names
    # the model with %CLUSTER_METADATA(sie:model)% (ingress.py).
    cluster.metadata.filter_metadata[METADATA_NAMESPACE].update({METADATA_KEY: svc.model_id})
    return cluster


def _pick_by_picker(cluster: cluster_pb2.Cluster) -> None:
    """The endpoint picker's choice (the header x-sie-endpoint, xds_server/picker) where it made one and the
    host is HEALTHY; least request over SIE's weights otherwise (Envoy's override_host policy)."""
    least = least_request_pb2.LeastRequest()
    fallback = cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=extension_pb2.TypedExtensionConfig(
                    name="envoy.load_balancing_policies.least_request", typed_config=typed(least)
                )
            )
        ]
    )
    source = override_host_pb2.OverrideHost.OverrideHostSource(header=picker.HEADER)
    policy = override_host_pb2.OverrideHost(override_host_sources=[source], fallback_policy=fallback)
    cluster.ClearField("lb_policy")
    cluster.load_balancing_policy.CopyFrom(
        cluster_pb2.LoadBalancingPolicy(
            policies=[
                cluster_pb2.LoadBalancingPolicy.Policy(
                    typed_extension_config=extension_pb2.TypedExtensionConfig(
                        name="envoy.load_balancing_policies.override_host", typed_config=typed(policy)
                    )
                )
            ]
        )
    )
    # Only a HEALTHY host is taken as the picker's choice: never a draining one.
    cluster.common_lb_config.override_host_status.CopyFrom(
        health_check_pb2.HealthStatusSet(statuses=[health_check_pb2.HEALTHY])
    )


def build_picker_cluster(address: str) -> cluster_pb2.Cluster:
    """Envoy's cluster of the endpoint picker (HTTP/2 for gRPC), at a fixed address beside it."""
    host, port = parse_endpoint_address(address)
    http2 = upstream_http.HttpProtocolOptions(
        explicit_http_config=upstream_http.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    return cluster_pb2.Cluster(
        name=picker.CLUSTER,
        type=cluster_pb2.Cluster.STATIC,
        connect_timeout=duration_pb2.Duration(nanos=250_000_000),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=picker.CLUSTER,
            endpoints=[
                ec.LocalityLbEndpoints(
                    lb_endpoints=[
                        ec.LbEndpoint(
                            endpoint=ec.Endpoint(
                                address=address_pb2.Address(
                                    socket_address=address_pb2.SocketAddress(address=host, port_value=port)
                                )
                            )
                        )
                    ]
                )
            ],
        ),
        typed_extension_protocol_options={"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(http2)},
        # As many streams as the picker serves (picker.MAX_STREAMS): one past them overflows here, at once,
        # and its request is balanced by least request (ext_proc's failure_mode_allow), instead of being
        # refused by the picker after a round trip. Stated, not left to Envoy's default of the same number.
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    priority=base_pb2.RoutingPriority.DEFAULT,
                    max_requests={"value": picker.MAX_STREAMS},
                    max_pending_requests={"value": picker.MAX_STREAMS},
                )
            ]
        ),
    )


def build_cla(model_id: str, decision: ModelDecision, name: str | None = None) -> endpoint_pb2.ClusterLoadAssignment:
    percent = min(100.0, max(0.0, decision.drop_overload_percent))
    per_million = round(percent * 10_000)
    lb_endpoints = []
    for iid in sorted(decision.endpoints):
        ep = decision.endpoints[iid]
        host, port = parse_endpoint_address(ep.address)
        lb_endpoint = ec.LbEndpoint(
            endpoint=ec.Endpoint(
                address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=host, port_value=port)),
                hostname=iid,
            ),
            health_status=_HEALTH[ep.health],
            load_balancing_weight={"value": max(MIN_WEIGHT, int(ep.weight))},
        )
        # Envoy 1.40 hands a new drop_overloads value to its workers only with a host-set update: an EDS
        # update that changes the drop policy alone is accepted (config_dump shows it) but not applied.
        # Carrying the drop in every endpoint's metadata makes a drop change a host change, so it applies.
        # (Found by tests/integration/test_xds_envoy.py::test_pushed_weights_and_drop_overloads_reach_envoy.)
        lb_endpoint.metadata.filter_metadata["sie"].update({"drop_per_million": per_million})
        lb_endpoints.append(lb_endpoint)
    cla = endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name or cluster_name(model_id), endpoints=[ec.LocalityLbEndpoints(lb_endpoints=lb_endpoints)]
    )
    if per_million > 0:
        cla.policy.drop_overloads.append(
            endpoint_pb2.ClusterLoadAssignment.Policy.DropOverload(
                category=DROP_CATEGORY,
                drop_percentage=percent_pb2.FractionalPercent(
                    numerator=per_million, denominator=percent_pb2.FractionalPercent.MILLION
                ),
            )
        )
    return cla


@dataclass(frozen=True)
class CanaryInputs:
    """A model's new build during a rollout: its own cluster and endpoints."""

    service: ModelService
    decision: ModelDecision
    share: int | None  # its share of the model's traffic in the routes; None: not routed (it drains)


@dataclass(frozen=True)
class ModelInputs:
    """Everything one model's resources are built from."""

    service: ModelService
    decision: ModelDecision
    routed: bool = True  # False while a deleted model retires: cluster kept, routes gone
    canary: CanaryInputs | None = None
    state: str = "serving"  # what the model list says: serving, loading, asleep (at zero), unavailable

    @property
    def split(self) -> int | None:
        return self.canary.share if self.canary is not None else None


Resources = dict[str, dict[str, Resource]]  # type_url -> name -> resource


# Envoy's own bound on a RouteConfiguration's direct-response bodies is raised to fit the model list; this
# keeps that list (and the routes) to what a proxy should carry.
MAX_ROUTE_BYTES = 16 * 1024 * 1024


def buildable_problems(service: ModelService, others: Sequence[ModelService]) -> list[Problem]:
    """Why `service`'s Envoy resources (alone, and in the routes beside `others`) cannot be built; [] if
    they can. Run before a spec is accepted, so the control loop never meets a spec it cannot serve."""
    try:
        Resource.of(cluster_name(service.model_id), CLUSTER, build_cluster(service, service.spec.sla.max_replicas))
        Resource.of(
            cluster_name(service.model_id), ENDPOINT, build_cla(service.model_id, ModelDecision(service.model_id))
        )
        routes = build_routes([*others, service])
        size = routes.ByteSize()
    except (ValueError, TypeError, OverflowError) as exc:
        return [Problem("spec", f"cannot be turned into Envoy configuration: {exc}")]
    if size > MAX_ROUTE_BYTES:
        return [
            Problem("spec", f"the ingress routes would be {size} bytes with this model, more than {MAX_ROUTE_BYTES}")
        ]
    return []


@dataclass
class ResourceCache:
    """The memo of `build`: inputs are compared by identity (specs) or equality (decisions).

    One model's failure is its own: if its cluster or endpoints cannot be built, its last good resources
    are kept (or, if it never had any, it is left out of the snapshot with its routes), the reason is
    in `errors`, and every other model is built as usual."""

    lb_policy: str = "least_request"  # the same for every cluster, for the life of the cache
    prefix_affinity: bool = True  # False: no model gets prefix affinity (a baseline), for the cache's life
    picker: str | None = None  # the endpoint picker's host:port; None: none runs, and no model has affinity

    @property
    def affinity(self) -> bool:
        """Whether models asking for prefix affinity get it: a picker runs, and no baseline turned it off."""
        return self.prefix_affinity and self.picker is not None and self.lb_policy == "least_request"

    _clusters: dict[str, tuple[ModelService, int, Resource]] = field(default_factory=dict)
    _clas: dict[str, tuple[ModelDecision, Resource]] = field(default_factory=dict)
    _routes: tuple[tuple[ModelService, ...], tuple[tuple[str, int], ...], Resource, tuple[str, ...]] | None = None
    _listener: tuple[IngressConfig, Resource] | None = None
    _picker: tuple[str, Resource] | None = None
    rebuilt: int = 0  # resources built by the last call, for tests and metrics
    errors: dict[str, str] = field(default_factory=dict)  # model id -> why its resources could not be built

    def _cluster(self, name: str, service: ModelService, decision: ModelDecision) -> tuple[Resource, Resource]:
        live = len(decision.endpoints)
        cached = self._clusters.get(name)
        if cached is None or cached[0] is not service or cached[1] != _capacity_key(service, live):
            res = Resource.of(
                name,
                CLUSTER,
                build_cluster(service, live, self.lb_policy, name=name, affinity=self.affinity),
                refs=((ENDPOINT, name),),
            )
            cached = (service, _capacity_key(service, live), res)
            self._clusters[name] = cached
            self.rebuilt += 1
        cla = self._clas.get(name)
        if cla is None or cla[0] != decision:
            cla = (decision, Resource.of(name, ENDPOINT, build_cla(service.model_id, decision, name=name)))
            self._clas[name] = cla
            self.rebuilt += 1
        return cached[2], cla[1]

    def _model(self, mid: str, inputs: ModelInputs) -> list[tuple[Resource, Resource]]:
        built = [self._cluster(cluster_name(mid), inputs.service, inputs.decision)]
        if inputs.canary is not None:
            built.append(self._cluster(canary_cluster_name(mid), inputs.canary.service, inputs.canary.decision))
        return built

    def build(self, models: Mapping[str, ModelInputs], ingress: IngressConfig) -> Resources:
        self.rebuilt = 0
        out: Resources = {t: {} for t in TYPE_ORDER}
        built: list[str] = []
        names: set[str] = set()
        for mid in sorted(models):
            try:
                pairs = self._model(mid, models[mid])
                self.errors.pop(mid, None)
            except Exception as exc:  # noqa: BLE001 - one model's failure must not stop the others
                if self.errors.get(mid) != str(exc):
                    log.exception("cannot build the Envoy resources of model %s; keeping its last good ones", mid)
                self.errors[mid] = str(exc)
                wanted = [cluster_name(mid)] + ([canary_cluster_name(mid)] if models[mid].canary else [])
                pairs = []
                for name in wanted:
                    previous, last_cla = self._clusters.get(name), self._clas.get(name)
                    if previous is None or last_cla is None:
                        break
                    pairs.append((previous[2], last_cla[1]))
                if len(pairs) != len(wanted):
                    continue
            for cluster, cla in pairs:
                out[CLUSTER][cluster.name] = cluster
                out[ENDPOINT][cla.name] = cla
                names.add(cluster.name)
            built.append(mid)
        for gone in set(self._clusters) - names:
            self._clusters.pop(gone)
            self._clas.pop(gone, None)
        for gone in set(self.errors) - set(models):
            del self.errors[gone]

        routed = tuple(models[m].service for m in built if models[m].routed)
        splits = tuple(
            (m, share) for m in built if models[m].routed and (share := models[m].split) is not None and share > 0
        )
        states = tuple(models[m].state for m in built if models[m].routed)
        if (
            self._routes is None
            or len(self._routes[0]) != len(routed)
            or any(a is not b for a, b in zip(self._routes[0], routed))
            or self._routes[1] != splits
            or self._routes[3] != states
        ):
            refs = tuple(
                (CLUSTER, name) for s in routed for name in routed_clusters(s.model_id, dict(splits).get(s.model_id))
            )
            states_by_id = {svc.model_id: state for svc, state in zip(routed, states)}
            resource = Resource.of(
                ROUTE_CONFIG_NAME,
                ROUTE,
                build_routes(
                    routed,
                    dict(splits),
                    states_by_id,
                    affinity=self.affinity,
                ),
                refs=refs,
            )
            self._routes = (routed, splits, resource, states)
            self.rebuilt += 1
        out[ROUTE][ROUTE_CONFIG_NAME] = self._routes[2]
        if self._listener is None or self._listener[0] != ingress:
            needs: tuple[tuple[str, str], ...] = ((ROUTE, ROUTE_CONFIG_NAME),)
            if ingress.picker:
                needs += ((CLUSTER, picker.CLUSTER),)
            self._listener = (ingress, Resource.of(LISTENER_NAME, LISTENER, build_listener(ingress), refs=needs))
            self.rebuilt += 1
        if ingress.picker:
            out[CLUSTER][picker.CLUSTER] = self._picker_cluster(ingress.picker)
        out[LISTENER][LISTENER_NAME] = self._listener[1]
        return out

    def _picker_cluster(self, address: str) -> Resource:
        if self._picker is None or self._picker[0] != address:
            self._picker = (address, Resource.of(picker.CLUSTER, CLUSTER, build_picker_cluster(address)))
            self.rebuilt += 1
        return self._picker[1]


def _capacity_key(svc: ModelService, live: int) -> int:
    # Only a live count above what the spec expects changes the breaker, so scaling within the spec's
    # bounds never touches the cluster (a cluster update makes Envoy re-warm it).
    return breaker_capacity(svc, live)
