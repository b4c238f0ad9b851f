"""A control-plane restart keeps the fleet as it was: an autoscaled model's count (recorded in the state
file or a ModelService's status.build, and raised to what the node hosts report serving), the generation
its instances run under, and a state file part of which cannot be read."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from sie.auth import Signer
from sie.telemetry import InstanceState
from tests.unit.xds_server.test_rollout_registry import V1, V2, Changes, Clock, hb, rec, recorded_rollout, report, svc
from xds_server.autoscale.driver import Autoscaler
from xds_server.autoscale.policy import ScaleState
from xds_server.k8s_source import RegistrySink
from xds_server.main import XdsServer
from xds_server.placement import instance_ids
from xds_server.registry import Registry
from xds_server.rollout.machine import Phase, RolloutState
from xds_server.settings import Settings
from xds_server.state import ModelState, SavedModel

SCALED = svc("1", replicas=1, sla={"max_replicas": 8}, resources={"max_concurrent_requests": 10})
TO_ZERO = svc("1", replicas=0, sla={"max_replicas": 8}, resources={"max_concurrent_requests": 10})


def fresh() -> Registry:
    return Registry(clock=Clock(200.0), wall_clock=Clock(6000.0), changes=Changes())


def running(service, awake: int, asleep: int = 0, generation: int = 0) -> list:
    """What a node host reports of a model: `awake` instances serving, then `asleep` of the warm pool."""
    ids = instance_ids("m", awake + asleep, generation)
    return [
        report(iid, service, InstanceState.READY if n < awake else InstanceState.SLEEPING, port=9000 + n)
        for n, iid in enumerate(ids)
    ]


def synced(reg: Registry, reports: list, *nodes: str) -> list[tuple[str, bool]]:
    """The startup sync with `reports` dealt over `nodes` (n1 alone by default), then every (instance id,
    awake) the nodes' first authoritative replies tell them to run."""
    nodes = nodes or ("n1",)
    beats = {n: [r for i, r in enumerate(reports) if nodes[i % len(nodes)] == n] for n in nodes}
    for node, mine in beats.items():
        reg.heartbeat(hb(*mine, node=node))
    reg.mark_synced()
    told = []
    for node, mine in beats.items():
        told += [(a.instance_id, a.awake) for a in reg.heartbeat(hb(*mine, node=node)).assignments]
    return sorted(told)


def shape(awake: int, asleep: int = 1, generation: int = 0) -> list[tuple[str, bool]]:
    return sorted((iid, n < awake) for n, iid in enumerate(instance_ids("m", awake + asleep, generation)))


# ---- the autoscaler's count -----------------------------------------------------------------------

# (the model, its stable build's generation, what the nodes run, the count recorded before the restart)
# -> what the fleet is told to run
COUNTS = {
    "six serving, one warm, nothing recorded": (SCALED, 0, running(SCALED, 6, 1), None, shape(6)),
    "min 0, five serving": (TO_ZERO, 0, running(TO_ZERO, 5), None, shape(5)),
    "min 0, asleep at zero": (TO_ZERO, 0, running(TO_ZERO, 0, 1), None, shape(0)),
    "recorded above what serves (still loading)": (SCALED, 0, running(SCALED, 3), 5, shape(5)),
    "serving above the record": (SCALED, 0, running(SCALED, 6, 1), 4, shape(6)),
    "recorded above max_replicas": (SCALED, 0, [], 12, shape(8, 0)),
    "nothing serving, nothing recorded": (SCALED, 0, [], None, shape(1)),
    "an older build's instances do not count": (
        SCALED,
        1,
        running(SCALED, 2) + running(SCALED, 4, 0, 1),
        None,
        shape(4, 1, 1),
    ),
}


@pytest.mark.parametrize(("service", "generation", "reports", "recorded", "told"), COUNTS.values(), ids=COUNTS.keys())
def test_a_restart_keeps_an_autoscaled_models_count(service, generation, reports, recorded, told):
    reg = fresh()
    reg.restore_model(service, "api", generation=generation)
    if recorded is not None:
        reg.restore_scale("m", recorded)
    assert synced(reg, reports) == told
    entry = reg.models["m"]
    assert entry.replicas == sum(awake for _, awake in told)
    if entry.scale is not None:
        assert entry.scale_decision is not None and "restart" in entry.scale_decision["reason"]


def test_instances_on_every_node_count():
    reg = fresh()
    reg.put_model(SCALED, "api")
    assert synced(reg, running(SCALED, 6, 1), "n1", "n2") == shape(6)


def test_the_autoscaler_starts_from_the_count_the_restart_kept():
    reg = fresh()
    reg.put_model(SCALED, "api")
    synced(reg, running(SCALED, 6, 1))
    for n in range(6):  # each at the target (0.7 x 10): the count holds
        reg.record_telemetry(dataclasses.replace(rec(f"m-{n}", port=9000 + n), in_flight=7))
    Autoscaler(reg).tick()
    entry = reg.models["m"]
    assert entry.replicas == 6 and entry.scale_decision is not None
    assert entry.scale_decision["reason"].startswith("hold"), entry.scale_decision


def test_the_count_goes_through_the_state_file(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        textwrap.dedent("""
            kind: ModelService
            spec:
              model: {name: f}
              backend: {type: sim}
              sla: {min_replicas: 1, max_replicas: 8}
        """)
    )
    settings = Settings(cluster_file=cluster, state_dir=tmp_path / "state")
    before = XdsServer(settings, signer=Signer.generate())
    before.load_models()
    before.registry.put_model(SCALED, "api")
    before.save_models()
    for mid, count in (("f", 5), ("m", 3)):  # as the autoscaler does: the count, then its decision callback
        before.registry.set_scale(mid, count)
        before._scaled(mid, ScaleState(desired=count))
    saved = json.loads((tmp_path / "state" / "models.json").read_text())
    assert saved["scales"] == {"f": 5, "m": 3}
    after = XdsServer(settings, signer=Signer.generate())
    after.load_models()
    assert {mid: e.replicas for mid, e in after.registry.models.items()} == {"f": 5, "m": 3}


