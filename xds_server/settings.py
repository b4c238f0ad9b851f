"""xds_server's settings: command-line flags over the cluster file's `kind: Cluster` document over defaults.

Three dataclasses, each default stated once with a docstring per field (unit, default, why), and every
flag derived from them (sie.settings_flags); `python -m xds_server --help` prints them:

    Settings             the process: where its files are, what it listens on   (--cluster-file, --host, ...)
    ControlLoopSettings  how the registry and the control loop react             (--startup-sync-s, ...)
                         also the Cluster's `settings: {control_plane: {...}}`
    KubernetesSettings   the in-process ModelService controller                  (--kubernetes, --namespace, ...)
    WeightSettings       the weight policy (xds_server.policy.settings)          (--weights-<field>)
                         also the Cluster's `settings: {weights: {...}}`

The Cluster's host and ports (host, admin_port, xds_port, envoy_port) and `ingress` are the base the
flags override. Read once, in main; nothing here reads the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sie.cluster import ClusterSettings, IngressLimits
from sie.settings_flags import add_flags, from_args, from_mapping
from sie.wire import HEARTBEAT_INTERVAL_S
from xds_server.policy.settings import WeightSettings

__all__ = ["ControlLoopSettings", "KubernetesSettings", "Settings", "cluster_file_arg", "parse_args"]


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"a port is 0..65535, got {value}")
    return value


_PORT = {"parse": _port, "metavar": "PORT"}


def _connections(text: str) -> int:
    value = int(text)
    if not 16 <= value <= 1_000_000:
        raise ValueError(f"a connection limit is 16..1000000, got {value}")
    return value


def _handshake_s(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 60:
        raise ValueError(f"a handshake timeout is 0.1..60 seconds, got {value}")
    return value


@dataclass(frozen=True)
class ControlLoopSettings:
    """How the registry forgets and the control loop pushes. Invalid values raise ValueError."""

    startup_sync_s: float = 2.0
    """Seconds (default 2.0) the control plane rebuilds its registry from node hosts' and sidecars'
    reports before it answers Envoy. Longer than two heartbeat and telemetry intervals, so after a
    restart every live node host and sidecar has reported before the first snapshot is built."""

    startup_nodes: int = 0
    """Node hosts (count, default 0) the startup sync also waits for before the first placement, up to
    startup_nodes_timeout_s: a cluster of several nodes starting together is placed over all of them,
    not on whichever reported first. A Cluster file's `nodes:` list sets it to their number."""

    startup_nodes_timeout_s: float = 60.0
    """Seconds (default 60) the startup sync waits for startup_nodes at most; then it places on the node
    hosts that reported, and logs which are missing."""

    debounce_ms: float = 50.0
    """Milliseconds (default 50) changes are coalesced before one push: a burst of telemetry becomes
    one snapshot, and a single change reaches Envoy within this long."""

    heartbeat_timeout_s: float = 30.0
    """Seconds (default 30, the source's) without a heartbeat after which a node is lost: marked unhealthy,
    its endpoints leave EDS at once, and its instances are placed on the live nodes (new before old: the
    lost copies are dropped when the node returns). Node hosts heartbeat every 0.5 s; lower it for
    faster failover (at least a few heartbeats, so one late heartbeat is not a lost node)."""

    rebalance: Literal["none", "return"] = "none"
    """What a lost node gets back when it heartbeats again (default none): `none` leaves its instances
    where they were placed meanwhile; `return` moves them back to it where they fit, each new copy
    serving before the interim one is dropped (xds_server.placement rules 5 and 6)."""

    retire_s: float = 2.0
    """Seconds (default 2.0) a deleted model's cluster outlives its routes, so requests Envoy already
    routed to it finish instead of meeting a missing cluster."""

    policy: Literal["sie", "equal"] = "sie"
    """The weight policy (default sie): `sie` weighs endpoints by their telemetry
    (xds_server.policy.WeightPolicy); `equal` gives every ready endpoint the same weight, a baseline."""

    lb_policy: Literal["least_request", "round_robin"] = "least_request"
    """Envoy's balancer for every model cluster (default least_request, SIE's design: pushed weights
    combined with Envoy's live in-flight counts). round_robin ignores in-flight counts; it exists as a
    baseline for bench/routing."""

    prefix_affinity: bool = True
    """Let models ask for prefix affinity (default true; their spec's routing.prefix_affinity, on by
    default for LLMs): requests sharing a prompt prefix go to the instance that caches it, under a
    bounded load. false balances every model by load alone, a baseline for bench/prefix. Only with
    lb_policy least_request."""

    def __post_init__(self) -> None:
        for name in (
            "startup_sync_s",
            "startup_nodes",
            "startup_nodes_timeout_s",
            "debounce_ms",
            "heartbeat_timeout_s",
            "retire_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    @property
    def debounce_s(self) -> float:
        return self.debounce_ms / 1000.0


@dataclass(frozen=True)
class KubernetesSettings:
    """The ModelService controller run in-process: models from ModelService objects, endpoints from
    their ready pods."""

    enabled: bool = field(default=False, metadata={"flag": "--kubernetes"})
    """Run the ModelService controller (default false). Its API access is the in-cluster service
    account unless --kube-api-url or --kubeconfig says otherwise."""

    namespace: str | None = field(default=None, metadata={"flag": "--namespace"})
    """Watch ModelServices in this namespace only (default: all namespaces)."""

    system_namespace: str = field(default="sie-system", metadata={"flag": "--system-namespace"})
    """The namespace of SIE's own components (default sie-system): only the node-host service account
    there may send heartbeats."""

    api_url: str | None = field(default=None, metadata={"flag": "--kube-api-url"})
    """An API server URL used without authentication (kubectl proxy, tests). Default: in-cluster."""

    kubeconfig: str | None = field(default=None, metadata={"flag": "--kubeconfig"})
    """A kubeconfig file to reach the API server with. Default: in-cluster."""

    sync_timeout_s: float = field(default=30.0, metadata={"flag": "--kube-sync-timeout-s"})
    """Seconds (default 30) the startup sync waits for the controller's first list of ModelServices;
    after it the control plane answers Envoy with what it knows, and says so."""

    p0_only_tiers: str = field(default="", metadata={"flag": "--kube-p0-only-tiers", "metavar": "TIER,..."})
    """Tiers (comma-separated) only P0 ModelServices may name in scheduling.tier, e.g. 'gold': a P1 or P2
    one naming one is invalid (SpecInvalid), as a node host's --p0-only-tiers refuses it. Default none."""

    worker_run_as_user: int | None = field(default=None, metadata={"flag": "--kube-worker-run-as-user"})
    """The uid model workers run as, with runAsNonRoot. Default: the image's own user, since GPU images
    (SGLang's, NVIDIA's) run as root; either way a worker has no capabilities and cannot gain privileges."""

    @property
    def p0_only(self) -> frozenset[str]:
        return frozenset(t.strip() for t in self.p0_only_tiers.split(",") if t.strip())

    def __post_init__(self) -> None:
        if self.api_url and self.kubeconfig:
            raise ValueError("give --kube-api-url or --kubeconfig, not both")
        if self.sync_timeout_s < 0:
            raise ValueError(f"the sync timeout must not be negative, got {self.sync_timeout_s}")


@dataclass(frozen=True)
class Settings:
    """One control plane process."""

    cluster_file: Path | None = None
    """Cluster YAML: ModelService documents and an optional `kind: Cluster` document (its host, ports,
    ingress limits and settings sections are this process's base). Models can also be added through
    POST /v1/models. Default: none."""

    credentials_dir: Path | None = None
    """The signing key (signing.key) and trust bundle (trust.pem) of SIE's identities: every caller of
    the admin API and ADS is checked against them, and sidecar credentials are signed with them.
    Required to start (`sie up` creates them in <run-dir>/credentials)."""

    state_dir: Path | None = None
    """Where models created, replaced or deleted through the admin API, their rollouts and the
    autoscaler's counts are recorded, so a restart keeps them (state.py). Default: nowhere; models come
    back from the node hosts' reports, and counts from what those report serving."""

    xds_tls_dir: Path | None = None
    """Serve ADS over TLS: tls.crt and tls.key serve it, ca.crt verifies Envoy's client certificate.
    Default: plain gRPC, for loopback (Envoy then proves itself with its token in the stream's metadata)."""

    admin_tls_dir: Path | None = None
    """Serve the admin API over HTTPS: DIR/tls.crt (its certificate, then any intermediates) and
    DIR/tls.key; node hosts, sidecars and the picker verify it against the CA certificate in their trust
    bundle (sie.auth.tls). Default: plain HTTP, for loopback (`sie up` sets it when its host is not).
    Clients still authenticate with their tokens inside the connection."""

    admin_max_connections: int = field(default=4096, metadata={"parse": _connections, "metavar": "N"})
    """Connections the admin API holds open at once, TLS handshakes included (xds_server.admin_listener);
    one past them is closed as it is accepted, counted (sie_admin_connections_refused_total) and logged.
    Default 4096: a node host and a sidecar keep one each, the picker and Prometheus one, and at about
    80 KiB a TLS connection (5 KiB a plain one) the whole limit stays near 330 MiB, inside sie-xds's
    1 GiB. A fleet of more instances needs it raised, with the memory limit (80 KiB a connection)."""

    admin_handshake_timeout_s: float = field(default=10.0, metadata={"parse": _handshake_s, "metavar": "SECONDS"})
    """Seconds a client may take to finish its TLS handshake with the admin API before it is closed
    (default 10; asyncio's own is 60): a connection that never handshakes holds a slot of
    admin_max_connections only this long."""

    host: str = "127.0.0.1"
    """Address the admin API and the xDS server bind (default 127.0.0.1, or the Cluster's host)."""

    admin_port: int = field(default=8000, metadata=_PORT)
    """Admin HTTP port (default 8000, or the Cluster's admin_port; 0 picks a free one)."""

    xds_port: int = field(default=18000, metadata=_PORT)
    """ADS gRPC port (default 18000, or the Cluster's xds_port; 0 picks a free one)."""

    listener_host: str | None = None
    """Address of Envoy's ingress listener, as pushed in LDS (default: the same as --host)."""

    listener_port: int = field(default=8080, metadata=_PORT)
    """Port of Envoy's ingress listener, as pushed in LDS (default 8080, or the Cluster's envoy_port)."""

    picker_address: str | None = None
    """host:port where Envoy reaches the endpoint picker (`python -m xds_server.picker`, beside Envoy;
    `sie up` starts one). Models with prefix affinity have their requests picked there; unset (the
    default), no picker runs and every model is balanced by load alone."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level (default info)."""

    ingress: IngressLimits = field(default=IngressLimits(), metadata={"cli": False})
    """Client timeouts and limits at Envoy: the Cluster's `ingress`, no flags."""

    loop: ControlLoopSettings = ControlLoopSettings()
    """The registry's and the control loop's tunables (their own flags)."""

    kubernetes: KubernetesSettings = KubernetesSettings()
    """The in-process ModelService controller (its own flags)."""

    weights: WeightSettings = WeightSettings()
    """The weight policy's tunables: --weights-* flags over the Cluster's `settings: {weights: ...}`."""

    @property
    def listener_address(self) -> str:
        return self.listener_host or self.host

    def warnings(self) -> list[str]:
        out = []
        if self.loop.startup_sync_s < 2 * HEARTBEAT_INTERVAL_S:
            out.append(
                f"--startup-sync-s {self.loop.startup_sync_s} is shorter than two heartbeat intervals "
                f"({2 * HEARTBEAT_INTERVAL_S} s): after a restart Envoy may get a partial registry"
            )
        return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m xds_server",
        description="SIE control plane: registry, xDS (ADS) server for Envoy, admin API",
        allow_abbrev=False,
    )
    add_flags(p, Settings, "", title="")
    add_flags(p, ControlLoopSettings, "", title="control loop (the Cluster's settings.control_plane)")
    add_flags(p, KubernetesSettings, "", title="Kubernetes")
    add_flags(p, WeightSettings, "weights", title="weight policy (the Cluster's settings.weights)")
    return p


