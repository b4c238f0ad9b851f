"""Resource builders: clusters, CLAs, listener and routes, and the memo that rebuilds only what changed."""

from __future__ import annotations

import json

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import health_check_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2

from sie.spec_loader import parse_model_service
from xds_server.ingress import IngressConfig, build_listener, build_routes
from xds_server.policy.decisions import EndpointDecision, Health, ModelDecision
from xds_server.resources import (
    CLUSTER,
    ENDPOINT,
    LISTENER,
    ROUTE,
    ModelInputs,
    ResourceCache,
    build_cla,
    build_cluster,
    parse_endpoint_address,
)


def svc(name: str, **spec):
    doc = {"model": {"name": name}, "backend": {"type": "sim"}}
    doc.update(spec)
    return parse_model_service({"spec": doc})


def decision(model: str, *endpoints: tuple[str, str, int, Health], drop: float = 0.0) -> ModelDecision:
    return ModelDecision(model, {iid: EndpointDecision(addr, w, h) for iid, addr, w, h in endpoints}, drop)


# ---- routes -----------------------------------------------------------------------------------


def names(routes) -> list[str]:
    return [r.name for r in routes]


def test_route_order_header_path_body_then_lists_then_refusals_then_404():
    routes = build_routes([svc("b", model={"name": "b", "service_type": "scoring"}), svc("a")]).virtual_hosts[0].routes
    assert names(routes) == [
        "a.header/v1/chat/completions",
        "a.header/v1/completions",
        "a.header/generate",
        "b.header/infer",
        "a.path/v1/chat/completions",
        "a.path/v1/completions",
        "a.path/generate",
        "b.path/infer",
        "a.body/v1/chat/completions",
        "a.body/v1/completions",
        "a.body/generate",
        "b.body/infer",
        "models.list",
        "a.info",
        "b.info",
        *[
            f"{kind}{path}"
            for path in ("/generate", "/infer", "/v1/chat/completions", "/v1/completions")
            for kind in ("unknown_model", "invalid_json", "method")
        ],
        "a.method/v1/chat/completions",
        "a.method/v1/completions",
        "a.method/generate",
        "a.info.method",
        "b.method/infer",
        "b.info.method",
        "models.list.method",
        "not_found",
    ]


def test_each_route_kind_matches_what_it_should():
    routes = {
        r.name: r
        for r in build_routes([svc("scorer", model={"name": "scorer", "service_type": "scoring"})])
        .virtual_hosts[0]
        .routes
    }
    header = routes["scorer.header/infer"].match
    assert header.path == "/infer"
    assert [(h.name, h.string_match.exact) for h in header.headers] == [("x-sie-model", "scorer"), (":method", "POST")]
    path = routes["scorer.path/infer"]
    assert path.match.path == "/v1/models/scorer/infer" and path.route.prefix_rewrite == "/infer"
    body = routes["scorer.body/infer"].match
    assert body.path == "/infer" and [(h.name, h.string_match.exact) for h in body.headers] == [(":method", "POST")]
    meta = body.dynamic_metadata[0]
    assert (meta.filter, meta.path[0].key, meta.value.string_match.exact) == ("sie", "model", "scorer")
    assert {r.route.cluster for n, r in routes.items() if r.HasField("route")} == {"model.scorer"}
    # Nothing but the model's inference paths is ever routed to it: every route is an exact path.
    assert all(r.match.path for r in routes.values() if r.HasField("route"))


def test_a_spec_can_add_an_inference_path_but_never_reach_anything_else():
    extra = svc("r", model={"name": "r", "service_type": "scoring"}, routing={"inference_paths": ["/v1/rerank"]})
    routed = {r.match.path for r in build_routes([extra]).virtual_hosts[0].routes if r.HasField("route")}
    assert routed == {"/infer", "/v1/rerank", "/v1/models/r/infer", "/v1/models/r/v1/rerank"}


