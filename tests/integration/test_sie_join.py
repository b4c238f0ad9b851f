"""`sie up --control-plane` runs no node host; `sie token node NAME` mints a node's credentials there, and
`sie join` runs a node host that reports to it: the model is placed on the joined node and answers
through Envoy. Stopping the joined node host stops its workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.integration.standalone_helpers import alive, descendants, request, start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CLUSTER = textwrap.dedent("""
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: chat}
    spec:
      model: {name: chat, service_type: llm}
      backend: {type: sim}
    """)


def test_a_node_joins_a_control_plane_and_serves(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    stack = start_stack(tmp_path, tmp_path / "cluster.yaml", timeout=120, extra=("--control-plane",))
    joined = None
    try:
        assert stack.status()["nodes"] == []
        (row,) = stack.model("chat")["instances"]
        assert row["state"] == "unplaced" and "no live node" in row["detail"]

        minted = stack.sie("token", "node", "far-1", "--run-dir", str(stack.run_dir))
        assert minted.returncode == 0, minted.stderr
        creds = stack.run_dir / "credentials"
        log = open(tmp_path / "join.log", "wb")
        joined = subprocess.Popen(
            [sys.executable, "-m", "sie", "join", stack.admin, "--node", "far-1"]
            + ["--token-file", str(creds / "node-far-1.token"), "--trust-file", str(creds / "trust.pem")]
            + ["--run-dir", str(tmp_path / "far-1"), "--labels", "site=far"],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

        def serving():
            rows = stack.model("chat")["instances"]
            return rows and rows[0]["state"] == "ready" and rows[0]["node"] == "far-1"

        wait_until(serving, 90, "chat serves on the joined node")
        (node,) = stack.status()["nodes"]
        assert (node["node"], node["labels"]) == ("far-1", {"site": "far"})
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        wait_until(lambda: request("POST", stack.envoy + "/v1/chat/completions", body)[0] == 200, 30, "a 200")

        tree = descendants(joined.pid)
        joined.send_signal(signal.SIGTERM)
        assert joined.wait(timeout=60) == 0
        wait_until(lambda: not any(alive(p) for p in tree), 30, "the joined node's workers stopped")
    finally:
        if joined is not None and joined.poll() is None:
            joined.kill()
            joined.wait(timeout=10)
        stop_stack(stack)
