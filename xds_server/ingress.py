"""The ingress Listener and its RouteConfiguration (pure builders of Envoy protos).

The ingress is public (DESIGN §10), so it serves the public inference API and nothing else:

- per model, `POST` on the inference paths of its service type (sie.spec.INFERENCE_PATHS: chat and
  completions and SGLang's /generate for LLMs, /infer for scorers, /v1/embeddings for embedders) plus the
  spec's routing.inference_paths, which can never name a control path;
- `GET /v1/models` and `GET /v1/models/<id>`, answered by Envoy itself;
- every other path a JSON 404, every other method on a known path a JSON 405 (with Allow), answered
  by Envoy: nothing else ever reaches a sidecar, whichever way the model was named.

Before any route matches, Envoy normalises the path (RFC 3986 `normalize_path`, `merge_slashes`, and
escaped slashes unescaped, `%2F` -> `/`), and routes match whole paths exactly, so no spelling
(`/v1//chat/completions`, `/x/../-/drain`, `/%2D/drain`, a trailing `;`) gets around a rule.

How a request finds its model (first match wins, so a request that names its model twice is routed by
the more explicit spelling):

  1. header `x-sie-model: <id>`, on one of the model's paths    -> model.<id>
  2. path `/v1/models/<id><path>`                              -> model.<id>, rewritten to `<path>`
  3. JSON body `"model": "<id>"`, on one of the model's paths    -> model.<id>   (json_to_metadata)
  4. `GET /v1/models`, `GET /v1/models/<id>`                    -> 200, the OpenAI-style model list / object
  5. an inference path whose body names no known model          -> 404 model_not_found, naming the known ones
     ... whose body is not JSON                                  -> 400 invalid_json
     ... with another method than POST                           -> 405
  6. anything else                                              -> 404 not_found

Body routing: json_to_metadata buffers a JSON body and copies its top-level `model` into the dynamic
metadata namespace `sie` (key `model`); a body without one gets the placeholder "-". Either way the
filter clears the route cache, so the router matches again with the metadata present. A body that is
not JSON sets no metadata and so clears nothing: the route chosen when the headers arrived stands,
which for an inference path is rule 5's 400 `invalid_json` (verified on Envoy 1.40 by
tests/integration/test_xds_envoy.py and tests/security/).

Slow or stuck clients cannot hold capacity (DESIGN §10): the buffer filter makes the router, and so a
circuit-breaker slot, see a request only once its whole body has arrived; `request_headers_timeout`
and `request_timeout` bound how long the headers and the whole request may take to arrive (408);
idle connections close; each connection carries a bounded number of requests and streams, and the
bootstrap bounds the connections Envoy holds at all (bootstrap.py).

Envoy's own answers are SIE's JSON error: shed requests (EDS drop_overloads, response flag DO/UDO) get
503 `overloaded` with Retry-After, naming the model through the cluster's metadata (resources.py stamps
`sie.model` on every model cluster); a full circuit breaker, no healthy instance, an upstream failure,
a timeout, a body or headers too large, a request too slow to arrive, a malformed request each get
their own type (see `local_replies`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.buffer.v3 import buffer_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2 as j2m
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2 as early_header_mutation_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2, value_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2

from sie.cluster import IngressLimits
from sie.errors import error_body
from sie.spec import ModelService
from xds_server.picker import protocol as picker
from xds_server.policy.decisions import MAX_WEIGHT, MIN_WEIGHT

LISTENER_NAME = "ingress"
ROUTE_CONFIG_NAME = "ingress_routes"
MODEL_HEADER = "x-sie-model"
RETRYABLE_HEADER = "x-sie-retryable"
METADATA_NAMESPACE = "sie"
METADATA_KEY = "model"
NO_MODEL = "-"  # json_to_metadata's value for a JSON body without "model" (not a model id: ids are DNS labels)
# Retry only what the worker never saw: a refused or failed connection, a reset before the request was
# sent, or an answer the sidecar marked retryable (draining, worker down). Never a model's own error.
RETRY_ON = "connect-failure,refused-stream,reset-before-request,retriable-headers"
# With routing.retry_on_worker_loss (the default), also a connection reset before any response header
# (a sidecar that died mid-request): inference has no side effects, and Envoy retries only while
# nothing of the answer has gone to the client.
RETRY_ON_WORKER_LOSS = RETRY_ON + ",reset"
NUM_RETRIES = 2
# previous_hosts makes a retry pick another instance; each pick that lands on a tried host is redrawn,
# up to this many times. Envoy picks among unequal weights by EDF in proportion to weight/(active+1), so
# a tried host at MAX_WEIGHT with a few requests active outdraws an untried one at the floor by up to
# MAX_WEIGHT/MIN_WEIGHT to one: 10 redraws left a retry on the instance whose worker had just died
# (tests/security/test_worker_loss.py), while 2 * MAX_WEIGHT redraws reach any untried host under EDF.
# A redraw is one LB pick (microseconds) and happens only on a retry.
HOST_SELECTION_ATTEMPTS = 2 * MAX_WEIGHT // MIN_WEIGHT
# Envoy's response flags for a request dropped by EDS drop_overloads (RESPONSE_FLAGS in the access log):
# DO (DropOverLoad) below 100%, UDO (UnconditionalDropOverload, body "unconditional drop overload") at
# 100%, as seen on Envoy 1.40.
DROP_OVERLOAD_FLAGS = ("DO", "UDO")
SHED_RETRY_AFTER_S = 1
# Clients often POST JSON without a content type, or with curl's default form type.
BODY_CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "application/json;charset=utf-8",
    "application/json; charset=UTF-8",
    "application/x-www-form-urlencoded",
    "text/plain",
    "text/plain; charset=utf-8",
)


@dataclass(frozen=True)
class IngressConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # Timeouts and bounds per client (sie.cluster.IngressLimits: the Cluster document's `ingress`).
    limits: IngressLimits = IngressLimits()
    # host:port of the endpoint picker (xds_server/picker) for models with prefix affinity; None: none runs,
    # and every model is balanced by load alone.
    picker: str | None = None


def cluster_name(model_id: str) -> str:
    return f"model.{model_id}"


def canary_cluster_name(model_id: str) -> str:
    """The cluster of a model's new build during a rollout. Clusters are named by role, not build: after
    a rollout `model.<id>` holds the promoted build, so routes, shedding and dashboards keep their names."""
    return f"model.{model_id}.canary"


def ads_config_source() -> config_source_pb2.ConfigSource:
    """'Over ADS', as a ConfigSource: every dynamic resource comes on the one aggregated stream."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.ApiVersion.V3
    )


