"""What the control plane decides for each model's endpoints, and the policy interface that decides it.

The weight policy (weights.py) turns telemetry into a ModelDecision; the snapshot builder turns
decisions into EDS ClusterLoadAssignments. Keeping the decision a plain value lets both sides be tested
alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from sie.spec import ModelService
from sie.telemetry import TelemetryRecord

# Envoy requires load_balancing_weight >= 1; MAX_WEIGHT is "full share", the floor keeps a trickle for
# measurement. LEAST_REQUEST divides each weight by (active requests + 1), so a busy full-share host
# with ~10 in flight scores ~MAX_WEIGHT/11: with 100 a host at the floor (1) still took ~2-3% of the
# traffic; with 1000 it takes ~0.3%. Hence 1000, floor 1.
MAX_WEIGHT = 1000
MIN_WEIGHT = 1


class Health(str, Enum):
    HEALTHY = "HEALTHY"
    DRAINING = "DRAINING"  # Envoy sends no new requests; in-flight ones finish


@dataclass(frozen=True)
class EndpointDecision:
    address: str  # host:port of the sidecar
    weight: int = MAX_WEIGHT
    health: Health = Health.HEALTHY
    reason: str = ""  # why the weight is what it is, for /v1/endpoints and logs


@dataclass(frozen=True)
class ModelDecision:
    model_id: str
    endpoints: Mapping[str, EndpointDecision] = field(default_factory=dict)  # by instance_id
    drop_overload_percent: float = 0.0  # EDS policy.drop_overloads; never above 0 for P0
    reason: str = ""


class DecisionPolicy(Protocol):
    """Turns the latest telemetry of one model's instances into its endpoint decision. The control loop
    (xds_server.control.ControlLoop) calls exactly these two methods, directly: every policy has both.

    `records` holds only instances that may take traffic or are draining (the caller filters out
    failed, loading and sleeping instances). Implementations may keep state between calls (smoothing).
    """

    def decide(self, model: ModelService, records: Sequence[TelemetryRecord], now: float) -> ModelDecision:
        """The model's decision now (`now`: wall-clock seconds). May raise: the loop then uses equal
        weights for this round."""
        ...

    def forget(self, model_id: str) -> None:
        """The model is gone: drop whatever state the policy keeps for it."""
        ...


class EqualWeights:
    """The baseline policy: every serving instance gets the same weight; draining ones drain."""

    def forget(self, model_id: str) -> None:
        pass  # no state

    def decide(self, model: ModelService, records: Sequence[TelemetryRecord], now: float) -> ModelDecision:
        endpoints: dict[str, EndpointDecision] = {}
        for rec in records:
            draining = rec.state.value == "draining"
            endpoints[rec.instance_id] = EndpointDecision(
                address=rec.address,
                weight=MAX_WEIGHT,
                health=Health.DRAINING if draining else Health.HEALTHY,
                reason="draining" if draining else "equal",
            )
        return ModelDecision(model_id=model.model_id, endpoints=endpoints)


def unchanged(a: Mapping[str, EndpointDecision], b: Mapping[str, EndpointDecision]) -> bool:
    return dict(a) == dict(b)
