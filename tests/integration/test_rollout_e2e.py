"""Rollouts on the whole stack (`sie up`: xds_server, a real Envoy, the node host, sim workers), with
traffic flowing through Envoy the whole time.

One stack for the module, one story in order: a breaking schema change is refused with its differences;
a good new build goes live step by step, and Envoy's own `/config_dump` and `/clusters` show each step's
split; a build that answers errors rolls back by itself; so does a build that never becomes ready, at
its progress deadline; a control-plane SIGKILL in the middle of a rollout resumes it from its recorded
step (no second canary, no lost step). Not one request fails except the bad build's own errors.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.standalone_helpers import start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

HOLD_S = 3.0


def spec(
    version: str, *, hold_s: float = HOLD_S, config: str = "{}", schema: str = "", progress_deadline_s: float = 600
) -> str:
    return textwrap.dedent(f"""
        apiVersion: sie.io/v1alpha1
        kind: ModelService
        metadata: {{name: chat}}
        spec:
          model: {{name: chat, version: "{version}", service_type: llm}}
          backend: {{type: sim, config: {config}}}
          sla: {{min_replicas: 2, max_replicas: 2, p99_latency_ms: 2000}}
          rollout:
            steps: [50, 100]
            hold_s: {hold_s}
            gates: {{min_requests: 15}}
            progress_deadline_s: {progress_deadline_s}
        """) + textwrap.indent(textwrap.dedent(schema), "  ")


def as_doc(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


class Load:
    """Closed-loop clients through Envoy's ingress; every answer recorded as (status, instance, body)."""

    def __init__(self, url: str, threads: int = 3):
        self.url = url + "/v1/chat/completions"
        self.answers: list[tuple[int, str, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        self._lock = threading.Lock()

    def _run(self) -> None:
        body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        while not self._stop.is_set():
            req = urllib.request.Request(self.url, data=body.encode(), headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=15) as resp:
                    answer = (resp.status, resp.headers.get("x-sie-instance", ""), "")
            except urllib.error.HTTPError as exc:
                answer = (exc.code, exc.headers.get("x-sie-instance", ""), exc.read()[:300].decode(errors="replace"))
            except OSError as exc:
                answer = (0, "", repr(exc))
            with self._lock:
                self.answers.append(answer)
            time.sleep(0.01)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=20)

    def mark(self) -> int:
        with self._lock:
            return len(self.answers)

    def since(self, mark: int) -> list[tuple[int, str, str]]:
        with self._lock:
            return list(self.answers[mark:])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("rollout")
    cluster = workdir / "cluster.yaml"
    cluster.write_text(spec("1.0"))
    s = start_stack(workdir, cluster, timeout=120)
    try:
        yield s
    finally:
        stop_stack(s)


@pytest.fixture(scope="module")
def load(stack):
    with Load(stack.envoy) as running:
        wait_until(lambda: running.mark() > 20, 30, "traffic through Envoy")
        yield running


def rollout(stack) -> dict:
    code, _, body = stack.request("GET", stack.admin + "/v1/models/chat/rollout", timeout=5)
    assert code == 200, body
    return body


def put(stack, text: str, query: str = "") -> tuple[int, object]:
    code, _, body = stack.request("PUT", f"{stack.admin}/v1/models/chat{query}", as_doc(text), timeout=10)
    return code, body


def chat_route_action(stack) -> dict:
    """The route action Envoy holds for the model's header route (from its own /config_dump)."""
    code, dump = stack.envoy_admin("/config_dump?resource=dynamic_route_configs")
    assert code == 200, dump
    for config in dump["configs"]:
        for vhost in config["route_config"].get("virtual_hosts", []):
            for route in vhost.get("routes", []):
                if route.get("name") == "chat.header/v1/chat/completions":
                    return route["route"]
    raise AssertionError("no route chat.header/v1/chat/completions in Envoy's config")


def split_in_envoy(stack) -> dict[str, int]:
    action = chat_route_action(stack)
    if "cluster" in action:
        return {action["cluster"]: 100}
    return {c["name"]: int(c.get("weight", 0)) for c in action["weighted_clusters"]["clusters"]}


def envoy_hosts(stack, cluster: str) -> set[str]:
    code, dump = stack.envoy_admin("/clusters?format=json")
    assert code == 200, dump
    for status in dump.get("cluster_statuses", []):
        if status["name"] == cluster:
            return {
                f"{h['address']['socket_address']['address']}:{h['address']['socket_address']['port_value']}"
                for h in status.get("host_statuses", [])
            }
    return set()


def addresses_of(stack, build: str) -> dict[str, str]:
    (model,) = [m for m in stack.status()["models"] if m["model_id"] == "chat"]
    rows = model["instances"]
    return {r["instance_id"]: r["address"] for r in rows if r.get("build") == build and r.get("address")}


def test_a_breaking_schema_change_is_refused_with_each_difference(stack, load):
    schema = """
        input_schema:
          fields:
            - {name: tenant, type: string, required: true}
    """
    code, body = put(stack, spec("1.1", schema=schema))
    assert code == 409, body
    error = body["error"]
    assert error["type"] == "schema_incompatible"
    assert [(d["side"], d["kind"], d["breaking"]) for d in error["differences"]] == [("input", "schema_added", True)]
    assert "requires 'tenant'" in error["differences"][0]["message"] and "tenant" in error["message"]
    # Nothing started: the model still runs its one build.
    assert stack.request("GET", stack.admin + "/v1/models/chat/rollout", timeout=5)[0] == 404


def test_a_good_build_goes_live_step_by_step_and_envoy_carries_each_split(stack, load):
    mark = load.mark()
    started = time.monotonic()
    code, body = put(stack, spec("2.0"))
    assert code == 202, body
    assert body["rollout"]["phase"] == "progressing"

    seen_splits: list[dict[str, int]] = []

    def at_share(share: int) -> bool:
        r = rollout(stack)
        if r["live"] and r["share"]["new"] == share:
            seen_splits.append(split_in_envoy(stack))
            return seen_splits[-1] == (
                {"model.chat": 100 - share, "model.chat.canary": share} if share < 100 else {"model.chat.canary": 100}
            )
        return False

    wait_until(lambda: at_share(50), 60, "step 1 (50%) in Envoy's routes")
    new_addresses = set(addresses_of(stack, "new").values())
    assert new_addresses and envoy_hosts(stack, "model.chat.canary") == new_addresses
    assert not new_addresses & envoy_hosts(stack, "model.chat"), "the new build is only in its own cluster"
    wait_until(lambda: at_share(100), 60, "step 2 (100%) in Envoy's routes")
    wait_until(lambda: rollout(stack)["phase"] == "succeeded", 60, "the rollout to succeed")
    took = time.monotonic() - started
    wait_until(lambda: split_in_envoy(stack) == {"model.chat": 100}, 30, "the promoted build in model.chat")

    r = rollout(stack)
    assert [e["what"] for e in r["events"]] == ["started", "step 1/2", "step 2/2", "succeeded"]
    assert took < 2 * HOLD_S + 40, f"the rollout took {took:.0f} s"
    promoted = set(addresses_of(stack, "stable").values())
    wait_until(lambda: envoy_hosts(stack, "model.chat") == promoted, 30, "only the new build in model.chat")
    time.sleep(1.0)
    answers = load.since(mark)
    assert [a for a in answers if a[0] != 200] == []
    served_by = {a[1] for a in answers[-20:]}
    assert served_by and all(".g1-" in iid for iid in served_by), served_by


def test_a_build_that_answers_errors_rolls_back_and_the_old_build_serves_everything(stack, load):
    mark = load.mark()
    code, body = put(stack, spec("3.0", hold_s=20, config="{error_rate: 0.3, seed: 1}"))
    assert code == 202, body
    wait_until(lambda: rollout(stack)["phase"] == "rolled_back", 60, "the bad build to roll back")
    r = rollout(stack)
    assert r["failed_gate"]["name"] == "error_rate_vs_old", r
    assert r["share"] == {"new": 0, "old": 100}
    wait_until(lambda: split_in_envoy(stack) == {"model.chat": 100}, 30, "the old build at 100% in the routes")
    after = load.mark()
    wait_until(lambda: load.mark() > after + 30, 30, "traffic after the rollback")
    answers = load.since(mark)
    bad_build = ".g2-"
    assert [a for a in answers if a[0] != 200 and bad_build not in a[1]] == [], "only the bad build failed requests"
    assert all(bad_build not in a[1] for a in load.since(after + 5)), "the old build takes all traffic again"
    # The model's spec is still the good build's.
    code, _, model = stack.request("GET", stack.admin + "/v1/models/chat", timeout=5)
    assert code == 200 and model["spec"]["model"]["version"] == "2.0"


def test_a_build_that_never_becomes_ready_rolls_back_at_its_progress_deadline(stack, load):
    """A sim `slowdown` of 0 is a setting every node host refuses (check_engine_settings), so the new
    build's instance never starts and its first step can never go live. Before, the rollout waited at 0%
    for ever, saying only that it waited; now it rolls back after the spec's progress_deadline_s."""
    mark = load.mark()
    serving = stack.request("GET", stack.admin + "/v1/models/chat", timeout=5)[2]["spec"]["model"]["version"]
    code, body = put(stack, spec("3.1", config="{slowdown: 0}", progress_deadline_s=3))
    assert code == 202, body
    assert body["rollout"]["phase"] == "progressing"

    def rolled_back() -> bool:
        r = rollout(stack)
        return r["to_version"] == "3.1" and r["phase"] == "rolled_back"

    wait_until(rolled_back, 60, "the never-ready build to roll back")
    r = rollout(stack)
    assert "the new version had 0 of the 1 ready instances step 50% needs for 3 s" in r["reason"], r["reason"]
    assert (r["failed_gate"], r["live"], r["share"]) == (None, False, {"new": 0, "old": 100})
    assert [e["what"] for e in r["events"]] == ["started", "rolled_back"]
    assert split_in_envoy(stack) == {"model.chat": 100}
    wait_until(lambda: not addresses_of(stack, "new"), 30, "no instance of the never-ready build")
    code, _, model = stack.request("GET", stack.admin + "/v1/models/chat", timeout=5)
    assert code == 200 and model["spec"]["model"]["version"] == serving
    # The old build served everything all along: the new one never had a share.
    assert [a for a in load.since(mark) if a[0] != 200] == []


def test_a_control_plane_sigkill_mid_rollout_resumes_it_from_its_recorded_step(stack, load):
    mark = load.mark()
    code, body = put(stack, spec("4.0", hold_s=8))
    assert code == 202, body
    wait_until(lambda: rollout(stack)["live"], 60, "the first step live")
    before = rollout(stack)
    canary = addresses_of(stack, "new")
    assert canary
    pid = stack.state()["children"]["xds_server"]
    os.kill(pid, signal.SIGKILL)

    def back() -> bool:
        try:
            state = stack.state()["children"]["xds_server"]
            return state != pid and stack.request("GET", stack.admin + "/healthz", timeout=2)[0] == 200
        except OSError:
            return False

    wait_until(back, 60, "sie up to restart the control plane and its sync window to end")
    resumed = rollout(stack)
    assert resumed["phase"] == "progressing" and resumed["step"] == before["step"], resumed
    assert resumed["step_since"] == before["step_since"], "the hold goes on from when it started"
    wait_until(lambda: rollout(stack)["phase"] == "succeeded", 90, "the resumed rollout to succeed")
    events = [e["what"] for e in rollout(stack)["events"]]
    assert events == ["started", "step 1/2", "step 2/2", "succeeded"], events
    # No second canary: the new build's first instance is the one that ran before the kill.
    stable_now = addresses_of(stack, "stable")
    assert set(canary) <= set(stable_now) and all(stable_now[i] == a for i, a in canary.items())
    assert [a for a in load.since(mark) if a[0] != 200] == []
