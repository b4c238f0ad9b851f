"""The admin API's rollout routes, in process with real credentials: PUT of a new build (202 with its
rollout, 409 schema_incompatible listing each breaking difference), GET /v1/models/<id>/rollout, and the
by-hand actions pause, resume, abort and undo, each refused with 409 where the phase does not allow it."""

from __future__ import annotations

import dataclasses

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sie.auth import Identity, Signer, TokenAuthenticator
from sie.telemetry import InstanceState, TelemetryRecord
from sie_testing import error_shape
from xds_server.admin import AdminContext, make_app
from xds_server.ads import AdsServer
from xds_server.control import ControlLoop, PendingChanges
from xds_server.credentials import TokenIssuer
from xds_server.ingress import IngressConfig
from xds_server.metrics import ControlPlaneMetrics
from xds_server.policy.decisions import EqualWeights
from xds_server.registry import Registry
from xds_server.rollout.driver import RolloutDriver
from xds_server.rollout.machine import Phase
from xds_server.snapshots import SnapshotCache

TEXT = {"name": "text", "type": "string", "required": True, "max_length": 4096}


def spec(version: str = "1", fields: list[dict] | None = None, **more) -> dict:
    return {
        "kind": "ModelService",
        "spec": {
            "model": {"name": "m", "version": version, "service_type": "scoring"},
            "backend": {"type": "sim"},
            "input_schema": {"fields": fields if fields is not None else [TEXT]},
            "rollout": {"steps": [50, 100], "hold_s": 30},
            **more,
        },
    }


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class World:
    def __init__(self, client: TestClient, registry: Registry, signer: Signer, wall: Clock, saves: list):
        self.client, self.registry, self.signer, self.wall, self.saves = client, registry, signer, wall, saves
        self.admin = self.auth(Identity.admin())
        self.reader = self.auth(Identity.reader())

    def auth(self, who: Identity) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.signer.issue(who)}"}

    async def call(self, method: str, path: str, status: int, headers=None, **kw) -> dict:
        resp = await self.client.request(method, path, headers=headers or self.admin, **kw)
        body = await resp.json()
        assert resp.status == status, body
        if status >= 400:
            error_shape.check(status, body)
        return body

    async def serving(self) -> None:
        """Model m, version 1, made through the API, with one ready instance."""
        await self.call("POST", "/v1/models", 201, json=spec("1"))
        self.registry.mark_synced()
        self.registry.record_telemetry(
            TelemetryRecord("m-0", "m", "1", "127.0.0.1:9000", "n1", InstanceState.READY, seq=1)
        )

    async def rolling(self) -> None:
        await self.serving()
        body = await self.call("PUT", "/v1/models/m", 202, json=spec("2"))
        assert body["rollout"]["phase"] == "progressing"

    def move(self, **changes) -> None:
        """The rollout machine moved (the driver's tick, by hand)."""
        state = self.registry.models["m"].rollout
        self.registry.set_rollout("m", dataclasses.replace(state, **changes))


async def open_world(with_driver: bool = True) -> World:
    signer = Signer.generate()
    mono, wall = Clock(100.0), Clock(5000.0)
    metrics, cache = ControlPlaneMetrics(), SnapshotCache()
    changes = PendingChanges(mono)
    registry = Registry(clock=mono, wall_clock=wall, changes=changes, tokens=TokenIssuer(signer))
    control = ControlLoop(registry, EqualWeights(), cache, metrics, IngressConfig(), mono, wall, changes=changes)
    saves: list = []
    ctx = AdminContext(
        registry,
        control,
        metrics,
        AdsServer(cache, metrics, mono),
        mono,
        wall,
        TokenAuthenticator(signer.verifier()),
        "equal",
        on_models_changed=lambda: saves.append(1),
        rollouts=RolloutDriver(registry) if with_driver else None,
    )
    client = TestClient(TestServer(make_app(ctx)))
    await client.start_server()
    return World(client, registry, signer, wall, saves)


@pytest.fixture
async def world():
    w = await open_world()
    try:
        yield w
    finally:
        await w.client.close()


# ---- PUT ----------------------------------------------------------------------------------------


