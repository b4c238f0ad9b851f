"""What the node host must start and stop to match the control plane's assignments (pure).

Rules:
- an assigned instance that does not run and is not being stopped is started;
- a running instance that is not assigned is stopped;
- a running instance whose assigned spec changed is stopped; it starts again with the new spec on a
  later heartbeat, once the old processes are gone (one instance id never has two sets of processes);
- an instance being stopped is left alone whether or not it is still assigned.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sie.wire import Assignment


@dataclass(frozen=True)
class Plan:
    start: tuple[Assignment, ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.start and not self.stop


def plan(assigned: Sequence[Assignment], running: Mapping[str, Mapping[str, Any]], stopping: Collection[str]) -> Plan:
    """`running`: instance id -> the spec dict it runs with; `stopping`: ids whose stop is under way."""
    wanted = {a.instance_id: a for a in assigned}
    start = tuple(a for iid, a in wanted.items() if iid not in running and iid not in stopping)
    stop = tuple(
        sorted(
            iid
            for iid, spec in running.items()
            if iid not in stopping and (iid not in wanted or wanted[iid].spec != spec)
        )
    )
    return Plan(start=start, stop=stop)
