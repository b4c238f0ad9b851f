"""Immutable, consistency-checked snapshots of the xDS resources, and the cache that holds them per node.

Versions. Every resource carries a content version (a hash of its bytes, see resources.Resource) and
every type a version derived from its resources' versions, so equal content gives equal versions, even
across a control-plane restart: a restarted xds_server re-sends what Envoy already has, and Envoy, seeing
unchanged clusters, listener and routes, changes nothing.

What a change re-sends (the ADS server in ads.py decides, per stream, from these versions):
- Cluster and Listener (CDS/LDS): State-of-the-World requires every response to hold every resource,
  so any change re-sends the whole type. Specs change rarely, so this is cheap.
- ClusterLoadAssignment and RouteConfiguration (EDS/RDS): Envoy names the resources it wants, keeps
  those a response leaves out, and delivers a response only to the watches of the resources it holds
  (GrpcMuxImpl). So a SotW EDS response may carry only the CLAs whose version changed: one model's
  endpoint change sends one CLA. The type version still changes, as the protocol requires a new
  version_info for a new response.

The cache holds a default snapshot (served to any node) and optional per-node ones; watchers (the ADS
streams) are called when a snapshot changes and read the one for their node. Bursts are coalesced twice:
the control loop (control.py) builds at most one snapshot per debounce window (--debounce-ms, 50 ms),
and a stream's watch answers at most once per client ACK, always with the newest snapshot.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from sie.errors import SIEError
from xds_server.resources import CLUSTER, ENDPOINT, LISTENER, ROUTE, TYPE_ORDER, Resource, Resources

log = logging.getLogger(__name__)


class InconsistentSnapshot(SIEError, ValueError):
    """The resources built reference what is missing: a bug in building them, not in any input. Nothing
    to retry or fix from outside: the loop gives up on this build and keeps the last good snapshot."""


def check_consistency(resources: Resources) -> list[str]:
    """What is wrong with a set of resources: a reference to a missing resource, or an orphan CLA."""
    problems = []
    for type_url in TYPE_ORDER:
        for res in resources.get(type_url, {}).values():
            for ref_type, ref_name in res.refs:
                if ref_name not in resources.get(ref_type, {}):
                    problems.append(
                        f"{_short(type_url)} {res.name!r} references missing {_short(ref_type)} {ref_name!r}"
                    )
    clusters_refs = {name for c in resources.get(CLUSTER, {}).values() for t, name in c.refs if t == ENDPOINT}
    for name in resources.get(ENDPOINT, {}):
        if name not in clusters_refs:
            problems.append(f"ClusterLoadAssignment {name!r} has no cluster")
    return problems


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]


def _type_version(resources: Mapping[str, Resource]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(resources):
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(resources[name].version.encode())
        digest.update(b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class Snapshot:
    resources: Mapping[str, Mapping[str, Resource]]
    versions: Mapping[str, str]
    # Monotonic time of the oldest registry change this snapshot carries: the ADS server measures
    # change-to-push latency from it.
    changed_at: float | None = field(default=None, compare=False)

    @classmethod
    def build(cls, resources: Resources, changed_at: float | None = None, check: bool = True) -> Snapshot:
        """A snapshot of `resources`; refuses an inconsistent set unless check=False (tests force bad ones)."""
        if check:
            problems = check_consistency(resources)
            if problems:
                raise InconsistentSnapshot("inconsistent xDS snapshot: " + "; ".join(problems))
        frozen = {t: dict(resources.get(t, {})) for t in TYPE_ORDER}
        return cls(frozen, {t: _type_version(frozen[t]) for t in TYPE_ORDER}, changed_at)

    def get(self, type_url: str) -> Mapping[str, Resource]:
        return self.resources.get(type_url, {})

    def version(self, type_url: str) -> str:
        return self.versions.get(type_url, "")

    def with_resource(self, resource: Resource) -> Snapshot:
        """A copy with one resource added or replaced, unchecked: the hook tests use to force a NACK."""
        resources = {t: dict(v) for t, v in self.resources.items()}
        resources[resource.type_url][resource.name] = resource
        return replace(self, resources=resources, versions={t: _type_version(resources[t]) for t in TYPE_ORDER})


Watcher = Callable[[], None]


@dataclass
class SnapshotCache:
    _default: Snapshot | None = None
    _by_node: dict[str, Snapshot] = field(default_factory=dict)
    _watchers: list[Watcher] = field(default_factory=list)

    def set_snapshot(self, snapshot: Snapshot, node_id: str | None = None) -> None:
        """Publish a snapshot for one node (or, with node_id None, the default for every other node)."""
        if node_id is None:
            self._default = snapshot
        else:
            self._by_node[node_id] = snapshot
        for watcher in list(self._watchers):
            try:
                watcher()
            except Exception:  # one broken stream must not stop the others from hearing of the change
                log.exception("snapshot watcher failed")

    def clear_node(self, node_id: str) -> None:
        if self._by_node.pop(node_id, None) is not None:
            for watcher in list(self._watchers):
                watcher()

    def get(self, node_id: str | None) -> Snapshot | None:
        """The node's snapshot, else the default; None until the first one is published."""
        if node_id is not None and node_id in self._by_node:
            return self._by_node[node_id]
        return self._default

    def subscribe(self, watcher: Watcher) -> Callable[[], None]:
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None


__all__ = ["CLUSTER", "ENDPOINT", "LISTENER", "ROUTE", "TYPE_ORDER", "Snapshot", "SnapshotCache", "check_consistency"]
