"""The standalone demo as a new user meets it: `sie up -f examples/cluster.yaml`, requests through the
real Envoy, a worker killed, the control plane killed, then `sie down` leaving no process behind.

One stack serves the whole module (it takes a while to start on two cores); tests run in file order
and the destructive ones come last.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from tests.integration.standalone_helpers import (
    REPO,
    alive,
    connect_as_nobody,
    descendants,
    listening_tcp_ports,
    request,
    start_stack,
    stop_stack,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHAT = {"model": "chat-p0", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("standalone")
    s = start_stack(workdir, REPO / "examples" / "cluster.yaml")
    try:
        yield s
    finally:
        stop_stack(s)


def envoy_hosts(stack, model_id: str) -> dict[str, str]:
    """address -> eds health status of a model's cluster in Envoy."""
    code, body = stack.envoy_admin("/clusters?format=json")
    assert code == 200
    for cluster in body.get("cluster_statuses", []):
        if cluster["name"] == f"model.{model_id}":
            out = {}
            for host in cluster.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                out[f"{sock['address']}:{sock['port_value']}"] = host["health_status"].get("eds_health_status", "?")
            return out
    return {}


def test_sie_up_prints_the_table_and_curl_lines(stack):
    log = stack.log()
    for model in ("chat-p0", "chat-p2", "risk-scorer"):
        assert model in log
    assert "curl" in log and stack.envoy in log


def test_chat_completion_through_envoy(stack):
    code, _, body = request("POST", stack.envoy + "/v1/chat/completions", CHAT)
    assert code == 200, body
    assert body["object"] == "chat.completion"
    assert body["model"] == "chat-p0"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["usage"]["completion_tokens"] >= 1


def test_model_by_header_and_by_path(stack):
    code, _, body = request(
        "POST",
        stack.envoy + "/v1/completions",
        {"prompt": "Once upon", "max_tokens": 4},
        headers={"x-sie-model": "chat-p2"},
    )
    assert code == 200, body
    assert body["model"] == "chat-p2"


def test_scorer_returns_a_typed_score(stack):
    code, _, body = request(
        "POST", stack.envoy + "/v1/models/risk-scorer/infer", {"text": "wire transfer to a new account"}
    )
    assert code == 200, body
    assert isinstance(body["score"], float) and 0.0 <= body["score"] <= 1.0


def test_envoy_lists_each_models_cluster_with_its_instances(stack):
    # The serving instances; each model's warm pool instance (autoscale.warm_pool 1) sleeps, out of EDS.
    assert len(envoy_hosts(stack, "chat-p0")) == 2
    assert len(envoy_hosts(stack, "chat-p2")) == 1
    assert len(envoy_hosts(stack, "risk-scorer")) == 1
    assert all(h == "HEALTHY" for h in envoy_hosts(stack, "chat-p0").values())


def test_unknown_model_gets_404_listing_the_known_models(stack):
    code, headers, body = request("POST", stack.envoy + "/v1/chat/completions", {**CHAT, "model": "nope"})
    assert code == 404
    assert headers.get("content-type", "").startswith("application/json")
    assert set(body["error"]["known_models"]) == {"chat-p0", "chat-p2", "risk-scorer"}


def test_a_body_that_breaks_the_input_schema_gets_400_naming_the_field(stack):
    code, _, body = request("POST", stack.envoy + "/v1/models/risk-scorer/infer", {"text": 42})
    assert code == 400, body
    assert body["error"]["type"] == "invalid_schema"
    assert body["error"]["field"] == "text"
    code, _, body = request("POST", stack.envoy + "/v1/chat/completions", {**CHAT, "max_tokens": 100000})
    assert code == 400 and body["error"]["field"] == "max_tokens"
    # The model's token limit (the schema's range on max_tokens) holds for the other spelling too.
    code, _, body = request("POST", stack.envoy + "/v1/chat/completions", {**CHAT, "max_completion_tokens": 100000})
    assert code == 400 and body["error"]["field"] == "max_completion_tokens"


