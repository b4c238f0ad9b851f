"""Scale to zero on the whole stack (`sie up`: xds_server, a real Envoy, the node host, sim workers): a model
with min_replicas 0 starts asleep and is listed so; its first request through Envoy is held by the
sleeping instance's sidecar and answered after one wake, however many arrive together; after idle_s
without a request it sleeps again; a wake that fails answers 503 wake_failed naming why; a model that
sleeps by unloading (autoscale.sleep_mode unload) loads again for its first request.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time

import pytest

from tests.integration.standalone_helpers import request, start_stack, stop_stack, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLUSTER = textwrap.dedent("""
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: chat}
    spec:
      model: {name: chat, service_type: llm}
      backend: {type: sim, config: {wake_ms: 200}}
      sla: {min_replicas: 0, max_replicas: 2, p99_latency_ms: 5000}
      autoscale: {idle_s: 4, scale_down_window_s: 1, wake_timeout_s: 20, warm_pool: 0}
    ---
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: broken}
    spec:
      model: {name: broken, service_type: llm}
      backend: {type: sim, config: {fail_resume: true}}
      sla: {min_replicas: 0, max_replicas: 1, p99_latency_ms: 5000}
      autoscale: {wake_timeout_s: 10}
    ---
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: cold}
    spec:
      model: {name: cold, service_type: llm}
      backend: {type: sim}
      sla: {min_replicas: 0, max_replicas: 1, p99_latency_ms: 5000}
      autoscale: {sleep_mode: unload, wake_timeout_s: 30}
    """)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("zero")
    (workdir / "cluster.yaml").write_text(CLUSTER)
    s = start_stack(workdir, workdir / "cluster.yaml", timeout=120)
    try:
        yield s
    finally:
        stop_stack(s)


def states(stack, name: str) -> list[str]:
    return [i["state"] for i in stack.model(name)["instances"]]


def listed(stack, name: str) -> str:
    code, _, body = request("GET", f"{stack.envoy}/v1/models", timeout=5)
    assert code == 200, body
    (entry,) = [m for m in body["data"] if m["id"] == name]
    return entry["state"]


def chat(stack, name: str = "chat") -> tuple[int, dict, object]:
    body = {"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return request("POST", f"{stack.envoy}/v1/chat/completions", body, timeout=60)


def asleep(stack, name: str) -> bool:
    return states(stack, name) == ["sleeping"] and listed(stack, name) == "asleep"


def test_a_model_at_zero_is_listed_asleep_and_twenty_first_requests_share_one_wake(stack):
    wait_until(lambda: asleep(stack, "chat"), 60, "chat to load and go to sleep (min_replicas 0)")
    assert stack.model("chat")["autoscale"]["desired"] == 0
    wakes_before = len(stack.node_events("woken_for_request"))

    results: list[tuple[int, dict, object]] = []
    lock = threading.Lock()

    def one() -> None:
        got = chat(stack)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=one) for _ in range(20)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    took = time.monotonic() - started
    assert [code for code, _, _ in results] == [200] * 20, [body for code, _, body in results if code != 200]
    assert took >= 0.2, "the sim's wake takes 200 ms: the requests were held through it"
    assert len(stack.node_events("woken_for_request")) == wakes_before + 1, "one wake for twenty requests"
    wait_until(lambda: stack.model("chat")["autoscale"]["desired"] >= 1, 10, "the autoscaler to see the demand")
    # The list is the control plane's view: the sidecar's ready record reaches it at once, but the
    # answers can come back before that record is in (a telemetry post and the 50 ms debounce later), and
    # the held requests' demand may have raised `desired` during the wake; until then it says "loading".
    wait_until(lambda: listed(stack, "chat") == "serving", 5, "the model list to show the woken instance")


def test_after_idle_s_without_a_request_the_model_sleeps_again(stack):
    code, _, body = chat(stack)
    assert code == 200, body
    wait_until(lambda: stack.model("chat")["autoscale"]["desired"] == 0, 30, "the model to go back to zero")
    reason = stack.model("chat")["autoscale"]["reason"]
    assert "no request for" in reason or "at zero" in reason, reason
    wait_until(lambda: asleep(stack, "chat"), 30, "its instance to sleep")
    code, _, body = chat(stack)
    assert code == 200, "and it wakes again for the next request"


def test_a_wake_that_fails_answers_a_503_naming_why(stack):
    wait_until(lambda: asleep(stack, "broken"), 60, "broken to load and go to sleep")
    code, headers, body = chat(stack, "broken")
    assert code == 503, body
    assert body["error"]["type"] == "wake_failed", json.dumps(body)
    assert "fail_resume" in body["error"]["message"], "the reason reaches the client"
    assert {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1"
    assert states(stack, "broken") == ["sleeping"], "still asleep, ready for the next try"


def test_an_unloaded_model_at_zero_loads_again_for_its_first_request(stack):
    wait_until(lambda: asleep(stack, "cold"), 60, "cold to load and go to sleep")
    (node,) = stack.status()["nodes"]
    code, _, body = stack.request("GET", node["address"] + "/v1/instances", timeout=5)
    (row,) = [r for r in body["instances"] if r["instance_id"] == "cold-0"]
    assert row["worker_parked"] and "unloaded" in row["detail"], row
    code, _, body = chat(stack, "cold")
    assert code == 200, body
    (wake,) = [e for e in stack.node_events("wake_started") if e["instance_id"] == "cold-0"]
    assert wake["unloaded"] is True, "the worker was started afresh: a cold load"