async def test_put_of_a_new_build_of_a_serving_model_starts_a_rollout(world):
    await world.serving()
    saves = len(world.saves)
    body = await world.call("PUT", "/v1/models/m", 202, json=spec("2"))
    rollout = body["rollout"]
    assert body["model"] == "m"
    assert (rollout["phase"], rollout["from_version"], rollout["to_version"]) == ("progressing", "1", "2")
    assert (rollout["generation"], rollout["step"], rollout["steps"], rollout["share"]) == (
        1,
        1,
        [50, 100],
        {"new": 0, "old": 100},
    )
    assert rollout["held_s"] is None and rollout["started_at"] == 5000.0
    entry = world.registry.models["m"]
    assert entry.rolling and entry.service.spec.model.version == "1" and entry.target.spec.model.version == "2"
    assert len(world.saves) == saves + 1  # recorded, so a restart resumes it
    assert await world.call("GET", "/v1/models/m/rollout", 200, headers=world.reader) == rollout


@pytest.mark.parametrize(
    ("ready", "new", "status"),
    [
        (True, spec("1", sla={"p99_latency_ms": 500}), 200),  # not a new build: applied in place
        (False, spec("2"), 200),  # a new build with nothing serving: nothing to protect
    ],
    ids=["sla change", "nothing serving"],
)
async def test_put_that_is_no_rollout_applies_in_place(world, ready, new, status):
    await world.call("POST", "/v1/models", 201, json=spec("1"))
    world.registry.mark_synced()
    if ready:
        world.registry.record_telemetry(
            TelemetryRecord("m-0", "m", "1", "127.0.0.1:9000", "n1", InstanceState.READY, seq=1)
        )
    body = await world.call("PUT", "/v1/models/m", status, json=new)
    assert body["spec"]["model"]["version"] == new["spec"]["model"]["version"]
    assert world.registry.models["m"].rollout is None
    await world.call("GET", "/v1/models/m/rollout", 404)


async def test_put_during_a_rollout_is_409_rollout_in_progress(world):
    await world.rolling()
    body = await world.call("PUT", "/v1/models/m", 409, json=spec("3"))
    assert body["error"]["type"] == "rollout_in_progress" and "sie rollout abort m" in body["error"]["message"]
    assert world.registry.models["m"].target.spec.model.version == "2"


# ---- schema compatibility -------------------------------------------------------------------------

LANG = {"name": "lang", "type": "string", "required": True}

BREAKING = {
    "a required field added": ([TEXT, LANG], [("lang", "required_field_added")]),
    "a narrower length and a required field": (
        [{**TEXT, "max_length": 100}, LANG],
        [("lang", "required_field_added"), ("text", "length_narrowed")],
    ),
}


@pytest.mark.parametrize(("fields", "differences"), BREAKING.values(), ids=BREAKING.keys())
async def test_a_breaking_schema_change_is_409_listing_each_difference(world, fields, differences):
    await world.serving()
    saves = len(world.saves)
    body = await world.call("PUT", "/v1/models/m", 409, json=spec("2", fields))
    error = body["error"]
    assert (error["type"], error["model"]) == ("schema_incompatible", "m")
    assert [(d["field"], d["kind"]) for d in error["differences"]] == differences
    assert all(d["breaking"] and d["side"] == "input" and d["message"] for d in error["differences"])
    assert f"in {len(differences)} way(s)" in error["message"] and "allow_breaking=true" in error["message"]
    entry = world.registry.models["m"]
    assert entry.rollout is None and entry.service.spec.model.version == "1" and len(world.saves) == saves


@pytest.mark.parametrize(
    ("query", "status"),
    [("true", 202), ("1", 202), ("yes", 202), ("TRUE", 202), ("false", 409), ("no", 409), ("", 409)],
)
async def test_allow_breaking_applies_a_breaking_change_anyway(world, query, status):
    await world.serving()
    await world.call("PUT", f"/v1/models/m?allow_breaking={query}", status, json=spec("2", [TEXT, LANG]))
    assert (world.registry.models["m"].rollout is not None) is (status == 202)


async def test_a_compatible_schema_change_needs_no_permission(world):
    await world.serving()
    optional = {"name": "lang", "type": "string", "required": False}
    await world.call("PUT", "/v1/models/m", 202, json=spec("2", [{**TEXT, "max_length": 8192}, optional]))


# ---- GET rollout ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/v1/models/nope/rollout", "model_not_found"), ("/v1/models/m/rollout", "no_rollout")],
)
async def test_get_rollout_without_one_is_404(world, path, kind):
    await world.serving()
    body = await world.call("GET", path, 404, headers=world.reader)
    assert body["error"]["type"] == kind


async def test_get_rollout_shows_how_long_the_live_step_has_held(world):
    await world.rolling()
    world.move(live=True, share=50, step_since=5000.0)
    world.wall.now = 5012.34
    body = await world.call("GET", "/v1/models/m/rollout", 200, headers=world.reader)
    assert (body["held_s"], body["hold_s"], body["share"], body["live"]) == (12.3, 30.0, {"new": 50, "old": 50}, True)


