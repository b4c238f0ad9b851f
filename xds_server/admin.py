"""The admin API (aiohttp): models, endpoints, telemetry intake, node heartbeats, status, metrics.

Every route but /healthz authenticates its caller (sie.auth: `Authorization: Bearer <token>`) and
authorises by identity (DESIGN §10):

    GET    /v1/models             admin, reader   ModelService JSON of every model, `status` with live counts
    POST   /v1/models             admin           create (JSON or YAML body): 201; 400 naming the field; 409 if it exists
    GET    /v1/models/<id>        admin, reader   one model;  PUT (admin) replaces or creates it;  DELETE (admin) removes it
                                                  PUT of a new build (version, image, weights, backend) of a
                                                  serving model starts a rollout: 202; 409 schema_incompatible
                                                  listing each breaking difference unless ?allow_breaking=true
    GET    /v1/models/<id>/rollout          admin, reader   the current or last rollout: step, shares, gates
    POST   /v1/models/<id>/rollout/<action> admin   pause | resume | abort | undo (a rollout back to the build
                                                  before the last successful one); 409 when the phase forbids it
    GET    /v1/endpoints          admin, reader   every instance with telemetry: record, age, in EDS or not, its decision
    POST   /v1/telemetry          sidecar         its own instance's TelemetryRecord (instance, model and node must
                                                  be the credential's); 400 on a bad record; a reordered one is ignored
    POST   /v1/nodes/heartbeat    node            its own NodeHeartbeat (node must be the credential's) -> HeartbeatReply
    GET    /v1/nodes              admin, reader   nodes, liveness, what they run and what they are assigned
    GET    /v1/status             admin, reader   what `sie status` prints: models, instances, control-plane state
    GET    /v1/picker/endpoints   admin, reader   per model cluster with prefix affinity, the instances the endpoint
                                                  picker may choose (HEALTHY, in EDS) and their weights
    GET    /v1/prometheus/targets admin, reader   every live sidecar's control listener as a Prometheus http_sd target;
                                                  ?role=node: every live node host's API (its GPU metrics)
    GET    /metrics               admin, reader   the control plane's Prometheus metrics
    GET    /healthz               anyone          200 once the startup sync is over, 503 before

Input is bounded where it enters: each route's body up to what its contract holds (a telemetry record
MAX_TELEMETRY_BYTES, a heartbeat sie.wire.MAX_HEARTBEAT_BYTES, a model MAX_MODEL_BODY_BYTES), a larger one
a 413 naming the limit before it is read whole; one heartbeat of a node at a time (a second is a 429 to
retry); JSON through sie.strict_json (depth,
integer size, UTF-8), YAML through sie.strict_yaml (no aliases), specs validated and then built into
Envoy resources before they are accepted, so a spec Envoy cannot take is a 400 with the reason, never a
control loop that fails later. Every error is `{"error": {"type", "message", ...}}`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from sie import strict_json, strict_yaml
from sie.auth import Authenticator, Role, middleware, require
from sie.errors import InputError, Problem, SpecError, error_body
from sie.http import as_json, internal_error
from sie.model_files import ModelFilePolicy, spec_problems
from sie.schema_compat import breaking, compare_specs
from sie.spec import MAX_SPEC_BYTES, ModelService
from sie.spec_loader import parse_model_service
from sie.telemetry import TelemetryRecord
from sie.wire import MAX_HEARTBEAT_BYTES, NodeHeartbeat
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop
from xds_server.metrics import ControlPlaneMetrics, short_type
from xds_server.prometheus_sd import ROLES, node_targets, scrape_targets
from xds_server.registry import ModelExists, Registry
from xds_server.resources import buildable_problems
from xds_server.rollout.driver import RolloutDriver
from xds_server.views import (
    autoscale_json,
    endpoints_json,
    instance_rows,
    model_json,
    node_reports,
    nodes_json,
    rollout_json,
)

log = logging.getLogger(__name__)

# Bodies per route, each from what its contract holds, so no caller makes the control plane read or
# parse more than its route needs (DESIGN §10). A heartbeat: what a node host sends at most (sie.wire;
# NodeAgent._encoded cuts its beat to fit).
MAX_HEARTBEAT_BODY_BYTES = MAX_HEARTBEAT_BYTES
# A telemetry record: about 40 bounded fields, under 14 KiB even with every text character escaped as a
# surrogate pair; a real one is under 1 KB.
MAX_TELEMETRY_BYTES = 64 * 1024
# A model's body as posted (YAML or JSON, comments and spacing included); the spec it holds is bounded
# again once parsed (sie.spec.MAX_SPEC_BYTES).
MAX_MODEL_BODY_BYTES = 1024 * 1024
# The most any route reads (the application's own cap, behind the routes' own).
MAX_BODY_BYTES = max(MAX_HEARTBEAT_BODY_BYTES, MAX_TELEMETRY_BYTES, MAX_MODEL_BODY_BYTES)
ROLLOUT_ACTIONS = ("pause", "resume", "abort", "undo")
OPEN_PATHS = ("/healthz",)
READERS = (Role.ADMIN, Role.READER)


@dataclass
class AdminContext:
    registry: Registry
    control: ControlLoop
    metrics: ControlPlaneMetrics
    ads: AdsServer
    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    authenticator: Authenticator
    policy_name: str = "equal"
    package_roots: tuple[Path, ...] = ()  # where the control plane may read a model's model-spec.yaml
    file_policy: ModelFilePolicy = ModelFilePolicy()  # what the cluster lets a spec load (sie.model_files)
    on_models_changed: Callable[[], None] = lambda: None  # persists API-made models (state.py)
    rollouts: RolloutDriver | None = None  # by-hand rollout actions (None: the routes answer 404)

    @property
    def ready(self) -> bool:
        return self.registry.synced


def _error(status: int, kind: str, message: str, headers: dict[str, str] | None = None, **context: Any) -> web.Response:
    return web.json_response(error_body(kind, message, **context), status=status, headers=headers)


@web.middleware
async def _input_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Bad input is a 4xx naming the problem; a bug is a 500 in the same shape, and never a dead server."""
    try:
        return await handler(request)
    except SpecError as exc:
        return web.json_response(exc.to_json(), status=400)
    except InputError as exc:
        return web.json_response(exc.to_json(), status=exc.status)
    except web.HTTPException as exc:
        raise as_json(exc, request) from None
    except Exception:  # noqa: BLE001 - one request must never take the control plane down
        return internal_error(request)


