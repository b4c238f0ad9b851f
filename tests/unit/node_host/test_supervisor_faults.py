"""ProcessManager when a start fails partway (nothing is left behind) and when the worker of a sleeping
instance crashes (it waits for the wake); fake children, real port reservations."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from node_host.process import PortReservations
from node_host.restarts import BackoffPolicy
from node_host.supervisor import ProcessManager
from sie.wire import Assignment
from tests.unit.node_host.node_fakes import Clock, Spawner

SIM = {"metadata": {"name": "m1"}, "spec": {"model": {"name": "m1"}, "backend": {"type": "sim"}}}


def refused_command(*args, **kwargs):
    raise ValueError("backend.config.port is set by node_host")  # as the SGLang launcher refuses a config


class Failing:
    """What fails during a start: the worker command, the last port, the secrets, the sidecar's spawn."""

    def __init__(self, where: str, ports: PortReservations, run_dir: Path):
        self.where, self.ports, self.taken = where, ports, 0
        if where == "token":
            (run_dir / "secrets").write_text("")  # the secrets folder cannot be made: an OSError

    def pick_port(self) -> int:
        self.taken += 1
        if self.where == "port" and self.taken % 3 == 0:  # the last of each start's three
            raise OSError(24, "Too many open files")
        return self.ports.take()

    def spawn(self, spawner: Spawner):
        def spawn(argv, log_path, env=None, cpus=None, background=False):
            if self.where == "sidecar" and log_path.name.endswith(".sidecar.log"):
                raise RuntimeError("not an OSError: a bug, say")
            return spawner(argv, log_path, env, cpus, background)

        return spawn


FAILURES = [
    ("worker command", ValueError),
    ("port", OSError),
    ("token", OSError),
    ("sidecar", RuntimeError),
]


@pytest.mark.parametrize("where,error", FAILURES)
def test_a_start_that_fails_partway_leaves_no_port_file_or_child(tmp_path, where, error):
    ports, spawner = PortReservations(), Spawner()
    failing = Failing(where, ports, tmp_path)
    sup = ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url="http://cp",
        trust_file=tmp_path / "trust.pem",
        spawn=failing.spawn(spawner),
        ports=ports,
        pick_port=failing.pick_port,
        **({"worker_command": refused_command} if where == "worker command" else {}),
    )
    try:
        for n in range(3):
            with pytest.raises(error):
                sup.start(Assignment(f"i{n}", "m1", SIM, token="SIDECAR-TOKEN"))
        assert sup.instances == {} and ports.held() == set()
        left = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name in ("specs", "secrets")]
        assert left == []
        assert all(signal.SIGKILL in c.signals for c in spawner.children)  # a worker already spawned is killed
        assert len(spawner.children) == (3 if where == "sidecar" else 0)
    finally:
        ports.close()


@pytest.fixture
def manager(tmp_path):
    clock, spawner = Clock(100.0), Spawner()
    sup = ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url="http://cp",
        trust_file=tmp_path / "trust.pem",
        spawn=spawner,
        clock=clock,
        pick_port=iter(range(20000, 20100)).__next__,
        policy=BackoffPolicy(initial_s=0.5, factor=2.0, max_s=10.0, stable_after_s=30.0),
    )
    return sup, clock, spawner


@pytest.mark.parametrize("falls_asleep", ["before the crash", "after the crash, before its restart"])
def test_a_worker_that_crashes_while_asleep_waits_for_the_wake(manager, falls_asleep):
    sup, clock, spawner = manager
    inst = sup.start(Assignment("i1", "m1", SIM))
    first = inst.worker_child
    asleep: set[str] = {"i1"} if falls_asleep == "before the crash" else set()
    first.status = -signal.SIGKILL
    sup.tick(asleep=asleep.__contains__)
    asleep.add("i1")  # the ledger holds it sleeping: no memory for a worker at full size
    for _ in range(3):
        clock.now += 60.0
        sup.tick(asleep=asleep.__contains__)
    workers = [c for c in spawner.children if "node_host.backends.sim" in c.argv]
    assert workers == [first] and inst.worker_child is None and inst.worker_parked
    assert inst.worker.restart_at is None and inst.detail() == "worker killed by SIGKILL"
    asleep.clear()  # the wake has reserved its memory again
    sup.unpark_worker("i1")
    assert inst.worker_child is not None and inst.worker_child is not first and not inst.worker_parked


def test_a_worker_that_crashes_awake_restarts_as_before(manager):
    sup, clock, spawner = manager
    inst = sup.start(Assignment("i1", "m1", SIM))
    inst.worker_child.status = 1
    sup.tick(asleep=lambda instance_id: False)
    clock.now += 0.5
    sup.tick(asleep=lambda instance_id: False)
    assert inst.worker_child is not None and inst.worker.restarts == 1 and not inst.worker_parked