def typed(msg) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(msg)
    return out


def _seconds(value: float) -> duration_pb2.Duration:
    whole = int(value)
    return duration_pb2.Duration(seconds=whole, nanos=int(round((value - whole) * 1e9)))


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _mapper(
    filter_: accesslog_pb2.AccessLogFilter,
    kind: str,
    message: str,
    *,
    status: int | None = None,
    retry_after: bool = False,
    **context: Any,
) -> hcm.ResponseMapper:
    body = struct_pb2.Struct()
    body.update(error_body(kind, message, **context))
    mapper = hcm.ResponseMapper(
        filter=filter_,
        body_format_override=substitution_format_string_pb2.SubstitutionFormatString(json_format=body),
        headers_to_add=[_header("retry-after", str(SHED_RETRY_AFTER_S))] if retry_after else [],
    )
    if status is not None:
        mapper.status_code.value = status
    return mapper


def _flags(*flags: str) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=list(flags)))


def _status(code: int) -> accesslog_pb2.AccessLogFilter:
    return accesslog_pb2.AccessLogFilter(
        status_code_filter=accesslog_pb2.StatusCodeFilter(
            comparison=accesslog_pb2.ComparisonFilter(
                op=accesslog_pb2.ComparisonFilter.EQ,
                value=base_pb2.RuntimeUInt32(default_value=code, runtime_key="sie.unused"),
            )
        )
    )