async def _body(request: web.Request, limit: int) -> bytes:
    """The body, or a 413 naming `limit` as soon as the body is known to pass it: from Content-Length
    before a byte is read, else once the bytes read pass it (a chunked body), so no more is ever held."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(request, limit, str(declared))
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _too_large(request, limit, f"over {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(request: web.Request, limit: int, has: str) -> InputError:
    where = f"{request.method} {request.path}"[:128]
    return InputError("body_too_large", f"the body has {has} bytes; {where} takes at most {limit}", 413)


async def _json(request: web.Request, what: str, limit: int) -> Any:
    return strict_json.loads(await _body(request, limit), what=what)


async def _spec_document(request: web.Request) -> Any:
    raw = await _body(request, MAX_MODEL_BODY_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("invalid_yaml", f"the spec is not valid UTF-8 (byte {exc.start})") from None
    if "json" in (request.content_type or "") or text.lstrip().startswith(("{", "[")):
        return strict_json.loads(raw, what="the spec")
    return strict_yaml.load(text, what="the spec")


class HeartbeatBodies:
    """The last heartbeat body of each node and what it decoded to. A node host sends the same heartbeat
    every second until something changes, and a large node's body is hundreds of kilobytes: the same
    bytes decode to the same record, so they are compared, not parsed again. A body over INLINE_BYTES is
    parsed on `decoder` (None: on the loop too), so a beat of megabytes shares the interpreter with the
    event loop instead of stopping it for the whole parse."""

    INLINE_BYTES = 256 * 1024  # a steady node's beat (no specs) of a hundred instances is a tenth of this

    def __init__(self, decoder: Executor | None = None, most: int = 10_000):
        self._last: dict[str, tuple[bytes, NodeHeartbeat]] = {}
        self._decoder = decoder
        self._most = most

    async def decode(self, node: str, body: bytes) -> NodeHeartbeat:
        last = self._last.get(node)
        if last is not None and last[0] == body:
            return last[1]
        if self._decoder is None or len(body) <= self.INLINE_BYTES:
            hb = _heartbeat(body)
        else:
            hb = await asyncio.get_running_loop().run_in_executor(self._decoder, _heartbeat, body)
        if hb.node == node:  # only a heartbeat the caller may send is remembered
            self._last.pop(node, None)
            self._last[node] = (body, hb)
            while len(self._last) > self._most:
                self._last.pop(next(iter(self._last)))
        return hb


def _heartbeat(body: bytes) -> NodeHeartbeat:
    return NodeHeartbeat.from_json(strict_json.loads(body, what="the node heartbeat"))


def admission_problems(service: ModelService, others: list[ModelService], files: ModelFilePolicy) -> list[Problem]:
    """Why the admin API refuses `service` beside `others`: the cluster's model-file policy forbids it, or
    its Envoy resources cannot be built; [] if it takes it. The control plane holds specs it recovers from
    the nodes' reports to the same rule (Registry.admission)."""
    return spec_problems(service, files) + buildable_problems(service, others)