def test_the_ingress_reaches_no_control_endpoint(stack):
    for method, path, body, headers in (
        ("POST", "/v1/models/chat-p0/release_memory_occupation", {}, {}),
        ("POST", "/v1/models/chat-p0/-/drain", {}, {}),
        ("POST", "/-/drain", {}, {"x-sie-model": "chat-p0"}),
        ("POST", "/%2D/sleep", {"model": "chat-p0"}, {}),
        ("GET", "/v1/models/chat-p0/metrics", None, {}),
        ("GET", "/stats", None, {}),
    ):
        code, _, answer = request(method, stack.envoy + path, body, headers=headers)
        assert code in (404, 405) and answer["error"]["type"] in ("not_found", "method_not_allowed"), (path, answer)
    # Nothing moved: every instance still serves, or sleeps in its model's warm pool as before.
    assert all(row["state"] in ("ready", "sleeping") for m in stack.status()["models"] for row in m["instances"])


def test_the_control_apis_answer_only_with_a_credential(stack):
    for url in (stack.admin + "/v1/status", stack.admin + "/v1/endpoints"):
        code, _, answer = request("GET", url, timeout=5)
        assert code == 401 and answer["error"]["type"] == "unauthenticated"
    code, _, answer = request(
        "POST", stack.admin + "/v1/models", {"spec": {"model": {"name": "x"}, "backend": {"type": "sim"}}}
    )
    assert code == 401
    assert oct((stack.run_dir / "credentials").stat().st_mode & 0o777) == "0o700"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in (stack.run_dir / "credentials").iterdir())


def test_envoys_admin_has_no_tcp_port_and_its_token_is_for_this_user_alone(stack):
    """Envoy's admin asks no credential, shows the ADS token (/config_dump) and stops the ingress on POST
    /quitquitquit: `sie up` puts it on a Unix socket of its own user. Over TCP, Envoy serves the ingress
    and its stats port's GET /ready and /stats/prometheus, nothing else; no file or command line another
    local user can read holds the token."""
    token = (stack.run_dir / "credentials" / "envoy.token").read_text().strip()
    envoy_pid = stack.state()["children"]["envoy"]
    ports = {int(url.rsplit(":", 1)[1]) for url in (stack.envoy, stack.envoy_stats)}
    assert listening_tcp_ports(envoy_pid) == ports
    for base in (stack.envoy, stack.envoy_stats):
        for path in ("/config_dump", "/clusters", "/stats/prometheus/../config_dump", "/ready/../config_dump"):
            code, _, body = request("GET", base + path, timeout=5)
            assert code == 404 and token not in str(body), (base, path, code)
        for path in ("/quitquitquit", "/healthcheck/fail", "/runtime_modify?a=b"):
            assert request("POST", base + path, timeout=5)[0] in (404, 405), (base, path)
    assert alive(envoy_pid)
    code, _, metrics = request("GET", stack.envoy_stats + "/stats/prometheus", timeout=5)
    assert code == 200 and "envoy_server_live" in str(metrics) and token not in str(metrics)
    assert request("GET", stack.envoy_stats + "/ready", timeout=5)[0] == 200

    socket_path = stack.run_dir / "envoy" / "admin.sock"
    assert stack.state()["envoy_admin_socket"] == str(socket_path)
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    assert stack.envoy_admin("/ready")[0] == 200, "the admin still answers its own user"
    # Every file of the run directory that holds the token (the credentials, Envoy's bootstrap) is its
    # owner's alone; logs, the state file and the rest do not hold it. Nor does any process's command line.
    for path in stack.run_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 8 << 20 and token.encode() in path.read_bytes():
            assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path
    for pid in {stack.proc.pid, *descendants(stack.proc.pid)}:
        try:
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        except FileNotFoundError:
            continue  # it ended meanwhile
    if os.geteuid() == 0:  # only root can become another user to try
        assert connect_as_nobody(socket_path) == errno.EACCES


