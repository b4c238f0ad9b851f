"""xds_server's settings: command-line flags over the cluster file's `kind: Cluster` document over defaults.

    python -m xds_server --cluster-file PATH --credentials-dir DIR [--state-dir DIR] --host 127.0.0.1
                         --admin-port 8000 --xds-port 18000 [--xds-tls-dir DIR]
                         --listener-port 8080 [--listener-host H] [--startup-sync-s 2.0] [--debounce-ms 50]
                         [--policy equal|sie] [--lb-policy least_request|round_robin]
                         [--node-ttl-s 3.0] [--retire-s 2.0] [--log-level info]
                         [--kubernetes [--namespace NS] [--kube-api-url URL | --kubeconfig FILE]]
                         [--weights-<field> VALUE ...]   (one per WeightSettings field, see --help)

Read once, in main; nothing here reads the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from sie.cluster import ClusterSettings, IngressLimits
from sie.settings_flags import add_flags, from_args, from_mapping
from sie.wire import HEARTBEAT_INTERVAL_S
from xds_server.policy.settings import WeightSettings
from xds_server.resources import LB_POLICIES


@dataclass(frozen=True)
class Settings:
    cluster_file: Path | None = None
    # The signing key (signing.key) and trust bundle (trust.pem) of SIE's identities: every caller of the
    # admin API and ADS is checked against them, and sidecar credentials are signed with them.
    credentials_dir: Path | None = None
    # Where models created, replaced or deleted through the admin API are recorded, so a restart keeps
    # them (state.py). None: nowhere; they come back only from the node hosts' reports during the sync.
    state_dir: Path | None = None
    # ADS over TLS: tls.crt and tls.key serve it, ca.crt verifies Envoy's client certificate. None: plain
    # gRPC, for loopback (Envoy then proves itself with its token in the stream's metadata).
    xds_tls_dir: Path | None = None
    host: str = "127.0.0.1"
    admin_port: int = 8000
    xds_port: int = 18000
    listener_host: str = "127.0.0.1"
    listener_port: int = 8080
    ingress: IngressLimits = IngressLimits()  # client timeouts and limits at Envoy (the Cluster's `ingress`)
    # Longer than two heartbeat/telemetry intervals, so every live node host and sidecar has reported
    # before the first snapshot is built.
    startup_sync_s: float = 2.0
    debounce_s: float = 0.05
    policy: str | None = None  # "equal", "sie", or None: "sie" (xds_server.policy.WeightPolicy)
    # Envoy's balancer for every model cluster. least_request is SIE's design (pushed weights combined
    # with Envoy's live in-flight counts); round_robin exists as a baseline for bench/routing.
    lb_policy: str = "least_request"
    node_ttl_s: float = 3.0
    retire_s: float = 2.0
    log_level: str = "info"
    # Kubernetes: run the ModelService controller in-process (models and ready pods from the API server).
    kubernetes: bool = False
    k8s_namespace: str | None = None
    k8s_system_namespace: str = "sie-system"  # where SIE's own service accounts (the node host's) live
    k8s_api_url: str | None = None  # a plain URL without auth (kubectl proxy, tests); default: in-cluster
    kubeconfig: str | None = None
    k8s_sync_timeout_s: float = 30.0  # how long the startup sync waits for the controller's first list
    # The weight policy's tunables: --weights-* flags over the Cluster's `settings: {weights: ...}`.
    weights: WeightSettings = WeightSettings()

    def warnings(self) -> list[str]:
        out = []
        if self.startup_sync_s < 2 * HEARTBEAT_INTERVAL_S:
            out.append(
                f"--startup-sync-s {self.startup_sync_s} is shorter than two heartbeat intervals "
                f"({2 * HEARTBEAT_INTERVAL_S} s): after a restart Envoy may get a partial registry"
            )
        return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xds_server", description="SIE control plane: registry, xDS (ADS) server for Envoy, admin API"
    )
    p.add_argument(
        "--cluster-file",
        type=Path,
        default=None,
        help="cluster YAML (ModelService documents and an "
        "optional kind: Cluster document); models can also be added through POST /v1/models",
    )
    p.add_argument(
        "--credentials-dir",
        type=Path,
        default=None,
        help="signing.key and trust.pem of SIE's identities (`sie up` creates them in <run-dir>/credentials)",
    )
    p.add_argument(
        "--state-dir", type=Path, default=None, help="record admin-API changes to models here so a restart keeps them"
    )
    p.add_argument(
        "--xds-tls-dir",
        type=Path,
        default=None,
        help="serve ADS over TLS: tls.crt, tls.key, and ca.crt to verify Envoy's client certificate",
    )
    p.add_argument("--host", default=None, help="address the admin API and the xDS server bind (default 127.0.0.1)")
    p.add_argument("--admin-port", type=int, default=None, help="admin HTTP port (default 8000; 0 picks one)")
    p.add_argument("--xds-port", type=int, default=None, help="ADS gRPC port (default 18000; 0 picks one)")
    p.add_argument("--listener-host", default=None, help="address of Envoy's ingress listener (default: --host)")
    p.add_argument("--listener-port", type=int, default=None, help="port of Envoy's ingress listener (default 8080)")
    p.add_argument(
        "--startup-sync-s",
        type=float,
        default=2.0,
        help="seconds to rebuild the registry from node hosts and sidecars before answering Envoy",
    )
    p.add_argument("--debounce-ms", type=float, default=50.0, help="coalesce changes for this long before a push")
    p.add_argument("--policy", choices=("equal", "sie"), default=None, help="weight policy (default: sie)")
    p.add_argument(
        "--lb-policy",
        choices=tuple(LB_POLICIES),
        default="least_request",
        help="Envoy's load balancer for model clusters (default least_request; round_robin is a "
        "baseline for benchmarks: it ignores in-flight counts)",
    )
    p.add_argument("--node-ttl-s", type=float, default=3.0, help="a node without a heartbeat this long is not live")
    p.add_argument(
        "--retire-s", type=float, default=2.0, help="a deleted model's cluster outlives its routes by this long"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    k8s = p.add_argument_group("Kubernetes")
    k8s.add_argument(
        "--kubernetes",
        action="store_true",
        help="run the ModelService controller: models come from ModelService objects, endpoints from "
        "their ready pods (in-cluster service account unless --kube-api-url/--kubeconfig)",
    )
    k8s.add_argument("--namespace", default=None, help="watch ModelServices in one namespace (default: all)")
    k8s.add_argument(
        "--system-namespace",
        default="sie-system",
        help="the namespace of SIE's own components (whose node-host service account may heartbeat)",
    )
    where = k8s.add_mutually_exclusive_group()
    where.add_argument("--kube-api-url", default=None, help="API server URL without auth (kubectl proxy, tests)")
    where.add_argument("--kubeconfig", default=None, help="kubeconfig file")
    add_flags(p, WeightSettings, "weights", title="weight policy (xds_server.policy.WeightSettings)")
    return p


def parse_args(argv: list[str] | None = None, cluster: ClusterSettings | None = None) -> Settings:
    """Flags win over `cluster` (the cluster file's settings, when the caller has loaded them).

    The cluster's `settings.weights` is checked first, so a bad key there is a SpecError naming it, not
    argparse's complaint about the flag `sie up` derived from it."""
    base = cluster or ClusterSettings()
    source = f"{cluster_file_arg(argv) or 'the cluster file'} (kind: Cluster)"
    weights = from_mapping(WeightSettings, base.settings.weights, source, "spec.settings.weights")
    args = _parser().parse_args(argv)
    host = args.host if args.host is not None else base.host
    ports = {"--admin-port": args.admin_port, "--xds-port": args.xds_port, "--listener-port": args.listener_port}
    for flag, value in ports.items():
        if value is not None and not 0 <= value <= 65535:
            raise SystemExit(f"{flag} {value}: a port is 0..65535")
    if args.startup_sync_s < 0 or args.debounce_ms < 0:
        raise SystemExit("--startup-sync-s and --debounce-ms must not be negative")
    return Settings(
        cluster_file=args.cluster_file,
        credentials_dir=args.credentials_dir,
        state_dir=args.state_dir,
        xds_tls_dir=args.xds_tls_dir,
        host=host,
        admin_port=args.admin_port if args.admin_port is not None else base.admin_port,
        xds_port=args.xds_port if args.xds_port is not None else base.xds_port,
        listener_host=args.listener_host or host,
        listener_port=args.listener_port if args.listener_port is not None else base.envoy_port,
        ingress=base.ingress,
        startup_sync_s=args.startup_sync_s,
        debounce_s=args.debounce_ms / 1000.0,
        policy=args.policy,
        lb_policy=args.lb_policy,
        node_ttl_s=args.node_ttl_s,
        retire_s=args.retire_s,
        log_level=args.log_level,
        kubernetes=args.kubernetes,
        k8s_namespace=args.namespace,
        k8s_system_namespace=args.system_namespace,
        k8s_api_url=args.kube_api_url,
        kubeconfig=args.kubeconfig,
        weights=from_args(WeightSettings, args, "weights", weights),
    )


def cluster_file_arg(argv: list[str] | None) -> Path | None:
    """The --cluster-file value alone, so main can load the file before the other flags are resolved."""
    known, _ = _parser().parse_known_args(argv)
    return known.cluster_file
