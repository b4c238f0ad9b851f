"""Rollouts through the registry and what it feeds: which update starts one, the placement of both builds,
promotion and rollback, undo, the driver's tick, the split of endpoints by build (control.split_by_build),
the canary's Envoy resources (weighted clusters), and the state file's round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2

from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import InstanceReport, NodeHeartbeat
from xds_server.control import split_by_build
from xds_server.ingress import IngressConfig
from xds_server.placement import Track
from xds_server.policy.decisions import EndpointDecision, Health, ModelDecision
from xds_server.registry import ModelEntry, Registry, RolloutInProgress
from xds_server.resources import CLUSTER, ENDPOINT, ROUTE, CanaryInputs, ModelInputs, ResourceCache
from xds_server.rollout.driver import RolloutDriver
from xds_server.rollout.machine import Phase, RolloutConflict, RolloutState, act
from xds_server.rollout.machine import start as start_rollout
from xds_server.snapshots import check_consistency
from xds_server.state import ModelState, SavedModel


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Changes(list):
    """A ChangeSink that keeps every report, in order."""

    notify = list.append


def svc(version: str = "1", replicas: int = 2, **spec):
    doc = {
        "model": {"name": "m", "version": version},
        "backend": {"type": "sim"},
        "sla": {"min_replicas": replicas},
        "rollout": {"steps": [50, 100], "hold_s": 10, "gates": {"min_requests": 1}},
    }
    for key, value in spec.items():
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) else value
    return parse_model_service({"spec": doc})


V1, V2 = svc("1"), svc("2")


def report(iid: str, service=V1, state=InstanceState.READY, port: int = 9000, detail: str = "") -> InstanceReport:
    return InstanceReport(
        iid,
        "m",
        service.spec.model.version,
        state,
        service.to_dict(),
        sidecar_address=f"127.0.0.1:{port}",
        detail=detail,
    )


def hb(*instances: InstanceReport, node: str = "n1") -> NodeHeartbeat:
    return NodeHeartbeat(node=node, address=f"http://{node}", instances=list(instances))


def rec(iid: str, state=InstanceState.READY, seq: int = 1, port: int = 9000, n: int = 0, p99=None) -> TelemetryRecord:
    return TelemetryRecord(
        iid, "m", "1", f"127.0.0.1:{port}", "n1", state, seq=seq, window_requests=n, latency_p99_ms=p99
    )


@pytest.fixture
def clocks():
    return Clock(100.0), Clock(5000.0)


@pytest.fixture
def changes():
    return Changes()


@pytest.fixture
def reg(clocks, changes):
    mono, wall = clocks
    return Registry(clock=mono, wall_clock=wall, changes=changes)


def serving(reg: Registry, service=V1, ready: tuple[str, ...] = ("m-0",)) -> None:
    """The model runs on node n1 and its listed instances report ready."""
    reg.put_model(service, "api")
    reg.heartbeat(hb())
    reg.mark_synced()
    for iid in ready:
        reg.record_telemetry(rec(iid))


def assigned(reg: Registry) -> list[tuple[str, str]]:
    """(instance id, the spec's version) of what node n1 is told to run (a reply carries each spec once)."""
    assignments = reg.heartbeat(hb()).assignments
    versions = {a.spec_digest: a.spec["spec"]["model"]["version"] for a in assignments if a.spec is not None}
    return [(a.instance_id, versions[a.spec_digest]) for a in assignments]


# ---- which update is a rollout ----------------------------------------------------------------------

# (what the new spec changes, what is ready) -> the outcome
UPDATES = {
    "sla only": ({"sla": {"p99_latency_ms": 500}}, ("m-0",), "replaced"),
    "replicas only": ({"sla": {"min_replicas": 3}}, ("m-0",), "replaced"),
    "the rollout policy only": ({"rollout": {"hold_s": 99}}, ("m-0",), "replaced"),
    "version, nothing ready": ({"model": {"version": "2"}}, (), "replaced"),
    "version, a new build's instance ready only": ({"model": {"version": "2"}}, ("m.g3-0",), "replaced"),
    "version, serving": ({"model": {"version": "2"}}, ("m-0",), "rollout"),
    "image, serving": ({"model": {"image": "registry.example/m:2"}}, ("m-0",), "rollout"),
    "backend config, serving": ({"backend": {"config": {"max_seq_len": 4096}}}, ("m-0",), "rollout"),
}


@pytest.mark.parametrize(("change", "ready", "outcome"), UPDATES.values(), ids=UPDATES.keys())
def test_update_model_replaces_in_place_or_starts_a_rollout(reg, changes, change, ready, outcome):
    serving(reg, ready=ready)
    new = svc(**change)
    assert reg.update_model(new, "api") == outcome
    entry = reg.models["m"]
    if outcome == "replaced":
        assert (entry.service, entry.spec_dict, entry.generation) == (new, new.to_dict(), 0)
        assert entry.rollout is None and entry.target is None and not entry.rolling
        return
    assert entry.service == V1 and entry.target == new and entry.target_dict == new.to_dict()
    state = entry.rollout
    assert state is not None and entry.rolling and changes[-1] is None
    assert (state.phase, state.from_generation, state.generation) == (Phase.PROGRESSING, 0, 1)
    assert (state.from_version, state.to_version, state.started_at) == ("1", new.spec.model.version, 5000.0)
    assert state.policy == new.spec.rollout and state.replicas == 2


def test_a_new_model_is_created(reg):
    assert reg.update_model(V1, "api") == "created" and reg.models["m"].service == V1


@pytest.mark.parametrize("second", [svc("3"), svc("1", sla={"p99_latency_ms": 500})], ids=["a build", "the sla"])
def test_any_second_update_during_a_rollout_is_refused(reg, second):
    serving(reg)
    reg.update_model(V2, "api")
    before = reg.models["m"].rollout
    with pytest.raises(RolloutInProgress) as info:
        reg.update_model(second, "api")
    assert (info.value.kind, info.value.status) == ("rollout_in_progress", 409)
    assert "sie rollout abort m" in str(info.value)
    entry = reg.models["m"]
    assert (entry.service, entry.target, entry.rollout) == (V1, V2, before)


def test_after_an_abort_the_next_build_gets_a_generation_past_every_earlier_one(reg):
    serving(reg)
    reg.update_model(V2, "api")
    reg.set_rollout("m", act(reg.models["m"].rollout, "abort", 5001.0))
    assert reg.update_model(svc("3"), "api") == "rollout"
    state = reg.models["m"].rollout
    assert (state.from_generation, state.generation, state.to_version) == (0, 2, "3")
    assert [iid for iid, _ in assigned(reg)] == ["m-0", "m-1", "m.g2-0"]


# ---- both builds in the placement ---------------------------------------------------------------


def test_during_a_rollout_each_build_runs_its_own_spec_in_its_own_ids(reg):
    serving(reg)
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1")]
    reg.update_model(V2, "api")
    entry = reg.models["m"]
    assert entry.tracks() == [Track(0, 2), Track(1, 1)]
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1"), ("m.g1-0", "2")]
    assert entry.spec_of(1) == (V2, V2.to_dict()) and entry.spec_of(0) == (V1, V1.to_dict())
    # 50% live: the default surge keeps the old build whole; then the 100% step is prepared: 2 new.
    live = dataclasses.replace(entry.rollout, live=True, share=50, step_since=5001.0)
    reg.set_rollout("m", live)
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1"), ("m.g1-0", "2")]
    reg.set_rollout("m", dataclasses.replace(live, step=1, live=False))
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1"), ("m.g1-0", "2"), ("m.g1-1", "2")]


def test_promotion_makes_the_new_build_stable_under_the_same_ids(reg):
    serving(reg)
    reg.update_model(V2, "api")
    state = reg.models["m"].rollout
    last = dataclasses.replace(state, step=1, live=True, share=100, step_since=5001.0)
    reg.set_rollout("m", last)
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1"), ("m.g1-0", "2"), ("m.g1-1", "2")]
    placed = {iid: reg.placement.by_instance[iid] for iid in ("m.g1-0", "m.g1-1")}
    reg.set_rollout("m", dataclasses.replace(last, phase=Phase.SUCCEEDED, finished_at=5020.0))
    entry = reg.models["m"]
    assert (entry.generation, entry.service, entry.spec_dict, entry.previous) == (1, V2, V2.to_dict(), V1)
    assert entry.target is None and entry.target_dict is None and not entry.rolling
    assert entry.tracks() == [Track(1, 2)]
    assert assigned(reg) == [("m.g1-0", "2"), ("m.g1-1", "2")]  # no instance renamed or moved
    assert {iid: reg.placement.by_instance[iid] for iid in placed} == placed


@pytest.mark.parametrize("how", ["rolled back", "aborted"])
def test_a_rollback_leaves_only_the_old_build(reg, clocks, how):
    serving(reg)
    reg.update_model(V2, "api")
    state = dataclasses.replace(reg.models["m"].rollout, live=True, share=50, step_since=5001.0)
    reg.set_rollout("m", state)
    if how == "aborted":
        state = act(state, "abort", 5002.0)
    else:
        state = dataclasses.replace(state, phase=Phase.ROLLED_BACK, share=0, live=False, finished_at=5002.0)
    reg.set_rollout("m", state)
    entry = reg.models["m"]
    assert (entry.generation, entry.service, entry.previous, entry.rolling) == (0, V1, None, False)
    assert entry.target == V2  # kept while its instances drain (split_by_build)
    # The new build stays placed, with its own spec, while the routes leave it (retire_s): stopping it at
    # once could take its hosts out of Envoy before Envoy has the routes without it.
    assert entry.tracks() == [Track(0, 2), Track(1, 1)]
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1"), ("m.g1-0", "2")]
    reg.sweep()
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1"), ("m.g1-0", "2")]
    clocks[0].now += reg.retire_s
    reg.sweep()
    assert entry.tracks() == [Track(0, 2)]
    assert assigned(reg) == [("m-0", "1"), ("m-1", "1")]


def test_set_rollout_tells_the_routes_of_a_share_and_the_placement_of_counts(reg, changes):
    serving(reg)
    reg.update_model(V2, "api")
    state = reg.models["m"].rollout
    changes.clear()
    reg.set_rollout("m", dataclasses.replace(state, reason="still waiting"))
    assert changes == []  # nothing Envoy or a node host sees moved
    live = dataclasses.replace(state, live=True, share=50, step_since=5001.0)
    reg.set_rollout("m", live)  # the same counts (the default surge keeps the old build whole), a split
    assert changes == [{"m"}]
    reg.set_rollout("m", dataclasses.replace(live, step=1, live=False))  # the next step: counts move (new 1 -> 2)
    assert changes == [{"m"}, None]


# ---- undo ---------------------------------------------------------------------------------------


def test_undo_after_a_success_rolls_out_the_build_before(reg):
    serving(reg)
    reg.update_model(V2, "api")
    state = reg.models["m"].rollout
    reg.set_rollout("m", dataclasses.replace(state, phase=Phase.SUCCEEDED, share=100, finished_at=5020.0))
    undo = reg.rollout_undo("m")
    entry = reg.models["m"]
    assert (undo.from_version, undo.to_version, undo.from_generation, undo.generation) == ("2", "1", 1, 2)
    assert entry.rolling and entry.target == V1 and entry.service == V2
    assert [iid for iid, _ in assigned(reg)] == ["m.g1-0", "m.g1-1", "m.g2-0"]
    with pytest.raises(RolloutInProgress):
        reg.rollout_undo("m")


def test_undo_without_an_earlier_build_is_a_conflict(reg):
    serving(reg)
    with pytest.raises(RolloutConflict) as info:
        reg.rollout_undo("m")
    assert "no earlier build" in str(info.value) and info.value.status == 409


# ---- the driver -----------------------------------------------------------------------------------


def test_the_driver_advances_on_each_builds_own_telemetry(reg, clocks):
    mono, _ = clocks
    saved, moved = [], []
    driver = RolloutDriver(reg, on_change=lambda: saved.append(1), on_transition=moved.append)
    serving(reg, ready=())
    reg.heartbeat(hb(report("m-0"), report("m-1", port=9001)))
    mono.now += 0.1
    reg.record_telemetry(rec("m-0", n=50, p99=10.0))
    reg.record_telemetry(rec("m-1", port=9001, n=50, p99=10.0))
    assert reg.update_model(V2, "api") == "rollout"
    driver.tick()
    state = reg.models["m"].rollout
    assert (state.live, state.new_stats.ready, state.old_stats.ready, state.old_stats.requests) == (False, 0, 2, 100)
    # The first observation starts the first step's wait for its instances: recorded, so that a restart
    # keeps its progress deadline; no transition.
    assert (state.preparing_since, saved, moved) == (reg.wall_clock(), [1], [])
    driver.tick()
    assert saved == [1], "an observation that changes nothing to resume from records nothing"
    reg.heartbeat(hb(report("m-0"), report("m-1", port=9001), report("m.g1-0", V2, port=9002)))
    mono.now += 0.1
    reg.record_telemetry(rec("m.g1-0", port=9002))
    driver.tick()
    state = reg.models["m"].rollout
    assert (state.live, state.share, state.new_stats.ready) == (True, 50, 1)
    assert saved == [1, 1] and [s.events[-1].what for s in moved] == ["step 1/2"]


def test_the_driver_takes_a_share_with_no_ready_instance_out_of_the_routes_and_records_it(reg, clocks, changes):
    """The new build's only instance crashes at 50%: Envoy would send half the traffic to an empty canary
    cluster (its own 503s, which no gate sees). The split goes to 0 at once and back when it is ready."""
    mono, wall = clocks
    saved = []
    driver = RolloutDriver(reg, on_change=lambda: saved.append(1))
    serving(reg, ready=("m-0", "m-1"))
    reg.update_model(V2, "api")
    old = (report("m-0"), report("m-1", port=9001))
    reg.heartbeat(hb(*old, report("m.g1-0", V2, port=9002)))
    reg.record_telemetry(rec("m.g1-0", port=9002))
    driver.tick()
    assert reg.models["m"].rollout.share == 50
    split = lambda: split_by_build(reg.models["m"], DECISION, wall(), retire_s=2.0).split  # noqa: E731
    assert split() == 50
    saved.clear()
    changes.clear()

    mono.now += 0.5
    wall.now += 0.5
    reg.heartbeat(hb(*old, report("m.g1-0", V2, state=InstanceState.FAILED, port=9002, detail="worker crashed")))
    reg.record_telemetry(rec("m.g1-0", state=InstanceState.FAILED, seq=2, port=9002))
    driver.tick()
    state = reg.models["m"].rollout
    assert (state.phase, state.live, state.share, state.withdrawn, state.new_stats.ready) == (
        Phase.PROGRESSING,
        True,
        0,
        50,
        0,
    )
    assert split() == 0 and {"m"} in changes and saved == [1]  # the routes leave the canary; recorded
    assert reg.models["m"].tracks() == [Track(0, 2), Track(1, 1)]  # the instance restarts where it is

    mono.now += 0.5
    wall.now += 30.0
    reg.heartbeat(hb(*old, report("m.g1-0", V2, port=9002)))
    reg.record_telemetry(rec("m.g1-0", seq=3, port=9002))
    driver.tick()
    assert (reg.models["m"].rollout.share, reg.models["m"].rollout.withdrawn, split()) == (50, 0, 50)
    assert reg.models["m"].rollout.events[-1].what == "restored"


def test_the_driver_waits_for_the_sync_and_reads_memory_waits_from_the_node(reg, clocks):
    driver = RolloutDriver(reg)
    reg.put_model(V1, "api")
    reg.record_telemetry(rec("m-0"))
    reg.update_model(V2, "api")
    before = reg.models["m"].rollout
    driver.tick()
    assert reg.models["m"].rollout is before  # not synced: nothing observed yet
    reg.heartbeat(
        hb(report("m.g1-0", V2, state=InstanceState.LOADING, detail="pending: waiting for GPU memory: 0/20480 MB"))
    )
    reg.mark_synced()
    driver.tick()
    assert "m.g1-0 on n1: pending: waiting for GPU memory" in reg.models["m"].rollout.reason


def test_a_restarted_driver_does_not_count_the_downtime_as_the_new_builds_wait(reg, clocks):
    """A rollout recorded while its first step was prepared, its control plane down for 11 minutes: the
    first tick after the restart gave it up at once (progress_deadline_s 600). The driver's first
    observation is when its watch began; the wait counts from there."""
    mono, wall = clocks
    driver = RolloutDriver(reg)
    serving(reg, ready=("m-0", "m-1"))
    reg.update_model(V2, "api")
    driver.tick()
    state = reg.models["m"].rollout
    assert (state.live, state.preparing_since) == (False, wall.now)
    record = RolloutState.from_json(json.loads(json.dumps(state.to_json())))
    mono.now += 660.0
    wall.now += 660.0
    again = Registry(clock=mono, wall_clock=wall)
    again.restore_model(V1, "api", generation=0, rollout=record, target=V2)
    again.heartbeat(hb(report("m-0"), report("m-1", port=9001)))
    again.mark_synced()
    restarted = RolloutDriver(again)
    restarted.tick()
    after = again.models["m"].rollout
    assert after.phase is Phase.PROGRESSING, after.reason
    assert after.reason.endswith("; preparing for 0 s, given up at 600 s")
    mono.now += 600.0
    wall.now += 600.0
    restarted.tick()
    assert again.models["m"].rollout.phase is Phase.ROLLED_BACK  # a whole deadline under watch


def test_a_by_hand_action_through_the_driver_is_applied_and_recorded(reg):
    saved = []
    driver = RolloutDriver(reg, on_change=lambda: saved.append(1))
    serving(reg)
    reg.update_model(V2, "api")
    assert driver.act("m", "pause").phase is Phase.PAUSED and reg.models["m"].rollout.phase is Phase.PAUSED
    assert saved == [1]
    with pytest.raises(RolloutConflict):
        driver.act("m", "pause")
    assert driver.act("m", "abort").phase is Phase.ABORTED and not reg.models["m"].rolling


# ---- endpoints by build ---------------------------------------------------------------------------


def entry_with(rollout: RolloutState | None, generation: int = 0, target=V2) -> ModelEntry:
    stable = V2 if generation else V1
    entry = ModelEntry(stable, "api", stable.to_dict(), generation=generation, rollout=rollout)
    if rollout is not None and rollout.phase.active:
        entry.target, entry.target_dict = target, target.to_dict()
    elif rollout is not None and rollout.phase is not Phase.SUCCEEDED:
        entry.target, entry.target_dict = target, target.to_dict()  # kept while the new build drains
    return entry


def rollout_at(phase: Phase = Phase.PROGRESSING, share: int = 50, finished_at: float | None = None) -> RolloutState:
    state = start_rollout(
        "m", from_generation=0, from_version="1", to_version="2", policy=V2.spec.rollout, replicas=2, now=0.0
    )
    return dataclasses.replace(state, phase=phase, share=share, live=share > 0, finished_at=finished_at)


DECISION = ModelDecision(
    "m",
    {
        "m-0": EndpointDecision("127.0.0.1:9000"),
        "m-1": EndpointDecision("127.0.0.1:9001", weight=40),
        "m.g1-0": EndpointDecision("127.0.0.1:9002"),
    },
    drop_overload_percent=5.0,
)
H, D = Health.HEALTHY, Health.DRAINING

# (entry, wall) -> (stable endpoints' health, canary endpoints' health or None for no canary, its share)
SPLITS = {
    "no rollout: another build drains": (entry_with(None), 10.0, {"m-0": H, "m-1": H, "m.g1-0": D}, None, None),
    "rolling at 50%": (entry_with(rollout_at()), 10.0, {"m-0": H, "m-1": H}, {"m.g1-0": H}, 50),
    "rolling, step not live": (entry_with(rollout_at(share=0)), 10.0, {"m-0": H, "m-1": H}, {"m.g1-0": H}, 0),
    "paused at 50%": (entry_with(rollout_at(Phase.PAUSED)), 10.0, {"m-0": H, "m-1": H}, {"m.g1-0": H}, 50),
    # Envoy may apply the endpoints before the routes that leave the canary: its hosts stay as they were.
    "rolled back, first retire_s: the routes leave, the new build's hosts stay": (
        entry_with(rollout_at(Phase.ROLLED_BACK, 0, finished_at=9.0)),
        10.0,
        {"m-0": H, "m-1": H},
        {"m.g1-0": H},
        None,
    ),
    "rolled back: the new build drains unrouted": (
        entry_with(rollout_at(Phase.ROLLED_BACK, 0, finished_at=9.0)),
        100.0,
        {"m-0": H, "m-1": H},
        {"m.g1-0": D},
        None,
    ),
    # A promotion changes model.m, which Envoy re-warms: for retire_s the routes stay on the canary, where
    # the promoted build serves too; then they move back to model.m, and the canary goes retire_s later.
    "promoted, first retire_s: routes stay on the canary": (
        entry_with(rollout_at(Phase.SUCCEEDED, 100, finished_at=9.0), generation=1),
        10.9,
        {"m-0": D, "m-1": D, "m.g1-0": H},
        {"m.g1-0": H},
        100,
    ),
    "promoted, second retire_s: routes back, canary kept": (
        entry_with(rollout_at(Phase.SUCCEEDED, 100, finished_at=9.0), generation=1),
        12.9,
        {"m-0": D, "m-1": D, "m.g1-0": H},
        {"m.g1-0": H},
        None,
    ),
    "promoted, past twice retire_s": (
        entry_with(rollout_at(Phase.SUCCEEDED, 100, finished_at=9.0), generation=1),
        13.0,
        {"m-0": D, "m-1": D, "m.g1-0": H},
        None,
        None,
    ),
}


@pytest.mark.parametrize(("entry", "wall", "stable", "canary", "share"), SPLITS.values(), ids=SPLITS.keys())
def test_split_by_build(entry, wall, stable, canary, share):
    inputs = split_by_build(entry, DECISION, wall, retire_s=2.0)
    assert inputs.service is entry.service and inputs.routed
    assert {iid: ep.health for iid, ep in inputs.decision.endpoints.items()} == stable
    assert inputs.decision.drop_overload_percent == 5.0
    if canary is None:
        assert inputs.canary is None and inputs.split is None
        return
    assert inputs.canary is not None and inputs.split == share
    assert {iid: ep.health for iid, ep in inputs.canary.decision.endpoints.items()} == canary
    assert inputs.canary.service is (entry.target or entry.service)
    for iid, ep in inputs.canary.decision.endpoints.items():  # only the health moves, never the weight or address
        assert (ep.address, ep.weight) == (DECISION.endpoints[iid].address, DECISION.endpoints[iid].weight)


@pytest.mark.parametrize(("wall", "kept"), [(9.0, True), (10.9, True), (13.0, False)])
def test_after_a_rollback_the_canary_outlives_its_instances_by_the_retire_window(wall, kept):
    entry = entry_with(rollout_at(Phase.ROLLED_BACK, 0, finished_at=9.0))
    only_old = dataclasses.replace(DECISION, endpoints={k: v for k, v in DECISION.endpoints.items() if k != "m.g1-0"})
    inputs = split_by_build(entry, only_old, wall, retire_s=2.0)
    assert (inputs.canary is not None) is kept
    if kept:
        assert inputs.canary.decision.endpoints == {} and inputs.split is None


# ---- the canary's Envoy resources -----------------------------------------------------------------


def canary_inputs(share: int | None, canary=V2) -> dict[str, ModelInputs]:
    stable = dataclasses.replace(DECISION, endpoints={k: DECISION.endpoints[k] for k in ("m-0", "m-1")})
    new = dataclasses.replace(DECISION, endpoints={"m.g1-0": DECISION.endpoints["m.g1-0"]}, drop_overload_percent=0)
    return {"m": ModelInputs(V1, stable, canary=CanaryInputs(canary, new, share))}


def unpack(resource, message):
    resource.packed.Unpack(message)
    return message


def model_routes(resources) -> list:
    config = unpack(resources[ROUTE]["ingress_routes"], route_pb2.RouteConfiguration())
    return [r for r in config.virtual_hosts[0].routes if r.HasField("route") and r.name.startswith("m.")]


def test_a_canary_is_a_second_cluster_with_its_own_load_assignment():
    resources = ResourceCache().build(canary_inputs(50), IngressConfig())
    assert sorted(resources[CLUSTER]) == sorted(resources[ENDPOINT]) == ["model.m", "model.m.canary"]
    for name, endpoints in (("model.m", ["127.0.0.1:9000", "127.0.0.1:9001"]), ("model.m.canary", ["127.0.0.1:9002"])):
        cla = unpack(resources[ENDPOINT][name], endpoint_pb2.ClusterLoadAssignment())
        assert cla.cluster_name == name  # Envoy files a CLA under the cluster it names
        got = [
            f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}"
            for e in cla.endpoints[0].lb_endpoints
        ]
        assert sorted(got) == endpoints
        assert resources[CLUSTER][name].refs == ((ENDPOINT, name),)
    assert check_consistency(resources) == []