def test_sie_status_prints_the_live_table(stack):
    out = stack.sie("status", "--run-dir", str(stack.run_dir))
    assert out.returncode == 0, out.stderr
    assert "chat-p0" in out.stdout and "ready" in out.stdout
    as_json = stack.sie("status", "--json", "--run-dir", str(stack.run_dir))
    assert as_json.returncode == 0
    assert '"chat-p0"' in as_json.stdout


def _worker_pid(stack, instance_id: str) -> int:
    code, _, body = stack.request("GET", stack.admin + "/v1/status", timeout=5)
    for model in body["models"]:
        for inst in model["instances"]:
            if inst["instance_id"] == instance_id and inst.get("worker_pid"):
                return int(inst["worker_pid"])
    # Fall back to the process table: the worker's command line names its spec file, which names the instance.
    for pid in descendants(stack.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "backends.torch_engine" in cmd and instance_id in cmd:
            return pid
    raise AssertionError(f"no worker process found for {instance_id}")


def test_a_killed_worker_leaves_eds_while_down_and_comes_back(stack):
    before = envoy_hosts(stack, "chat-p0")
    assert len(before) == 2
    pid = _worker_pid(stack, "chat-p0-1")
    os.kill(pid, signal.SIGKILL)
    # While it is down its endpoint leaves EDS, and the model keeps serving from the other instance.
    wait_until(lambda: len(envoy_hosts(stack, "chat-p0")) == 1, 20, "the dead instance leaves EDS")
    code, _, body = request("POST", stack.envoy + "/v1/chat/completions", CHAT)
    assert code == 200, body
    # It is restarted with backoff and comes back.
    wait_until(lambda: envoy_hosts(stack, "chat-p0") == before, 120, "the instance serves again")
    assert _worker_pid(stack, "chat-p0-1") != pid


def test_killing_xds_server_does_not_stop_traffic_and_its_restart_never_empties_envoy(stack):
    old_pid = stack.state()["children"]["xds_server"]
    expected = {m: envoy_hosts(stack, m) for m in ("chat-p0", "chat-p2", "risk-scorer")}
    seen_partial: list[str] = []
    stop = threading.Event()

    def watch_envoy():
        while not stop.is_set():
            for model, hosts in expected.items():
                now = envoy_hosts(stack, model)
                if set(now) != set(hosts):
                    seen_partial.append(f"{model}: {now}")
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_envoy, name="envoy-watch", daemon=True)
    watcher.start()
    try:
        os.kill(old_pid, signal.SIGKILL)
        # Traffic goes on through Envoy while the control plane is away.
        for _ in range(3):
            code, _, body = request("POST", stack.envoy + "/v1/models/risk-scorer/infer", {"text": "hello"})
            assert code == 200, body
        wait_until(lambda: stack.state()["children"]["xds_server"] != old_pid, 30, "sie up restarts xds_server")
        wait_until(
            lambda: request("GET", stack.admin + "/healthz", timeout=2)[0] == 200, 60, "the new xds_server is ready"
        )
        time.sleep(2.0)  # let the new control plane push whatever it pushes
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert not seen_partial, f"Envoy saw a partial configuration during the restart: {seen_partial[:5]}"
    code, _, body = request("POST", stack.envoy + "/v1/chat/completions", CHAT)
    assert code == 200, body
    status = stack.status()
    assert {m["model_id"] for m in status["models"]} == {"chat-p0", "chat-p2", "risk-scorer"}


def test_sie_down_leaves_no_process_behind(stack):
    tree = descendants(stack.proc.pid)
    assert tree, "sie up should have children"
    out = stack.sie("down", "--run-dir", str(stack.run_dir), timeout=120)
    assert out.returncode == 0, out.stderr
    stack.proc.wait(timeout=60)
    wait_until(lambda: not [p for p in tree if alive(p)], 30, "every child of sie up is gone")
    assert not (stack.run_dir / "sie.json").exists()
