"""ProcessManager: restarts with backoff under a fake clock and fake children; ordered graceful stops."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from node_host.cpus import CpuShare
from node_host.process import last_words, read_tail
from node_host.restarts import BackoffPolicy
from node_host.supervisor import ProcessManager, SidecarArgs
from sie.model_files import ModelFilePolicy
from sie.wire import Assignment

SPEC = {"metadata": {"name": "m1"}, "spec": {"model": {"name": "m1", "path": "/m"}, "backend": {"type": "torch"}}}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeChild:
    def __init__(self, pid: int, argv: list[str], obeys_term: bool = True):
        self.pid = pid
        self.argv = argv
        self.status: int | None = None
        self.signals: list[int] = []
        self.obeys_term = obeys_term

    def poll(self) -> int | None:
        return self.status

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if self.status is None and (sig == signal.SIGKILL or (sig == signal.SIGTERM and self.obeys_term)):
            self.status = -sig


class Spawner:
    def __init__(self) -> None:
        self.children: list[FakeChild] = []
        self.envs: list = []
        self.cpus: list = []
        self.obeys_term = True
        self.fail: set[str] = set()  # argv[0] values that cannot be spawned

    def __call__(self, argv, log_path, env=None, cpus=None, background=False):
        if argv[0] in self.fail:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
        child = FakeChild(1000 + len(self.children), list(argv), self.obeys_term)
        self.children.append(child)
        self.envs.append((log_path.name, env))
        self.cpus.append((log_path.name, cpus, background))
        return child


@pytest.fixture
def rig(tmp_path):
    clock, spawner, events = Clock(), Spawner(), []
    ports = iter(range(20000, 20100))

    async def sleep(seconds: float) -> None:
        events.append(("sleep", seconds))
        clock.now += seconds

    sup = ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url="http://cp",
        trust_file=tmp_path / "trust.pem",
        files=ModelFilePolicy(roots=(Path("/"),)),
        spawn=spawner,
        clock=clock,
        sleep=sleep,
        pick_port=lambda: next(ports),
        worker_command=lambda spec, spec_file, host, port, **kw: ["worker", str(spec_file), host, str(port)],
        sidecar_command=lambda a: ["sidecar", a.instance_id, a.listen, a.worker_url, a.control_url, a.node],
        policy=BackoffPolicy(initial_s=0.5, factor=2.0, max_s=10.0, stable_after_s=30.0),
        sidecar_grace_s=30.0,
        worker_grace_s=10.0,
    )
    return sup, clock, spawner


def test_start_writes_spec_and_launches_worker_then_sidecar(rig, tmp_path):
    sup, _, spawner = rig
    inst = sup.start(Assignment("i1", "m1", SPEC))
    worker, sidecar = spawner.children
    assert worker.argv == ["worker", str(tmp_path / "specs" / "i1.json"), "127.0.0.1", "20000"]
    assert sidecar.argv == ["sidecar", "i1", "127.0.0.1:20001", "http://127.0.0.1:20000", "http://cp", "n1"]
    assert (tmp_path / "specs" / "i1.json").is_file()
    assert spawner.envs == [("i1.worker.log", {"CUDA_VISIBLE_DEVICES": ""}), ("i1.sidecar.log", None)]
    assert (inst.worker_address, inst.sidecar_address) == ("127.0.0.1:20000", "127.0.0.1:20001")


def test_crashed_worker_restarts_with_doubling_backoff_and_sidecar_stays(rig):
    sup, clock, spawner = rig
    inst = sup.start(Assignment("i1", "m1", SPEC))
    sidecar = spawner.children[1]
    delays = []
    for _ in range(7):
        inst.worker_child.status = 1  # crashes right after start
        sup.tick()
        assert inst.worker_child is None and inst.worker.last_exit == "exit code 1"
        delays.append(inst.worker.restart_at - clock.now)
        clock.now += delays[-1] - 0.01
        sup.tick()
        assert inst.worker_child is None  # not yet due
        clock.now += 0.01
        sup.tick()
        assert inst.worker_child is not None
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert inst.worker.restarts == 7
    assert sidecar.signals == [] and inst.sidecar_child is sidecar
    worker_argvs = {tuple(c.argv) for c in spawner.children if c.argv[0] == "worker"}
    assert len(worker_argvs) == 1  # restarted on the same port, so the sidecar's --worker-url holds


def test_backoff_resets_after_stable_running(rig):
    sup, clock, _ = rig
    inst = sup.start(Assignment("i1", "m1", SPEC))
    for _ in range(3):
        inst.worker_child.status = 1
        sup.tick()
        clock.now = inst.worker.restart_at
        sup.tick()
    assert inst.worker.crashes_in_a_row == 3
    clock.now += 30.0  # ran long enough to count as stable
    inst.worker_child.status = -9
    sup.tick()
    assert inst.worker.crashes_in_a_row == 1
    assert inst.worker.restart_at - clock.now == 0.5
    assert inst.detail() == "worker killed by SIGKILL"


SIM = {
    "metadata": {"name": "m1"},
    "spec": {"model": {"name": "m1"}, "backend": {"type": "sim", "config": {"kv_tokens": 1000}}},
}


def crash(sup, clock, inst, status: int) -> None:
    inst.worker_child.status = status
    sup.tick()
    clock.now = inst.worker.restart_at
    sup.tick()


def test_a_worker_oom_killed_twice_in_a_row_restarts_with_a_smaller_kv_budget(rig, tmp_path):
    import json

    from node_host.backends.protocol import OOM_EXIT_CODE
    from node_host.backends.sim.worker import sim_params_from_spec
    from node_host.supervisor import MIN_KV_SCALE
    from sie.spec_loader import parse_model_service

    sup, clock, _ = rig
    inst = sup.start(Assignment("i1", "m1", SIM))
    spec_file = tmp_path / "specs" / "i1.json"
    crash(sup, clock, inst, -signal.SIGKILL)
    assert inst.kv_scale == 1.0, "one OOM kill is not a pattern"
    crash(sup, clock, inst, OOM_EXIT_CODE)
    assert inst.kv_scale == 0.75 and "KV budget cut to 75% of the spec's after 2 OOM kills in a row" in inst.detail()
    written = json.loads(spec_file.read_text())
    assert written["spec"]["backend"]["config"] == {"kv_tokens": 1000, "kv_budget_scale": 0.75}
    assert sim_params_from_spec(parse_model_service(written)).kv_tokens == 750, "the engine takes the cut"
    assert inst.spec == SIM, "the assignment is unchanged: the control plane sees no spec change"
    # Other crashes do not count, and break the row.
    crash(sup, clock, inst, -signal.SIGKILL)
    crash(sup, clock, inst, 1)
    crash(sup, clock, inst, -signal.SIGKILL)
    assert inst.kv_scale == 0.75
    for _ in range(12):
        crash(sup, clock, inst, -signal.SIGKILL)
    assert inst.kv_scale == MIN_KV_SCALE, "never below the floor"
    sup.respec("i1", SIM, inst.service)  # a new assignment with only the fleet's shape changed keeps the cut
    assert json.loads(spec_file.read_text())["spec"]["backend"]["config"]["kv_budget_scale"] == MIN_KV_SCALE


def test_a_stable_run_between_oom_kills_starts_the_count_again(rig):
    sup, clock, _ = rig
    inst = sup.start(Assignment("i1", "m1", SIM))
    crash(sup, clock, inst, -signal.SIGKILL)
    clock.now += 30.0
    crash(sup, clock, inst, -signal.SIGKILL)
    assert inst.kv_scale == 1.0 and inst.oom_in_a_row == 1


def test_crashed_child_group_is_swept(rig):
    sup, _, spawner = rig
    sup.start(Assignment("i1", "m1", SPEC))
    spawner.children[1].status = 2
    sup.tick()
    assert spawner.children[1].signals == [signal.SIGKILL]
    assert sup.instances["i1"].sidecar.last_exit == "exit code 2"


def test_a_child_that_exits_with_an_error_leaves_its_last_words_in_the_report(rig, tmp_path):
    # As Kubernetes' FallbackToLogsOnError: `sie status` says why, not only "exit code 2".
    sup, clock, spawner = rig
    log = sup.log_path("i1", "worker")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"an earlier run's last line\n")
    inst = sup.start(Assignment("i1", "m1", SPEC))
    with log.open("ab") as f:
        f.write(
            b"loading with key " + inst.worker_key.encode() + b"\n"
            b"2026-12-04 ERROR sie.worker: cannot serve the spec in i1.json: ModelService 'm1' is invalid:\n"
            b"  - spec.model.path: the torch backend needs a local model directory\x1b[0m\n\n"
        )
    inst.worker_child.status = 2
    sup.tick()
    words = inst.worker.last_words
    assert words == (
        "loading with key *** | 2026-12-04 ERROR sie.worker: cannot serve the spec in i1.json: ModelService "
        "'m1' is invalid: | - spec.model.path: the torch backend needs a local model directory"
    )
    assert inst.detail() == f"worker exit code 2 ({words})"
    assert sup.describe(inst)["worker"]["last_words"] == words
    # The next run that exits without a word does not repeat this one's.
    clock.now = inst.worker.restart_at
    sup.tick()
    inst.worker_child.status = 1
    sup.tick()
    assert inst.worker.last_exit == "exit code 1" and inst.worker.last_words is None
    # A signal says nothing of why: no words then (the log's end is whatever it was doing).
    clock.now = inst.worker.restart_at
    sup.tick()
    with log.open("ab") as f:
        f.write(b"serving\n")
    inst.worker_child.status = -signal.SIGKILL
    sup.tick()
    assert inst.worker.last_exit == "killed by SIGKILL" and inst.worker.last_words is None


@pytest.mark.parametrize(
    ("tail", "words"),
    [
        (b"", None),
        (b"\n \n", None),
        (b"one\ntwo\nthree\nfour\n", "two | three | four"),
        (b"\xff\xfe bad bytes\n", "\ufffd\ufffd bad bytes"),
        (b"a\tb\x00c\n", "a bc"),
        (b"\x1b[38:2:255:0:0mred\x1b[0m \x1b[>4;2mplain\n", "red plain"),
        (b"\x1b]0;a title\x07text \x1b]8;;http://x\x1b\\link\n", "text link"),
        (b"token s3cret in a line\n", "token *** in a line"),
        (("y" * 400).encode(), "..." + "y" * 297),
    ],
)
def test_last_words(tail, words):
    assert last_words(tail, secrets=("s3cret", "")) == words


def test_read_tail_reads_one_run_and_whole_lines_only(tmp_path):
    path = tmp_path / "w.log"
    path.write_bytes(b"a" * 5000 + b"\nlast line")
    assert read_tail(path, 12) == b"last line"  # the partial line before it is left out
    assert read_tail(path, 100_000, start=4990) == b"a" * 10 + b"\nlast line"  # a run's first line is whole
    assert read_tail(path, 100_000, start=5001) == b"last line"  # from where this run began, whole
    assert read_tail(tmp_path / "none.log") == b""


def test_read_tail_never_opens_anything_but_a_regular_file(tmp_path):
    fifo = tmp_path / "w.log"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    assert read_tail(fifo) == b""


async def test_stop_is_sidecar_first_then_worker(rig):
    sup, _, spawner = rig
    sup.start(Assignment("i1", "m1", SPEC))
    worker, sidecar = spawner.children
    order = []
    for child in (worker, sidecar):
        original = child.signal_group
        child.signal_group = lambda sig, c=child, o=original: (order.append((c.argv[0], sig)), o(sig))
    await sup.stop("i1")
    assert not sup.instances.get("i1") and not (sup.run_dir / "specs" / "i1.json").exists()
    assert order[0] == ("sidecar", signal.SIGTERM)
    assert order.index(("worker", signal.SIGTERM)) > order.index(("sidecar", signal.SIGTERM))
    assert sup.instances == {}


async def test_stop_escalates_to_sigkill_after_grace(rig):
    sup, clock, spawner = rig
    spawner.obeys_term = False
    sup.start(Assignment("i1", "m1", SPEC))
    start = clock.now
    await sup.stop("i1")
    worker, sidecar = spawner.children
    assert sidecar.signals[:2] == [signal.SIGTERM, signal.SIGKILL]
    assert worker.signals[:2] == [signal.SIGTERM, signal.SIGKILL]
    assert worker.status == -signal.SIGKILL
    assert clock.now - start == pytest.approx(40.0, abs=0.2)  # 30 s sidecar grace + 10 s worker grace


async def test_stopping_instance_is_not_restarted(rig):
    sup, _, spawner = rig
    sup.start(Assignment("i1", "m1", SPEC))
    sup.instances["i1"].stopping = True
    spawner.children[0].status = 1
    sup.tick()
    assert len(spawner.children) == 2


async def test_stop_all_stops_every_sidecar_before_any_worker(rig):
    sup, _, spawner = rig
    sup.start(Assignment("i1", "m1", SPEC))
    sup.start(Assignment("i2", "m1", SPEC))
    order = []
    for child in spawner.children:
        original = child.signal_group
        child.signal_group = lambda sig, c=child, o=original: (
            order.append(c.argv[0]) if sig == signal.SIGTERM else None,
            o(sig),
        )
    await sup.stop_all()
    assert order == ["sidecar", "sidecar", "worker", "worker"]
    assert sup.instances == {}
    assert all(c.status is not None for c in spawner.children)


def test_invalid_spec_is_refused_with_field_path(rig):
    sup, _, spawner = rig
    bad = {"spec": {"model": {"name": "m1"}, "backend": {"type": "nope"}}}
    with pytest.raises(ValueError, match="backend.type"):
        sup.start(Assignment("i1", "m1", bad))
    assert spawner.children == [] and sup.instances == {}


def test_sidecar_args_default_command():
    from node_host.supervisor import sidecar_command

    argv = sidecar_command(
        SidecarArgs(
            "i1",
            "/s.json",
            "127.0.0.1:5",
            "127.0.0.1:7",
            "http://127.0.0.1:6",
            Path("/k"),
            "http://cp",
            Path("/t"),
            Path("/trust.pem"),
            "n1",
            gpu_index=1,
        ),
        python="py",
    )
    assert argv == [
        "py",
        "-m",
        "sidecar",
        "--instance-id",
        "i1",
        "--spec-file",
        "/s.json",
        "--listen",
        "127.0.0.1:5",
        "--control-listen",
        "127.0.0.1:7",
        "--worker-url",
        "http://127.0.0.1:6",
        "--worker-key-file",
        "/k",
        "--control-url",
        "http://cp",
        "--token-file",
        "/t",
        "--trust-file",
        "/trust.pem",
        "--node",
        "n1",
        "--gpu-index",
        "1",
    ]


def test_an_instance_gets_its_own_secrets_and_loses_them_when_it_goes(rig):
    sup, clock, spawner = rig
    import stat

    inst = sup.start(Assignment("i1", "m1", SPEC, token="tok-1"))
    key, token = sup.secret_path("i1", "worker-key"), sup.secret_path("i1", "token")
    assert token.read_text() == "tok-1" and key.read_text() == inst.worker_key and len(inst.worker_key) >= 32
    for path in (key, token, key.parent):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0  # nobody else may read them
    sup.update_token("i1", "tok-2")
    assert token.read_text() == "tok-2"
    sup._forget(inst)
    assert not key.exists() and not token.exists()


def test_a_model_file_outside_the_roots_is_refused_before_anything_starts(rig, tmp_path):
    sup, _, spawner = rig
    sup.files = ModelFilePolicy(roots=(tmp_path / "models",))
    outside = {"spec": {"model": {"name": "m1", "path": "/etc/passwd"}, "backend": {"type": "sklearn"}}}
    with pytest.raises(ValueError, match="outside the model roots"):
        sup.start(Assignment("i1", "m1", outside))
    dots = {
        "spec": {"model": {"name": "m1", "path": str(tmp_path / "models/../x.skops")}, "backend": {"type": "sklearn"}}
    }
    with pytest.raises(ValueError, match=r"'\.\.'"):
        sup.start(Assignment("i1", "m1", dots))
    assert spawner.children == [] and sup.instances == {}


@pytest.mark.parametrize("backend", ["torch", "sglang"])
def test_a_model_directory_linking_out_of_the_roots_is_refused_before_anything_starts(rig, tmp_path, backend):
    sup, _, spawner = rig
    root, outside = tmp_path / "models", tmp_path / "outside"
    (root / "llm").mkdir(parents=True)
    outside.mkdir()
    (outside / "token").write_text("secret")
    (root / "llm" / "config.json").write_text("{}")
    (root / "llm" / "chat_template.jinja").symlink_to(outside / "token")  # what a hostile archive ships
    sup.files = ModelFilePolicy(roots=(root,))
    spec = {"spec": {"model": {"name": "m1", "path": str(root / "llm")}, "backend": {"type": backend}}}
    with pytest.raises(ValueError, match="'chat_template.jinja' is a symlink to .*outside the model roots"):
        sup.start(Assignment("i1", "m1", spec))
    assert spawner.children == [] and sup.instances == {}
    (root / "llm" / "chat_template.jinja").unlink()
    assert sup.start(Assignment("i1", "m1", spec)).instance_id == "i1"


def test_a_child_that_cannot_be_spawned_is_a_crash_retried_with_backoff(rig):
    sup, clock, spawner = rig
    spawner.fail = {"sidecar"}
    inst = sup.start(Assignment("i1", "m1", SPEC))
    assert inst.sidecar_child is None and inst.sidecar.last_exit.startswith("could not start")
    assert inst.sidecar.restart_at - clock.now == 0.5
    spawner.fail = set()
    clock.now += 0.5
    sup.tick()
    assert inst.sidecar_child is not None and inst.sidecar.restarts == 1


def test_the_gpu_and_worker_options_come_from_the_caller(tmp_path):
    spawner, seen = Spawner(), []
    ports = iter(range(20000, 20100))

    keys = []

    def worker_command(spec, spec_file, host, port, *, key, key_file, files, **options):
        assert files == sup.files  # every worker gets the file policy, and its key (written once built: below)
        keys.append((key_file, key))
        seen.append(options)
        return ["worker"]

    sup = ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url="http://cp",
        trust_file=tmp_path / "t.pem",
        files=ModelFilePolicy(roots=(Path("/"),)),
        spawn=spawner,
        pick_port=lambda: next(ports),
        worker_command=worker_command,
        gpu_for=lambda iid, spec: {"i1": 3}.get(iid),
        worker_options=lambda iid, spec: {"budget_mb": 1024.0, "free_mb": 8192.0} if iid == "i1" else {},
    )
    inst = sup.start(Assignment("i1", "m1", SPEC))
    ((key_file, key),) = keys
    assert key_file.read_text() == key == inst.worker_key
    assert inst.gpu_index == 3
    assert seen == [{"budget_mb": 1024.0, "free_mb": 8192.0}]
    assert spawner.children[1].argv[-2:] == ["--gpu-index", "3"] and spawner.envs[0][1] == {"CUDA_VISIBLE_DEVICES": "3"}
    other = sup.start(Assignment("i2", "m1", SPEC))
    assert other.gpu_index is None and seen[-1] == {} and "--gpu-index" not in spawner.children[3].argv


def pinned_manager(tmp_path, spawner, seen, environ=None, clock=None, lower_group=None):
    """A manager whose plan pins gold instances to CPU 0 and the rest to 1-3 in the background; `seen(pid)`
    is what the kernel answers about a child."""
    ports = iter(range(20000, 20100))

    def share_for(service):
        if service.spec.scheduling.tier == "gold":
            return CpuShare(frozenset({0}))
        return CpuShare(frozenset({1, 2, 3}), background=True)

    return ProcessManager(
        run_dir=tmp_path,
        node="n1",
        control_url="http://cp",
        trust_file=tmp_path / "t.pem",
        files=ModelFilePolicy(roots=(Path("/"),)),
        spawn=spawner,
        pick_port=lambda: next(ports),
        worker_command=lambda spec, spec_file, host, port, **kw: ["worker"],
        cpu_share_for=share_for,
        read_share=seen,
        lower_group=lower_group or (lambda pid: False),
        environ=environ or {},
        clock=clock or Clock(),
    )


GOLD = {**SPEC, "spec": {**SPEC["spec"], "scheduling": {"tier": "gold"}}}


def test_a_pinned_instance_starts_worker_and_sidecar_on_its_cores_with_pools_to_match(tmp_path):
    spawner = Spawner()
    sup = pinned_manager(tmp_path, spawner, seen=lambda pid: CpuShare(frozenset({0})), environ={"MKL_NUM_THREADS": "8"})
    inst = sup.start(Assignment("i1", "m1", GOLD))
    assert spawner.cpus == [("i1.worker.log", {0}, False), ("i1.sidecar.log", {0}, False)]
    threads = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # MKL's is the operator's own
    assert spawner.envs == [("i1.worker.log", {**threads, "CUDA_VISIBLE_DEVICES": ""}), ("i1.sidecar.log", threads)]
    assert inst.cpu_list == "0" and inst.detail() == ""
    row = sup.describe(inst)
    assert row["cpus"] == "0" and row["worker"]["cpus"] == "0" and row["sidecar"]["cpus"] == "0"
    assert row["background"] is False and row["worker"]["background"] is False
    from node_host.reports import report

    assert report(inst, "ok").cpus == "0"


def test_a_shared_pool_instance_runs_in_the_background_and_a_restart_keeps_it_so(tmp_path):
    spawner, clock = Spawner(), Clock()
    sup = pinned_manager(tmp_path, spawner, seen=lambda pid: CpuShare(frozenset({1, 2, 3}), True), clock=clock)
    inst = sup.start(Assignment("i1", "m1", SPEC))  # no tier: the shared pool
    inst.worker_child.status = 1
    sup.tick()
    clock.now += 60  # past the backoff
    sup.tick()
    assert [c[1:] for c in spawner.cpus] == [({1, 2, 3}, True)] * 3 and inst.cpu_list == "1-3"
    assert sup.describe(inst)["background"] is True and inst.detail().startswith("worker exit code 1")


def test_a_child_the_kernel_did_not_pin_is_said_loudly(tmp_path):
    spawner = Spawner()
    sup = pinned_manager(
        tmp_path,
        spawner,
        seen=lambda pid: CpuShare(frozenset({0, 1, 2, 3})) if pid == 1001 else CpuShare(frozenset({0})),
    )
    inst = sup.start(Assignment("i1", "m1", GOLD))
    assert inst.detail() == "sidecar may use CPUs 0-3, not the 0 it was started with"
    assert sup.describe(inst)["sidecar"]["cpus"] == "0-3"


class Groups:
    """The kernel's autogroups, as the supervisor sees them: a child's group is lowered once `lower_group`
    has been called for it `after` times (the kernel said EAGAIN before)."""

    def __init__(self, after: int) -> None:
        self.after, self.tries, self.lowered = after, {}, set()

    def lower_group(self, pid: int) -> bool:
        self.tries[pid] = self.tries.get(pid, 0) + 1
        if self.tries[pid] >= self.after:
            self.lowered.add(pid)
        return pid in self.lowered

    def seen(self, pid: int) -> CpuShare:
        return CpuShare(frozenset({1, 2, 3}), background=pid in self.lowered)


def test_a_background_child_whose_autogroup_the_kernel_put_off_is_lowered_by_the_next_ticks(tmp_path, caplog):
    groups, clock = Groups(after=2), Clock()
    sup = pinned_manager(tmp_path, Spawner(), groups.seen, clock=clock, lower_group=groups.lower_group)
    inst = sup.start(Assignment("i1", "m1", SPEC))
    assert set(inst.group_pending) == {"worker", "sidecar"} and sup.describe(inst)["worker"]["background"] is False
    assert inst.detail() == ""  # not a problem while the supervisor is at it
    sup.tick()  # the kernel is still busy
    assert groups.tries == {1000: 1, 1001: 1} and set(inst.group_pending) == {"worker", "sidecar"}
    clock.now += 0.1
    sup.tick()
    row = sup.describe(inst)
    assert inst.group_pending == {} and row["worker"]["background"] is row["sidecar"]["background"] is True
    assert inst.detail() == ""
    sup.tick()
    assert groups.tries == {1000: 2, 1001: 2}  # nothing more to do
    assert "may use CPUs" not in caplog.text


def test_a_background_child_whose_autogroup_stays_put_off_is_reported_once_the_time_is_up(tmp_path, caplog):
    from node_host.supervisor import GROUP_RETRY_S

    groups, clock = Groups(after=10**9), Clock()
    sup = pinned_manager(tmp_path, Spawner(), groups.seen, clock=clock, lower_group=groups.lower_group)
    inst = sup.start(Assignment("i1", "m1", SPEC))
    for _ in range(3):
        sup.tick()
        clock.now += 0.1
    assert set(inst.group_pending) == {"worker", "sidecar"} and "may use CPUs" not in caplog.text
    clock.now += GROUP_RETRY_S
    sup.tick()
    assert inst.group_pending == {} and sup.describe(inst)["worker"]["background"] is False
    assert "worker may use CPUs 1-3, not the 1-3 (background)" in inst.detail()
    assert caplog.text.count("may use CPUs 1-3, not 1-3 (background)") == 2, caplog.text


def test_an_unpinned_instance_is_spawned_as_before(rig):
    sup, _, spawner = rig
    inst = sup.start(Assignment("i1", "m1", GOLD))
    assert spawner.cpus == [("i1.worker.log", None, False), ("i1.sidecar.log", None, False)]
    assert inst.cpu_list == "" and sup.describe(inst)["cpus"] == "" and sup.describe(inst)["worker"]["cpus"] is None