@pytest.mark.parametrize(
    "name, status, kind",
    [
        ("unknown_model/infer", 404, "model_not_found"),
        ("invalid_json/infer", 400, "invalid_json"),
        ("method/infer", 405, "method_not_allowed"),
        ("a.info.method", 405, "method_not_allowed"),
        ("not_found", 404, "not_found"),
    ],
)
def test_refusals_are_json_naming_what_was_wrong(name, status, kind):
    routes = {
        r.name: r
        for r in build_routes([svc("b"), svc("a", model={"name": "a", "service_type": "scoring"})])
        .virtual_hosts[0]
        .routes
    }
    route = routes[name]
    assert route.direct_response.status == status
    body = json.loads(route.direct_response.body.inline_string)
    assert body["error"]["type"] == kind and body["error"]["message"]
    headers = {h.header.key: h.header.value for h in route.response_headers_to_add}
    assert headers["content-type"] == "application/json"
    if status == 405:
        assert headers["allow"] in ("POST", "GET")
    if kind in ("model_not_found", "not_found"):
        assert body["error"]["known_models"] == ["a", "b"]


def test_the_model_list_is_openai_shaped_and_get_only():
    route = next(r for r in build_routes([svc("a")]).virtual_hosts[0].routes if r.name == "models.list")
    assert route.match.path == "/v1/models"
    assert route.match.headers[0].name == ":method" and route.match.headers[0].string_match.exact == "GET"
    body = json.loads(route.direct_response.body.inline_string)
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["a"]


@pytest.mark.parametrize(
    ("sla", "seconds"),
    [
        ({}, 15.0),  # the 15 s floor
        ({"p99_latency_ms": 5000, "max_queue_time_ms": 1000}, 51.0),  # 10 x p99 + queue
        ({"request_timeout_ms": 120000}, 120.0),  # explicit
        ({"request_timeout_ms": 2500}, 2.5),
    ],
)
def test_route_timeout_comes_from_the_sla(sla, seconds):
    route = build_routes([svc("a", sla=sla)]).virtual_hosts[0].routes[1].route
    assert route.timeout.seconds + route.timeout.nanos / 1e9 == seconds


@pytest.mark.parametrize(
    "retry_on_loss, expected",
    [
        (True, {"connect-failure", "refused-stream", "reset-before-request", "retriable-headers", "reset"}),
        (False, {"connect-failure", "refused-stream", "reset-before-request", "retriable-headers"}),
    ],
)
def test_retries_only_what_the_worker_never_answered_on_another_host(retry_on_loss, expected):
    spec = svc("a", routing={"retry_on_worker_loss": retry_on_loss})
    policy = build_routes([spec]).virtual_hosts[0].routes[1].route.retry_policy
    assert set(policy.retry_on.split(",")) == expected
    assert policy.num_retries.value == 2 and policy.host_selection_retry_max_attempts >= 10
    assert policy.retry_host_predicate[0].name == "envoy.retry_host_predicates.previous_hosts"
    header = policy.retriable_headers[0]
    assert (header.name, header.string_match.exact) == ("x-sie-retryable", "true")


def test_listener_reads_the_body_model_before_routing():
    listener = build_listener(IngressConfig("127.0.0.1", 8123))
    assert listener.address.socket_address.port_value == 8123
    manager = http_connection_manager_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert manager.rds.route_config_name == "ingress_routes" and manager.rds.config_source.HasField("ads")
    assert [f.name for f in manager.http_filters] == [
        "envoy.filters.http.json_to_metadata",
        "envoy.filters.http.buffer",
        "envoy.filters.http.router",
    ]
    with_picker = http_connection_manager_pb2.HttpConnectionManager()
    build_listener(IngressConfig(picker="127.0.0.1:18001")).filter_chains[0].filters[0].typed_config.Unpack(with_picker)
    names = [f.name for f in with_picker.http_filters]
    assert names[-2:] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]  # after the buffer
    assert with_picker.http_filters[-2].disabled, "off but on the routes of models with prefix affinity"
    j2m = json_to_metadata_pb2.JsonToMetadata()
    manager.http_filters[0].typed_config.Unpack(j2m)
    rule = j2m.request_rules.rules[0]
    assert rule.selectors[0].key == "model"
    assert (rule.on_present.metadata_namespace, rule.on_present.key) == ("sie", "model")
    assert rule.on_missing.value.string_value == "-"  # a JSON body without a model re-routes too


