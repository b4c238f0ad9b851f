"""The autoscaler on the whole stack (`sie up`: xds_server, a real Envoy, the node host, sim workers):
load through Envoy scales a model up within seconds; when the load stops, the count falls back after the
stabilisation window, by drain, with no failed request; the warm pool's instance is woken first on the
way up and put back to sleep on the way down; `sie status` and the admin API say why.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from tests.integration.standalone_helpers import start_stack, stop_stack, wait_until
from tests.integration.test_rollout_e2e import Load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLUSTER = textwrap.dedent("""
    apiVersion: sie.io/v1alpha1
    kind: ModelService
    metadata: {name: chat}
    spec:
      model: {name: chat, service_type: llm}
      backend: {type: sim}
      resources: {max_concurrent_requests: 8}
      sla: {min_replicas: 1, max_replicas: 3, p99_latency_ms: 5000}
      autoscale: {target_concurrency: 2, scale_down_window_s: 5}
    """)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("autoscale")
    (workdir / "cluster.yaml").write_text(CLUSTER)
    s = start_stack(workdir, workdir / "cluster.yaml", timeout=120)
    try:
        yield s
    finally:
        stop_stack(s)


def model(stack) -> dict:
    return stack.model("chat")


def ready(stack) -> int:
    return sum(1 for i in model(stack)["instances"] if i["state"] == "ready")


def states(stack) -> dict[str, str]:
    """The instances that hold processes, and their states (a stopped one is listed until it is swept)."""
    return {i["instance_id"]: i["state"] for i in model(stack)["instances"] if i["state"] != "stopped"}


def test_load_scales_the_model_up_and_its_end_scales_it_down_by_drain(stack):
    # One serves; the warm pool's one (autoscale.warm_pool, default 1) loads, then sleeps.
    wait_until(lambda: states(stack) == {"chat-0": "ready", "chat-1": "sleeping"}, 60, "one ready, one asleep")
    assert model(stack)["autoscale"]["by"] == "sie"
    with Load(stack.envoy, threads=8) as load:
        started = time.monotonic()
        wait_until(lambda: model(stack)["autoscale"]["desired"] == 3, 30, "the autoscaler to ask for 3")
        asked_after = time.monotonic() - started
        assert "demand" in model(stack)["autoscale"]["reason"]  # up, then holding while the step settles
        wait_until(lambda: ready(stack) == 3, 60, "three instances ready")
        # max_replicas 3: at the top nothing is kept asleep beyond the count.
        assert sorted(states(stack)) == ["chat-0", "chat-1", "chat-2"], states(stack)
        events = stack.node_events()
        assert [e["kind"] for e in events if e["instance_id"] == "chat-1"].count("placed") == 1, "loaded once"
        assert any(e["kind"] == "woken" and e["instance_id"] == "chat-1" for e in events), "woken, not loaded"
        # Every instance serves. Within a bound of time, not of requests: the weights follow telemetry,
        # so the newest instance's share may start small, and on a loaded machine (the whole suite on
        # 2 cores, 2026-12-04) the first 50 answers after it was ready once all came from the other two.
        mark = load.mark()
        served: set[str] = set()

        def all_three_served() -> bool:
            served.update(answer[1] for answer in load.since(mark))
            return served == {"chat-0", "chat-1", "chat-2"}

        try:
            wait_until(all_three_served, 30, "traffic over the three")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; served only {sorted(served)}") from None
    stopped = time.monotonic()  # the load ends here: the 5 s window counts from its last busy decision
    assert asked_after < 15, f"scaling up took {asked_after:.1f} s to decide"
    out = stack.sie("status", "--run-dir", str(stack.run_dir))
    assert out.returncode == 0 and "sie -> 3" in out.stdout, out.stdout

    # No load: after the 5 s window the count falls to the floor, the removed instances drain and stop.
    # (The last busy decision is at most one 1 s tick before the load stopped, so the fall comes >= 4 s
    # after it; 3.5 s leaves room for the status poll.)
    wait_until(lambda: model(stack)["autoscale"]["desired"] == 1, 40, "the autoscaler to ask for 1")
    assert time.monotonic() - stopped >= 3.5, "no scale-down before the stabilisation window"
    wait_until(lambda: ready(stack) == 1, 60, "back to one instance")
    assert [a for a in load.answers if a[0] != 200] == [], "no request failed, up or down"
    # chat-1 drained and went to sleep (the warm pool), chat-2 drained and stopped.
    try:
        wait_until(lambda: states(stack) == {"chat-0": "ready", "chat-1": "sleeping"}, 30, "chat-1 asleep, chat-2 gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {model(stack)['instances']}") from None
