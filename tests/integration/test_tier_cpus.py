"""Tier CPU isolation on real processes (`sie up`, one node host with `tier_cpus`): the P0 scorer on the
P0-only tier runs, worker and sidecar, on the tier's core only; the other (P2) model on the rest, in the
background (SCHED_IDLE); the node host, the control plane and Envoy stay off the tier's core; the kernel
says so (os.sched_getaffinity and sched_getscheduler of each pid and thread), their thread pools are
sized to match, and /v1/status and `sie status` show each instance's cores."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from sie.cpu_lists import format_cpu_list
from sie.processes import AUTOGROUP_NICE, autogroup_nice
from tests.integration.standalone_helpers import start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CPUS = sorted(os.sched_getaffinity(0))
if len(CPUS) < 2:
    pytest.skip(
        f"tier isolation needs 2 CPUs to split (a tier's and the shared pool); this process may use {CPUS}",
        allow_module_level=True,
    )
GOLD, SHARED = frozenset(CPUS[:1]), frozenset(CPUS[1:])

SCORER = """
    ---
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {{name: {name}}}
    spec:
      model: {{name: {name}, path: .sie/data/{name}.skops, service_type: scoring, priority_level: {priority}}}
      backend: {{type: sklearn, config: {{demo: true}}}}
      {scheduling}
      input_schema: {{type: json, fields: [{{name: text, type: string, max_length: 4096}}]}}
"""

CLUSTER = textwrap.dedent(f"""
    apiVersion: sie.io/v1alpha1
    kind: Cluster
    spec:
      picker_port: 0
      nodes:
        - {{name: n1, tier_cpus: "gold={format_cpu_list(GOLD)}", p0_only_tiers: gold}}
""") + "".join(
    textwrap.dedent(SCORER.format(name=name, priority=priority, scheduling=scheduling))
    for name, priority, scheduling in (
        ("fast", "P0", "scheduling: {tier: gold}"),
        ("other", "P2", ""),
    )
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tiers")
    (workdir / "cluster.yaml").write_text(CLUSTER)
    s = start_stack(workdir, workdir / "cluster.yaml", timeout=180)
    try:
        yield s
    finally:
        stop_stack(s)


def node_instances(stack) -> dict[str, dict]:
    (node,) = stack.status()["nodes"]
    code, _, body = stack.request("GET", node["address"] + "/v1/instances", timeout=5)
    assert code == 200, body
    return {row["model_id"]: row for row in body["instances"]}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def test_worker_and_sidecar_run_on_their_tiers_cores_only(stack):
    rows = node_instances(stack)
    for model, cpus, policy in (("fast", GOLD, os.SCHED_OTHER), ("other", SHARED, os.SCHED_IDLE)):
        row = rows[model]
        assert row["cpus"] == format_cpu_list(cpus) and row["background"] is (policy == os.SCHED_IDLE), row
        for role in ("worker", "sidecar"):
            pid = row[role]["pid"]
            assert os.sched_getaffinity(pid) == cpus, (model, role)
            assert row[role]["cpus"] == format_cpu_list(cpus)
            # Every thread it started since (the event loop's executor, the BLAS pool) inherited both.
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == cpus, (model, role, tid)
                assert os.sched_getscheduler(int(tid)) == policy, (model, role, tid)
            assert environ(pid)["OMP_NUM_THREADS"] == str(len(cpus))
            # A background child's session group is lowered too: SCHED_IDLE alone ranks it only within it.
            group = autogroup_nice(pid)
            assert group is None or (group == AUTOGROUP_NICE) is (policy == os.SCHED_IDLE), (model, role, group)


def test_sies_own_processes_stay_off_the_tiers_core(stack):
    node_host = json.loads((stack.run_dir / "node_host.json").read_text())["pid"]
    children = stack.state()["children"]
    for name, pid in (("node host", node_host), ("xds_server", children["xds_server"]), ("envoy", children["envoy"])):
        for tid in os.listdir(f"/proc/{pid}/task"):
            assert os.sched_getaffinity(int(tid)) == SHARED, (name, tid)


def test_status_shows_each_instances_cores(stack):
    by_model = {m["model_id"]: m["instances"] for m in stack.status()["models"]}
    assert [i["cpus"] for i in by_model["fast"]] == [format_cpu_list(GOLD)]
    assert [i["cpus"] for i in by_model["other"]] == [format_cpu_list(SHARED)]
    out = wait_until(
        lambda: (r := stack.sie("status", "--run-dir", str(stack.run_dir))).returncode == 0 and r.stdout,
        30,
        "sie status answers",
    )
    header = next(line for line in out.splitlines() if line.startswith("INSTANCE"))
    assert "CPUS" in header.split()
    column = header.index("CPUS")
    cells = {
        line.split()[0]: line[column:].split()[0] for line in out.splitlines() if line.startswith(("fast-", "other-"))
    }
    assert cells == {"fast-0": format_cpu_list(GOLD), "other-0": format_cpu_list(SHARED)}, out