def test_the_listener_normalises_paths_and_bounds_slow_clients():
    manager = http_connection_manager_pb2.HttpConnectionManager()
    build_listener(IngressConfig()).filter_chains[0].filters[0].typed_config.Unpack(manager)
    assert manager.normalize_path.value and manager.merge_slashes
    assert manager.path_with_escaped_slashes_action == manager.UNESCAPE_AND_FORWARD
    assert manager.request_headers_timeout.seconds == 10 and manager.request_timeout.seconds == 60
    assert manager.common_http_protocol_options.max_requests_per_connection.value == 10_000
    assert manager.http2_protocol_options.max_concurrent_streams.value == 100


# ---- clusters and endpoints -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resources", "sla", "live", "cap"),
    [
        ({"max_concurrent_requests": 10}, {}, 0, 20),  # 1 instance x 10 x 2
        ({"max_concurrent_requests": 10}, {"min_replicas": 2, "max_replicas": 3}, 1, 60),  # max_replicas
        ({"max_concurrent_requests": 10}, {"max_replicas": 3}, 5, 100),  # more live than the spec says
    ],
)
def test_circuit_breakers_scale_with_instances_and_leave_queue_headroom(resources, sla, live, cap):
    cluster = build_cluster(svc("a", resources=resources, sla=sla), live)
    t = cluster.circuit_breakers.thresholds[0]
    assert (t.max_requests.value, t.max_pending_requests.value) == (cap, cap)
    # Idle keep-alive connections count against max_connections: room for as many again.
    assert t.max_connections.value == 2 * cap


def test_cluster_is_eds_over_ads_least_request_and_never_panics():
    cluster = build_cluster(svc("a", routing={"prefix_affinity": {"enabled": False}}), 1)
    assert cluster.name == "model.a"
    assert cluster.type == cluster_pb2.Cluster.EDS and cluster.eds_cluster_config.eds_config.HasField("ads")
    assert cluster.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert cluster.common_lb_config.healthy_panic_threshold.value == 0
    assert cluster.connect_timeout.seconds == 1
    assert cluster.outlier_detection.enforcing_consecutive_5xx.value == 0  # a model's own 500s never eject
    assert cluster.outlier_detection.consecutive_local_origin_failure.value > 0
    assert "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in cluster.typed_extension_protocol_options


def test_cla_maps_health_and_weights():
    cla = build_cla(
        "a", decision("a", ("a-1", "127.0.0.1:9001", 0, Health.DRAINING), ("a-0", "127.0.0.1:9000", 70, Health.HEALTHY))
    )
    eps = cla.endpoints[0].lb_endpoints
    assert [e.endpoint.hostname for e in eps] == ["a-0", "a-1"]
    assert [e.endpoint.address.socket_address.port_value for e in eps] == [9000, 9001]
    assert [e.health_status for e in eps] == [health_check_pb2.HEALTHY, health_check_pb2.DRAINING]
    assert [e.load_balancing_weight.value for e in eps] == [70, 1]  # Envoy needs >= 1


@pytest.mark.parametrize(
    ("percent", "per_million"), [(0.0, None), (12.5, 125_000), (100.0, 1_000_000), (150.0, 1_000_000)]
)
def test_drop_overloads(percent, per_million):
    cla = build_cla("a", decision("a", ("a-0", "127.0.0.1:9000", 100, Health.HEALTHY), drop=percent))
    drops = cla.policy.drop_overloads
    if per_million is None:
        assert len(drops) == 0
    else:
        assert drops[0].category == "sie_overload" and drops[0].drop_percentage.numerator == per_million
    # Envoy applies a drop change only with a host change: the endpoints carry it in their metadata.
    meta = cla.endpoints[0].lb_endpoints[0].metadata.filter_metadata["sie"]
    assert meta["drop_per_million"] == (per_million or 0)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("[::1]:9000", ("::1", 9000)),
        ("localhost:9000", ValueError),
        ("127.0.0.1", ValueError),
        ("127.0.0.1:0", ValueError),
        ("127.0.0.1:x", ValueError),
        ("127.0.0.1:\u00b2", ValueError),  # a Unicode digit: isdigit() takes it, int() does not
        ("127.0.0.1:\u0663", ValueError),  # Arabic-Indic 3: int() reads it, no client sends it
        ("[fe80::1%nosuchif]:9004", ValueError),  # Envoy NACKs a zone its host lacks: the whole EDS response
        ("[fe80::1%lo]:9004", ValueError),  # and takes this one only where Envoy's host has `lo`
    ],
)
def test_parse_endpoint_address(address, expected):
    if expected is ValueError:
        with pytest.raises(ValueError):
            parse_endpoint_address(address)
    else:
        assert parse_endpoint_address(address) == expected


