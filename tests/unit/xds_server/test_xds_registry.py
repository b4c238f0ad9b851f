"""Registry: the startup sync, recovery of models from node reports, telemetry ordering, EDS membership."""

from __future__ import annotations

import dataclasses

import pytest

from sie.errors import Problem
from sie.spec import spec_digest
from sie.spec_loader import parse_model_service
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import GPUInfo, InstanceReport, NodeHeartbeat
from xds_server.registry import EDS_TELEMETRY_TTL_S, SPEC_WAIT_BEATS, Registry


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def svc(name: str, replicas: int = 1, version: str = "1"):
    return parse_model_service(
        {
            "spec": {
                "model": {"name": name, "version": version},
                "backend": {"type": "sim"},
                "sla": {"min_replicas": replicas, "max_replicas": max(1, replicas)},
            }
        }
    )


def report(iid: str, service, state=InstanceState.READY) -> InstanceReport:
    return InstanceReport(
        iid, service.model_id, service.spec.model.version, state, service.to_dict(), sidecar_address="127.0.0.1:9000"
    )


def hb(node: str, *instances: InstanceReport) -> NodeHeartbeat:
    return NodeHeartbeat(node=node, address=f"http://{node}", instances=list(instances))


def rec(
    iid: str, model: str, state=InstanceState.READY, node="n1", seq=1, ts=1.0, reporter="r1", address="127.0.0.1:9000"
) -> TelemetryRecord:
    return TelemetryRecord(iid, model, "1", address, node, state, seq=seq, timestamp=ts, reporter=reporter)


def registered(reg, iid: str = "a-0", model: str = "a", node: str = "n1", address: str = "127.0.0.1:9000"):
    """The node host registers the instance (its report carries the address EDS will use)."""
    reg.heartbeat(
        hb(node, InstanceReport(iid, model, "1", InstanceState.READY, svc(model).to_dict(), sidecar_address=address))
    )


@pytest.fixture
def clock():
    return Clock()


class Changes(list):
    """A ChangeSink that keeps every report, in order."""

    notify = list.append


@pytest.fixture
def changes():
    return Changes()


@pytest.fixture
def reg(clock, changes):
    return Registry(clock=clock, changes=changes)


def test_before_sync_replies_are_not_authoritative_and_echo_what_runs(reg):
    a = svc("a")
    reg.add_model(a, "file")
    reply = reg.heartbeat(hb("n1", report("a-0", a), report("zombie-0", svc("zombie"))))
    assert reply.authoritative is False
    assert [x.instance_id for x in reply.assignments] == ["a-0", "zombie-0"]


def test_after_sync_replies_carry_the_complete_assignment(reg):
    reg.add_model(svc("a", 2), "file")
    reg.heartbeat(hb("n1"))
    reg.mark_synced()
    reply = reg.heartbeat(hb("n1"))
    assert reply.authoritative is True
    assert [(x.instance_id, x.model_id) for x in reply.assignments] == [("a-0", "a"), ("a-1", "a")]
    assert reply.assignments[0].spec == reg.models["a"].spec_dict


def test_a_model_only_nodes_know_comes_back_from_their_reports_during_the_sync(reg):
    api_model = svc("from-api")
    reg.heartbeat(hb("n1", report("from-api-0", api_model)))
    assert reg.models["from-api"].service == api_model
    assert reg.models["from-api"].source == "node"
    reg.mark_synced()
    reply = reg.heartbeat(hb("n1", report("from-api-0", api_model)))
    assert [x.instance_id for x in reply.assignments] == ["from-api-0"]


def test_after_the_sync_a_nodes_report_never_creates_a_model(reg):
    reg.mark_synced()
    reply = reg.heartbeat(hb("n1", report("planted-0", svc("planted"))))
    assert "planted" not in reg.models and reply.assignments == []


