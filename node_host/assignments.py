"""What the node host must start and stop to match the control plane's assignments (pure).

Rules:
- an assigned instance that does not run and is not being stopped is started;
- a running instance that is not assigned is stopped;
- a running instance whose assigned spec changed is stopped; it starts again with the new spec on a
  later heartbeat, once the old processes are gone (one instance id never has two sets of processes);
- unless only the fleet's shape changed (replicas, the SLA's replica bounds, the rollout policy: nothing
  a running instance reads): then it keeps running and takes the new spec as its own (`respec`), so
  scaling a model or editing its rollout policy restarts nothing;
- an instance being stopped is left alone whether or not it is still assigned.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sie.wire import Assignment

# Spec fields no running instance reads: how many instances the fleet runs, how it rolls out and scales.
FLEET_FIELDS = (
    ("spec", "replicas"),
    ("spec", "sla", "min_replicas"),
    ("spec", "sla", "max_replicas"),
    ("spec", "rollout"),
    ("spec", "autoscale"),
)


def instance_view(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec without FLEET_FIELDS: what an instance's processes depend on."""
    out: dict[str, Any] = copy.deepcopy(dict(spec))
    for path in FLEET_FIELDS:
        node: Any = out
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return out


@dataclass(frozen=True)
class Plan:
    start: tuple[Assignment, ...] = ()
    stop: tuple[str, ...] = ()
    respec: tuple[Assignment, ...] = ()  # running instances that take a new spec without a restart

    @property
    def empty(self) -> bool:
        return not self.start and not self.stop and not self.respec


def plan(assigned: Sequence[Assignment], running: Mapping[str, Mapping[str, Any]], stopping: Collection[str]) -> Plan:
    """`running`: instance id -> the spec dict it runs with; `stopping`: ids whose stop is under way."""
    wanted = {a.instance_id: a for a in assigned}
    start = tuple(a for iid, a in wanted.items() if iid not in running and iid not in stopping)
    stop: list[str] = []
    respec: list[Assignment] = []
    for iid, spec in sorted(running.items()):
        if iid in stopping:
            continue
        if iid not in wanted:
            stop.append(iid)
        elif wanted[iid].full_spec != spec:
            if instance_view(wanted[iid].full_spec) == instance_view(spec):
                respec.append(wanted[iid])
            else:
                stop.append(iid)
    return Plan(start=start, stop=tuple(stop), respec=tuple(respec))
