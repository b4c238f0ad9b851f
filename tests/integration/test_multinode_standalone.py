"""Several node hosts from one cluster file (`nodes:`): each with its own run directory and virtual GPUs;
the control plane spreads a model's replicas over them, honours a nodeSelector, and `sie status` shows
every node, its GPUs and where each instance runs."""

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
