"""Several node hosts from one cluster file (`nodes:`): each with its own run directory and virtual GPUs;
the control plane spreads a model's replicas over them, honours a nodeSelector, and `sie status` shows
every node, its GPUs and where each instance runs."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import pytest

from tests.integration.standalone_helpers import request, start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CLUSTER = textwrap.dedent("""
    apiVersion: sie.io/v1alpha1
    kind: Cluster
    metadata: {name: three}
    spec:
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


def test_a_lost_node_hosts_instances_are_placed_again_elsewhere(stack):
    """Last: it kills a node host. Its instances come back on a live node (node-c is tainted, so
    spread-0's new home is node-b, next to spread-1), and stay there when the node returns."""
    lost = {i["instance_id"] for i in stack.model("spread")["instances"] if i["node"] == "node-a"}
    assert lost
    state = json.loads((stack.run_dir / "nodes" / "node-a" / "node_host.json").read_text())
    os.killpg(int(state["pid"]), signal.SIGKILL)  # the node host and everything in its session
    killed_at = time.monotonic()

    def moved():
        rows = {i["instance_id"]: i for i in stack.model("spread")["instances"]}
        return all(rows.get(iid, {}).get("node") == "node-b" and rows[iid]["state"] == "ready" for iid in lost)

    wait_until(moved, 60, "the lost instances serve on node-b")
    took = time.monotonic() - killed_at
    # `sie up` restarts the node host; node-a comes back, and the moved instance stays where it serves.
    wait_until(lambda: {n["node"]: n for n in stack.status()["nodes"]}["node-a"]["live"], 60, "node-a back")
    assert moved()
    body = {"model": "spread", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for _ in range(5):
        assert request("POST", stack.envoy + "/v1/chat/completions", body, timeout=30)[0] == 200
    assert took < 60
