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
from sie import strict_json
from sie.auth import TokenSource
from sie.errors import SpecError
from sie.model_files import ModelFilePolicy
from sie.spec import spec_digest
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState
from sie.wire import (
    MAX_DETAIL,
    MAX_SPEC_BYTES_PER_BEAT,
    MAX_UNPLACEABLE,
    GPUInfo,
    InstanceReport,
    NodeHeartbeat,
)
from xds_server.admin import MAX_BODY_BYTES
from xds_server.registry import Registry


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
    """Answers heartbeats with `reply`, or, once `registry` is set, as the control plane does (the real
    registry, the heartbeat decoded as the admin API decodes it). Keeps every beat and its size."""

    def __init__(self):
        self.reply = {"authoritative": True, "assignments": []}
        self.beats = []
        self.sizes: list[int] = []
        self.registry: Registry | None = None
        self.replies: list[dict] = []
        # The node's own token, and every node token a reply handed out (as the real control plane
        # verifies what it signed); a test empties `issued` to play a control plane with a new key.
        self.issued: set[str] = set()
        self.shown: list[str] = []  # the credential of each beat, accepted or not

    def app(self) -> web.Application:
        async def heartbeat(request):
            shown = request.headers.get("Authorization", "")
            self.shown.append(shown)
            if shown not in {"Bearer node-token", *(f"Bearer {t}" for t in self.issued)}:
                return web.json_response({"error": {"type": "unauthenticated", "message": "no"}}, status=401)
            body = await request.read()
            self.sizes.append(len(body))
            self.beats.append(json.loads(body))
            if self.registry is None:
                reply = self.reply
            else:
                reply = self.registry.heartbeat_json(NodeHeartbeat.from_json(strict_json.loads(body)))
                self.replies.append(reply)
            if reply.get("node_token"):
                self.issued.add(reply["node_token"])
            return web.json_response(reply)

        app = web.Application(client_max_size=MAX_BODY_BYTES)
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

    ports = iter(range(30000, 31000))
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


async def test_the_node_token_in_a_reply_is_what_the_node_shows_from_then_on(agent):
    # The node's own credential (its token file; on Kubernetes its service-account token, which sidecars
    # cannot check) goes to the control plane once; the SIE token the reply carries, renewed by every
    # reply and expiring within the hour, is what its heartbeats and its calls to its sidecars show after.
    assert agent.node_credential.headers() == {"Authorization": "Bearer node-token"}
    agent.cp.reply = {"authoritative": True, "assignments": [], "node_token": "issued-1"}
    await agent.heartbeat_once()
    assert agent.node_credential.headers() == {"Authorization": "Bearer issued-1"}
    assert agent.control._credential is agent.node_credential
    agent.cp.reply = {"authoritative": False, "assignments": [], "node_token": ""}  # nothing new: keep the last
    await agent.heartbeat_once()
    assert agent.node_credential.token == "issued-1"
    assert agent.cp.shown == ["Bearer node-token", "Bearer issued-1"]


async def test_a_renewed_token_the_control_plane_refuses_gives_way_to_the_nodes_own(agent):
    """A control plane with a new signing key refuses what the old one signed: the node goes back to its
    own credential on the next beat rather than being locked out."""
    agent.cp.reply = {"authoritative": True, "assignments": [], "node_token": "issued-1"}
    await agent.heartbeat_once()
    agent.cp.issued.clear()
    agent.cp.reply = {"authoritative": True, "assignments": [], "node_token": "issued-2"}
    assert await agent.heartbeat_once() is not None, "the same beat, again with the node's own credential"
    assert agent.cp.shown == ["Bearer node-token", "Bearer issued-1", "Bearer node-token"]
    assert agent.node_credential.token == "issued-2"


# ---- specs travel once (sie.wire) ----------------------------------------------------------------------


def big_spec(name: str, replicas: int, pad: int = 0) -> dict:
    """A sim model's spec, `pad` characters of annotation larger: a spec may have 256 KiB."""
    doc = spec(name, backend="sim", path=None)
    doc["spec"]["sla"] = {"min_replicas": replicas, "max_replicas": replicas}
    if pad:
        doc["metadata"]["annotations"] = {"notes": "x" * pad}
    return parse_model_service(doc).to_dict()


def synced_registry(*specs: dict) -> Registry:
    registry = Registry(clock=lambda: 1000.0)
    for doc in specs:
        registry.add_model(parse_model_service(doc), "file")
    registry.mark_synced()
    return registry


