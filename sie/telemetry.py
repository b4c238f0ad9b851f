"""The telemetry record a sidecar sends to xds_server (POST /v1/telemetry), at least every 0.5 s and at
once on a state change.

Absent is not zero: a field the instance cannot measure (GPU figures on a machine without a GPU, KV use
of a scorer, latency before the first request) is None, and the weight policy treats it as unknown.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from sie.errors import Problem, SpecError
from sie.records import bounds, decode

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
    instance_id: str = field(metadata=bounds(max_len=253))
    model_id: str = field(metadata=bounds(max_len=63))
    version: str = field(metadata=bounds(max_len=64))
    # host:port the sidecar serves on. Informational: the address in EDS is the one the instance's node
    # host (or Kubernetes) registered, never this one (DESIGN §10).
    address: str = field(metadata=bounds(max_len=300))
    node: str = field(metadata=bounds(max_len=253))
    state: InstanceState
    priority: str = field(default="P1", metadata=bounds(max_len=2))
    service_type: str = field(default="llm", metadata=bounds(max_len=32))
    gpu_index: int | None = field(default=None, metadata=bounds(low=0, high=1024))
    in_flight: int = field(default=0, metadata=bounds(low=0, high=10_000_000))
    queued: int = field(default=0, metadata=bounds(low=0, high=10_000_000))
    max_concurrent: int = field(default=0, metadata=bounds(low=0, high=10_000_000))
    queue_time_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))  # p99 queue wait
    kv_cache_usage: float | None = field(default=None, metadata=bounds(low=0, high=1))
    # prompt tokens the engine found in its prefix cache (sglang:cache_hit_rate); None: no prefix cache
    cache_hit_rate: float | None = field(default=None, metadata=bounds(low=0, high=1))
    # the worker's own running/waiting counts (SGLang /v1/loads)
    engine_running: int | None = field(default=None, metadata=bounds(low=0, high=10_000_000))
    engine_waiting: int | None = field(default=None, metadata=bounds(low=0, high=10_000_000))
    gpu_utilization: float | None = field(default=None, metadata=bounds(low=0, high=1))  # NVML; None: no GPU
    gpu_memory_used_mb: float | None = field(default=None, metadata=bounds(low=0, high=1e9))
    gpu_memory_total_mb: float | None = field(default=None, metadata=bounds(low=0, high=1e9))
    latency_p50_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    latency_p99_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    # The fast signal: the requests that completed in the sidecar's short recent window (the last
    # `recent_window_s`, ~0.5 s, and at least the last few), plus those still running, each counted at
    # its age so far (a lower bound on its latency): how many, their mean latency and its standard
    # deviation (None when there were none). It moves within a few hundred milliseconds of a slowdown,
    # where the p50/p99 above (over tens of seconds) take far longer; count and spread say how far to
    # trust it. `recent_running` says how many of the requests were still running. Older sidecars'
    # records carry 0 / None.
    recent_requests: int = field(default=0, metadata=bounds(low=0, high=10_000_000))
    recent_latency_mean_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    recent_latency_std_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    recent_window_s: float | None = field(default=None, metadata=bounds(low=0, high=1e6))
    recent_running: int = field(default=0, metadata=bounds(low=0, high=10_000_000))
    # Stall evidence: the age of the oldest request at the worker (None when none runs), the longest
    # answer in the window leaving out its last 2 s (None when there is none; so a slowdown's first slow
    # answers do not raise the bar at once) and how many answers the window holds. A request running
    # well past every one of many recent answers shows a slowdown before its slow answers are many
    # (xds_server/policy/signals.py, "overdue").
    oldest_running_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    latency_max_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    window_requests: int = field(default=0, metadata=bounds(low=0, high=10_000_000))
    # Service time over the same window: latency less the wait in the sidecar's queue, which depends on
    # the share of the load the instance was given rather than on how fast it serves. None when the
    # window is empty (and from older sidecars).
    service_p50_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    service_p99_ms: float | None = field(default=None, metadata=bounds(low=0, high=1e10))
    error_rate: float = field(default=0.0, metadata=bounds(low=0, high=1))  # errors / requests over the window
    requests_total: int = field(default=0, metadata=bounds(low=0, high=2**63 - 1))
    simulated: bool = False  # True where the worker is the `sim` backend
    timestamp: float = field(default=0.0, metadata=bounds(low=0, high=1e11))  # sidecar's wall clock at measurement
    # Increases by one per record of one sidecar process (`reporter`, random per process start); the
    # receiver drops a post older than the last one of the same reporter. A new reporter (a restarted
    # sidecar) starts over, so no value a record carries can lock the genuine sidecar out.
    seq: int = field(default=0, metadata=bounds(low=0, high=2**63 - 1))
    reporter: str = field(default="", metadata=bounds(max_len=64))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["state"] = self.state.value
        return out

    @classmethod
    def from_json(cls, data: Any) -> TelemetryRecord:
        """A record from parsed JSON, with every field's type and bound and the address checked."""
        record = decode(cls, data, "telemetry record")
        problem = address_problem(record.address)
        if problem:
            raise SpecError("telemetry record", [Problem("address", problem)])
        return record

    def age(self, now: float) -> float:
        return max(0.0, now - self.timestamp)


