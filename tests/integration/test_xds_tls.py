"""ADS over mutual TLS, with a REAL Envoy (the Kubernetes wiring: no token in Envoy's bootstrap, the client
certificate is its credential). Envoy with a certificate from SIE's CA gets its listener; a client with
no certificate, or one from another CA, never completes the handshake; a plain-text client is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from sie.auth import CredentialDir
from sie.auth.pki import CertificateAuthority
from sie_testing.polling import eventually
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyProcess, admin_socket_in
from xds_server.main import XdsServer
from xds_server.settings import ControlLoopSettings, Settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SERVER_NAME = "sie-xds.sie-system.svc"
CLUSTERS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"


def _write(folder, **files: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = folder / name.replace("_", ".")
        path.write_bytes(data)
        path.chmod(0o600)


def _first_response(port: int, credentials: grpc.ChannelCredentials | None) -> discovery_pb2.DiscoveryResponse:
    target = f"127.0.0.1:{port}"
    options = (("grpc.ssl_target_name_override", SERVER_NAME),)
    channel = grpc.secure_channel(target, credentials, options) if credentials else grpc.insecure_channel(target)
    with channel:
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
        req = discovery_pb2.DiscoveryRequest(type_url=CLUSTERS, node={"id": "probe", "cluster": "x"})
        return next(iter(stub.StreamAggregatedResources(iter([req]), timeout=5)))


async def test_envoy_with_a_certificate_from_sies_ca_gets_its_config_and_nobody_else_does(tmp_path):
    ca, stranger_ca = CertificateAuthority.generate("sie-ca"), CertificateAuthority.generate("other-ca")
    server_pair = ca.issue("sie-xds", dns_names=[SERVER_NAME], server=True)
    envoy_pair = ca.issue("sie-envoy", client=True)
    stranger = stranger_ca.issue("sie-envoy", client=True)
    _write(tmp_path / "xds-tls", ca_crt=ca.cert_pem, tls_crt=server_pair.cert_pem, tls_key=server_pair.key_pem)
    _write(tmp_path / "envoy-tls", ca_crt=ca.cert_pem, tls_crt=envoy_pair.cert_pem, tls_key=envoy_pair.key_pem)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("kind: ModelService\nspec: {model: {name: chat}, backend: {type: sim}}\n")
    creds = CredentialDir(tmp_path / "credentials").ensure()
    server = XdsServer(
        Settings(
            cluster_file=cluster,
            credentials_dir=creds.path,
            xds_tls_dir=tmp_path / "xds-tls",
            admin_port=0,
            xds_port=0,
            listener_port=0,
            loop=ControlLoopSettings(startup_sync_s=0.2),
        ),
        signer=creds.signer(),
    )
    envoy = None
    try:
        await server.start()
        tls = {
            "ca_file": str(tmp_path / "envoy-tls" / "ca.crt"),
            "cert_file": str(tmp_path / "envoy-tls" / "tls.crt"),
            "key_file": str(tmp_path / "envoy-tls" / "tls.key"),
            "server_name": SERVER_NAME,
        }
        envoy = EnvoyProcess(
            envoy_bootstrap(
                "tls-envoy", "sie-ingress", "127.0.0.1", server.xds_port, admin_socket_in(tmp_path), tls=tls
            ),
            tmp_path,
        )
        envoy.start()
        await envoy.wait_ready(20)

        async def has_listener() -> bool:
            status, body = await envoy.admin_async("/listeners?format=json")
            return status == 200 and b"listener_statuses" in body

        await eventually(has_listener, what="Envoy's ingress listener, over mutual TLS")

        good = grpc.ssl_channel_credentials(ca.cert_pem, envoy_pair.key_pem, envoy_pair.cert_pem)
        reply = await asyncio.to_thread(_first_response, server.xds_port, good)
        assert any(r.type_url == CLUSTERS for r in reply.resources)
        for label, credentials in (
            ("no client certificate", grpc.ssl_channel_credentials(ca.cert_pem)),
            (
                "another CA's certificate",
                grpc.ssl_channel_credentials(ca.cert_pem, stranger.key_pem, stranger.cert_pem),
            ),
            ("plain text", None),
        ):
            with pytest.raises(grpc.RpcError) as err:
                await asyncio.to_thread(_first_response, server.xds_port, credentials)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED), label
    finally:
        if envoy is not None:
            await envoy.stop_async()
        await server.stop()
