"""A worker that dies mid-request loses nothing it need not (DESIGN §10), tried on the running stack: gold's
first worker is SIGKILLed while clients keep six non-streaming requests in flight. A request whose worker
died before any byte of its answer left is retried on the other instance (the sidecar answers 503
`worker_lost`, retryable, and Envoy retries it, or Envoy sees the reset and retries), so not one fails; the
node host restarts the worker and gold-0 serves again."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.integration.standalone_helpers import request, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLIENTS = 6


def _retries(target) -> int:
    code, text = target.stack.envoy_admin("/stats?filter=^cluster.model.gold.upstream_rq_retry$")
    assert code == 200
    return int(str(text).split(": ")[1]) if ": " in str(text) else 0


BODY = {"model": "gold", "text": "keep going", "sampling_params": {"max_new_tokens": 32}}


def test_sigkill_of_a_worker_under_steady_load_fails_no_request(target):
    victim = target.instance("gold-0")
    pid = victim["worker"]["pid"]
    assert pid and victim["state"] == "ready"
    retries = _retries(target)
    results: list[tuple[int, object]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            code, _, body = request("POST", target.envoy + "/generate", BODY, timeout=30)
            with lock:
                results.append((code, body))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(results) >= 12, 30, "steady load")
        control = f"http://{victim['control_address']}/-/state"
        wait_until(
            lambda: target.stack.request("GET", control, timeout=5)[2]["in_flight"] > 0,
            30,
            "requests in flight on gold-0",
        )
        os.kill(pid, signal.SIGKILL)
        killed_at = len(results)
        time.sleep(4.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=35)
    failed = [(code, body) for code, body in results if code != 200]
    assert not failed, failed[:3]
    assert len(results) - killed_at >= 2 * CLIENTS  # the load went on after the kill
    assert _retries(target) > retries  # requests were in flight on the killed worker, and were retried
    restarted = wait_until(
        lambda: (i := target.instance("gold-0"))["state"] == "ready" and i["worker"]["pid"] != pid and i,
        60,
        "gold-0's worker restarted",
    )
    assert restarted["worker"]["restarts"] >= 1
    target.gold_serves()