@pytest.mark.parametrize(
    ("share", "clusters"),
    [
        (None, [("model.m", None)]),  # draining after the rollout: not routed
        (0, [("model.m", None)]),  # the first step not yet live
        (10, [("model.m", 90), ("model.m.canary", 10)]),
        (50, [("model.m", 50), ("model.m.canary", 50)]),
        (99, [("model.m", 1), ("model.m.canary", 99)]),
        (100, [("model.m.canary", None)]),
    ],
)
def test_routes_split_the_models_traffic_by_share(share, clusters):
    resources = ResourceCache().build(canary_inputs(share), IngressConfig())
    routes = model_routes(resources)
    assert len(routes) == 9  # header, path and body routes of the three LLM paths
    for route in routes:
        action = route.route
        if len(clusters) == 1:
            assert action.cluster == clusters[0][0] and not action.HasField("weighted_clusters")
        else:
            got = [(c.name, c.weight.value) for c in action.weighted_clusters.clusters]
            assert got == clusters and not action.cluster
        assert action.timeout.seconds == 15 and action.retry_policy.num_retries.value == 2
    refs = resources[ROUTE]["ingress_routes"].refs
    assert sorted(name for _, name in refs) == sorted(name for name, _ in clusters)
    assert check_consistency(resources) == []