def make_app(ctx: AdminContext) -> web.Application:
    routes = web.RouteTableDef()
    reg = ctx.registry
    # One thread: large beats wait for each other, not for the loop; a node has one in flight at most.
    decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heartbeat-decoder")
    heartbeats = HeartbeatBodies(decoder)
    beating: set[str] = set()  # nodes whose heartbeat is being read or parsed

    def accept(service: ModelService) -> None:
        """Refuse a spec the cluster's file policy forbids, or whose Envoy resources cannot be built,
        before anything else sees it."""
        others = [e.service for mid, e in reg.models.items() if mid != service.model_id]
        problems = admission_problems(service, others, ctx.file_policy)
        if problems:
            raise SpecError(f"ModelService {service.model_id!r}", problems)

    def parse(doc: Any) -> ModelService:
        service = parse_model_service(doc, "request body", package_roots=ctx.package_roots, max_bytes=MAX_SPEC_BYTES)
        accept(service)
        return service

    @routes.get("/v1/models")
    async def list_models(request: web.Request) -> web.Response:
        require(request, *READERS)
        now, wall, reports = ctx.clock(), ctx.wall_clock(), node_reports(reg)
        return web.json_response(
            {"models": [model_json(reg, ctx.control, m, now, wall, reports) for m in sorted(reg.models)]}
        )

    @routes.post("/v1/models")
    async def create_model(request: web.Request) -> web.Response:
        require(request, Role.ADMIN)
        service = parse(await _spec_document(request))
        try:
            reg.add_model(service, "api")
        except ModelExists:
            return _error(
                409,
                "model_exists",
                f"model {service.model_id!r} already exists; use PUT /v1/models/{service.model_id} to replace it",
                model=service.model_id,
            )
        ctx.on_models_changed()
        log.info("model %s created through the admin API", service.model_id)
        return web.json_response(reg.models[service.model_id].spec_dict, status=201)

    @routes.get("/v1/models/{model_id}")
    async def get_model(request: web.Request) -> web.Response:
        require(request, *READERS)
        mid = request.match_info["model_id"]
        if mid not in reg.models:
            return _error(404, "model_not_found", f"no model {mid[:64]!r}", known_models=sorted(reg.models))
        return web.json_response(model_json(reg, ctx.control, mid, ctx.clock(), ctx.wall_clock()))

    @routes.put("/v1/models/{model_id}")
    async def put_model(request: web.Request) -> web.Response:
        require(request, Role.ADMIN)
        mid = request.match_info["model_id"]
        service = parse(await _spec_document(request))
        if service.model_id != mid:
            raise SpecError(
                "request body",
                [
                    Problem(
                        "spec.model.name", f"is {service.model_id!r} but the path names {mid[:64]!r}; they must agree"
                    )
                ],
            )
        entry = reg.models.get(mid)
        if entry is not None and request.query.get("allow_breaking", "false").lower() not in ("true", "1", "yes"):
            changes = breaking(compare_specs(entry.service.spec, service.spec))
            if changes:
                return _error(
                    409,
                    "schema_incompatible",
                    f"the new spec of {mid!r} breaks its clients in {len(changes)} way(s): "
                    + "; ".join(c.message for c in changes[:5])
                    + " (PUT ?allow_breaking=true applies it anyway)",
                    model=mid,
                    differences=[c.to_json() for c in changes],
                )
        outcome = reg.update_model(service, "api")
        ctx.on_models_changed()
        log.info("model %s %s through the admin API", mid, outcome)
        if outcome == "rollout":
            rollout = reg.models[mid].rollout
            assert rollout is not None
            return web.json_response({"model": mid, "rollout": rollout_json(rollout, ctx.wall_clock())}, status=202)
        return web.json_response(reg.models[mid].spec_dict, status=201 if outcome == "created" else 200)

    @routes.get("/v1/models/{model_id}/rollout")
    async def get_rollout(request: web.Request) -> web.Response:
        require(request, *READERS)
        mid = request.match_info["model_id"]
        entry = reg.models.get(mid)
        if entry is None:
            return _error(404, "model_not_found", f"no model {mid[:64]!r}", known_models=sorted(reg.models))
        if entry.rollout is None:
            return _error(404, "no_rollout", f"model {mid!r} has had no rollout since it was created", model=mid)
        return web.json_response(rollout_json(entry.rollout, ctx.wall_clock()))

    @routes.post("/v1/models/{model_id}/rollout/{action}")
    async def rollout_action(request: web.Request) -> web.Response:
        require(request, Role.ADMIN)
        mid, action = request.match_info["model_id"], request.match_info["action"]
        if mid not in reg.models:
            return _error(404, "model_not_found", f"no model {mid[:64]!r}", known_models=sorted(reg.models))
        if action not in ROLLOUT_ACTIONS or ctx.rollouts is None:
            return _error(404, "not_found", f"no rollout action {action[:32]!r}; one of {', '.join(ROLLOUT_ACTIONS)}")
        if action == "undo":
            state = reg.rollout_undo(mid)
        else:
            state = ctx.rollouts.act(mid, action)  # type: ignore[arg-type]
        ctx.on_models_changed()
        log.info("model %s: rollout %s by hand", mid, action)
        return web.json_response(rollout_json(state, ctx.wall_clock()))

    @routes.delete("/v1/models/{model_id}")
    async def delete_model(request: web.Request) -> web.Response:
        require(request, Role.ADMIN)
        mid = request.match_info["model_id"]
        if not reg.delete_model(mid):
            return _error(404, "model_not_found", f"no model {mid[:64]!r}", known_models=sorted(reg.models))
        ctx.on_models_changed()
        return web.json_response({"deleted": mid})

    @routes.get("/v1/endpoints")
    async def endpoints(request: web.Request) -> web.Response:
        require(request, *READERS)
        return web.json_response({"endpoints": endpoints_json(reg, ctx.control, ctx.clock(), ctx.wall_clock())})

    @routes.post("/v1/telemetry")
    async def telemetry(request: web.Request) -> web.Response:
        who = require(request, Role.SIDECAR)
        try:
            record = TelemetryRecord.from_json(await _json(request, "the telemetry record", MAX_TELEMETRY_BYTES))
        except (SpecError, InputError):
            ctx.metrics.telemetry.labels("invalid").inc()
            raise
        claimed = (record.instance_id, record.model_id, record.node)
        if claimed != (who.name, who.model, who.node):
            ctx.metrics.telemetry.labels("forbidden").inc()
            return _error(
                403,
                "forbidden",
                f"{who.subject} (model {who.model}, node {who.node}) may report only its "
                f"own instance, not {record.instance_id[:64]!r} of model {record.model_id!r} on node "
                f"{record.node[:64]!r}",
            )
        accepted = reg.record_telemetry(record)
        ctx.metrics.telemetry.labels("accepted" if accepted else "reordered").inc()
        return web.json_response({"accepted": accepted})

    @routes.post("/v1/nodes/heartbeat")
    async def heartbeat(request: web.Request) -> web.Response:
        who = require(request, Role.NODE)
        node = who.node or ""
        # A node host waits for each answer before its next beat; more at once from one node would only
        # make the control plane read and parse one node's megabytes side by side.
        if node in beating:
            return _error(
                429,
                "heartbeat_in_flight",
                f"node {node[:64]!r} has a heartbeat in flight; send the next once it is answered",
                headers={"Retry-After": "1"},
            )
        beating.add(node)
        try:
            hb = await heartbeats.decode(node, await _body(request, MAX_HEARTBEAT_BODY_BYTES))
        finally:
            beating.discard(node)
        if hb.node != who.node:
            return _error(
                403, "forbidden", f"{who.subject} may heartbeat only as node {who.node!r}, not as {hb.node[:64]!r}"
            )
        return web.json_response(reg.heartbeat_json(hb))

    @routes.get("/v1/nodes")
    async def nodes(request: web.Request) -> web.Response:
        require(request, *READERS)
        return web.json_response({"nodes": nodes_json(reg, ctx.clock())})

    @routes.get("/v1/status")
    async def status(request: web.Request) -> web.Response:
        require(request, *READERS)
        now, wall, reports = ctx.clock(), ctx.wall_clock(), node_reports(reg)
        snap = ctx.control.snapshot
        models = []
        for mid in sorted(reg.models):
            entry = reg.models[mid]
            info = entry.service.spec.model
            desired = entry.replicas
            models.append(
                {
                    # `id`/`desired_instances` and `model_id`/`desired_replicas` are the same values; sie's status
                    # table reads the latter.
                    "id": mid,
                    "model_id": mid,
                    "version": info.version,
                    "priority": info.priority_level.value,
                    "service_type": info.service_type.value,
                    "backend": entry.service.spec.backend.type.value,
                    "source": entry.source,
                    "desired_instances": desired,
                    "desired_replicas": desired,
                    "resource_error": ctx.control.resource_errors.get(mid),
                    "instances": instance_rows(reg, ctx.control, mid, now, wall, reports),
                    "autoscale": autoscale_json(entry),
                    "rollout": (
                        {
                            "phase": entry.rollout.phase.value,
                            "from_version": entry.rollout.from_version,
                            "to_version": entry.rollout.to_version,
                            "step": entry.rollout.step + 1,
                            "steps": len(entry.rollout.steps),
                            "share": entry.rollout.share,
                            "reason": entry.rollout.reason,
                        }
                        if entry.rollout is not None
                        else None
                    ),
                }
            )
        return web.json_response(
            {
                "control_plane": {
                    "ready": ctx.ready,
                    "policy": ctx.policy_name,
                    "xds_versions": {short_type(t): v for t, v in snap.versions.items()} if snap else None,
                    "envoy_connections": [
                        {
                            "stream": info.stream_id,
                            "node": info.node_id,
                            "peer": info.peer,
                            "connected_s": round(now - info.opened_at, 3),
                            "acked_versions": {short_type(t): st.acked_version for t, st in stream.types.items()},
                        }
                        for info, stream in ctx.ads.streams.values()
                    ],
                    "nacks": ctx.metrics.nack_count(),
                    "last_nack": ctx.metrics.last_nack.to_json() if ctx.metrics.last_nack else None,
                },
                "models": models,
                "nodes": [
                    {
                        "node": n["node"],
                        "live": n["live"],
                        "health": n["health"],
                        "lost_at": n["lost_at"],
                        "last_seen_age_s": n["last_seen_age_s"],
                        "address": n["address"],
                        "instances": len(n["instances"]),
                        "gpus": n["gpus"],
                        "labels": n["labels"],
                        "taints": n["taints"],
                    }
                    for n in nodes_json(reg, now)
                ],
                "failover": {
                    "heartbeat_timeout_s": reg.heartbeat_timeout_s,
                    "rebalance": reg.rebalance,
                    "homes": dict(reg.placement.homes),
                    "handing_over": dict(reg.placement.leaving),
                },
                "node_events": list(reg.node_events)[-50:],
            }
        )

    @routes.get("/v1/picker/endpoints")
    async def picker_endpoints(request: web.Request) -> web.Response:
        require(request, *READERS)
        return web.json_response({"clusters": ctx.control.picker_view})

    @routes.get("/v1/prometheus/targets")
    async def prometheus_targets(request: web.Request) -> web.Response:
        require(request, *READERS)
        role = request.query.get("role", "sidecar")
        if role not in ROLES:
            raise InputError("bad_request", f"role must be one of {', '.join(ROLES)}, got {role[:32]!r}")
        targets = node_targets if role == "node" else scrape_targets
        return web.json_response(targets(reg, ctx.clock()))

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        require(request, *READERS)
        return web.Response(body=ctx.metrics.exposition(), content_type="text/plain", charset="utf-8")

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        if ctx.ready:
            return web.json_response({"ready": True})
        return web.json_response(
            {
                "ready": False,
                "reason": "startup sync: rebuilding the registry from node hosts and sidecars before answering Envoy",
            },
            status=503,
        )

    # The middlewares run outermost first: input errors wrap authentication, which wraps the handler.
    app = web.Application(
        client_max_size=MAX_BODY_BYTES, middlewares=[_input_errors, middleware(ctx.authenticator, OPEN_PATHS)]
    )
    app.add_routes(routes)

    async def stop_decoder(_: web.Application) -> None:
        decoder.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_decoder)
    return app
