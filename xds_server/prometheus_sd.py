"""Prometheus HTTP service discovery (pure): the sidecars and node hosts the control plane hears from, as
scrape targets.

Served at GET /v1/prometheus/targets (a reader credential, like the scrape itself) in the format
Prometheus' `http_sd_configs` expects (Prometheus 2.28 and later): a JSON list of target groups,

    [{"targets": ["127.0.0.1:41234"],
      "labels": {"__metrics_path__": "/-/metrics", "model_id": "chat", "instance_id": "chat-0",
                 "priority_level": "P0", "service_type": "llm", "node": "node-a"}}]

one group per sidecar, because the labels differ per instance. Every sidecar exports the unified schema
(sie/metric_names.py) at /-/metrics on its control listener (never on the data listener Envoy dials),
at the address its node host registered, so one scrape job covers every model, whatever its backend.
examples/prometheus.yaml is a ready configuration.

Which sidecars: every instance whose telemetry arrived within `ttl_s` (EDS's TTL by default) and that is
not `stopped`. Draining, sleeping and failed sidecars stay listed: they still answer /-/metrics, and
their counters are what explains an incident. An instance that went silent is dropped once its TTL
passes, so Prometheus stops scraping an address that may be reused by another process.

With `?role=node` (`node_targets`) it lists the node hosts instead, one group each, at the address each
registers in its heartbeat, for their GPU metrics (node_host/metrics.py) at /metrics:

    [{"targets": ["127.0.0.1:41000"], "labels": {"__metrics_path__": "/metrics", "node": "node-a"}}]

A separate list, not more groups in the sidecars' one, so each scrape job keeps its own discovery and a
Prometheus configured before node hosts had metrics scrapes no path that would answer 404. A node host
is listed while its heartbeats arrive (within `ttl_s`), and only at an address that is an IP literal
with a port (sie.telemetry.address_problem, as for sidecars: a registered name is never resolved), not
a wildcard (a node host listening on 0.0.0.0 says so; that is no address to scrape). Its scheme (http or
https) is kept.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from sie.telemetry import InstanceState, address_problem
from xds_server.registry import EDS_TELEMETRY_TTL_S, Registry

METRICS_PATH = "/-/metrics"
NODE_METRICS_PATH = "/metrics"
ROLES = ("sidecar", "node")  # ?role= of GET /v1/prometheus/targets; sidecar when absent


def scrape_targets(registry: Registry, now: float, ttl_s: float = EDS_TELEMETRY_TTL_S) -> list[dict[str, Any]]:
    """Target groups for `http_sd_configs`, sorted by instance id. `now` is on the registry's clock."""
    groups = []
    for iid in sorted(registry.telemetry):
        tel = registry.telemetry[iid]
        rec = tel.record
        if rec.state is InstanceState.STOPPED or now - tel.received_at > ttl_s:
            continue
        address = registry.control_address(rec)
        if address is None:
            continue
        groups.append(
            {
                "targets": [address],
                "labels": {
                    "__metrics_path__": METRICS_PATH,
                    "model_id": rec.model_id,
                    "instance_id": rec.instance_id,
                    "priority_level": rec.priority,
                    "service_type": rec.service_type,
                    "node": rec.node,
                },
            }
        )
    return groups


def node_targets(registry: Registry, now: float, ttl_s: float = EDS_TELEMETRY_TTL_S) -> list[dict[str, Any]]:
    """Target groups for the node hosts' own metrics, sorted by node. `now` is on the registry's clock."""
    groups = []
    for name in sorted(registry.nodes):
        entry = registry.nodes[name]
        target = _node_address(entry.heartbeat.address)
        if target is None or now - entry.last_seen > ttl_s:
            continue
        scheme, address = target
        labels = {"__metrics_path__": NODE_METRICS_PATH, "node": name}
        if scheme != "http":
            labels["__scheme__"] = scheme
        groups.append({"targets": [address], "labels": labels})
    return groups


def _node_address(url: str) -> tuple[str, str] | None:
    """(scheme, ip:port) of a node host's registered API address, or None when it is no place to scrape."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or parts.path not in ("", "/") or parts.query or parts.username:
        return None
    if address_problem(parts.netloc) is not None or ipaddress.ip_address(parts.hostname or "").is_unspecified:
        return None
    return parts.scheme, parts.netloc
