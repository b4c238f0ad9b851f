"""The Envoy bootstrap that points an Envoy at xds_server over ADS (FACTS.md: "Bootstrap for ADS").

Everything but the control-plane connection and the admin interface comes over ADS: clusters and
listeners (CDS/LDS via ADS), and through them endpoints and routes (EDS/RDS via ADS).
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
    reconnect_base_s: float = 0.25,
    reconnect_max_s: float = 2.0,
) -> dict:
    """An Envoy v3 bootstrap (as a dict; write it as JSON or YAML) for an ADS client of xds_server.

    admin_port 0 lets Envoy pick one; EnvoyProcess reads it back through --admin-address-path.
    The reconnect back-off is short so Envoy is back on a restarted control plane within about a second
    (it serves its last config meanwhile).
    """
    ads = {"ads": {}, "resource_api_version": "V3"}
    return {
        "node": {"id": node_id, "cluster": cluster_name},
        "admin": {"address": {"socket_address": {"address": admin_host, "port_value": admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{
                    "envoy_grpc": {
                        "cluster_name": XDS_CLUSTER,
                        "retry_policy": {
                            "retry_back_off": {
                                "base_interval": _duration(reconnect_base_s),
                                "max_interval": _duration(reconnect_max_s),
                            }
                        },
                    }
                }],
            },
            "cds_config": ads,
            "lds_config": ads,
        },
        "static_resources": {
            "clusters": [{
                "name": XDS_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {
                    "cluster_name": XDS_CLUSTER,
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                        "socket_address": {"address": xds_host, "port_value": xds_port}
                    }}}]}],
                },
                # gRPC needs HTTP/2 to the control plane.
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {
                            "connection_keepalive": {"interval": "10s", "timeout": "5s"}
                        }},
                    }
                },
            }]
        },
    }