def test_a_share_change_rebuilds_the_routes_only():
    cache = ResourceCache()
    inputs = canary_inputs(10)
    first = cache.build(inputs, IngressConfig())
    again = cache.build(inputs, IngressConfig())
    assert cache.rebuilt == 0 and again[ROUTE]["ingress_routes"] is first[ROUTE]["ingress_routes"]
    moved = {"m": dataclasses.replace(inputs["m"], canary=dataclasses.replace(inputs["m"].canary, share=50))}
    after = cache.build(moved, IngressConfig())
    assert cache.rebuilt == 1
    assert after[ROUTE]["ingress_routes"].version != first[ROUTE]["ingress_routes"].version
    assert after[CLUSTER]["model.m.canary"] is first[CLUSTER]["model.m.canary"]


def test_the_canary_leaves_with_its_rollout():
    cache = ResourceCache()
    cache.build(canary_inputs(50), IngressConfig())
    plain = {"m": dataclasses.replace(canary_inputs(50)["m"], canary=None)}
    resources = cache.build(plain, IngressConfig())
    assert list(resources[CLUSTER]) == ["model.m"] and list(resources[ENDPOINT]) == ["model.m"]
    assert [r.route.cluster for r in model_routes(resources)] == ["model.m"] * 9
    assert check_consistency(resources) == []


