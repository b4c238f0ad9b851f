"""Several node hosts from one cluster file (`nodes:`): each with its own run directory and virtual GPUs;
the control plane spreads a model's replicas over them, honours a nodeSelector, and `sie status` shows
every node, its GPUs and where each instance runs. Failover on real processes: a failed virtual GPU's
instance runs on the node's healthy GPU; a node cut off (its node host stopped, its workers running)
is lost after the heartbeat timeout, its instance serves on another node, and requests keep answering;
when it comes back, the spread rule has its running copy serve again (rebalance none moves nothing
back for its own sake)."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest

from tests.integration.standalone_helpers import request, start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CLUSTER = textwrap.dedent("""
    apiVersion: sie.io/v1alpha1
    kind: Cluster
    metadata: {name: three}
    spec:
      settings:
        control_plane: {heartbeat_timeout_s: 3}
      nodes:
        - {name: node-a, virtual_gpus: 1x24GB}
        - {name: node-b, virtual_gpus: 1x24GB}
        - {name: node-c, virtual_gpus: 2x48GB, labels: {zone: c}, taints: ["dedicated=zone-c:NoSchedule"]}
    ---
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: spread}
    spec:
      model: {name: spread, service_type: llm}
      backend: {type: sim}
      sla: {min_replicas: 2, max_replicas: 2}
    ---
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: pinned}
    spec:
      model: {name: pinned, service_type: llm}
      backend: {type: sim}
      resources: {min_gpu_memory_mb: 4096}
      scheduling:
        nodeSelector: {zone: c}
        tolerations: [{key: dedicated, operator: Equal, value: zone-c, effect: NoSchedule}]
    """)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("multinode")
    (workdir / "cluster.yaml").write_text(CLUSTER)
    s = start_stack(workdir, workdir / "cluster.yaml", timeout=240)
    try:
        yield s
    finally:
        stop_stack(s)


def test_three_node_hosts_each_with_its_own_run_directory(stack):
    nodes = {n["node"]: n for n in stack.status()["nodes"]}
    assert set(nodes) == {"node-a", "node-b", "node-c"}
    assert all(n["live"] for n in nodes.values())
    assert [len(nodes[n]["gpus"]) for n in ("node-a", "node-b", "node-c")] == [1, 1, 2]
    for name in nodes:
        assert (stack.run_dir / "nodes" / name / "node_host.json").exists()


def test_replicas_spread_and_the_selector_pins(stack):
    where = {i["instance_id"]: i["node"] for i in stack.model("spread")["instances"]}
    # node-c is tainted: the untolerating model goes on a and b, one replica each.
    assert sorted(where.values()) == ["node-a", "node-b"], where
    pinned = stack.model("pinned")["instances"]
    assert [i["node"] for i in pinned] == ["node-c"]
    assert "placed on node-c" in pinned[0]["placement"] or "runs on node-c" in pinned[0]["placement"]


def test_requests_reach_every_model_and_status_shows_the_nodes(stack):
    for model in ("spread", "pinned"):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        code, _, _ = request("POST", stack.envoy + "/v1/chat/completions", body, timeout=30)
        assert code == 200, model
    out = stack.sie("status", "--run-dir", str(stack.run_dir))
    assert out.returncode == 0, out.stderr
    for name in ("node-a", "node-b", "node-c"):
        assert name in out.stdout


def test_a_failed_gpus_instance_serves_on_the_nodes_healthy_gpu(stack):
    (row,) = stack.model("pinned")["instances"]
    assert row["node"] == "node-c" and row["gpu"] is not None
    node_c = next(n for n in stack.status()["nodes"] if n["node"] == "node-c")
    code, _, body = stack.request("POST", f"{node_c['address']}/v1/gpus/{row['gpu']}/fail", {"reason": "test"})
    assert code == 200 and body["instances"] == ["pinned-0"], body

    def moved():
        (now,) = stack.model("pinned")["instances"]
        return now["state"] == "ready" and now["in_eds"] and now["gpu"] not in (None, row["gpu"]) and now

    wait_until(moved, 60, "pinned-0 serving on node-c's other GPU")
    gpus = {g["index"]: g for g in next(n for n in stack.status()["nodes"] if n["node"] == "node-c")["gpus"]}
    assert "test" in gpus[row["gpu"]]["failed"] and not gpus[1 - row["gpu"]]["failed"]
    events = [e for e in stack.status()["node_events"] if e["kind"] == "gpu_failed"]
    assert events and events[-1]["node"] == "node-c"
    # Failing it again, or a GPU the node does not have, or without an admin's token: refused, named.
    assert stack.request("POST", f"{node_c['address']}/v1/gpus/7/fail")[0] == 404
    reader = (stack.run_dir / "credentials" / "reader.token").read_text().strip()
    refused = request("POST", f"{node_c['address']}/v1/gpus/0/fail", headers={"Authorization": f"Bearer {reader}"})
    assert refused[0] == 403
    body = {"model": "pinned", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert request("POST", stack.envoy + "/v1/chat/completions", body, timeout=30)[0] == 200


def test_a_node_cut_off_is_lost_after_the_timeout_and_its_instance_serves_elsewhere(stack):
    """SIGSTOP node-b's node host: its heartbeats stop, its workers and sidecars go on. After the timeout
    (3 s here) node-b is lost, its endpoint leaves EDS and its spread replica is placed on node-a; the
    model answers throughout. SIGCONT: node-b comes back and its copy serves again (spread)."""
    before = {i["instance_id"]: i["node"] for i in stack.model("spread")["instances"]}
    (moved,) = [iid for iid, node in before.items() if node == "node-b"]
    state = json.loads((stack.run_dir / "nodes" / "node-b" / "node_host.json").read_text())
    body = {"model": "spread", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    os.kill(int(state["pid"]), signal.SIGSTOP)
    try:
        failures = []

        def elsewhere():
            code = request("POST", stack.envoy + "/v1/chat/completions", body, timeout=30)[0]
            if code != 200:
                failures.append(code)
            rows = {i["instance_id"]: i for i in stack.model("spread")["instances"]}
            row = rows.get(moved, {})
            return row.get("node") == "node-a" and row.get("state") == "ready" and row.get("in_eds")

        wait_until(elsewhere, 60, f"{moved} serving on node-a", interval=0.1)
        status = stack.status()
        node_b = next(n for n in status["nodes"] if n["node"] == "node-b")
        assert node_b["health"] == "lost" and not node_b["live"]
        lost = [e for e in status["node_events"] if e["node"] == "node-b" and e["kind"] == "lost"]
        assert lost and "timeout 3 s" in lost[-1]["detail"]
        assert failures == [], "a model with replicas on two nodes answers throughout"
    finally:
        os.kill(int(state["pid"]), signal.SIGCONT)
    wait_until(lambda: next(n for n in stack.status()["nodes"] if n["node"] == "node-b")["live"], 30, "node-b back")
    # rebalance none moves nothing back for its own sake, but the spread rule wants the two replicas on
    # two nodes again: node-b's running copy serves again and node-a's interim copy is dropped.
    wait_until(
        lambda: (
            sorted((i["node"], i["state"]) for i in stack.model("spread")["instances"])
            == [("node-a", "ready"), ("node-b", "ready")]
        ),
        30,
        "the two replicas on node-a and node-b again",
    )
    for _ in range(5):
        assert request("POST", stack.envoy + "/v1/chat/completions", body, timeout=30)[0] == 200


def test_a_lost_node_hosts_instances_serve_again(stack):
    """Last: it kills a node host and its workers. `sie up` restarts the node host; whichever comes
    first, the control plane noticing the loss (heartbeat_timeout_s) and placing the instance on node-b (node-c
    is tainted), or the restarted node-a starting it again, the instance serves again and the model
    answers."""
    lost = {i["instance_id"] for i in stack.model("spread")["instances"] if i["node"] == "node-a"}
    assert lost
    state = json.loads((stack.run_dir / "nodes" / "node-a" / "node_host.json").read_text())
    os.killpg(int(state["pid"]), signal.SIGKILL)  # the node host and everything in its session

    def serving():
        rows = {i["instance_id"]: i for i in stack.model("spread")["instances"]}
        return all(
            rows.get(iid, {}).get("state") == "ready" and rows[iid]["node"] in ("node-a", "node-b") for iid in lost
        )

    wait_until(lambda: not serving(), 10, "the lost instance is seen gone")
    wait_until(serving, 90, "the lost instances serve again")
    wait_until(lambda: {n["node"]: n for n in stack.status()["nodes"]}["node-a"]["live"], 60, "node-a back")
    body = {"model": "spread", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(5):
        assert request("POST", stack.envoy + "/v1/chat/completions", body, timeout=30)[0] == 200
