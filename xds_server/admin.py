"""The admin HTTP API (aiohttp): models, endpoints, telemetry intake, node heartbeats, status, metrics.

    GET    /v1/models             ModelService JSON of every model, `status` holding live instance counts
    POST   /v1/models             create (JSON or YAML body): 201 + stored spec; 400 naming the field; 409 if it exists
    GET    /v1/models/<id>        one model;  PUT replaces (or creates) it;  DELETE removes it
    GET    /v1/endpoints          every instance with telemetry: record, age, in EDS or not, the EndpointDecision
    POST   /v1/telemetry          a sidecar's TelemetryRecord; 400 on a bad record; a reordered (older) one is ignored
    POST   /v1/nodes/heartbeat    a node host's NodeHeartbeat -> HeartbeatReply
    GET    /v1/nodes              nodes, liveness, what they run and what they are assigned
    GET    /v1/status             what `sie status` prints: models, instances, control-plane state
    GET    /v1/prometheus/targets every live sidecar as a Prometheus http_sd target group (prometheus_sd.py)
    GET    /metrics               the control plane's Prometheus metrics
    GET    /healthz               200 once the startup sync is over, 503 before
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

import yaml
from aiohttp import web

from sie.errors import Problem, SpecError
from sie.spec_loader import parse_model_service
from sie.wire import NodeHeartbeat
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop
from xds_server.metrics import ControlPlaneMetrics, short_type
from xds_server.prometheus_sd import scrape_targets
from xds_server.registry import ModelExists, Registry
from xds_server.views import endpoints_json, instance_rows, model_json, node_reports, nodes_json, parse_telemetry

log = logging.getLogger(__name__)


@dataclass
class AdminContext:
    registry: Registry
    control: ControlLoop
    metrics: ControlPlaneMetrics
    ads: AdsServer
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    policy_name: str = "equal"

    @property
    def ready(self) -> bool:
        return self.registry.synced


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": kind, "message": message}}, status=status)


def _spec_error(exc: SpecError) -> web.Response:
    return web.json_response(exc.to_json(), status=400)


async def _body_document(request: web.Request) -> Any:
    text = await request.text()
    try:
        if "json" in (request.content_type or "") or text.lstrip().startswith(("{", "[")):
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecError("request body", [Problem("", f"not valid JSON or YAML: {exc}")]) from None


async def _json_body(request: web.Request, what: str) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SpecError(what, [Problem("", f"not valid JSON: {exc}")]) from None


def make_app(ctx: AdminContext) -> web.Application:
    routes = web.RouteTableDef()
    reg = ctx.registry

    @routes.get("/v1/models")
    async def list_models(request: web.Request) -> web.Response:
        now, wall, reports = ctx.clock(), ctx.wall_clock(), node_reports(reg)
        return web.json_response({"models": [model_json(reg, ctx.control, m, now, wall, reports)
                                             for m in sorted(reg.models)]})

    @routes.post("/v1/models")
    async def create_model(request: web.Request) -> web.Response:
        try:
            service = parse_model_service(await _body_document(request), "request body")
            reg.add_model(service, "api")
        except SpecError as exc:
            return _spec_error(exc)
        except ModelExists:
            return _error(409, "model_exists", f"model {service.model_id!r} already exists; "
                                               f"use PUT /v1/models/{service.model_id} to replace it")
        log.info("model %s created through the admin API", service.model_id)
        return web.json_response(reg.models[service.model_id].spec_dict, status=201)

    @routes.get("/v1/models/{model_id}")
    async def get_model(request: web.Request) -> web.Response:
        mid = request.match_info["model_id"]
        if mid not in reg.models:
            return _error(404, "model_not_found", f"no model {mid!r}; known: {sorted(reg.models)}")
        return web.json_response(model_json(reg, ctx.control, mid, ctx.clock(), ctx.wall_clock()))

    @routes.put("/v1/models/{model_id}")
    async def put_model(request: web.Request) -> web.Response:
        mid = request.match_info["model_id"]
        try:
            service = parse_model_service(await _body_document(request), "request body")
        except SpecError as exc:
            return _spec_error(exc)
        if service.model_id != mid:
            return _spec_error(SpecError("request body", [Problem(
                "spec.model.name", f"is {service.model_id!r} but the path names {mid!r}; they must agree")]))
        created = reg.put_model(service, "api")
        log.info("model %s %s through the admin API", mid, "created" if created else "replaced")
        return web.json_response(reg.models[mid].spec_dict, status=201 if created else 200)

    @routes.delete("/v1/models/{model_id}")
    async def delete_model(request: web.Request) -> web.Response:
        mid = request.match_info["model_id"]
        if not reg.delete_model(mid):
            return _error(404, "model_not_found", f"no model {mid!r}; known: {sorted(reg.models)}")
        return web.json_response({"deleted": mid})

    @routes.get("/v1/endpoints")
    async def endpoints(request: web.Request) -> web.Response:
        return web.json_response({"endpoints": endpoints_json(reg, ctx.control, ctx.clock(), ctx.wall_clock())})

    @routes.post("/v1/telemetry")
    async def telemetry(request: web.Request) -> web.Response:
        try:
            record = parse_telemetry(await _json_body(request, "telemetry record"))
        except SpecError as exc:
            ctx.metrics.telemetry.labels("invalid").inc()
            return _spec_error(exc)
        accepted = reg.record_telemetry(record)
        ctx.metrics.telemetry.labels("accepted" if accepted else "reordered").inc()
        return web.json_response({"accepted": accepted})

    @routes.post("/v1/nodes/heartbeat")
    async def heartbeat(request: web.Request) -> web.Response:
        try:
            data = await _json_body(request, "node heartbeat")
            hb = NodeHeartbeat.from_json(data)
        except SpecError as exc:
            return _spec_error(exc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return _spec_error(SpecError("node heartbeat", [Problem("", f"does not match sie.wire.NodeHeartbeat: {exc!r}")]))
        return web.json_response(reg.heartbeat_json(hb))

    @routes.get("/v1/nodes")
    async def nodes(request: web.Request) -> web.Response:
        return web.json_response({"nodes": nodes_json(reg, ctx.clock())})

    @routes.get("/v1/status")
    async def status(request: web.Request) -> web.Response:
        now, wall, reports = ctx.clock(), ctx.wall_clock(), node_reports(reg)
        snap = ctx.control.snapshot
        models = []
        for mid in sorted(reg.models):
            entry = reg.models[mid]
            info = entry.service.spec.model
            desired = entry.service.spec.desired_replicas
            models.append({
                # `id`/`desired_instances` and `model_id`/`desired_replicas` are the same values; sie's status
                # table reads the latter.
                "id": mid, "model_id": mid, "version": info.version, "priority": info.priority_level.value,
                "service_type": info.service_type.value, "backend": entry.service.spec.backend.type.value,
                "source": entry.source, "desired_instances": desired, "desired_replicas": desired,
                "instances": instance_rows(reg, ctx.control, mid, now, wall, reports),
            })
        return web.json_response({
            "control_plane": {
                "ready": ctx.ready,
                "policy": ctx.policy_name,
                "xds_versions": {short_type(t): v for t, v in snap.versions.items()} if snap else None,
                "envoy_connections": [
                    {"stream": info.stream_id, "node": info.node_id, "peer": info.peer,
                     "connected_s": round(now - info.opened_at, 3),
                     "acked_versions": {short_type(t): st.acked_version for t, st in stream.types.items()}}
                    for info, stream in ctx.ads.streams.values()
                ],
                "nacks": ctx.metrics.nack_count(),
                "last_nack": ctx.metrics.last_nack.to_json() if ctx.metrics.last_nack else None,
            },
            "models": models,
            "nodes": [{"node": n["node"], "live": n["live"], "address": n["address"], "instances": len(n["instances"]),
                       "gpus": n["gpus"]} for n in nodes_json(reg, now)],
        })

    @routes.get("/v1/prometheus/targets")
    async def prometheus_targets(request: web.Request) -> web.Response:
        return web.json_response(scrape_targets(reg.telemetry.values(), ctx.clock()))

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=ctx.metrics.exposition(), content_type="text/plain", charset="utf-8")

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        if ctx.ready:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": "startup sync: rebuilding the registry from node "
                                  "hosts and sidecars before answering Envoy"}, status=503)

    app = web.Application()
    app.add_routes(routes)
    return app