def test_the_canary_cluster_is_built_from_the_new_builds_spec():
    new = svc("2", resources={"max_concurrent_requests": 7})
    resources = ResourceCache().build(canary_inputs(50, canary=new), IngressConfig())
    stable = unpack(resources[CLUSTER]["model.m"], cluster_pb2.Cluster())
    canary = unpack(resources[CLUSTER]["model.m.canary"], cluster_pb2.Cluster())
    assert (stable.name, canary.name) == ("model.m", "model.m.canary")
    limits = lambda c: c.circuit_breakers.thresholds[0].max_requests.value  # noqa: E731
    assert limits(canary) != limits(stable)


# ---- the state file ----------------------------------------------------------------------------


def recorded_rollout(phase: Phase) -> RolloutState:
    state = rollout_at(phase, 50 if phase.active else 0, finished_at=None if phase.active else 70.0)
    if phase is Phase.SUCCEEDED:  # as the machine leaves it: live at its last step, 100%
        state = dataclasses.replace(state, step=len(state.steps) - 1, share=100, live=True)
    return dataclasses.replace(state, step_since=60.0, yielded=0, reason="recorded")


@pytest.mark.parametrize(
    ("saved", "rolling", "tracks"),
    [
        (SavedModel(V1), False, [Track(0, 2)]),
        (SavedModel(V1, 0, recorded_rollout(Phase.PROGRESSING), V2), True, [Track(0, 2), Track(1, 1)]),
        (SavedModel(V1, 0, recorded_rollout(Phase.PAUSED), V2), True, [Track(0, 2), Track(1, 1)]),
        (SavedModel(V1, 0, recorded_rollout(Phase.ROLLED_BACK), V2), False, [Track(0, 2)]),
        (SavedModel(V2, 1, recorded_rollout(Phase.SUCCEEDED), None, V1), False, [Track(1, 2)]),
    ],
    ids=["no rollout", "progressing", "paused", "rolled back", "succeeded"],
)
def test_a_rollout_survives_a_restart(tmp_path, clocks, saved, rolling, tracks):
    ModelState(tmp_path).save({"m": saved}, {}, {})
    doc = json.loads((tmp_path / "models.json").read_text())
    assert doc["models"]["m"]["generation"] == saved.generation
    state = ModelState(tmp_path)
    state.load()
    models, deleted = state.apply({})
    back = models["m"]
    assert deleted == set()
    assert (back.service, back.generation, back.target, back.previous) == (
        saved.service,
        saved.generation,
        saved.target,
        saved.previous,
    )
    assert back.rollout == saved.rollout
    mono, wall = clocks
    reg = Registry(clock=mono, wall_clock=wall)
    reg.restore_model(
        back.service,
        "api",
        generation=back.generation,
        rollout=back.rollout,
        target=back.target,
        previous=back.previous,
    )
    entry = reg.models["m"]
    assert (entry.rolling, entry.tracks(), entry.generation, entry.previous) == (
        rolling,
        tracks,
        saved.generation,
        saved.previous,
    )
    if rolling:
        assert entry.spec_of(1) == (V2, V2.to_dict())