def parse_port(text: str) -> int | None:
    """`text` as a TCP port, 1..65535, or None. ASCII digits only: str.isdigit() alone also takes
    '²' or '٣', which int() then refuses or reads as a digit no client would send."""
    if not (0 < len(text) <= 5 and text.isascii() and text.isdigit()):
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def ip_literal_problem(host: str) -> str | None:
    """Why Envoy would not take `host` as an endpoint's IP address (SocketAddress.address in EDS) on
    every machine it may run on, phrased to follow "the host", or None. The one rule for every address
    SIE may hand Envoy: split_address (telemetry, the registry, xds_server.resources) and the node
    host's wire (sie.wire.host_port_problem) apply it.

    Envoy 1.40 parses the address with getaddrinfo(AI_NUMERICHOST) (source/common/network/
    ip_address_parsing.cc): IPv4 only as the dotted quad that prints back the same, IPv6 with an
    optional %zone that must name a network interface of the machine Envoy runs on. A zone is refused
    here whatever it names: it means something on one machine only (the node host's, not Envoy's), and
    one that names no interface of Envoy's host (`[fe80::1%eth7]`) makes Envoy reject the whole EDS
    response ("malformed IP address"), which it then applies only in part."""
    if "%" in host:
        return (
            "must not carry an IPv6 zone id (%...): a zone names a network interface of one machine, which "
            "Envoy's may lack"
        )
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "must be an IP literal such as 127.0.0.1 or [::1] (Envoy's EDS does not resolve names)"
    if ip.version == 4 and str(ip) != host:  # Python takes no other IPv4 spelling today; Envoy never does
        return "must be an IPv4 dotted quad such as 10.0.0.7"
    return None


def split_address(address: str) -> tuple[str, int]:
    """`ip:port` or `[ipv6]:port` -> (ip, port); ValueError saying what is wrong otherwise. EDS takes IP
    literals only, as Envoy reads them (ip_literal_problem), so a registered address must be one."""
    host, sep, port_text = address.rpartition(":")
    if not sep:
        raise ValueError(f"{address!r} is not host:port")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    problem = ip_literal_problem(host)
    if problem is not None:
        raise ValueError(f"{address!r}: the host {problem}")
    port = parse_port(port_text)
    if port is None:
        raise ValueError(f"{address!r}: the port must be a number 1..65535")
    return host, port


def address_problem(address: str) -> str | None:
    """Why `address` is not `ip:port` / `[ipv6]:port` (split_address), or None. Never raises."""
    try:
        split_address(address)
    except ValueError as exc:
        return str(exc)
    return None
