"""Messages between node hosts and xds_server (JSON over the admin API).

A node host posts a heartbeat (POST /v1/nodes/heartbeat) every 0.5 s with its GPUs and every instance it
runs, full spec included. xds_server answers with the complete set of instances the node should run.
While xds_server is still rebuilding its registry after a start (`authoritative` false), a node host
changes nothing: it keeps what runs, so a restarted control plane never tears the data plane down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sie.telemetry import InstanceState

HEARTBEAT_INTERVAL_S = 0.5


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    total_mb: float
    used_mb: float
    utilization: float | None = None  # 0..1; None where unknown
    virtual: bool = False  # a --virtual-gpus stand-in, not a real device


@dataclass(frozen=True)
class InstanceReport:
    instance_id: str
    model_id: str
    version: str
    state: InstanceState
    spec: dict[str, Any]  # ModelService.to_dict()
    sidecar_address: str | None = None  # host:port once the sidecar listens
    worker_address: str | None = None
    gpu_index: int | None = None
    restarts: int = 0
    detail: str = ""  # e.g. the last crash reason


@dataclass(frozen=True)
class NodeHeartbeat:
    node: str
    address: str  # the node host's own API, http://host:port
    gpus: list[GPUInfo] = field(default_factory=list)
    instances: list[InstanceReport] = field(default_factory=list)
    facts: dict[str, str] = field(default_factory=dict)  # versions: python, torch, cuda, sglang

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for inst in out["instances"]:
            inst["state"] = InstanceState(inst["state"]).value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeHeartbeat:
        return cls(
            node=data["node"],
            address=data["address"],
            gpus=[GPUInfo(**g) for g in data.get("gpus", [])],
            instances=[
                InstanceReport(**{**i, "state": InstanceState(i["state"])}) for i in data.get("instances", [])
            ],
            facts=dict(data.get("facts", {})),
        )


@dataclass(frozen=True)
class Assignment:
    instance_id: str
    model_id: str
    spec: dict[str, Any]  # ModelService.to_dict()


@dataclass(frozen=True)
class HeartbeatReply:
    authoritative: bool  # False while xds_server is still rebuilding its registry: change nothing
    assignments: list[Assignment] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeartbeatReply:
        return cls(
            authoritative=bool(data["authoritative"]),
            assignments=[Assignment(**a) for a in data.get("assignments", [])],
        )
