"""The ingress Listener and its RouteConfiguration (pure builders of Envoy protos).

How a request finds its model (first match wins, so a request that names its model twice is routed by
the more explicit spelling):

  1. `/-/...`                                   -> 404: sidecar-internal paths are never reachable
  2. header `x-sie-model: <id>`                  -> model.<id>   (all models' header routes first)
  3. path `/v1/models/<id>/...`                  -> model.<id>, rewritten to `/...` (`/infer`)
  4. JSON body `"model": "<id>"`                 -> model.<id>   (json_to_metadata -> metadata sie.model)
  5. `GET /v1/models`, `GET /v1/models/<id>`     -> 200, OpenAI-style model list / model object
  6. anything else                               -> 404 JSON naming the known models

Body routing: the json_to_metadata filter buffers a JSON body, copies its top-level `model` into the
dynamic metadata namespace `sie`, key `model`, and clears the route cache, so the router re-matches with
the metadata present (verified on Envoy 1.40, see tests/integration/test_xds_envoy.py). The route match
uses `RouteMatch.dynamic_metadata`. Direct responses are answered by the router filter, which comes
after json_to_metadata, so a body-routed request is never answered 404 before its body is read.

Shed requests: when the weight policy sheds a model's lower-priority traffic (EDS drop_overloads, see
weights_shedding.py), Envoy's router answers 503 itself with the response flag DO (DropOverLoad) and
the body "drop overload" (UDO and "unconditional drop overload" at 100%). The listener's
local_reply_config rewrites exactly those answers into the JSON error every SIE refusal uses, with
Retry-After, naming the model through the cluster's metadata (resources.py stamps `sie.model` on every
model cluster). Verified on Envoy 1.40 by tests/integration/test_weights_envoy.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, config_source_pb2, substitution_format_string_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2 as rc
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2 as j2m
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.type.matcher.v3 import metadata_pb2, string_pb2, value_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2

from sie.spec import ModelService

LISTENER_NAME = "ingress"
ROUTE_CONFIG_NAME = "ingress_routes"
MODEL_HEADER = "x-sie-model"
RETRYABLE_HEADER = "x-sie-retryable"
METADATA_NAMESPACE = "sie"
METADATA_KEY = "model"
INTERNAL_PREFIX = "/-/"
# Retry only what the worker never saw: a refused or failed connection, a reset before the request was
# sent, or an answer the sidecar marked retryable (draining, worker down). Never a model's own error.
RETRY_ON = "connect-failure,refused-stream,reset-before-request,retriable-headers"
NUM_RETRIES = 2
# Envoy's response flags for a request dropped by EDS drop_overloads (RESPONSE_FLAGS in the access log):
# DO (DropOverLoad) below 100%, UDO (UnconditionalDropOverload, body "unconditional drop overload") at
# 100%, as seen on Envoy 1.40.
DROP_OVERLOAD_FLAGS = ("DO", "UDO")
SHED_RETRY_AFTER_S = 1
# Clients often POST JSON without a content type, or with curl's default form type.
BODY_CONTENT_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain")


@dataclass(frozen=True)
class IngressConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # json_to_metadata and retries buffer the request body; LLM prompts can be large.
    buffer_limit_bytes: int = 16 * 1024 * 1024


def cluster_name(model_id: str) -> str:
    return f"model.{model_id}"


def ads_config_source() -> config_source_pb2.ConfigSource:
    """'Over ADS', as a ConfigSource: every dynamic resource comes on the one aggregated stream."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.ApiVersion.V3
    )


def typed(msg) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(msg)
    return out


def shed_reply() -> hcm.LocalReplyConfig:
    """Envoy's 503 for a request shed by drop_overloads, as SIE's JSON error with Retry-After.

    The message keeps Envoy's own words "drop overload", so logs and older clients still match on them.
    """
    model = f"%CLUSTER_METADATA({METADATA_NAMESPACE}:{METADATA_KEY})%"
    body = struct_pb2.Struct()
    body.update({"error": {
        "type": "overloaded",
        "model": model,
        "message": f"model {model} is overloaded: Envoy's drop overload shed this request to protect "
                   f"higher-priority traffic; retry later",
        "retry_after_s": SHED_RETRY_AFTER_S,
    }})
    return hcm.LocalReplyConfig(mappers=[hcm.ResponseMapper(
        filter=accesslog_pb2.AccessLogFilter(
            response_flag_filter=accesslog_pb2.ResponseFlagFilter(flags=list(DROP_OVERLOAD_FLAGS))
        ),
        status_code={"value": 503},
        body_format_override=substitution_format_string_pb2.SubstitutionFormatString(json_format=body),
        headers_to_add=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="retry-after", value=str(SHED_RETRY_AFTER_S)),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )],
    )])


