"""The weight policy family (DESIGN.md section 5): telemetry in, per-endpoint weights, health and drops out.

Pure: no I/O, no clock of its own (`now` is passed in). What it offers:

- decisions.py: the values it decides (`ModelDecision`, `EndpointDecision`, `Health`, `MAX_WEIGHT`,
  `MIN_WEIGHT`), the interface the control loop calls (`DecisionPolicy`, a Protocol) and the baseline
  `EqualWeights`;
- weights.py: SIE's policy, `WeightPolicy` (stateful wrapper) over the pure `decide` and its
  `PolicyState`;
- settings.py: `WeightSettings`, its tunables;
- signals.py and shedding.py: what it reads from one endpoint's telemetry, and load shedding (internal to
  weights.py; tests import them by module).
"""

from xds_server.policy.decisions import (
    MAX_WEIGHT,
    MIN_WEIGHT,
    DecisionPolicy,
    EndpointDecision,
    EqualWeights,
    Health,
    ModelDecision,
)
from xds_server.policy.settings import WeightSettings
from xds_server.policy.weights import PolicyState, WeightPolicy, decide

__all__ = [
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "DecisionPolicy",
    "EndpointDecision",
    "EqualWeights",
    "Health",
    "ModelDecision",
    "PolicyState",
    "WeightPolicy",
    "WeightSettings",
    "decide",
]
