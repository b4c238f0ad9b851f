"""Every SIE server answers every error in the one shape (sie.errors.error_body), tried on the running
stack: Envoy's ingress (local replies), the admin API, the node host's API, a sidecar's data and control
listeners, and a worker, each asked for a path it has not, a method it does not take, a body it cannot
read, and without or with the wrong credential. `request` checks the shape of every answer >= 400
(sie_testing.error_shape); these cases only make sure each kind of error is met at least once."""

from __future__ import annotations

import pytest

from sie_testing import error_shape
from tests.integration.standalone_helpers import request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _expect(code: int, body: object, status: int, kind: str | None = None) -> None:
    assert code == status, body
    error_shape.check(code, body)
    if kind is not None:
        assert body["error"]["type"] == kind, body


def test_the_ingress_answers_errors_in_the_shape(target):
    e = target.envoy
    _expect(*request("GET", e + "/v1/nope")[::2], 404)
    _expect(*request("DELETE", e + "/v1/chat/completions")[::2], 405)
    _expect(*request("POST", e + "/generate", b"{not json")[::2], 400, "invalid_json")
    _expect(*request("POST", e + "/generate", {"model": "nope", "text": "x"})[::2], 404)
    _expect(*request("POST", e + "/v1/models/gold/-/drain")[::2], 404)


def test_the_admin_api_answers_errors_in_the_shape(target):
    a, s = target.stack.admin, target.stack
    _expect(*request("GET", a + "/v1/status")[::2], 401, "unauthenticated")
    _expect(*request("GET", a + "/v1/status", headers={"Authorization": "Bearer forged"})[::2], 401)
    _expect(*s.request("GET", a + "/v1/nope")[::2], 404, "not_found")
    _expect(*s.request("PATCH", a + "/v1/models")[::2], 405, "method_not_allowed")
    _expect(*s.request("POST", a + "/v1/models", b"kind: [")[::2], 400)
    _expect(*s.request("POST", a + "/v1/models", b"x" * (3 << 20))[::2], 413)
    _expect(*s.request("GET", a + "/v1/models/nope")[::2], 404)


def test_the_node_host_api_answers_errors_in_the_shape(target):
    n, s = target.node, target.stack
    _expect(*request("GET", n + "/v1/instances")[::2], 401, "unauthenticated")
    _expect(*s.request("GET", n + "/v1/nope")[::2], 404, "not_found")
    _expect(*s.request("DELETE", n + "/v1/instances")[::2], 405, "method_not_allowed")


def test_a_sidecar_answers_errors_in_the_shape(target):
    gold, s = target.instance("gold-0"), target.stack
    control, data = f"http://{gold['control_address']}", f"http://{gold['sidecar_address']}"
    _expect(*request("GET", control + "/-/state")[::2], 401, "unauthenticated")
    _expect(*s.request("GET", control + "/-/nope")[::2], 404)
    _expect(*request("GET", data + "/-/state")[::2], 404)
    _expect(*request("GET", data + "/generate")[::2], 405)
    _expect(*request("POST", data + "/generate", b"{not json")[::2], 400)


def test_a_worker_answers_errors_in_the_shape(target):
    worker = f"http://{target.instance('gold-0')['worker_address']}"
    _expect(*request("POST", worker + "/generate", {"text": "x"})[::2], 401)
    _expect(*request("GET", worker + "/nope")[::2], 401)