def build_listener(cfg: IngressConfig) -> listener_pb2.Listener:
    body_rule = j2m.JsonToMetadata.Rule(
        selectors=[j2m.JsonToMetadata.Selector(key=METADATA_KEY)],
        on_present=j2m.JsonToMetadata.KeyValuePair(
            metadata_namespace=METADATA_NAMESPACE, key=METADATA_KEY, type=j2m.JsonToMetadata.STRING
        ),
    )
    manager = hcm.HttpConnectionManager(
        stat_prefix=LISTENER_NAME,
        codec_type=hcm.HttpConnectionManager.AUTO,
        rds=hcm.Rds(config_source=ads_config_source(), route_config_name=ROUTE_CONFIG_NAME),
        local_reply_config=shed_reply(),
        http_filters=[
            hcm.HttpFilter(
                name="envoy.filters.http.json_to_metadata",
                typed_config=typed(
                    j2m.JsonToMetadata(
                        request_rules=j2m.JsonToMetadata.MatchRules(
                            rules=[body_rule], allow_content_types=list(BODY_CONTENT_TYPES), allow_empty_content_type=True
                        )
                    )
                ),
            ),
            hcm.HttpFilter(name="envoy.filters.http.router", typed_config=typed(router_pb2.Router())),
        ],
    )
    return listener_pb2.Listener(
        name=LISTENER_NAME,
        address=address_pb2.Address(socket_address=address_pb2.SocketAddress(address=cfg.host, port_value=cfg.port)),
        per_connection_buffer_limit_bytes={"value": cfg.buffer_limit_bytes},
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


def _json_response(status: int, body: dict) -> dict:
    return {
        "direct_response": rc.DirectResponseAction(
            status=status, body=base_pb2.DataSource(inline_string=json.dumps(body, sort_keys=True))
        ),
        "response_headers_to_add": [
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-type", value="application/json"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ],
    }


def _exact(value: str) -> string_pb2.StringMatcher:
    return string_pb2.StringMatcher(exact=value)


def _get_only() -> list[rc.HeaderMatcher]:
    return [rc.HeaderMatcher(name=":method", string_match=_exact("GET"))]


def _retry_policy() -> rc.RetryPolicy:
    return rc.RetryPolicy(
        retry_on=RETRY_ON,
        num_retries={"value": NUM_RETRIES},
        retry_host_predicate=[
            rc.RetryPolicy.RetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=typed(previous_hosts_pb2.PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=3,
        retriable_headers=[rc.HeaderMatcher(name=RETRYABLE_HEADER, string_match=_exact("true"))],
    )


def _to_model(svc: ModelService, prefix_rewrite: str = "") -> rc.RouteAction:
    ms = int(svc.spec.sla.route_timeout_ms)
    return rc.RouteAction(
        cluster=cluster_name(svc.model_id),
        timeout=duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000),
        retry_policy=_retry_policy(),
        prefix_rewrite=prefix_rewrite,
    )


def model_object(svc: ModelService) -> dict:
    """One entry of the OpenAI-style model list (`created` is fixed so the route content is stable)."""
    info = svc.spec.model
    return {
        "id": svc.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "sie",
        "version": info.version,
        "service_type": info.service_type.value,
        "priority_level": info.priority_level.value,
    }


def build_routes(services: Sequence[ModelService]) -> route_pb2.RouteConfiguration:
    services = sorted(services, key=lambda s: s.model_id)
    ids = [s.model_id for s in services]
    routes = [
        rc.Route(
            name="internal",
            match=rc.RouteMatch(prefix=INTERNAL_PREFIX),
            **_json_response(404, {"error": {"type": "not_found", "message": "paths under /-/ belong to the "
                                             "sidecar and are not served through the ingress"}}),
        )
    ]
    for svc in services:
        routes.append(rc.Route(
            name=f"{svc.model_id}.header",
            match=rc.RouteMatch(prefix="/", headers=[rc.HeaderMatcher(name=MODEL_HEADER, string_match=_exact(svc.model_id))]),
            route=_to_model(svc),
        ))
    for svc in services:
        routes.append(rc.Route(
            name=f"{svc.model_id}.path",
            match=rc.RouteMatch(prefix=f"/v1/models/{svc.model_id}/"),
            route=_to_model(svc, prefix_rewrite="/"),
        ))
    for svc in services:
        by_body = metadata_pb2.MetadataMatcher(
            filter=METADATA_NAMESPACE,
            path=[metadata_pb2.MetadataMatcher.PathSegment(key=METADATA_KEY)],
            value=value_pb2.ValueMatcher(string_match=_exact(svc.model_id)),
        )
        routes.append(rc.Route(
            name=f"{svc.model_id}.body", match=rc.RouteMatch(prefix="/", dynamic_metadata=[by_body]), route=_to_model(svc)
        ))
    routes.append(rc.Route(
        name="models.list",
        match=rc.RouteMatch(path="/v1/models", headers=_get_only()),
        **_json_response(200, {"object": "list", "data": [model_object(s) for s in services]}),
    ))
    for svc in services:
        routes.append(rc.Route(
            name=f"{svc.model_id}.info",
            match=rc.RouteMatch(path=f"/v1/models/{svc.model_id}", headers=_get_only()),
            **_json_response(200, model_object(svc)),
        ))
    routes.append(rc.Route(
        name="model_not_found",
        match=rc.RouteMatch(prefix="/"),
        **_json_response(404, {"error": {
            "type": "model_not_found",
            "message": f"no model matches this request: name one of the known models in the JSON body field "
                       f"'model', the header '{MODEL_HEADER}', or the path /v1/models/<id>/...",
            "known_models": ids,
        }}),
    ))
    # Envoy refuses a whole RouteConfiguration whose direct_response bodies exceed 4096 bytes unless the
    # limit is raised; the model list and the 404 carry every model id, so with ~30 models they do.
    largest = max((len(r.direct_response.body.inline_string.encode()) for r in routes if r.HasField("direct_response")),
                  default=0)
    return route_pb2.RouteConfiguration(
        name=ROUTE_CONFIG_NAME,
        virtual_hosts=[rc.VirtualHost(name="sie", domains=["*"], routes=routes)],
        max_direct_response_body_size_bytes=wrappers_pb2.UInt32Value(value=max(4096, largest)),
    )
