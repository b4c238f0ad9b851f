"""`sie up --control-plane` runs no node host; `sie token node NAME` mints a node's credentials there, and
`sie join` runs a node host that reports to it: the model is placed on the joined node and answers
through Envoy. Stopping the joined node host stops its workers."""

from __future__ import annotations

import http.client
import signal
import ssl
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

from sie.auth.pki import CertificateAuthority
from sie.auth.tls import pem_blocks, trust_bundle
from sie.processes import terminate
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


TLS_CLUSTER = (
    textwrap.dedent("""
    apiVersion: sie.io/v1alpha1
    kind: Cluster
    metadata: {name: tls}
    spec:
      admin_tls: "on"
    ---
    """)
    + CLUSTER
)


def test_a_node_joins_over_https_and_trusts_only_the_bundles_ca(tmp_path):
    """admin_tls on: the admin API serves HTTPS with a certificate from the run directory's CA, which
    trust.pem carries. A node host joining with that bundle heartbeats and serves; one whose bundle holds
    another CA refuses the handshake, so its token never reaches whoever answered; plain HTTP and a
    client that trusts only the system's CAs get no answer."""
    (tmp_path / "cluster.yaml").write_text(TLS_CLUSTER)
    stack = start_stack(tmp_path, tmp_path / "cluster.yaml", timeout=120, extra=("--control-plane",))
    joined: list[subprocess.Popen] = []
    try:
        assert stack.admin.startswith("https://127.0.0.1:"), stack.admin
        assert stack.status()["nodes"] == []  # verified against trust.pem's CA (Stack.request)
        plain = "http://" + stack.admin.removeprefix("https://") + "/healthz"
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(plain, timeout=5).read()
        with pytest.raises(urllib.error.URLError) as refused:
            urllib.request.urlopen(stack.admin + "/healthz", timeout=5, context=ssl.create_default_context())
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
        status = stack.sie("status", "--run-dir", str(stack.run_dir))  # the CLI finds the run dir's bundle
        assert status.returncode == 0, status.stderr
        creds = stack.run_dir / "credentials"
        remote = ("status", "--admin-url", stack.admin, "--token-file", str(creds / "admin.token"))
        elsewhere = ("--run-dir", str(tmp_path / "elsewhere"))  # no bundle there: the system's CAs
        status = stack.sie(*remote, *elsewhere)
        assert status.returncode == 1 and "certificate verify failed" in status.stderr, status.stderr
        status = stack.sie(*remote, *elsewhere, "--trust-file", str(creds / "trust.pem"))
        assert status.returncode == 0, status.stderr

        minted = stack.sie("token", "node", "far-1", "--run-dir", str(stack.run_dir))
        minted_too = stack.sie("token", "node", "far-2", "--run-dir", str(stack.run_dir))
        assert minted.returncode == 0 and minted_too.returncode == 0, minted.stderr + minted_too.stderr
        trust = (creds / "trust.pem").read_bytes()
        (public_key,) = pem_blocks(trust, "PUBLIC KEY")
        other = tmp_path / "other-trust.pem"
        other.write_bytes(trust_bundle(public_key, CertificateAuthority.generate("someone-else").cert_pem))
        other.chmod(0o600)

        def join(node: str, trust_file, log_name: str) -> subprocess.Popen:
            with open(tmp_path / log_name, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sie", "join", stack.admin, "--node", node]
                    + ["--token-file", str(creds / f"node-{node}.token"), "--trust-file", str(trust_file)]
                    + ["--run-dir", str(tmp_path / node)],
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            joined.append(proc)
            return proc

        impostor_trust = join("far-2", other, "far-2.log")
        join("far-1", creds / "trust.pem", "far-1.log")

        def serving():
            rows = stack.model("chat")["instances"]
            return rows and rows[0]["state"] == "ready" and rows[0]["node"] == "far-1"

        wait_until(serving, 90, "chat serves on the node that trusts the bundle's CA")
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        wait_until(lambda: request("POST", stack.envoy + "/v1/chat/completions", body)[0] == 200, 30, "a 200")
        wait_until(
            lambda: "CERTIFICATE_VERIFY_FAILED" in (tmp_path / "far-2.log").read_text(errors="replace"),
            30,
            "the node host with another CA refuses the control plane's certificate",
        )
        assert "verified against the trust bundle's CA alone" in (tmp_path / "far-1.log").read_text()
        # The node's sidecar posts its telemetry to the same HTTPS, verified with the bundle it was handed.
        wait_until(
            lambda: (stack.model("chat")["instances"][0].get("telemetry_age_s") or 99) < 5, 30, "fresh telemetry"
        )
        # The endpoint picker beside Envoy reads the instances over the same HTTPS, with the same bundle.
        picker_log = (stack.run_dir / "logs" / "picker.log").read_text(errors="replace")
        assert f"instances from {stack.admin}/v1/picker/endpoints" in picker_log, picker_log
        assert impostor_trust.poll() is None  # it keeps trying, as for a control plane that is away
        assert [n["node"] for n in stack.status()["nodes"]] == ["far-1"]  # far-2 never got through
    finally:
        for proc in joined:
            terminate(proc, grace_s=60)
        stop_stack(stack)
