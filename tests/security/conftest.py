"""One `sie up` stack for the security tests, attacked from outside as a client, a pod or a local process
would (DESIGN §10). It runs `sim` models (an LLM P0 with two instances, an LLM P2) and the demo scikit-learn
scorer, so it starts in seconds; every test leaves it serving, and `gold` (the P0 model) is checked to
serve after each probe.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass

import pytest

from tests.integration.standalone_helpers import Stack, request, start_stack, stop_stack

CLUSTER = textwrap.dedent("""
    kind: Cluster
    spec:
      model_roots: [models]
      ingress: {request_headers_timeout_s: 3, request_timeout_s: 5}  # short, so slow clients meet them in a test
    ---
    kind: ModelService
    spec:
      model: {name: gold, priority_level: P0}
      backend: {type: sim}
      resources: {max_concurrent_requests: 8}
      sla: {min_replicas: 2, max_replicas: 2, p99_latency_ms: 2000, max_queue_time_ms: 2000}
      limits: {max_new_tokens: 64}
    ---
    kind: ModelService
    spec:
      model: {name: bronze, priority_level: P2}
      backend: {type: sim}
      resources: {max_concurrent_requests: 4}
    ---
    kind: ModelService
    spec:
      model: {name: scorer, path: models/scorer.skops, service_type: scoring, priority_level: P1}
      backend: {type: sklearn, config: {demo: true}}
      input_schema: {fields: [{name: text, type: string, max_length: 256}]}
""")

GOLD = {"model": "gold", "text": "is gold still served?", "sampling_params": {"max_new_tokens": 4}}


@dataclass
class Target:
    """The running stack and what an attacker on this machine could find out about it."""

    stack: Stack
    node: str  # the node host's API

    @property
    def envoy(self) -> str:
        return self.stack.envoy

    def instances(self) -> list[dict]:
        code, _, body = self.stack.request("GET", self.node + "/v1/instances")
        assert code == 200, body
        return body["instances"]

    def instance(self, instance_id: str) -> dict:
        return next(i for i in self.instances() if i["instance_id"] == instance_id)

    def gold_serves(self) -> None:
        code, _, body = request("POST", self.envoy + "/generate", GOLD, timeout=30)
        assert code == 200, body

    def upstream_requests(self) -> dict[str, int]:
        """Envoy's count of requests sent to each model's sidecars."""
        code, text = self.stack.envoy_admin("/stats?filter=upstream_rq_total")
        out = {}
        for line in str(text).splitlines():
            name, _, value = line.partition(": ")
            if name.startswith("cluster.model.") and name.endswith(".upstream_rq_total"):
                out[name.split(".")[2]] = int(value)
        return out


@pytest.fixture(scope="session")
def target(tmp_path_factory) -> Target:
    workdir = tmp_path_factory.mktemp("security")
    (workdir / "models").mkdir()
    cluster = workdir / "cluster.yaml"
    cluster.write_text(CLUSTER)
    stack = start_stack(workdir, cluster, timeout=120)
    try:
        node = json.loads((stack.run_dir / "node_host.json").read_text())["address"]
        yield Target(stack, node)
    finally:
        stop_stack(stack)
