"""Rollouts (DESIGN §11): a changed version, image, path or backend of a running model goes live through
an SLA-gated canary and rolls back by itself.

    gates.py    one version's figures from its sidecars' windows, and the gates judged on them (pure)
    record.py   the rollout's state and its recorded form, read back only as the machine could write it
    machine.py  the rollout state machine: steps, holds, gates, rollback, by-hand actions (pure)
    driver.py   the thin shell run beside the control loop: observe the registry, advance, apply

A model's builds are tracks (xds_server.placement.Track: a generation and a count); their instances are
named by generation (placement.instance_ids), their Envoy clusters by role (ingress.canary_cluster_name).

The control plane records each rollout with the model (xds_server/state.py), so a restart resumes it.
"""

from xds_server.rollout.gates import GateResult, TrackStats, judge, track_stats
from xds_server.rollout.machine import Action, Phase, RolloutState, act, advance, replica_counts, start

__all__ = [
    "Action",
    "GateResult",
    "Phase",
    "RolloutState",
    "TrackStats",
    "act",
    "advance",
    "judge",
    "replica_counts",
    "start",
    "track_stats",
]