def reported_specs(beat: dict) -> int:
    return sum(len(json.dumps(i["spec"], separators=(",", ":"))) for i in beat["instances"] if i["spec"] is not None)


async def test_a_steady_node_sends_and_receives_no_specs(agent):
    doc = big_spec("m1", 2)
    agent.cp.registry = synced_registry(doc)
    await agent.heartbeat_once()  # the node runs nothing yet: the reply carries the spec, once
    assert [a["spec"] is not None for a in agent.cp.replies[-1]["assignments"]] == [True, False]
    assert sorted(agent.supervisor.instances) == ["m1-0", "m1-1"] and len(agent.children) == 4
    for _ in range(3):
        await agent.heartbeat_once()
    beat, reply = agent.cp.beats[-1], agent.cp.replies[-1]
    # Each side names the spec by its digest; neither sends it again, and nothing restarts.
    assert [(i["spec"], i["spec_digest"]) for i in beat["instances"]] == [(None, spec_digest(doc))] * 2
    assert [(a["spec"], a["spec_digest"]) for a in reply["assignments"]] == [(None, spec_digest(doc))] * 2
    assert reply["send_specs"] == [] and len(agent.children) == 4
    assert all(r.spec == doc for r in agent.cp.registry.nodes["n1"].reports.values())  # filled in from its build


async def test_a_new_build_travels_and_the_instance_takes_it(agent):
    agent.cp.registry = registry = synced_registry(big_spec("m1", 1))
    await agent.heartbeat_once()
    await agent.heartbeat_once()
    scaled = big_spec("m1", 1)
    scaled["spec"]["rollout"] = {**scaled["spec"]["rollout"], "hold_s": 7.0}  # the fleet's shape: taken in place
    registry.update_model(parse_model_service(scaled), "file")
    await agent.heartbeat_once()
    (assignment,) = agent.cp.replies[-1]["assignments"]
    assert assignment["spec"] == scaled and assignment["spec_digest"] == spec_digest(scaled)
    assert agent.supervisor.instances["m1-0"].spec == scaled and len(agent.children) == 2
    await agent.heartbeat_once()
    assert agent.cp.beats[-1]["instances"][0]["spec"] is None  # the control plane sent it: it has it


async def test_a_restarted_control_plane_asks_for_the_specs_and_recovers_the_model(agent):
    doc = big_spec("m1", 1)
    agent.cp.registry = synced_registry(doc)
    for _ in range(3):
        await agent.heartbeat_once()
    agent.cp.registry = fresh = Registry(clock=lambda: 1000.0)  # restarted, with no state directory
    await agent.heartbeat_once()
    assert agent.cp.beats[-1]["instances"][0]["spec"] is None  # the last control plane had it
    assert agent.cp.replies[-1]["send_specs"] == ["m1-0"] and fresh.specs_missing() == 1
    assert "m1" not in fresh.models
    await agent.heartbeat_once()
    assert agent.cp.beats[-1]["instances"][0]["spec"] == doc
    assert fresh.models["m1"].service == parse_model_service(doc) and fresh.specs_missing() == 0
    await agent.heartbeat_once()
    assert agent.cp.beats[-1]["instances"][0]["spec"] is None
    fresh.mark_synced()
    await agent.heartbeat_once()
    assert list(agent.supervisor.instances) == ["m1-0"] and len(agent.children) == 2  # nothing restarted


async def test_a_heartbeat_stays_under_the_body_cap_however_large_the_specs(agent):
    """90 models of a 200 KB spec each on one node: 18 MB of specs, which every heartbeat (and every
    reply) carried before, over the control plane's 16 MiB body cap: a 413 on every beat, the node cut
    off. Now at most 4 MiB of specs go either way in one beat, and each only until the other side has it."""
    docs = [big_spec(f"big{n}", 1, pad=200_000) for n in range(90)]
    assert sum(len(json.dumps(doc)) for doc in docs) > MAX_BODY_BYTES  # what one heartbeat used to carry
    agent.cp.registry = synced_registry(*docs)
    for _ in range(5):  # 20 specs a reply (4 MiB): 5 replies for 90, the others wait
        await agent.heartbeat_once()
        assert len(agent.cp.replies[-1]["assignments"]) == 90
    assert len(agent.supervisor.instances) == 90 and len(agent.children) == 180
    assert [sum(a["spec"] is not None for a in r["assignments"]) for r in agent.cp.replies] == [20, 20, 20, 20, 10]
    agent.cp.registry = fresh = Registry(clock=lambda: 1000.0)  # restarted: every spec is asked for
    await agent.heartbeat_once()
    assert len(agent.cp.replies[-1]["send_specs"]) == 90
    beats = 0
    while fresh.specs_missing() and beats < 10:
        await agent.heartbeat_once()
        beats += 1
    assert beats == 5 and {mid: m.service.to_dict() for mid, m in fresh.models.items()} == {
        doc["metadata"]["name"]: doc for doc in docs
    }
    assert max(agent.cp.sizes) < MAX_BODY_BYTES
    assert max(len(json.dumps(r)) for r in agent.cp.replies) < MAX_BODY_BYTES
    assert max(reported_specs(b) for b in agent.cp.beats) <= MAX_SPEC_BYTES_PER_BEAT
    await agent.heartbeat_once()
    assert reported_specs(agent.cp.beats[-1]) == 0 and len(agent.children) == 180  # nothing restarted


