"""The Envoy bootstrap that points an Envoy at xds_server over ADS (FACTS.md: "Bootstrap for ADS"), and
how SIE's own tools reach that Envoy's admin interface.

Everything but the control-plane connection and the admin interface comes over ADS: clusters and
listeners (CDS/LDS via ADS), and through them endpoints and routes (EDS/RDS via ADS).

Trust (DESIGN §10): the ADS stream carries Envoy's credential, a bearer token in its initial metadata
(so the bootstrap file is a secret: write it 0600), or runs over mutual TLS (`tls`: the client
certificate is the credential). Envoy's admin interface asks no credential of anyone: its /config_dump
shows that token, and POST /quitquitquit stops the ingress. So it listens on a Unix socket (mode 0600, in
a directory of the caller's that is 0700), which only Envoy's own user can connect to, never on a TCP
port, which every local process (and, in a pod, every container) can. What else must reach Envoy gets the
`stats` listener (`stats_port`): GET /ready and GET /stats/prometheus of the admin interface, nothing
else (as manifests/base/envoy.yaml does in Kubernetes). The overload manager bounds the downstream
connections Envoy holds at all, so no client can exhaust its file descriptors.
"""

from __future__ import annotations

import http.client
import socket
from pathlib import Path

from sie.errors import SIEError

XDS_CLUSTER = "sie_xds"
ADMIN_CLUSTER = "envoy_admin"  # the stats listener's way to the admin interface
# The read-only admin pages the stats listener passes on: readiness (for probes) and the metrics (for
# Prometheus). Nothing else: not /config_dump (the token), /clusters, nor any POST (/quitquitquit, /runtime_modify).
STATS_PAGES = ("/ready", "/stats/prometheus")
# sun_path holds 108 bytes with its terminating NUL; Envoy and every client need the whole path in it.
MAX_SOCKET_PATH = 107


class AdminSocketError(SIEError, ValueError):
    """The admin socket's path cannot be used (too long for a Unix socket). Fix it: a shorter run directory."""


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def envoy_bootstrap(
    node_id: str,
    cluster_name: str,
    xds_host: str,
    xds_port: int,
    admin_socket: str | Path,
    *,
    stats_port: int | None = None,
    stats_host: str = "127.0.0.1",
    token: str | None = None,
    tls: dict[str, str] | None = None,
    max_downstream_connections: int = 50_000,
    reconnect_base_s: float = 0.25,
    reconnect_max_s: float = 2.0,
) -> dict:
    """An Envoy v3 bootstrap (as a dict; write it as JSON or YAML) for an ADS client of xds_server.

    The admin interface listens on the Unix socket `admin_socket` (an absolute path in a 0700 directory);
    with `stats_port`, a listener on stats_host:stats_port serves its STATS_PAGES (port 0: Envoy picks one).
    The reconnect back-off is short so Envoy is back on a restarted control plane within about a second
    (it serves its last config meanwhile).
    """
    admin_path = admin_socket_path(admin_socket)
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
    static: dict = {"clusters": [xds_cluster]}
    if stats_port is not None:
        static["listeners"] = [stats_listener(stats_host, stats_port)]
        static["clusters"].append(admin_cluster(admin_path))
    return {
        "node": {"id": node_id, "cluster": cluster_name},
        # 0600: connect() on a Unix socket needs write permission on it, so only Envoy's user gets in.
        "admin": {"address": {"pipe": {"path": admin_path, "mode": 0o600}}},
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
        "static_resources": static,
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


def admin_socket_path(path: str | Path) -> str:
    """`path` as the admin socket's address: absolute (Envoy and its clients run in other directories) and
    short enough for a Unix socket, else AdminSocketError saying so."""
    full = str(Path(path).absolute())
    if len(full.encode()) > MAX_SOCKET_PATH:
        raise AdminSocketError(
            f"Envoy's admin socket {full} is {len(full.encode())} bytes long; a Unix socket's path holds at most "
            f"{MAX_SOCKET_PATH}: use a shorter run directory (--run-dir)"
        )
    return full


def stats_listener(host: str, port: int) -> dict:
    """A listener that passes GET of the STATS_PAGES to the admin interface and answers 404 to anything else.
    The path is normalised first, so `/stats/prometheus/../config_dump` is no way round the match."""
    get = [{"name": ":method", "string_match": {"exact": "GET"}}]
    routes: list[dict] = [
        {"match": {"path": page, "headers": get}, "route": {"cluster": ADMIN_CLUSTER}} for page in STATS_PAGES
    ]
    routes.append(
        {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}}}
    )
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "stats",
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "route_config": {"name": "stats", "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    return {
        "name": "stats",
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def admin_cluster(admin_path: str) -> dict:
    """The stats listener's upstream: the admin interface, over its Unix socket."""
    return {
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": admin_path}}}}]}],
        },
    }


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def admin_request(admin_socket: str | Path, path: str, method: str = "GET", timeout: float = 2.0) -> tuple[int, bytes]:
    """One call to Envoy's admin interface over its Unix socket: (status, body). Raises OSError (or
    http.client.HTTPException) when nothing answers there. Blocking: from a coroutine, run it in a thread."""
    connection = _UnixConnection(str(admin_socket), timeout)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()