def local_replies() -> hcm.LocalReplyConfig:
    """Envoy's own answers as SIE's JSON error. Only local replies are rewritten, never a sidecar's; a
    direct response (the routes' 404/405/400, which are already SIE's JSON) carries no response flag and
    no status below, so no mapper touches it."""
    model = f"%CLUSTER_METADATA({METADATA_NAMESPACE}:{METADATA_KEY})%"
    return hcm.LocalReplyConfig(
        mappers=[
            _mapper(
                _flags(*DROP_OVERLOAD_FLAGS),
                "overloaded",
                f"model {model} is overloaded: Envoy's drop overload "
                "shed this request to protect higher-priority traffic; retry later",
                status=503,
                retry_after=True,
                model=model,
                retry_after_s=SHED_RETRY_AFTER_S,
            ),
            _mapper(
                _flags("UO"),
                "overloaded",
                f"model {model} has as many requests in flight as its instances can "
                "take (circuit breaker); retry later",
                status=503,
                retry_after=True,
                model=model,
                retry_after_s=SHED_RETRY_AFTER_S,
            ),
            _mapper(
                _flags("UH"),
                "no_instance",
                f"model {model} has no instance ready to serve right now; retry later",
                status=503,
                retry_after=True,
                model=model,
                retry_after_s=SHED_RETRY_AFTER_S,
            ),
            _mapper(
                _flags("UT"),
                "timeout",
                f"model {model} did not answer within its request timeout (sla.request_timeout_ms)",
                status=504,
                model=model,
            ),
            _mapper(
                _flags("UF", "URX", "UC", "UR", "LR", "UPE", "UMSDR"),
                "upstream_unavailable",
                f"no instance of model {model} could take the request (%RESPONSE_FLAGS%); retry later",
                status=503,
                retry_after=True,
                model=model,
            ),
            _mapper(_flags("DPE"), "bad_request", "the request is not valid HTTP: %LOCAL_REPLY_BODY%", status=400),
            _mapper(_status(413), "body_too_large", "the request body is larger than the ingress accepts"),
            _mapper(
                _status(408),
                "request_timeout",
                "the request did not arrive in time (%LOCAL_REPLY_BODY%): send the headers and the whole body promptly",
            ),
            _mapper(_status(431), "headers_too_large", "the request headers are larger than the ingress accepts"),
            _mapper(_flags(), "proxy_error", "%LOCAL_REPLY_BODY% (%RESPONSE_FLAGS%)", flags="%RESPONSE_FLAGS%"),
        ]
    )


def build_listener(cfg: IngressConfig) -> listener_pb2.Listener:
    body_rule = j2m.JsonToMetadata.Rule(
        selectors=[j2m.JsonToMetadata.Selector(key=METADATA_KEY)],
        on_present=j2m.JsonToMetadata.KeyValuePair(
            metadata_namespace=METADATA_NAMESPACE, key=METADATA_KEY, type=j2m.JsonToMetadata.STRING
        ),
        # Not a model id: a JSON body without "model" still clears the route cache (see the docstring).
        on_missing=j2m.JsonToMetadata.KeyValuePair(
            metadata_namespace=METADATA_NAMESPACE, key=METADATA_KEY, value=struct_pb2.Value(string_value=NO_MODEL)
        ),
    )
    manager = hcm.HttpConnectionManager(
        stat_prefix=LISTENER_NAME,
        codec_type=hcm.HttpConnectionManager.AUTO,
        rds=hcm.Rds(config_source=ads_config_source(), route_config_name=ROUTE_CONFIG_NAME),
        local_reply_config=local_replies(),
        normalize_path={"value": True},
        merge_slashes=True,
        path_with_escaped_slashes_action=hcm.HttpConnectionManager.UNESCAPE_AND_FORWARD,
        request_headers_timeout=_seconds(cfg.limits.request_headers_timeout_s),
        request_timeout=_seconds(cfg.limits.request_timeout_s),
        stream_idle_timeout=_seconds(cfg.limits.stream_idle_timeout_s),
        max_request_headers_kb={"value": cfg.limits.max_request_headers_kb},
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(
            idle_timeout=_seconds(cfg.limits.idle_connection_timeout_s),
            max_requests_per_connection={"value": cfg.limits.max_requests_per_connection},
            headers_with_underscores_action=protocol_pb2.HttpProtocolOptions.REJECT_REQUEST,
        ),
        http2_protocol_options=protocol_pb2.Http2ProtocolOptions(
            max_concurrent_streams={"value": cfg.limits.max_concurrent_streams},
        ),
        early_header_mutation_extensions=[_early_removals()],
        http_filters=[
            hcm.HttpFilter(
                name="envoy.filters.http.json_to_metadata",
                typed_config=typed(
                    j2m.JsonToMetadata(
                        request_rules=j2m.JsonToMetadata.MatchRules(
                            rules=[body_rule],
                            allow_content_types=list(BODY_CONTENT_TYPES),
                            allow_empty_content_type=True,
                        )
                    )
                ),
            ),
            # The whole body before the router: a circuit-breaker slot is taken only for a complete request.
            hcm.HttpFilter(
                name="envoy.filters.http.buffer",
                typed_config=typed(buffer_pb2.Buffer(max_request_bytes={"value": cfg.limits.max_body_bytes})),
            ),
            *([_picker_filter()] if cfg.picker else []),
            hcm.HttpFilter(name="envoy.filters.http.router", typed_config=typed(router_pb2.Router())),
        ],
    )
    return listener_pb2.Listener(
        name=LISTENER_NAME,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=cfg.host, port_value=cfg.port)),
        per_connection_buffer_limit_bytes={"value": cfg.limits.max_body_bytes},
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(
                        name="envoy.filters.network.http_connection_manager", typed_config=typed(manager)
                    )
                ]
            )
        ],
    )