async def test_a_spec_goes_once_even_for_an_instance_the_control_plane_no_longer_assigns(agent):
    """A draining instance (or one a non-authoritative reply leaves out) is not in the reply's
    assignments; its spec went with a beat the control plane answered without asking again: it has it."""
    agent.cp.reply = {"authoritative": True, "assignments": [{"instance_id": "i1", "model_id": "m1", "spec": spec()}]}
    await agent.heartbeat_once()
    agent.cp.reply = {"authoritative": False, "assignments": []}
    for _ in range(3):
        await agent.heartbeat_once()
    assert [b["instances"][0]["spec"] is not None for b in agent.cp.beats[1:]] == [True, False, False]
    agent.cp.reply = {"authoritative": False, "assignments": [], "send_specs": ["i1"]}  # asked: sent again
    await agent.heartbeat_once()
    await agent.heartbeat_once()
    assert agent.cp.beats[-1]["instances"][0]["spec"] == spec()


def test_a_heartbeat_of_long_non_ascii_details_is_sent_short_not_refused(agent):
    detail = "内存不足" * 1024  # 4,096 characters, 24 KiB as escaped JSON
    doc = big_spec("m1", 1, pad=200_000)
    reports = [
        InstanceReport(f"i{n}", "m1", "1", InstanceState.FAILED, doc if n < 20 else None, detail=detail)
        for n in range(1024)
    ]
    body = agent._encoded(agent._beat([], reports))
    assert len(body) <= MAX_BODY_BYTES
    beat = NodeHeartbeat.from_json(strict_json.loads(body))  # as the control plane reads it
    assert len(beat.instances) == 1024 and beat.instances[0].detail == detail[:253] + "..."
    assert sum(i.spec is not None for i in beat.instances) == 20  # cut texts leave room for 4 MiB of specs


async def test_an_assignment_without_a_spec_the_node_does_not_hold_waits_for_the_next_reply(agent):
    doc = spec()
    agent.cp.reply = {"authoritative": True, "assignments": [{"instance_id": "i1", "model_id": "m1", "spec": doc}]}
    await agent.heartbeat_once()
    agent.cp.reply = {
        "authoritative": True,
        "assignments": [
            {"instance_id": "i1", "model_id": "m1", "spec": None, "spec_digest": "0" * 64},  # not what i1 runs
            {"instance_id": "i2", "model_id": "m1", "spec": None, "spec_digest": "0" * 64},  # nothing holds it
            {"instance_id": "i3", "model_id": "m1", "spec": None, "spec_digest": spec_digest(doc)},  # i1's
        ],
    }
    await agent.heartbeat_once()
    # i1 keeps running as it is, i2 is not started on a guess, i3 starts with the spec this node holds.
    assert sorted(agent.supervisor.instances) == ["i1", "i3"] and len(agent.children) == 4
    assert agent.supervisor.instances["i3"].spec == doc
    await agent.heartbeat_once()
    reports = {i["instance_id"]: i for i in agent.cp.beats[-1]["instances"]}
    # i1's spec went with the beat before (its first assignment named no digest), and the control plane
    # did not ask for it again; i3's was assigned with its digest: neither travels again.
    assert [i["spec"] is not None for i in agent.cp.beats[-2]["instances"]] == [True]
    assert (reports["i1"]["spec"], reports["i3"]["spec"]) == (None, None)
    assert reports["i3"]["spec_digest"] == spec_digest(doc)