def test_a_deleted_model_is_not_recovered_from_a_node_still_running_it(reg):
    a = svc("a")
    reg.add_model(a, "api")
    reg.mark_synced()
    assert reg.delete_model("a")
    reply = reg.heartbeat(hb("n1", report("a-0", a)))
    assert "a" not in reg.models
    assert reply.assignments == []


def test_during_sync_the_running_spec_wins_over_the_file(reg):
    reg.add_model(svc("a", version="1"), "file")
    running = svc("a", version="2")
    reg.heartbeat(hb("n1", report("a-0", running)))
    assert reg.models["a"].service.spec.model.version == "2"


def test_after_sync_reports_never_change_a_known_spec(reg):
    reg.add_model(svc("a", version="1"), "file")
    reg.mark_synced()
    reg.heartbeat(hb("n1", report("a-0", svc("a", version="2"))))
    assert reg.models["a"].service.spec.model.version == "1"


@pytest.mark.parametrize(
    ("first", "second", "accepted"),
    [
        ((5, "r1"), (6, "r1"), True),
        ((5, "r1"), (4, "r1"), False),  # a reordered post
        ((5, "r1"), (5, "r1"), False),  # the same record twice
        ((50, "r1"), (1, "r2"), True),  # a restarted sidecar (a new process) counts from 1 again
        ((2**62, "r1"), (1, "r2"), True),  # no seq a process sent can hold back its successor
    ],
)
def test_telemetry_order(reg, first, second, accepted):
    assert reg.record_telemetry(rec("a-0", "a", seq=first[0], reporter=first[1]))
    assert reg.record_telemetry(rec("a-0", "a", seq=second[0], reporter=second[1])) is accepted
    assert reg.telemetry["a-0"].record.seq == (second if accepted else first)[0]


def test_a_records_timestamp_is_the_control_planes_clock(clock):
    reg = Registry(clock=clock, wall_clock=lambda: 1234.5)
    reg.record_telemetry(rec("a-0", "a", ts=9e10))  # a sidecar's clock a thousand years ahead
    assert reg.telemetry["a-0"].record.timestamp == 1234.5


def test_telemetry_notifies_its_model(reg, changes):
    reg.record_telemetry(rec("a-0", "a"))
    assert changes[-1] == {"a"}


@pytest.mark.parametrize(
    ("state", "in_eds"),
    [
        (InstanceState.READY, True),
        (InstanceState.DRAINING, True),
        (InstanceState.LOADING, True),  # alone: the model's holder (its sidecar holds until it serves)
        (InstanceState.SLEEPING, True),  # alone: the model's wake holder
        (InstanceState.FAILED, False),
        (InstanceState.STOPPED, False),
    ],
)
def test_eds_membership_by_state(reg, clock, state, in_eds):
    registered(reg)
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a", state=state))
    assert [r.instance_id for r in reg.eds_records("a", clock())] == (["a-0"] if in_eds else [])


def test_a_sleeping_instance_is_in_eds_only_while_no_other_instance_of_its_model_is(reg, clock):
    two = [
        InstanceReport(iid, "a", "1", InstanceState.READY, svc("a").to_dict(), sidecar_address=f"127.0.0.1:900{n}")
        for n, iid in enumerate(("a-0", "a-1"))
    ]
    reg.heartbeat(hb("n1", *two))
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a", state=InstanceState.SLEEPING))
    reg.record_telemetry(rec("a-1", "a", address="127.0.0.1:9001", state=InstanceState.FAILED))
    assert [r.instance_id for r in reg.eds_records("a", clock())] == ["a-0"], "nothing awake: the sleeper holds"
    reg.record_telemetry(rec("a-1", "a", address="127.0.0.1:9001", state=InstanceState.READY, seq=2))
    assert [r.instance_id for r in reg.eds_records("a", clock())] == ["a-1"], "one serves: the sleeper leaves"


