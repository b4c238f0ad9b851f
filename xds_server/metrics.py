"""The control plane's own Prometheus metrics (GET /metrics on the admin port).

A private CollectorRegistry per instance, so tests can run several control planes in one process and
nothing is registered at import. The ADS streams and the control loop report here through plain method
calls; /v1/status reads the same object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from xds_server.autoscale.policy import ScaleState
    from xds_server.rollout.machine import RolloutState

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def short_type(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class NackInfo:
    node_id: str
    type_url: str
    version: str  # the version Envoy kept (its last accepted one)
    message: str  # Envoy's own error text
    at: float  # wall clock

    def to_json(self) -> dict:
        return {
            "node": self.node_id,
            "type": short_type(self.type_url),
            "kept_version": self.version,
            "message": self.message,
            "at": self.at,
        }


class ControlPlaneMetrics:
    def __init__(self, wall_clock=time.time):
        self.registry = CollectorRegistry(auto_describe=True)
        self._wall = wall_clock
        r = self.registry
        self.pushes = Counter("sie_xds_pushes", "xDS responses sent, by resource type", ["type"], registry=r)
        self.resources_pushed = Counter(
            "sie_xds_resources_pushed", "Resources carried by xDS responses, by type", ["type"], registry=r
        )
        self.nacks = Counter("sie_xds_nacks", "xDS responses Envoy rejected (NACK), by type", ["type"], registry=r)
        self.connected = Gauge("sie_xds_connected_envoys", "ADS streams open now", registry=r)
        self.admin_connections = Gauge(
            "sie_admin_connections", "Connections open to the admin API now, TLS handshakes included", registry=r
        )
        self.admin_refused = Counter(
            "sie_admin_connections_refused",
            "Connections to the admin API closed as they were accepted: admin_max_connections were open",
            registry=r,
        )
        self.push_latency = Histogram(
            "sie_xds_push_latency_seconds",
            "From a registry change to the xDS response that carries it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.build_seconds = Histogram(
            "sie_xds_snapshot_build_seconds",
            "Time to decide weights and build one snapshot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.models = Gauge("sie_registry_models", "Models in the registry", registry=r)
        self.nodes = Gauge("sie_registry_nodes", "Nodes that sent a heartbeat, by liveness", ["live"], registry=r)
        self.instances = Gauge("sie_registry_instances", "Instances with telemetry, by state", ["state"], registry=r)
        self.node_events = Counter(
            "sie_node_events",
            "Node events the control plane saw: lost (heartbeat timeout), back, gpu_failed",
            ["node", "kind"],
            registry=r,
        )
        self._node_events_seen: dict[tuple[str, str], int] = {}
        self.eds_endpoints = Gauge("sie_xds_endpoints", "Endpoints in EDS now", registry=r)
        self.telemetry = Counter(
            "sie_telemetry_records", "Telemetry records received, by outcome", ["outcome"], registry=r
        )
        self.rollout_share = Gauge(
            "sie_rollout_share_percent",
            "Share of a model's traffic each build gets in the routes, by model and version",
            ["model", "version"],
            registry=r,
        )
        self.rollout_step = Gauge(
            "sie_rollout_step", "The step a model's rollout is at (1-based; 0 once it ended)", ["model"], registry=r
        )
        self.rollout_events = Counter(
            "sie_rollout_transitions", "Rollout transitions, by model and what happened", ["model", "event"], registry=r
        )
        self.autoscale_desired = Gauge(
            "sie_autoscale_desired_replicas", "The autoscaler's replica count, by model", ["model"], registry=r
        )
        self.autoscale_changes = Counter(
            "sie_autoscale_changes",
            "Autoscaler changes of a model's count, by direction",
            ["model", "direction"],
            registry=r,
        )
        self._desired: dict[str, int] = {}
        self.last_nack: NackInfo | None = None

    def scaled(self, model: str, state: ScaleState) -> None:
        """An autoscaler decision (xds_server.autoscale.driver)."""
        before = self._desired.get(model)
        self._desired[model] = state.desired
        self.autoscale_desired.labels(model).set(state.desired)
        if before is not None and state.desired != before:
            self.autoscale_changes.labels(model, "up" if state.desired > before else "down").inc()

    def node_event_counts(self, counts: dict[tuple[str, str], int]) -> None:
        """The registry's running counts of node events, by (node, kind): the counter follows them."""
        for key, total in counts.items():
            seen = self._node_events_seen.get(key, 0)
            if total > seen:
                self.node_events.labels(*key).inc(total - seen)
                self._node_events_seen[key] = total

    def rollout(self, state: RolloutState) -> None:
        """A rollout moved (xds_server.rollout.driver)."""
        self.rollout_events.labels(state.model_id, state.events[-1].what.split(" ")[0]).inc()
        self.rollout_share.labels(state.model_id, state.to_version).set(state.share)
        self.rollout_share.labels(state.model_id, state.from_version).set(100 - state.share)
        self.rollout_step.labels(state.model_id).set(state.step + 1 if state.phase.active else 0)

    # ---- called by the ADS streams ------------------------------------------------------------

    def pushed(self, type_url: str, count: int, latency_s: float | None) -> None:
        t = short_type(type_url)
        self.pushes.labels(t).inc()
        self.resources_pushed.labels(t).inc(count)
        if latency_s is not None:
            self.push_latency.observe(latency_s)

    def nacked(self, node_id: str, type_url: str, version: str, message: str) -> None:
        self.nacks.labels(short_type(type_url)).inc()
        self.last_nack = NackInfo(node_id, type_url, version, message, self._wall())

    def nack_count(self) -> int:
        return int(sum(s.value for m in self.nacks.collect() for s in m.samples if s.name.endswith("_total")))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