def _early_removals() -> extension_pb2.TypedExtensionConfig:
    """Headers no client may send, removed before routing and before any filter sees them: the endpoint
    picker's answer (a client could otherwise choose the instance)."""
    removal = mutation_rules_pb2.HeaderMutation(remove=picker.HEADER)
    return extension_pb2.TypedExtensionConfig(
        name="envoy.http.early_header_mutation.header_mutation",
        typed_config=typed(early_header_mutation_pb2.HeaderMutation(mutations=[removal])),
    )


def _picker_filter() -> hcm.HttpFilter:
    """The endpoint picker's ext_proc filter, off by default: the routes of models with prefix affinity turn
    it on (`_model_route`). It sends the buffered body and the cluster the route chose; the pick comes
    back as the header x-sie-endpoint for the cluster's override_host policy (a client's own is removed
    before any filter, `_early_removals`). A picker that is down or slower than MESSAGE_TIMEOUT_S is
    passed by (failure_mode_allow): the request is balanced by least request."""
    mode = processing_mode_pb2.ProcessingMode
    return hcm.HttpFilter(
        name=picker.FILTER,
        disabled=True,
        typed_config=typed(
            ext_proc_pb2.ExternalProcessor(
                grpc_service=grpc_service_pb2.GrpcService(
                    envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=picker.CLUSTER),
                    timeout=_seconds(picker.MESSAGE_TIMEOUT_S),
                ),
                # Headers are sent (and held) so the pick, made on the body, can still set a header.
                processing_mode=mode(
                    request_header_mode=mode.SEND,
                    request_body_mode=mode.BUFFERED,
                    response_header_mode=mode.SEND,
                    response_body_mode=mode.NONE,
                    request_trailer_mode=mode.SKIP,
                    response_trailer_mode=mode.SKIP,
                ),
                request_attributes=[picker.CLUSTER_ATTRIBUTE],
                message_timeout=_seconds(picker.MESSAGE_TIMEOUT_S),
                failure_mode_allow=True,
            )
        ),
    )


def _direct(status: int, body: dict, **headers: str) -> dict:
    return {
        "direct_response": rc.DirectResponseAction(
            status=status, body=base_pb2.DataSource(inline_string=json.dumps(body, sort_keys=True))
        ),
        "response_headers_to_add": [
            _header("content-type", "application/json"),
            *(_header(k.replace("_", "-"), v) for k, v in headers.items()),
        ],
    }


def _exact(value: str) -> string_pb2.StringMatcher:
    return string_pb2.StringMatcher(exact=value)


def _method(name: str) -> rc.HeaderMatcher:
    return rc.HeaderMatcher(name=":method", string_match=_exact(name))


def _body_model(value: str | None) -> metadata_pb2.MetadataMatcher:
    """The body named this model (or, with None, any: the key is present)."""
    matcher = (
        value_pb2.ValueMatcher(present_match=True)
        if value is None
        else value_pb2.ValueMatcher(string_match=_exact(value))
    )
    return metadata_pb2.MetadataMatcher(
        filter=METADATA_NAMESPACE, path=[metadata_pb2.MetadataMatcher.PathSegment(key=METADATA_KEY)], value=matcher
    )