# ---- the memo ---------------------------------------------------------------------------------


def test_the_cache_rebuilds_only_what_changed():
    a, b = svc("a"), svc("b")
    da = decision("a", ("a-0", "127.0.0.1:9000", 100, Health.HEALTHY))
    db = decision("b", ("b-0", "127.0.0.1:9100", 100, Health.HEALTHY))
    cache, ingress = ResourceCache(), IngressConfig()
    first = cache.build({"a": ModelInputs(a, da), "b": ModelInputs(b, db)}, ingress)
    assert cache.rebuilt == 6  # 2 clusters, 2 CLAs, routes, listener
    again = cache.build({"a": ModelInputs(a, da), "b": ModelInputs(b, db)}, ingress)
    assert cache.rebuilt == 0 and again == first

    da2 = decision("a", ("a-0", "127.0.0.1:9000", 40, Health.HEALTHY))
    third = cache.build({"a": ModelInputs(a, da2), "b": ModelInputs(b, db)}, ingress)
    assert cache.rebuilt == 1
    changed = {(t, n) for t in third for n in third[t] if third[t][n].version != first[t][n].version}
    assert changed == {(ENDPOINT, "model.a")}

    a2 = svc("a", sla={"request_timeout_ms": 1000})
    fourth = cache.build({"a": ModelInputs(a2, da2), "b": ModelInputs(b, db)}, ingress)
    assert cache.rebuilt == 2  # a's cluster and the routes
    assert fourth[CLUSTER]["model.a"].version == third[CLUSTER]["model.a"].version  # same content
    assert fourth[ROUTE]["ingress_routes"].version != third[ROUTE]["ingress_routes"].version


def test_a_retiring_model_keeps_its_cluster_but_loses_its_routes():
    cache = ResourceCache()
    out = cache.build(
        {"a": ModelInputs(svc("a"), decision("a"), routed=False), "b": ModelInputs(svc("b"), decision("b"))},
        IngressConfig(),
    )
    assert set(out[CLUSTER]) == {"model.a", "model.b"} and set(out[ENDPOINT]) == {"model.a", "model.b"}
    assert out[ROUTE]["ingress_routes"].refs == ((CLUSTER, "model.b"),)
    assert set(out[LISTENER]) == {"ingress"}


def test_a_model_with_prefix_affinity_is_picked_by_the_picker_with_least_request_to_fall_back_on():
    chat = svc("chat", routing={"prefix_affinity": {"balance_factor": 1.25}})
    scorer = svc("score", model={"name": "score", "service_type": "scoring"})
    assert chat.spec.prefix_affinity and not scorer.spec.prefix_affinity
    cluster = build_cluster(chat, 2)
    (policy,) = cluster.load_balancing_policy.policies
    assert policy.typed_extension_config.name == "envoy.load_balancing_policies.override_host"
    assert list(cluster.common_lb_config.override_host_status.statuses) == [health_check_pb2.HEALTHY]
    assert cluster.common_lb_config.healthy_panic_threshold.value == 0  # draining hosts still get nothing
    assert build_cluster(scorer, 2).lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert build_cluster(chat, 2, affinity=False).lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    routes = build_routes([chat, scorer])
    by_name = {r.name: r for r in routes.virtual_hosts[0].routes}
    assert "envoy.filters.http.ext_proc" in by_name["chat.body/v1/chat/completions"].typed_per_filter_config
    assert "envoy.filters.http.ext_proc" not in by_name["score.body/infer"].typed_per_filter_config
    baseline = {r.name: r for r in build_routes([chat], affinity=False).virtual_hosts[0].routes}
    assert not baseline["chat.body/v1/chat/completions"].typed_per_filter_config