def parse_args(argv: list[str] | None = None, cluster: ClusterSettings | None = None) -> Settings:
    """Flags win over `cluster` (the cluster file's settings, when the caller has loaded them).

    The cluster's settings sections are checked first, so a bad key there is a SpecError naming it, not
    argparse's complaint about the flag `sie up` derived from it."""
    c = cluster or ClusterSettings()
    source = f"{cluster_file_arg(argv) or 'the cluster file'} (kind: Cluster)"
    base = Settings(
        host=c.host,
        admin_port=c.admin_port,
        xds_port=c.xds_port,
        listener_port=c.envoy_port,
        ingress=c.ingress,
        loop=from_mapping(
            ControlLoopSettings,
            {"startup_nodes": len(c.nodes), **c.settings.control_plane},
            source,
            "spec.settings.control_plane",
        ),
        weights=from_mapping(WeightSettings, c.settings.weights, source, "spec.settings.weights"),
    )
    args = _parser().parse_args(argv)
    return from_args(
        Settings,
        args,
        "",
        base,
        loop=from_args(ControlLoopSettings, args, "", base.loop),
        kubernetes=from_args(KubernetesSettings, args, "", base.kubernetes),
        weights=from_args(WeightSettings, args, "weights", base.weights),
    )


def cluster_file_arg(argv: list[str] | None) -> Path | None:
    """The --cluster-file value alone, so main can load the file before the other flags are resolved."""
    known, _ = _parser().parse_known_args(argv)
    return known.cluster_file