def _retry_policy(svc: ModelService) -> rc.RetryPolicy:
    return rc.RetryPolicy(
        retry_on=RETRY_ON_WORKER_LOSS if svc.spec.routing.retry_on_worker_loss else RETRY_ON,
        num_retries={"value": NUM_RETRIES},
        retry_host_predicate=[
            rc.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=typed(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=HOST_SELECTION_ATTEMPTS,
        retriable_headers=[rc.HeaderMatcher(name=RETRYABLE_HEADER, string_match=_exact("true"))],
    )


def _to_model(svc: ModelService, prefix_rewrite: str = "", canary_share: int | None = None) -> rc.RouteAction:
    """The model's route action: its cluster, or during a rollout its two clusters weighted by share
    (Envoy draws one per request, so each step moves exactly its share; retries stay in the drawn one)."""
    common: dict = {
        "timeout": _seconds(svc.spec.sla.route_timeout_ms / 1000.0),
        "retry_policy": _retry_policy(svc),
        "prefix_rewrite": prefix_rewrite,
    }
    if canary_share is None or canary_share <= 0:
        return rc.RouteAction(cluster=cluster_name(svc.model_id), **common)
    if canary_share >= 100:
        return rc.RouteAction(cluster=canary_cluster_name(svc.model_id), **common)
    split = rc.WeightedCluster(
        clusters=[
            rc.WeightedCluster.ClusterWeight(name=cluster_name(svc.model_id), weight={"value": 100 - canary_share}),
            rc.WeightedCluster.ClusterWeight(name=canary_cluster_name(svc.model_id), weight={"value": canary_share}),
        ]
    )
    return rc.RouteAction(weighted_clusters=split, **common)


def _model_route(
    svc: ModelService,
    name: str,
    match: rc.RouteMatch,
    shares: Mapping[str, int],
    affinity: bool,
    rewrite: str = "",
) -> rc.Route:
    """One of a model's inference routes; with prefix affinity, the endpoint picker is on for it."""
    route = rc.Route(name=name, match=match, route=_to_model(svc, rewrite, canary_share=shares.get(svc.model_id)))
    if affinity and svc.spec.prefix_affinity:
        _picker_on(route)
    return route


def _picker_on(route: rc.Route) -> None:
    """Turn the endpoint picker's filter (off by default in the listener) on for this route."""
    on = ext_proc_pb2.ExtProcPerRoute(overrides=ext_proc_pb2.ExtProcOverrides())
    route.typed_per_filter_config[picker.FILTER].CopyFrom(typed(on))


def routed_clusters(model_id: str, canary_share: int | None) -> tuple[str, ...]:
    """The clusters a model's routes name (what they must find in CDS)."""
    if canary_share is None or canary_share <= 0:
        return (cluster_name(model_id),)
    if canary_share >= 100:
        return (canary_cluster_name(model_id),)
    return (cluster_name(model_id), canary_cluster_name(model_id))


def model_object(svc: ModelService, state: str = "serving") -> dict:
    """One entry of the OpenAI-style model list (`created` is fixed so the route content is stable).
    `state` says whether it serves now; a model at zero is listed "asleep" and its first request wakes it."""
    info = svc.spec.model
    return {
        "state": state,
        "id": svc.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "sie",
        "version": info.version,
        "service_type": info.service_type.value,
        "priority_level": info.priority_level.value,
        "paths": list(svc.spec.inference_paths),
    }


def build_routes(
    services: Sequence[ModelService],
    splits: Mapping[str, int] | None = None,
    states: Mapping[str, str] | None = None,
    affinity: bool = True,
) -> route_pb2.RouteConfiguration:
    """`splits`: model id -> the new build's share (percent) for models in a rollout; `states`: model
    id -> its state in the model list (default serving); `affinity` False: no model gets prefix affinity
    (a baseline), else those whose spec asks (ModelServiceSpec.prefix_affinity)."""
    states = states or {}
    services = sorted(services, key=lambda s: s.model_id)
    shares = splits or {}
    ids = [s.model_id for s in services]
    paths = sorted({p for s in services for p in s.spec.inference_paths})
    post = [_method("POST")]
    routes: list[rc.Route] = []
    picked_paths = {p for s in services if affinity and s.spec.prefix_affinity for p in s.spec.inference_paths}
    for svc in services:
        header = rc.HeaderMatcher(name=MODEL_HEADER, string_match=_exact(svc.model_id))
        for path in svc.spec.inference_paths:
            routes.append(
                _model_route(
                    svc,
                    f"{svc.model_id}.header{path}",
                    rc.RouteMatch(path=path, headers=[header, *post]),
                    shares,
                    affinity,
                )
            )
    for svc in services:
        for path in svc.spec.inference_paths:
            match = rc.RouteMatch(path=f"/v1/models/{svc.model_id}{path}", headers=post)
            routes.append(_model_route(svc, f"{svc.model_id}.path{path}", match, shares, affinity, rewrite=path))
    for svc in services:
        for path in svc.spec.inference_paths:
            match = rc.RouteMatch(path=path, headers=post, dynamic_metadata=[_body_model(svc.model_id)])
            routes.append(_model_route(svc, f"{svc.model_id}.body{path}", match, shares, affinity))
    get = [_method("GET")]
    routes.append(
        rc.Route(
            name="models.list",
            match=rc.RouteMatch(path="/v1/models", headers=get),
            **_direct(
                200, {"object": "list", "data": [model_object(s, states.get(s.model_id, "serving")) for s in services]}
            ),
        )
    )
    for svc in services:
        routes.append(
            rc.Route(
                name=f"{svc.model_id}.info",
                match=rc.RouteMatch(path=f"/v1/models/{svc.model_id}", headers=get),
                **_direct(200, model_object(svc, states.get(svc.model_id, "serving"))),
            )
        )
    not_found_model = error_body(
        "model_not_found",
        f"no model matches this request: name one of the known models in the JSON body field 'model', the "
        f"header '{MODEL_HEADER}', or the path /v1/models/<id>/...",
        known_models=ids,
    )
    invalid_json = error_body(
        "invalid_json",
        "the body is not a JSON object (send Content-Type: application/json and a JSON body naming the model "
        f"in 'model'), or name the model in the header '{MODEL_HEADER}' or the path /v1/models/<id>/...",
    )
    for path in paths:
        routes.append(
            rc.Route(
                name=f"unknown_model{path}",
                match=rc.RouteMatch(path=path, headers=post, dynamic_metadata=[_body_model(None)]),
                **_direct(404, not_found_model),
            )
        )
        fallback = rc.Route(
            name=f"invalid_json{path}", match=rc.RouteMatch(path=path, headers=post), **_direct(400, invalid_json)
        )
        if path in picked_paths:
            # A request routed by its body matches this route when its headers arrive (the body, not yet
            # read, is what names its model), and that is when Envoy decides whether a filter runs: the
            # picker is on here for the paths of models with prefix affinity, and gets the model's cluster
            # once the body has routed the request (it answers a request for any other cluster with no pick).
            _picker_on(fallback)
        routes.append(fallback)
        routes.append(
            rc.Route(
                name=f"method{path}",
                match=rc.RouteMatch(path=path),
                **_direct(405, error_body("method_not_allowed", f"{path} takes POST"), allow="POST"),
            )
        )
    for svc in services:
        for path in svc.spec.inference_paths:
            routes.append(
                rc.Route(
                    name=f"{svc.model_id}.method{path}",
                    match=rc.RouteMatch(path=f"/v1/models/{svc.model_id}{path}"),
                    **_direct(
                        405,
                        error_body("method_not_allowed", f"/v1/models/{svc.model_id}{path} takes POST"),
                        allow="POST",
                    ),
                )
            )
        routes.append(
            rc.Route(
                name=f"{svc.model_id}.info.method",
                match=rc.RouteMatch(path=f"/v1/models/{svc.model_id}"),
                **_direct(405, error_body("method_not_allowed", f"/v1/models/{svc.model_id} takes GET"), allow="GET"),
            )
        )
    routes.append(
        rc.Route(
            name="models.list.method",
            match=rc.RouteMatch(path="/v1/models"),
            **_direct(405, error_body("method_not_allowed", "/v1/models takes GET"), allow="GET"),
        )
    )
    routes.append(
        rc.Route(
            name="not_found",
            match=rc.RouteMatch(prefix="/"),
            **_direct(
                404,
                error_body(
                    "not_found",
                    "the ingress serves models' inference APIs only: POST "
                    + ", ".join(paths or ["(no model yet)"])
                    + " (naming the model in the body, the x-sie-model header or /v1/models/<id>/<path>), and GET /v1/models",
                    known_models=ids,
                ),
            ),
        )
    )
    # Envoy refuses a whole RouteConfiguration whose direct_response bodies exceed 4096 bytes unless the
    # limit is raised; the model list and the 404 carry every model id, so with ~30 models they do.
    largest = max(
        (len(r.direct_response.body.inline_string.encode()) for r in routes if r.HasField("direct_response")), default=0
    )
    return route_pb2.RouteConfiguration(
        name=ROUTE_CONFIG_NAME,
        virtual_hosts=[rc.VirtualHost(name="sie", domains=["*"], routes=routes)],
        max_direct_response_body_size_bytes=wrappers_pb2.UInt32Value(value=max(4096, largest)),
    )
