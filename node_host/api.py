"""The node host's small HTTP API (on --host/--port), read-only but for one call: what runs, what the GPUs
hold, what memory pressure did, and the wake a sleeping instance's sidecar asks for. Every route but /healthz needs an admin or reader token the control plane
signed (checked against --trust-file), or this node's own; the answers are JSON, errors included.

    GET /healthz              {"status": "ok", "node", "control_plane_reachable", "instances"}
    GET /v1/instances         {"node", "address", "instances": [...]}: every instance with its processes,
                              GPU, state and detail (pending and refused ones included, with the reason)
    GET /v1/gpus              the memory ledger per GPU: total, headroom, level, watermarks, and each
                              instance's estimate, measured figure and state; virtual GPUs say so
    POST /v1/instances/<id>/wake
                              wake a sleeping instance for a request its sidecar holds (that instance's
                              own sidecar, or an admin): 200 {"state": "ready", "took_s"} once it
                              serves, 503 wake_failed naming why (no room, timed out, the wake failed)
    POST /v1/gpus/<index>/fail
                              (an admin) fail a VIRTUAL GPU, as NVML reports a real one failed (Xid, ECC,
                              device lost): {"reason": "..."} optional. Its instances stop and run
                              elsewhere; nothing is placed on it until the node host restarts. 409 for a
                              real GPU (NVML decides those), 404 for an index the node does not have
    GET /v1/events?since=T    memory events (placed, loaded, pressure, eviction_started, memory_released,
                              wake_started, woken, released, refused, ...) with wall-clock times, since T
    GET /metrics              Prometheus text: per GPU its memory (total, used, reserved, sleeping), what
                              each instance holds, utilisation, temperature, failed; instances by state;
                              evictions and wakes (node_host/metrics.py)
"""

from __future__ import annotations

import time

from aiohttp import web

from node_host.agent import NodeAgent
from node_host.ledger import LedgerError
from node_host.metrics import CONTENT_TYPE, NodeMetrics
from sie import auth, strict_json
from sie.auth import Authenticator, Role
from sie.errors import Forbidden, InputError, error_body
from sie.http import json_errors

MAX_REASON_CHARS = 256


def _reader(request: web.Request, node: str) -> None:
    who = auth.identity(request)
    if who.reads or (who.role is Role.NODE and who.node == node):
        return
    raise Forbidden(f"{who.subject} may not read node {node!r}: it needs an admin or reader token")


def build_api(agent: NodeAgent, authenticator: Authenticator) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "node": agent.settings.node,
                "control_plane_reachable": agent.reachable,
                "instances": len(agent.supervisor.instances),
            }
        )

    async def instances(request: web.Request) -> web.Response:
        _reader(request, agent.settings.node)
        rows = []
        for report in agent.instance_reports():
            inst = agent.supervisor.instances.get(report.instance_id)
            if inst is not None:
                row = agent.supervisor.describe(inst)
            else:
                row = {
                    "instance_id": report.instance_id,
                    "model_id": report.model_id,
                    "pending": report.instance_id in agent.pending,
                    "refused": report.instance_id in agent.refused,
                }
            sidecar = agent.sidecar_states.get(report.instance_id) or {}
            ledger_state = agent.manager.state_of(report.instance_id)
            row.update(
                state=report.state.value,
                restarts=report.restarts,
                detail=report.detail,
                gpu_index=report.gpu_index,
                sidecar_state=sidecar.get("state"),
                ledger=ledger_state.value if ledger_state is not None else None,
            )
            rows.append(row)
        return web.json_response({"node": agent.settings.node, "address": agent.address, "instances": rows})

    async def gpus(request: web.Request) -> web.Response:
        _reader(request, agent.settings.node)
        return web.json_response(
            {
                "node": agent.settings.node,
                "eviction": agent.settings.tunables.eviction.value,
                "memory_operation": agent.pressure.busy,
                **agent.manager.to_json(),
            }
        )

    async def events(request: web.Request) -> web.Response:
        _reader(request, agent.settings.node)
        raw = request.query.get("since")
        since: float | None = None
        if raw is not None:
            try:
                since = float(raw)
                if since != since:
                    raise ValueError("nan")
            except ValueError:
                return web.json_response(
                    error_body("bad_request", f"since must be wall-clock seconds (time.time()), got {raw[:32]!r}"),
                    status=400,
                )
        return web.json_response({"node": agent.settings.node, "events": agent.events.to_json(since)})

    async def wake(request: web.Request) -> web.Response:
        iid = request.match_info["instance_id"]
        who = auth.identity(request)
        own_sidecar = who.role is Role.SIDECAR and who.name == iid and who.node == agent.settings.node
        if not (own_sidecar or who.role is Role.ADMIN):
            raise Forbidden(f"{who.subject} may not wake {iid[:253]!r}: only its own sidecar or an admin may")
        started = time.monotonic()
        why = await agent.wake_for_request(iid)
        if why is not None:
            return web.json_response(
                error_body("wake_failed", f"{iid} could not be woken: {why}", instance_id=iid, retryable=True),
                status=503,
            )
        return web.json_response({"state": "ready", "took_s": round(time.monotonic() - started, 4)})

    async def fail_gpu(request: web.Request) -> web.Response:
        who = auth.identity(request)
        if who.role is not Role.ADMIN:
            raise Forbidden(f"{who.subject} may not fail a GPU: only an admin may")
        raw = request.match_info["index"]
        if not raw.isdigit() or len(raw) > 4:
            return web.json_response(
                error_body("bad_request", f"GPU index must be a number, got {raw[:16]!r}"), status=400
            )
        index = int(raw)
        body = await request.read()
        reason = "failed through the node host's API"
        if body:
            try:
                doc = strict_json.loads(body, what="the fail request")
            except InputError as exc:
                return web.json_response(error_body("invalid_json", str(exc)), status=400)
            given = doc.get("reason") if isinstance(doc, dict) else None
            if not isinstance(doc, dict) or set(doc) - {"reason"} or not isinstance(given, (str, type(None))):
                return web.json_response(
                    error_body("bad_request", 'expected {"reason": "..."} (a string) or no body'), status=400
                )
            if given:
                reason = f"failed through the node host's API: {given[:MAX_REASON_CHARS]}"
        try:
            gpu = agent.manager.ledger.gpu(index)
        except LedgerError:
            known = sorted(g.index for g in agent.manager.ledger.gpus)
            return web.json_response(
                error_body("not_found", f"node {agent.settings.node} has no GPU {index} (it has {known})"), status=404
            )
        if not gpu.virtual:
            return web.json_response(
                error_body("conflict", f"GPU {index} is a real GPU: NVML reports its failures (Xid, ECC, device lost)"),
                status=409,
            )
        victims = agent.fail_gpu(index, reason)
        return web.json_response(
            {"node": agent.settings.node, "gpu": index, "failed": gpu.failed or reason, "instances": victims}
        )

    node_metrics = NodeMetrics(agent)

    async def metrics(request: web.Request) -> web.Response:
        _reader(request, agent.settings.node)
        return web.Response(body=node_metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(
        client_max_size=1 << 16, middlewares=[json_errors(), auth.middleware(authenticator, ("/healthz",))]
    )
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/instances", instances)
    app.router.add_get("/v1/gpus", gpus)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/instances/{instance_id}/wake", wake)
    app.router.add_post("/v1/gpus/{index}/fail", fail_gpu)
    return app