def test_an_instance_without_telemetry_for_the_ttl_leaves_eds(reg, clock):
    registered(reg)
    reg.record_telemetry(rec("a-0", "a"))
    clock.now += EDS_TELEMETRY_TTL_S - 0.1
    assert reg.eds_records("a", clock())
    clock.now += 0.2
    assert reg.eds_records("a", clock()) == []


def test_an_instance_its_live_node_no_longer_reports_leaves_eds(reg, clock):
    a = svc("a")
    reg.add_model(a, "file")
    reg.heartbeat(hb("n1", report("a-0", a)))
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a"))
    assert reg.eds_records("a", clock())
    clock.now += 0.5
    reg.heartbeat(hb("n1"))  # the node stopped it (or its worker crashed and the node gave up)
    assert reg.eds_records("a", clock()) == []


def test_an_instance_no_node_registered_is_not_in_eds_whatever_its_telemetry_says(reg, clock):
    reg.heartbeat(hb("n1"))
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a", address="10.9.9.9:80"))
    assert reg.eds_records("a", clock()) == []
    registered(reg, address="127.0.0.1:9000")
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a", seq=2, address="10.9.9.9:80"))
    assert [(r.instance_id, r.address) for r in reg.eds_records("a", clock())] == [("a-0", "127.0.0.1:9000")]


def test_a_node_cannot_give_eds_an_address_for_an_instance_placed_elsewhere(reg, clock):
    reg.add_model(svc("a"), "file")
    registered(reg, node="n1", address="127.0.0.1:9000")
    reg.mark_synced()
    registered(reg, node="n1", address="127.0.0.1:9000")
    assert reg.placement.by_instance["a-0"] == "n1"
    registered(reg, node="evil", address="127.0.0.1:6666")
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a", node="evil"))
    assert reg.eds_records("a", clock()) == []


def test_a_lost_nodes_instance_that_still_reports_serves_only_as_the_last_resort(reg, clock):
    registered(reg)
    clock.now += 0.1
    reg.record_telemetry(rec("a-0", "a"))
    clock.now += reg.heartbeat_timeout_s + 1
    reg.record_telemetry(rec("a-0", "a", seq=2, ts=2.0))
    assert not reg.in_eds(reg.telemetry["a-0"], clock()), "a lost node's endpoints leave EDS"
    # ...but nothing else of the model serves, and its sidecar still reports ready: it stays, at the
    # address its node registered (a node cut off from the control plane may still serve).
    assert [r.instance_id for r in reg.eds_records("a", clock())] == ["a-0"]


def test_nodes_silent_for_long_are_forgotten(reg, clock):
    registered(reg)
    clock.now += 601
    reg.sweep()
    assert reg.nodes == {}


def test_a_deleted_model_retires_then_goes(reg, clock, changes):
    reg.add_model(svc("a"), "api")
    reg.delete_model("a")
    assert "a" in reg.retiring and changes[-1] is None
    clock.now += reg.retire_s - 0.1
    reg.sweep()
    assert "a" in reg.retiring
    clock.now += 0.2
    reg.sweep()
    assert "a" not in reg.retiring


def test_adding_a_model_again_cancels_its_retirement_and_tombstone(reg):
    a = svc("a")
    reg.add_model(a, "api")
    reg.delete_model("a")
    reg.add_model(a, "api")
    assert "a" not in reg.retiring
    reg.delete_model("a")
    reg.put_model(a, "api")
    reg.heartbeat(hb("n1", report("a-0", a)))
    assert reg.models["a"].source == "api"


# ---- specs by digest (sie.wire) ------------------------------------------------------------------------


def test_a_reported_specs_digest_is_computed_never_taken_from_the_node(reg):
    a = svc("a")
    forged = dataclasses.replace(report("a-0", a), spec_digest="f" * 64)
    reg.heartbeat(hb("n1", forged))
    assert reg.nodes["n1"].reports["a-0"].spec_digest == spec_digest(a.to_dict())


