"""The Envoy bootstrap that points an Envoy at xds_server over ADS (FACTS.md: "Bootstrap for ADS").

Everything but the control-plane connection and the admin interface comes over ADS: clusters and
listeners (CDS/LDS via ADS), and through them endpoints and routes (EDS/RDS via ADS).

Trust (DESIGN §10): the ADS stream carries Envoy's credential, a bearer token in its initial metadata
(so the bootstrap file is a secret: write it 0600), or runs over mutual TLS (`tls`: the client
certificate is the credential). The admin interface listens on loopback. The overload manager bounds
the downstream connections Envoy holds at all, so no client can exhaust its file descriptors.
"""

from __future__ import annotations

XDS_CLUSTER = "sie_xds"


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def envoy_bootstrap(
    node_id: str,
    cluster_name: str,
    xds_host: str,
    xds_port: int,
    admin_host: str = "127.0.0.1",
    admin_port: int = 0,
    *,
    token: str | None = None,
    tls: dict[str, str] | None = None,
    max_downstream_connections: int = 50_000,
    reconnect_base_s: float = 0.25,
    reconnect_max_s: float = 2.0,
) -> dict:
    """An Envoy v3 bootstrap (as a dict; write it as JSON or YAML) for an ADS client of xds_server.

    admin_port 0 lets Envoy pick one; EnvoyProcess reads it back through --admin-address-path.
    The reconnect back-off is short so Envoy is back on a restarted control plane within about a second
    (it serves its last config meanwhile).
    """
    ads = {"ads": {}, "resource_api_version": "V3"}
    grpc_service: dict = {
        "envoy_grpc": {
            "cluster_name": XDS_CLUSTER,
            "retry_policy": {
                "retry_back_off": {
                    "base_interval": _duration(reconnect_base_s),
                    "max_interval": _duration(reconnect_max_s),
                }
            },
        }
    }
    if token is not None:
        grpc_service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {token}"}]
    xds_cluster: dict = {
        "name": XDS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": xds_host, "port_value": xds_port}}}}
                    ]
                }
            ],
        },
        # gRPC needs HTTP/2 to the control plane.
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {"connection_keepalive": {"interval": "10s", "timeout": "5s"}}
                },
            }
        },
    }
    if tls is not None:
        xds_cluster["transport_socket"] = tls_transport_socket(**tls)
    return {
        "node": {"id": node_id, "cluster": cluster_name},
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [grpc_service],
            },
            "cds_config": ads,
            "lds_config": ads,
        },
        "static_resources": {"clusters": [xds_cluster]},
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3."
                        "DownstreamConnectionsConfig",
                        "max_active_downstream_connections": max_downstream_connections,
                    },
                }
            ],
        },
    }


def tls_transport_socket(ca_file: str, cert_file: str, key_file: str, server_name: str) -> dict:
    """Mutual TLS to the control plane: verify it against `ca_file`, present `cert_file`/`key_file`."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": server_name,
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificates": [
                    {"certificate_chain": {"filename": cert_file}, "private_key": {"filename": key_file}}
                ],
                "validation_context": {
                    "trusted_ca": {"filename": ca_file},
                    "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": server_name}}],
                },
            },
        },
    }
