"""Prometheus HTTP service discovery (pure): the sidecars the control plane hears from, as scrape targets.

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
"""

from __future__ import annotations

from typing import Any

from sie.telemetry import InstanceState
from xds_server.registry import EDS_TELEMETRY_TTL_S, Registry

METRICS_PATH = "/-/metrics"


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