# ---- actions ------------------------------------------------------------------------------------

# One rollout, acted on in turn: (action, status, phase after or error type)
ACTIONS = [
    ("pause", 200, "paused"),
    ("pause", 409, "rollout_conflict"),
    ("resume", 200, "progressing"),
    ("resume", 409, "rollout_conflict"),
    ("undo", 409, "rollout_in_progress"),
    ("abort", 200, "aborted"),
    ("abort", 409, "rollout_conflict"),
    ("resume", 409, "rollout_conflict"),
    ("pause", 409, "rollout_conflict"),
    ("undo", 409, "rollout_conflict"),  # nothing succeeded: no earlier build to go back to
]


async def test_by_hand_actions_follow_the_phase(world):
    await world.rolling()
    for action, status, outcome in ACTIONS:
        saves = len(world.saves)
        body = await world.call("POST", f"/v1/models/m/rollout/{action}", status)
        if status == 200:
            assert body["phase"] == outcome and world.registry.models["m"].rollout.phase.value == outcome
            assert len(world.saves) == saves + 1, action
        else:
            assert body["error"]["type"] == outcome, action
            assert len(world.saves) == saves, action
    entry = world.registry.models["m"]
    assert not entry.rolling and entry.service.spec.model.version == "1"


async def test_resume_restarts_the_hold(world):
    await world.rolling()
    world.move(live=True, share=50, step_since=5000.0)
    await world.call("POST", "/v1/models/m/rollout/pause", 200)
    world.wall.now = 5100.0
    body = await world.call("POST", "/v1/models/m/rollout/resume", 200)
    assert (body["step_since"], body["held_s"]) == (5100.0, 0.0)


async def test_undo_after_a_success_rolls_the_build_before_out_again(world):
    await world.rolling()
    world.move(live=True, share=100, step=1, step_since=5000.0)
    world.move(phase=Phase.SUCCEEDED, finished_at=5040.0)
    assert world.registry.models["m"].service.spec.model.version == "2"
    body = await world.call("POST", "/v1/models/m/rollout/undo", 200)
    assert (body["phase"], body["from_version"], body["to_version"], body["generation"]) == ("progressing", "2", "1", 2)
    assert world.registry.models["m"].target.spec.model.version == "1"
    body = await world.call("POST", "/v1/models/m/rollout/undo", 409)
    assert body["error"]["type"] == "rollout_in_progress"


@pytest.mark.parametrize(
    ("path", "status", "kind"),
    [
        ("/v1/models/nope/rollout/pause", 404, "model_not_found"),
        ("/v1/models/m/rollout/restart", 404, "not_found"),
        ("/v1/models/m/rollout/pause", 409, "rollout_conflict"),  # a model with no rollout
    ],
)
async def test_an_action_on_nothing_to_act_on(world, path, status, kind):
    await world.serving()
    body = await world.call("POST", path, status)
    assert body["error"]["type"] == kind


async def test_without_a_driver_the_actions_are_404():
    w = await open_world(with_driver=False)
    try:
        await w.rolling()
        body = await w.call("POST", "/v1/models/m/rollout/pause", 404)
        assert body["error"]["type"] == "not_found"
        assert w.registry.models["m"].rollout.phase is Phase.PROGRESSING
    finally:
        await w.client.close()


# ---- who may ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("who", "method", "path", "status"),
    [
        (Identity.reader(), "GET", "/v1/models/m/rollout", 200),
        (Identity.reader(), "POST", "/v1/models/m/rollout/pause", 403),
        (Identity.reader(), "POST", "/v1/models/m/rollout/undo", 403),
        (Identity.for_node("n1"), "GET", "/v1/models/m/rollout", 403),
        (Identity.for_node("n1"), "POST", "/v1/models/m/rollout/abort", 403),
        (Identity.for_sidecar("m-0", "m", "n1"), "POST", "/v1/models/m/rollout/abort", 403),
        (Identity.envoy(), "GET", "/v1/models/m/rollout", 403),
        (None, "GET", "/v1/models/m/rollout", 401),
        (None, "POST", "/v1/models/m/rollout/abort", 401),
    ],
)
async def test_an_identity_may_do_only_what_its_role_allows(world, who, method, path, status):
    await world.rolling()
    headers = world.auth(who) if who is not None else {}
    body = await world.call(method, path, status, headers=headers or {"Authorization": "Bearer nonsense"})
    if status >= 400:
        assert body["error"]["type"] == ("forbidden" if status == 403 else "unauthenticated")
    assert world.registry.models["m"].rollout.phase is Phase.PROGRESSING
