"""The node agent: heartbeats out, authoritative assignments in, refusals reported (fake supervisor
children, a real aiohttp control plane on port 0)."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from node_host.agent import NodeAgent
from node_host.reports import instance_state
from node_host.settings import AgentSettings, NodeTunables
from node_host.supervisor import ProcessManager
from sie.auth import TokenSource
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.telemetry import InstanceState
from sie.wire import MAX_DETAIL, MAX_UNPLACEABLE, GPUInfo, InstanceReport, NodeHeartbeat


def spec(
    name: str = "m1",
    requires: list[str] | None = None,
    backend: str = "sklearn",
    config: dict | None = None,
    path: str | None = "/m",
) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "version": "1.0.0", **({"path": path} if path else {})},
            "backend": {"type": backend, "requires": requires or [], **({"config": config} if config else {})},
        },
    }


class Child:
    def __init__(self, pid: int):
        self.pid, self.status = pid, None

    def poll(self):
        return self.status

    def signal_group(self, sig):
        if self.status is None and sig in (signal.SIGTERM, signal.SIGKILL):
            self.status = -sig


class ControlPlane:
    def __init__(self):
        self.reply = {"authoritative": True, "assignments": []}
        self.beats = []

    def app(self) -> web.Application:
        async def heartbeat(request):
            if request.headers.get("Authorization") != "Bearer node-token":
                return web.json_response({"error": {"type": "unauthenticated", "message": "no"}}, status=401)
            self.beats.append(await request.json())
            return web.json_response(self.reply)

        app = web.Application()
        app.router.add_post("/v1/nodes/heartbeat", heartbeat)
        return app


@pytest.fixture
async def agent(tmp_path):
    cp = ControlPlane()
    server = TestServer(cp.app())
    await server.start_server()
    children = []

    def spawn(argv, log_path, env=None, cpus=None, background=False):
        children.append(Child(5000 + len(children)))
        return children[-1]

    ports = iter(range(30000, 30100))
    url = str(server.make_url("")).rstrip("/")
    sup = ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url=url,
        trust_file=tmp_path / "trust.pem",
        files=ModelFilePolicy(roots=(Path("/"),)),
        spawn=spawn,
        pick_port=lambda: next(ports),
        sidecar_command=lambda a: ["sidecar"],
    )

    async def gpus():
        return [GPUInfo(index=0, name="virtual", total_mb=1000.0, used_mb=0.0, virtual=True)]

    async with aiohttp.ClientSession() as session:
        node = NodeAgent(
            AgentSettings("n1", url, NodeTunables(probe_timeout_s=0.05)),
            sup,
            session,
            credential=TokenSource(token="node-token"),
            gpus=gpus,
            facts={"python": "3.11.7"},
        )
        node.address = "http://127.0.0.1:1"
        node.cp, node.children = cp, children
        yield node
        await node.shutdown()
    await server.close()


async def test_heartbeat_reports_and_starts_assignments(agent):
    agent.cp.reply = {"authoritative": True, "assignments": [{"instance_id": "i1", "model_id": "m1", "spec": spec()}]}
    await agent.heartbeat_once()
    assert list(agent.supervisor.instances) == ["i1"] and len(agent.children) == 2
    await agent.heartbeat_once()
    beat = agent.cp.beats[-1]
    assert beat["node"] == "n1" and beat["gpus"][0]["virtual"] is True and beat["facts"] == {"python": "3.11.7"}
    (inst,) = beat["instances"]
    # The worker does not answer /health (a fake child): the process runs, so it is loading.
    assert inst["instance_id"] == "i1" and inst["state"] == "loading" and inst["version"] == "1.0.0"
    assert inst["spec"] == spec() and inst["sidecar_address"] == "127.0.0.1:30001"
    assert inst["control_address"] == "127.0.0.1:30002"  # the sidecar's control listener, a port of its own


async def test_non_authoritative_reply_changes_nothing(agent):
    agent.cp.reply = {"authoritative": True, "assignments": [{"instance_id": "i1", "model_id": "m1", "spec": spec()}]}
    await agent.heartbeat_once()
    agent.cp.reply = {"authoritative": False, "assignments": []}
    await agent.heartbeat_once()
    assert list(agent.supervisor.instances) == ["i1"]
    agent.cp.reply = {"authoritative": True, "assignments": []}
    await agent.heartbeat_once()
    for task in list(agent._stops.values()):
        await task
    assert agent.supervisor.instances == {}
    assert all(c.status is not None for c in agent.children)


async def test_unmet_requirements_are_refused_once_and_reported(agent):
    bad = {"instance_id": "i2", "model_id": "m1", "spec": spec(requires=["sglang==0.5.*"])}
    agent.cp.reply = {"authoritative": True, "assignments": [bad]}
    await agent.heartbeat_once()
    await agent.heartbeat_once()  # not retried: one refusal, no process
    assert agent.supervisor.instances == {} and agent.children == []
    (inst,) = agent.cp.beats[-1]["instances"]
    assert inst["state"] == "failed" and "sglang" in inst["detail"] and inst["detail"].startswith("refused:")
    agent.cp.reply = {"authoritative": True, "assignments": []}
    await agent.heartbeat_once()
    assert agent.refused == {}


@pytest.mark.parametrize(
    ("backend", "config", "field"),
    [
        ("sklearn", {"demo": "yes"}, "spec.backend.config.demo"),
        ("sklearn", {"seed": "3"}, "spec.backend.config.seed"),
        ("torch", {"max_running_requests": 0}, "spec.backend.config.max_running_requests"),
        ("sim", {"kv_tokens": "many"}, "kv_tokens"),
        # The spec may go without a model path (an image of its own on Kubernetes); SIE's worker may not.
        ("torch", None, "spec.model.path"),
        ("sklearn", None, "spec.model.path"),
    ],
)
async def test_a_wrong_engine_setting_is_refused_once_naming_the_field(agent, backend, config, field):
    # Its worker would exit with code 2 on start and be restarted with backoff for ever, its status
    # saying only "worker exit code 2"; refused here, no process starts and the status names the field.
    # (The control plane's spec loader refuses the others first; a node host checks what it is given.)
    path = None if field == "spec.model.path" else "/m"
    bad = {"instance_id": "i3", "model_id": "m1", "spec": spec(backend=backend, config=config, path=path)}
    agent.cp.reply = {"authoritative": True, "assignments": [bad]}
    await agent.heartbeat_once()
    await agent.heartbeat_once()
    assert agent.supervisor.instances == {} and agent.children == []
    (inst,) = agent.cp.beats[-1]["instances"]
    assert inst["state"] == "failed" and inst["detail"].startswith("refused:") and field in inst["detail"]


async def test_a_refusal_too_long_for_a_heartbeat_is_cut_not_left_to_break_it(agent):
    # 13 wrong simulator parameters of 4,000 characters each (the spec's bound for one value) made a
    # 52 KB reason; the control plane refuses a heartbeat whose texts exceed their bounds, and every
    # later one too while the refusal stands: the node would be cut off. Values are shown cut, and
    # each report's texts are cut to what a heartbeat may carry.
    from node_host.backends.sim.core import SimParams

    config = {f.name: "x" * 4000 for f in dataclasses.fields(SimParams)}
    bad = {"instance_id": "i3", "model_id": "m1", "spec": spec(backend="sim", config=config)}
    agent.cp.reply = {"authoritative": True, "assignments": [bad]}
    await agent.heartbeat_once()
    await agent.heartbeat_once()
    beat = NodeHeartbeat.from_json(json.loads(json.dumps(agent.cp.beats[-1])))  # as the control plane reads it
    (inst,) = beat.instances
    assert inst.state.value == "failed" and "prefill_ms_per_token" in inst.detail
    assert len(inst.detail) <= MAX_DETAIL and len(inst.unplaceable) <= MAX_UNPLACEABLE


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"labels": {f"k{i}": "v" for i in range(65)}}, "labels"),
        ({"taints": [f"k{i}=v:NoSchedule" for i in range(65)]}, "taints"),
        ({"node": "n" * 254}, "node"),
    ],
)
async def test_settings_that_every_heartbeat_would_break_on_are_found_before_the_first(agent, change, named):
    assert agent.heartbeat_problem() is None
    agent.settings = dataclasses.replace(agent.settings, **change)
    problem = agent.heartbeat_problem()
    assert problem is not None and named in problem
    # the control plane reads such a heartbeat as invalid (so the node host exits with code 2 instead)
    await agent.heartbeat_once()
    with pytest.raises(SpecError, match=named):
        NodeHeartbeat.from_json(json.loads(json.dumps(agent.cp.beats[-1])))


def test_a_report_is_fitted_to_the_heartbeat_bounds():
    long = InstanceReport("i", "m", "v" * 99, InstanceState.FAILED, {}, detail="d" * 10_000, unplaceable="u" * 5_000)
    fitted = long.fitted()
    assert (len(fitted.version), len(fitted.detail), len(fitted.unplaceable)) == (64, MAX_DETAIL, MAX_UNPLACEABLE)
    assert fitted.detail.endswith("...") and NodeHeartbeat.from_json(
        json.loads(json.dumps({"node": "n", "address": "http://n", "instances": [dataclasses.asdict(fitted)]}))
    )
    short = InstanceReport("i", "m", "1", InstanceState.FAILED, {}, detail="why")
    assert short.fitted() == short


async def test_unreachable_control_plane_keeps_instances(agent, tmp_path):
    agent.cp.reply = {"authoritative": True, "assignments": [{"instance_id": "i1", "model_id": "m1", "spec": spec()}]}
    await agent.heartbeat_once()
    agent.settings = AgentSettings("n1", "http://127.0.0.1:9", NodeTunables(post_timeout_s=0.5))
    assert await agent.heartbeat_once() is None
    assert agent.reachable is False and list(agent.supervisor.instances) == ["i1"]


@pytest.mark.parametrize(
    "stopping, worker_running, health, expect",
    [
        (True, True, "ok", InstanceState.DRAINING),
        (False, False, None, InstanceState.FAILED),
        (False, True, "ok", InstanceState.READY),
        (False, True, "sleeping", InstanceState.SLEEPING),
        (False, True, "failed", InstanceState.FAILED),
        (False, True, "loading", InstanceState.LOADING),
        (False, True, None, InstanceState.LOADING),
    ],
)
def test_instance_state(stopping, worker_running, health, expect):
    assert instance_state(stopping=stopping, worker_running=worker_running, health=health) is expect


async def test_the_node_token_in_a_reply_is_what_the_node_shows_its_sidecars(agent):
    # On Kubernetes the node's own credential is its service-account token, which sidecars cannot check:
    # it heartbeats with that, and calls its sidecars with the SIE token the reply carries.
    assert agent.sidecar_credential.headers() == {"Authorization": "Bearer node-token"}
    agent.cp.reply = {"authoritative": True, "assignments": [], "node_token": "issued-1"}
    await agent.heartbeat_once()
    assert agent.sidecar_credential.headers() == {"Authorization": "Bearer issued-1"}
    assert agent.control._credential is agent.sidecar_credential
    agent.cp.reply = {"authoritative": False, "assignments": [], "node_token": ""}  # nothing new: keep the last
    await agent.heartbeat_once()
    assert agent.sidecar_credential.token == "issued-1"
    assert len(agent.cp.beats) == 2  # heartbeats still carry the node's own credential (the fake checks it)