def test_a_report_by_digest_gets_the_spec_the_control_plane_holds_or_is_asked_for(reg):
    a = svc("a")
    reg.add_model(a, "file")
    known = dataclasses.replace(report("a-0", a), spec=None, spec_digest=spec_digest(a.to_dict()))
    other = svc("a", version="2")
    unknown = dataclasses.replace(report("a-1", other), spec=None, spec_digest=spec_digest(other.to_dict()))
    reply = reg.heartbeat(hb("n1", known, unknown))
    assert reply.send_specs == ["a-1"] and reg.specs_missing() == 1
    assert reg.nodes["n1"].reports["a-0"].spec == a.to_dict()
    # The echo before the sync names each spec by digest only: the node has them.
    assert [(x.spec, x.spec_digest) for x in reply.assignments] == [
        (None, known.spec_digest),
        (None, unknown.spec_digest),
    ]
    reply = reg.heartbeat(hb("n1", known, report("a-1", other)))  # the node sends it
    assert reply.send_specs == [] and reg.specs_missing() == 0
    reply = reg.heartbeat(hb("n1", known, unknown))  # and names it by digest from then on
    assert reply.send_specs == [] and reg.nodes["n1"].reports["a-1"].spec == other.to_dict()


def test_a_reply_carries_each_spec_the_node_lacks_once(reg):
    a = svc("a", 2)
    reg.add_model(a, "file")
    reg.heartbeat(hb("n1"))
    reg.mark_synced()
    reply = reg.heartbeat(hb("n1"))
    digest = spec_digest(a.to_dict())
    assert [(x.spec, x.spec_digest) for x in reply.assignments] == [(a.to_dict(), digest), (None, digest)]
    running = dataclasses.replace(report("a-0", a), spec=None, spec_digest=digest)
    reply = reg.heartbeat(hb("n1", running))  # the node holds it now: neither carries it
    assert [(x.instance_id, x.spec) for x in reply.assignments] == [("a-0", None), ("a-1", None)]
    reg.update_model(svc("a", 3), "file")  # a new spec travels again, once
    reply = reg.heartbeat(hb("n1", running))
    assert [x.spec for x in reply.assignments] == [svc("a", 3).to_dict(), None, None]


def test_a_digest_resolves_within_its_model_only(reg):
    a, b = svc("a"), svc("b")
    reg.heartbeat(hb("n1", report("a-0", a)))
    # A (buggy or forged) report of b-0 under a's digest does not get a's spec: it is asked for.
    forged = dataclasses.replace(report("b-0", b), spec=None, spec_digest=spec_digest(a.to_dict()))
    by_digest = dataclasses.replace(report("a-0", a), spec=None, spec_digest=spec_digest(a.to_dict()))
    reply = reg.heartbeat(hb("n1", by_digest, forged))
    assert reply.send_specs == ["b-0"] and reg.nodes["n1"].reports["b-0"].spec is None


def test_the_startup_sync_waits_for_asked_specs_while_a_node_keeps_sending_them(reg):
    """Counted in the node's own beats, whatever its interval: a node that sends some of what it was
    asked for in each beat is waited for; one that sends none for SPEC_WAIT_BEATS beats is not."""
    models = [svc(f"m{n}") for n in range(3)]
    by_digest = [
        dataclasses.replace(report(f"m{n}-0", m), spec=None, spec_digest=spec_digest(m.to_dict()))
        for n, m in enumerate(models)
    ]
    reg.heartbeat(hb("n1", *by_digest))  # restarted: the digests are unknown
    assert (reg.specs_missing(), reg.specs_awaited()) == (3, 3)
    for beat in range(1, 3):  # one spec a beat (a 4 MiB budget's worth, say)
        sent = [report(f"m{n}-0", m) if n < beat else by_digest[n] for n, m in enumerate(models)]
        reg.heartbeat(hb("n1", *sent))
        assert (reg.specs_missing(), reg.specs_awaited()) == (3 - beat, 3 - beat)
    for _ in range(SPEC_WAIT_BEATS - 1):  # then nothing more
        reg.heartbeat(hb("n1", *by_digest[:2], by_digest[2]))
        assert reg.specs_awaited() == 1
    reg.heartbeat(hb("n1", *by_digest))
    assert (reg.specs_missing(), reg.specs_awaited()) == (1, 0)  # still asked for, no longer waited for
    # A node whose first beat comes now is waited for, from its first beat.
    late = svc("late")
    reg.heartbeat(
        hb("n2", dataclasses.replace(report("late-0", late), spec=None, spec_digest=spec_digest(late.to_dict())))
    )
    assert reg.specs_awaited() == 1


