"""Envoy refuses a RouteConfiguration whose direct-response bodies pass its limit (4096 bytes by default);
the model list and the 404 name every model, so the limit must grow with the registry."""

from __future__ import annotations

import pytest

from sie.spec_loader import parse_model_service
from xds_server.ingress import build_routes


def svc(name: str):
    return parse_model_service({"spec": {"model": {"name": name}, "backend": {"type": "sim"}}})


@pytest.mark.parametrize("models", [1, 30, 500])
def test_the_route_body_limit_covers_every_direct_response(models):
    config = build_routes([svc(f"model-number-{i:04d}") for i in range(models)])
    bodies = [
        len(r.direct_response.body.inline_string.encode())
        for r in config.virtual_hosts[0].routes
        if r.HasField("direct_response")
    ]
    assert config.max_direct_response_body_size_bytes.value >= max(bodies)
    assert config.max_direct_response_body_size_bytes.value >= 4096