def test_an_unreadable_recorded_rollout_leaves_the_stable_build_serving(tmp_path):
    ModelState(tmp_path).save({"m": SavedModel(V1, 0, recorded_rollout(Phase.PROGRESSING), V2)}, {}, {})
    path = tmp_path / "models.json"
    doc = json.loads(path.read_text())
    del doc["models"]["m"]["rollout"]["policy"]
    path.write_text(json.dumps(doc))
    state = ModelState(tmp_path)
    state.load()
    models, _ = state.apply({})
    assert models["m"].service == V1 and models["m"].rollout is None


@pytest.mark.parametrize("build", ["target", "previous"])
def test_a_recorded_build_no_longer_valid_leaves_the_stable_build_serving(tmp_path, build):
    ModelState(tmp_path).save({"m": SavedModel(V1, 0, recorded_rollout(Phase.PROGRESSING), V2, V1)}, {}, {})
    path = tmp_path / "models.json"
    doc = json.loads(path.read_text())
    doc["models"]["m"][build]["spec"]["backend"]["config"] = {"kv_budget_scale": 2}  # refused since it was saved
    path.write_text(json.dumps(doc))
    state = ModelState(tmp_path)
    state.load()
    models, _ = state.apply({})
    assert models["m"].service == V1 and (models["m"].rollout, models["m"].target, models["m"].previous) == (None,) * 3