async def test_the_count_goes_through_a_modelservices_status_build():
    reg = fresh()
    sink = RegistrySink(reg)
    await sink.models_changed({"m": SCALED})
    reg.set_scale("m", 6, {"desired": 6, "recommended": 6, "reason": "up"})
    record = sink.record("m")
    assert record is not None
    # What the controller hands back after a restart: status.build, the record less its "autoscale"
    # (xds_server/k8s/reconcile.py with_rollout).
    build = {k: v for k, v in record.items() if k != "autoscale"}
    reg2 = fresh()
    await RegistrySink(reg2).models_changed({"m": SCALED}, {"m": build})
    entry = reg2.models["m"]
    assert entry.source == "kubernetes" and entry.replicas == 6
    assert [b.replicas for b in RegistrySink(reg2).builds("m") or []] == [6]


# ---- the generation of a model taken from the nodes ------------------------------------------------

# (the cluster file's model, the node's two instances: (generation, spec)) -> (source, generation, spec)
GENERATIONS = {
    "no file entry, after a rollout": (None, (1, V2), ("node", 1, V2)),
    "the file's old build, the nodes run a later one": (V1, (1, V2), ("node", 1, V2)),
    "the file names the build the nodes run under a later generation": (V2, (3, V2), ("file", 3, V2)),
    "the first build": (V1, (0, V1), ("file", 0, V1)),
}


@pytest.mark.parametrize(("file", "runs", "kept"), GENERATIONS.values(), ids=GENERATIONS.keys())
def test_a_model_taken_from_the_nodes_keeps_the_generation_they_run(file, runs, kept):
    reg = fresh()
    if file is not None:
        reg.add_model(file, "file")
    generation, spec = runs
    ids = instance_ids("m", 2, generation)
    reports = [report(iid, spec, port=9000 + n) for n, iid in enumerate(ids)]
    reg.heartbeat(hb(*reports))
    entry = reg.models["m"]
    assert (entry.source, entry.generation, entry.service) == kept
    reg.mark_synced()
    assert [a.instance_id for a in reg.heartbeat(hb(*reports)).assignments] == ids, "nothing is stopped"


def test_a_generation_reported_by_a_later_node_is_kept():
    reg = fresh()
    reg.heartbeat(hb(report("m.g1-0", V2), node="n1"))
    reg.heartbeat(hb(report("m.g2-0", V2, port=9001), node="n2"))
    assert reg.models["m"].generation == 2


# ---- a state file part of which cannot be read -----------------------------------------------------


def corrupt(doc: dict, path: tuple, value) -> dict:
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


# (where, what) -> what of model m loads: its rollout too, its stable build alone, or nothing (left out)
UNREADABLE = {
    "a rollout that is a list": (("models", "m", "rollout"), [], "stable"),
    "a rollout that is a string": (("models", "m", "rollout"), "x", "stable"),
    "a rollout that is a number": (("models", "m", "rollout"), 7, "stable"),
    "a rollout's policy that is a list": (("models", "m", "rollout", "policy"), [1], "stable"),
    "a rollout's events that are a dict": (("models", "m", "rollout", "events"), {"a": 1}, "stable"),
    "a rollout's phase unknown": (("models", "m", "rollout", "phase"), "sideways", "stable"),
    "a generation that is a string": (("models", "m", "generation"), "1", "rollout"),
    "a model that is a list": (("models", "m"), [], "nothing"),
    "models that are a list": (("models",), [1], "nothing"),
    "deletions that are a list": (("deleted",), [1], "rollout"),
    "counts that are a list": (("scales",), [1], "rollout"),
    "a count that is a string": (("scales", "m"), "3", "rollout"),
}


@pytest.mark.parametrize(("where", "value", "loads"), UNREADABLE.values(), ids=UNREADABLE.keys())
def test_an_unreadable_part_of_the_state_file_is_left_out_and_the_rest_loads(tmp_path, where, value, loads):
    rollout = recorded_rollout(Phase.PROGRESSING)
    ModelState(tmp_path).save({"m": SavedModel(V1, 0, rollout, V2)}, {}, {})
    path = tmp_path / "models.json"
    doc = {**json.loads(path.read_text()), "scales": {"m": 3}}
    path.write_text(json.dumps(corrupt(doc, where, value)))
    state = ModelState(tmp_path)
    saved = state.load()
    models, _ = state.apply({})
    if loads == "nothing":
        assert models == {}
    else:
        assert (models["m"].service, models["m"].generation) == (V1, 0)
        assert models["m"].rollout == (rollout if loads == "rollout" else None)
    if where[0] == "scales":
        assert saved.scales == {}


def test_any_error_reading_a_recorded_rollout_leaves_the_stable_build_serving(tmp_path, monkeypatch):
    """from_json may refuse a record in ways of its own (a range check): none stops the start."""

    def refuse(doc):
        raise IndexError("step 9 of 2")

    ModelState(tmp_path).save({"m": SavedModel(V1, 0, recorded_rollout(Phase.PROGRESSING), V2)}, {}, {})
    monkeypatch.setattr(RolloutState, "from_json", staticmethod(refuse))
    state = ModelState(tmp_path)
    state.load()
    models, _ = state.apply({})
    assert models["m"].service == V1 and models["m"].rollout is None
