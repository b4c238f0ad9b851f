"""The telemetry record a sidecar sends to xds_server (POST /v1/telemetry), at least every 0.5 s and at
once on a state change.

Absent is not zero: a field the instance cannot measure (GPU figures on a machine without a GPU, KV use
of a scorer, latency before the first request) is None, and the weight policy treats it as unknown.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sie.errors import Problem, SpecError

TELEMETRY_INTERVAL_S = 0.5
# Records older than this are stale; the control plane treats a stale instance as saturated, never idle.
STALE_AFTER_S = 3.0


class InstanceState(str, Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def serves(self) -> bool:
        """Whether Envoy may send new requests to an instance in this state."""
        return self is InstanceState.READY


@dataclass(frozen=True)
class TelemetryRecord:
    instance_id: str
    model_id: str
    version: str
    address: str  # host:port of the sidecar, which is the Envoy endpoint
    node: str
    state: InstanceState
    priority: str = "P1"
    service_type: str = "llm"
    gpu_index: int | None = None
    in_flight: int = 0
    queued: int = 0
    max_concurrent: int = 0
    queue_time_ms: float | None = None  # p99 of the queue wait over the window
    kv_cache_usage: float | None = None  # 0..1
    engine_running: int | None = None  # the worker's own running/waiting counts (SGLang /v1/loads)
    engine_waiting: int | None = None
    gpu_utilization: float | None = None  # 0..1, NVML; None where there is no GPU
    gpu_memory_used_mb: float | None = None
    gpu_memory_total_mb: float | None = None
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None
    # The fast signal: the requests that completed in the sidecar's short recent window (the last
    # `recent_window_s`, ~0.5 s, and at least the last few), plus those still running, each counted at
    # its age so far (a lower bound on its latency): how many, their mean latency and its standard
    # deviation (None when there were none). It moves within a few hundred milliseconds of a slowdown,
    # where the p50/p99 above (over tens of seconds) take far longer; count and spread say how far to
    # trust it. `recent_running` says how many of the requests were still running. Older sidecars'
    # records carry 0 / None.
    recent_requests: int = 0
    recent_latency_mean_ms: float | None = None
    recent_latency_std_ms: float | None = None
    recent_window_s: float | None = None
    recent_running: int = 0
    # Stall evidence: the age of the oldest request at the worker (None when none runs), the longest
    # answer in the window leaving out its last 2 s (None when there is none; so a slowdown's first slow
    # answers do not raise the bar at once) and how many answers the window holds. A request running
    # well past every one of many recent answers shows a slowdown before its slow answers are many
    # (weights_signals.py, "overdue").
    oldest_running_ms: float | None = None
    latency_max_ms: float | None = None
    window_requests: int = 0
    error_rate: float = 0.0  # errors / requests over the window
    requests_total: int = 0
    simulated: bool = False  # True where the worker is the `sim` backend
    timestamp: float = 0.0  # wall clock (time.time()) when the sidecar measured this
    seq: int = 0  # increases by one per record of an instance; lets the receiver drop reordered posts

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_json(cls, data: Any) -> TelemetryRecord:
        if not isinstance(data, dict):
            raise SpecError("telemetry record", [Problem("", "expected a JSON object")])
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecError("telemetry record", [Problem(k, "unknown field") for k in unknown])
        missing = [k for k in ("instance_id", "model_id", "version", "address", "node", "state") if k not in data]
        if missing:
            raise SpecError("telemetry record", [Problem(k, "required") for k in missing])
        try:
            state = InstanceState(data["state"])
        except ValueError:
            allowed = ", ".join(s.value for s in InstanceState)
            raise SpecError("telemetry record", [Problem("state", f"must be one of {allowed}")]) from None
        return cls(**{**data, "state": state})

    def age(self, now: float) -> float:
        return max(0.0, now - self.timestamp)
