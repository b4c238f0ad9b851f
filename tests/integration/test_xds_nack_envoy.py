"""A NACKed EDS response against a REAL Envoy: Envoy applies it only in part (the CLAs after the one it
cannot read not at all), and the control plane delivers the rest without waiting for a new snapshot.

The plane of test_xds_envoy.py (its own control plane and Envoy for this module): a CLA Envoy rejects is
forced past the builder, which since sie.telemetry.ip_literal_problem refuses its address itself.
"""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2

from sie_testing.polling import eventually
from tests.integration import test_xds_envoy
from tests.integration.test_xds_envoy import Plane, _async, _health_is
from xds_server.resources import ENDPOINT, Resource

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

plane = test_xds_envoy.plane  # the module-scoped fixture: a plane of this module's own
BAD_HOST = "fe80::1%nosuchif"  # Envoy: "malformed IP address" (no such interface on its host)


def _cla(plane: Plane, name: str) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment()
    plane.server.cache.get(None).get(ENDPOINT)[name].packed.Unpack(cla)
    return cla


async def test_a_rejected_cla_does_not_hold_back_another_models_cla_pushed_with_it(plane):
    server = plane.server
    good = server.cache.get(None)
    # One push: model.chat gains an endpoint Envoy cannot read, model.scorer drains scorer-1.
    chat = _cla(plane, "model.chat")
    bad = endpoint_components_pb2.LbEndpoint()
    bad.CopyFrom(chat.endpoints[0].lb_endpoints[0])
    bad.endpoint.hostname = "chat-9"
    bad.endpoint.address.CopyFrom(
        address_pb2.Address(socket_address=address_pb2.SocketAddress(address=BAD_HOST, port_value=9004))
    )
    chat.endpoints[0].lb_endpoints.append(bad)
    scorer = _cla(plane, "model.scorer")
    drained = plane.sidecars["scorer-1"]
    for ep in scorer.endpoints[0].lb_endpoints:
        if ep.endpoint.address.socket_address.port_value == drained.port:
            ep.health_status = health_check_pb2.HealthStatus.DRAINING
    forced = good.with_resource(Resource.of("model.chat", ENDPOINT, chat)).with_resource(
        Resource.of("model.scorer", ENDPOINT, scorer)
    )
    nacks = server.metrics.nack_count()
    server.cache.set_snapshot(forced)
    try:
        await eventually(lambda: _async(server.metrics.nack_count() > nacks), what="Envoy's NACK")
        assert server.metrics.last_nack is not None and "malformed IP address" in server.metrics.last_nack.message
        # Without bisection scorer-1 stays HEALTHY in Envoy until scorer's CLA changes again.
        await eventually(lambda: _health_is(plane, drained, "DRAINING"), what="scorer-1 DRAINING in Envoy")
        assert server.metrics.nack_count() == nacks + 2  # the push of both, then model.chat sent alone
    finally:
        server.control.republish()
    await eventually(lambda: _health_is(plane, drained, "HEALTHY"), what="scorer-1 HEALTHY again")

    async def chat_served() -> bool:
        status, _, body = await plane.call("/generate", {"model": "chat"})
        return status == 200 and body["instance"] == "chat-0"

    await eventually(chat_served, what="chat served again")
