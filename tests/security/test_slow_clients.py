"""Slow or stuck clients cannot hold capacity (DESIGN §10), tried on the running stack: 50 connections that
dribble a request body hold connections at Envoy and nothing else. The buffer filter receives the whole body
before the router takes one of the model's circuit-breaker slots, so gold (P0) serves every request
meanwhile, whichever model the slow bodies name; and each slow request ends in a JSON 408 once the
cluster's `ingress.request_timeout_s` (5 s here) has passed."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from tests.integration.standalone_helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SLOW = 50


def _open_slow(port: int, model: str, header_routed: bool) -> socket.socket:
    """A request whose headers arrive at once and whose 4 KB body never finishes arriving."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = ["POST /generate HTTP/1.1", "Host: ingress", "Content-Type: application/json", "Content-Length: 4096"]
    if header_routed:
        head.append(f"x-sie-model: {model}")
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + json.dumps({"model": model, "text": ""})[:-2].encode())
    return sock


def _reply(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("model", ["bronze", "gold"])
def test_slow_bodies_hold_no_capacity_and_end_in_408(target, model):
    port = int(target.envoy.rsplit(":", 1)[1])
    before = target.upstream_requests()
    slow = [_open_slow(port, model, header_routed=i % 2 == 0) for i in range(SLOW)]
    stop = threading.Event()

    def dribble() -> None:
        while not stop.is_set():
            for sock in slow:
                try:
                    sock.send(b"a")
                except OSError:
                    pass
            stop.wait(0.5)

    dripper = threading.Thread(target=dribble, daemon=True)
    dripper.start()
    try:
        served = 0
        started = time.monotonic()
        while time.monotonic() - started < 3.5:  # while all 50 still dribble (they end at 5 s)
            code, _, body = request(
                "POST",
                target.envoy + "/generate",
                {"model": "gold", "text": "still here?", "sampling_params": {"max_new_tokens": 4}},
                timeout=10,
            )
            assert code == 200, body
            served += 1
        assert served >= 5
        # Not one slow request reached a sidecar: only the ones gold answered did.
        after = target.upstream_requests()
        assert after.get(model, 0) - before.get(model, 0) == (served if model == "gold" else 0)
        assert after.get("gold", 0) - before.get("gold", 0) == served
        replies = [_reply(sock) for sock in slow]
    finally:
        stop.set()
        dripper.join(timeout=5)
        for sock in slow:
            sock.close()
    assert {code for code, _ in replies} == {408}, replies[:3]
    assert {body["error"]["type"] for _, body in replies} == {"request_timeout"}
    target.gold_serves()
