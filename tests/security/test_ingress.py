"""The ingress serves the public inference API and nothing else (DESIGN §10), tried as a client would: every
path, spelling and method that is not a model's inference endpoint gets a JSON 404 or 405 from Envoy
itself, and no such request ever reaches a sidecar, however the model was named."""

from __future__ import annotations

import json
import select
import socket

import pytest

from tests.integration.standalone_helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Control endpoints of the sidecar, the workers (SIE's, SGLang's, the simulator's) and Envoy's admin.
CONTROL = [
    "/-/drain",
    "/-/sleep",
    "/-/wake",
    "/-/state",
    "/-/metrics",
    "/-/ready",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/flush_cache",
    "/abort_request",
    "/update_weights_from_disk",
    "/v1/loads",
    "/metrics",
    "/server_info",
    "/get_server_info",
    "/sim/config",
    "/health",
    "/model_info",
    "/clusters",
    "/config_dump",
    "/stats",
    "/quitquitquit",
    "/v1/status",
    "/v1/endpoints",
    "/v1/telemetry",
    "/v1/nodes/heartbeat",
    "/pause_generation",
    "/load_lora_adapter",
]
# Ways to write a control path that a raw prefix match would not see as one (Envoy normalises them all).
SPELLINGS = [
    "{p}",
    "/%2D/drain",
    "/%2d/sleep",
    "/-%2Fdrain",
    "//-/drain",
    "/./-/drain",
    "/x/../-/drain",
    "/generate/../release_memory_occupation",
    "/v1/chat/completions/../../-/sleep",
    "/-/drain;x",
    "/-/drain?model=gold",
    "/%2e%2e/-/drain",
    "/-/drain/",
    "/-/DRAIN",
    "/v1/models/gold/../../-/drain",
]


def raw(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, port: int = 0
) -> tuple[int, bytes]:
    """One request sent byte for byte (no client library rewrites the path). The body goes out in pieces,
    and sending stops as soon as the server answers, as a real client's would when refused early."""
    lines = [f"{method} {path} HTTP/1.1", "Host: ingress", "Connection: close", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        for start in range(0, len(body), 1 << 16):
            if select.select([sock], [], [], 0)[0]:
                break  # answered before the body was all sent
            try:
                sock.sendall(body[start : start + (1 << 16)])
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        try:
            while not _complete(data) and (chunk := sock.recv(65536)):
                data += chunk
        except ConnectionResetError:
            pass  # a reset after the reply: what was read is the reply
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


def _complete(data: bytes) -> bool:
    """Whether a whole response with a Content-Length is in (Envoy then waits for the client to close)."""
    head, sep, payload = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(payload) >= int(value)
    return False


def _port(target) -> int:
    return int(target.envoy.rsplit(":", 1)[1])


def _ways_to_name(model: str) -> list[tuple[str, dict[str, str], bytes]]:
    """(path prefix, headers, body) for each way a request can name a model."""
    body = json.dumps({"model": model, "text": "x"}).encode()
    return [
        ("", {"Content-Type": "application/json"}, body),  # the body
        ("", {"x-sie-model": model, "Content-Type": "application/json"}, b"{}"),  # the header
        (f"/v1/models/{model}", {"Content-Type": "application/json"}, b"{}"),
    ]  # the path


@pytest.mark.parametrize("control", CONTROL)
def test_no_control_path_reaches_a_sidecar_whichever_way_the_model_is_named(target, control):
    before = target.upstream_requests()
    for prefix, headers, body in _ways_to_name("gold"):
        for method in ("POST", "GET", "PUT", "DELETE"):
            status, payload = raw(method, prefix + control, body, headers, _port(target))
            assert status in (404, 405), (method, prefix + control, status, payload[:200])
            assert json.loads(payload)["error"]["type"] in ("not_found", "method_not_allowed", "model_not_found")
    assert target.upstream_requests() == before
    target.gold_serves()


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_no_spelling_of_a_control_path_gets_around_the_rules(target, spelling):
    before = target.upstream_requests()
    path = spelling.format(p="/-/drain")
    for prefix, headers, body in _ways_to_name("gold"):
        status, payload = raw("POST", prefix + path, body, headers, _port(target))
        assert status in (400, 404, 405), (prefix + path, status, payload[:200])
        if payload:
            assert "error" in json.loads(payload)
    assert target.upstream_requests() == before
    assert all(i["state"] == "ready" for i in target.instances())


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
def test_an_inference_path_takes_post_only(target, method):
    before = target.upstream_requests()
    status, payload = raw(
        method, "/generate", b'{"model": "gold"}', {"Content-Type": "application/json"}, _port(target)
    )
    assert status == 405 and json.loads(payload)["error"]["type"] == "method_not_allowed"
    assert target.upstream_requests() == before


def test_a_model_is_reached_only_on_the_paths_of_its_service_type(target):
    before = target.upstream_requests()
    # The scorer has /infer only; the LLMs have chat, completions and /generate, never /infer.
    for path, model in (("/generate", "scorer"), ("/v1/chat/completions", "scorer"), ("/infer", "gold")):
        code, _, body = request("POST", target.envoy + path, {"model": model, "text": "x"})
        assert code == 404 and body["error"]["type"] == "model_not_found", (path, model, body)
    assert target.upstream_requests() == before
    code, _, body = request("POST", target.envoy + "/v1/models/scorer/infer", {"text": "hello"})
    assert code == 200 and 0 <= body["score"] <= 1


@pytest.mark.parametrize(
    "body, content_type",
    [
        (b"{not json", "application/json"),
        (b"model=gold", "application/x-www-form-urlencoded"),
        (b'{"model": "gold"', "application/json"),
        (b"[" * 5000 + b"]" * 5000, "application/json"),
        (b'{"model": "gold"}', "application/octet-stream"),
    ],
)
def test_a_body_routed_request_whose_body_is_not_json_is_400_invalid_json(target, body, content_type):
    status, payload = raw("POST", "/generate", body, {"Content-Type": content_type}, _port(target))
    assert status == 400 and json.loads(payload)["error"]["type"] == "invalid_json", payload[:300]


def test_the_model_list_is_answered_by_envoy_and_lists_paths_not_controls(target):
    before = target.upstream_requests()
    code, _, body = request("GET", target.envoy + "/v1/models")
    assert code == 200 and {m["id"] for m in body["data"]} == {"gold", "bronze", "scorer"}
    code, _, one = request("GET", target.envoy + "/v1/models/scorer")
    assert code == 200 and one["paths"] == ["/infer"]
    assert target.upstream_requests() == before


@pytest.mark.parametrize(
    "headers",
    [
        {"x-sie-model": "../admin"},
        {"x-sie-model": "gold\r\nx-injected: 1"},
        {"x_sie_model": "gold"},
        {"x-sie-model": "GOLD"},
        {"x-sie-model": "gold "},
    ],
)
def test_odd_model_headers_route_nothing_they_should_not(target, headers):
    clean = {k: v for k, v in headers.items() if "\r" not in v}
    try:
        status, payload = raw("POST", "/infer", b"{}", {"Content-Type": "application/json", **clean}, _port(target))
    except OSError:
        return  # the connection refused outright
    assert status in (400, 404), (headers, payload[:200])


def test_envoy_bounds_bodies_and_headers_with_json_errors(target):
    status, payload = raw("POST", "/generate", b"x" * (17 << 20), {"Content-Type": "application/json"}, _port(target))
    assert status == 413 and json.loads(payload)["error"]["type"] == "body_too_large"
    status, payload = raw("POST", "/generate", b"{}", {"x-big": "a" * 70_000}, _port(target))
    assert status == 431 and json.loads(payload)["error"]["type"] == "headers_too_large"
    target.gold_serves()
