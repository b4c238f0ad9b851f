"""Who a caller is: the identities SIE's control APIs authorise by (DESIGN §10).

    admin      may change models and read everything (an operator, `sie` commands)
    reader     may read status, endpoints and metrics (Prometheus, dashboards)
    node       a node host, bound to one node name: heartbeats as that node, drives its own sidecars
    sidecar    one instance's sidecar, bound to (instance, model, node): reports that instance only
    envoy      an Envoy ingress: may open the ADS stream, nothing else

An identity is what a verified credential says, never what a request body claims: the handlers compare
the body (a heartbeat's node, a record's instance) with the identity and refuse a mismatch with 403.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    ADMIN = "admin"
    READER = "reader"
    NODE = "node"
    SIDECAR = "sidecar"
    ENVOY = "envoy"


@dataclass(frozen=True)
class Identity:
    role: Role
    name: str  # admin/reader/envoy: a label (who holds it); node: the node; sidecar: the instance id
    node: str | None = None  # sidecar: the node its instance was placed on; node: the node itself
    model: str | None = None  # sidecar: its model
    issued_at: float = 0.0
    expires_at: float | None = None

    @property
    def subject(self) -> str:
        return f"{self.role.value}:{self.name}"

    def __str__(self) -> str:
        return self.subject

    @classmethod
    def admin(cls, name: str = "admin") -> Identity:
        return cls(Role.ADMIN, name)

    @classmethod
    def reader(cls, name: str = "reader") -> Identity:
        return cls(Role.READER, name)

    @classmethod
    def envoy(cls, name: str = "envoy") -> Identity:
        return cls(Role.ENVOY, name)

    @classmethod
    def for_node(cls, node: str) -> Identity:
        return cls(Role.NODE, node, node=node)

    @classmethod
    def for_sidecar(cls, instance_id: str, model_id: str, node: str) -> Identity:
        return cls(Role.SIDECAR, instance_id, node=node, model=model_id)

    @property
    def reads(self) -> bool:
        """May read the control plane's and node hosts' status, endpoints and metrics."""
        return self.role in (Role.ADMIN, Role.READER)