@pytest.mark.parametrize(
    ("node", "iid", "reserved_mb", "needs"),
    [
        pytest.param("n1", "a-0", 20_000.0, {"a": 10_000.0}, id="the placed node's report counts, per GPU"),
        pytest.param("n2", "a-9", 1e9, {}, id="a stray id placed nowhere does not"),
        pytest.param("n2", "a-0", 1e9, {}, id="an instance placed on another node does not"),
        pytest.param("n1", "a-0", 1e9, {"a": 80_000.0}, id="no more than the node's largest GPU has"),
    ],
)
def test_memory_needs_come_only_from_the_node_an_instance_is_placed_on(reg, node, iid, reserved_mb, needs):
    doc = svc("a").to_dict()
    doc["spec"]["resources"] = {"gpus": 2}
    service = parse_model_service(doc)
    reg.add_model(service, "file")
    reg.mark_synced()
    gpus = [GPUInfo(i, "H100", total, 0.0) for i, total in enumerate((40_000.0, 80_000.0))]
    for name in ("n1", "n2"):
        reg.heartbeat(dataclasses.replace(hb(name), gpus=gpus))
    assert reg.placement.by_instance == {"a-0": "n1"}
    ready = dataclasses.replace(report(iid, service), reserved_mb=reserved_mb)
    reg.heartbeat(dataclasses.replace(hb(node, ready), gpus=gpus))
    assert reg.memory_needs() == needs


def test_a_spec_the_control_plane_does_not_admit_is_not_recovered_from_a_nodes_report(clock, changes, caplog):
    """A node speaks for what it runs, not for what the cluster allows: a recovered spec passes the same
    checks as one PUT through the admin API (Registry.admission), or stays out; the file's spec stays."""
    refused = {"planted", "a"}

    def admission(service, others):
        if service.model_id in refused and service.spec.model.version == "2":
            return [Problem("spec.model.path", "not under a model root")]
        return []

    reg = Registry(clock=clock, changes=changes, admission=admission)
    reg.add_model(svc("a", version="1"), "file")
    reg.heartbeat(hb("n1", report("planted-0", svc("planted", version="2")), report("a-0", svc("a", version="2"))))
    assert "planted" not in reg.models
    assert reg.models["a"].service.spec.model.version == "1"  # the file's, not the node's refused one
    assert "not under a model root" in caplog.text and "not recovered" in caplog.text
    reg.heartbeat(hb("n1", report("b-0", svc("b", version="2"))))  # one it admits comes back as before
    assert reg.models["b"].source == "node"


def test_the_control_plane_admits_recovered_specs_by_its_cluster_file_policy(tmp_path):
    from sie.auth import Signer
    from xds_server.main import XdsServer
    from xds_server.settings import Settings

    server = XdsServer(Settings(), signer=Signer.generate())
    pickled = parse_model_service(
        {"spec": {"model": {"name": "p", "path": "m.joblib"}, "backend": {"type": "sklearn"}}}
    )
    (problem,) = server.registry.admission(pickled, [])
    assert problem.path == "spec.model.path" and "pickle" in problem.reason
    assert server.registry.admission(svc("fine"), []) == []
