r"""Envoy's view of one model's endpoints, for bench.reaction: read it, and wait until it shows a change.

What is read: `/clusters?format=json&filter=^model\.<id>$`, the load balancer's live host set of one
model's cluster, with each host's weight and EDS health (and outlier state). The filter keeps it to one
cluster: 7 KB and about 0.4 ms of Envoy's main thread at 1000 endpoints, where the unfiltered listing is
0.8 MB and 15-30 ms on the thread that also applies xDS updates, so polling that every few ms would slow
the very thing measured. Not `/config_dump?include_eds`: Envoy rebuilds that from the host set with a
coarse health, in which a DRAINING host and one ejected by outlier detection both read UNHEALTHY (a
draining sidecar's retryable 503s can get it ejected first).

Polling runs every `POLL_S` only while a trial waits; a reading's time is when its answer arrived, so a
reaction is over-stated by at most one poll interval plus one admin round trip (both are reported). The
admin interface is a Unix socket (xds_server/bootstrap.py), called from a worker thread; the round trips
include that hop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from xds_server.envoy_process import admin_request_async

POLL_S = 0.005


@dataclass(frozen=True)
class HostView:
    weight: int
    health: str  # the EDS health xds_server sent: HEALTHY or DRAINING
    ejected: bool  # outlier detection took it out


@dataclass(frozen=True)
class EdsReading:
    at: float  # time.monotonic() when the answer arrived
    hosts: dict[str, HostView]  # by the endpoint's hostname, which xds_server sets to the instance id


def parse_clusters(doc: dict, cluster: str) -> dict[str, HostView]:
    hosts: dict[str, HostView] = {}
    for status in doc.get("cluster_statuses", []):
        if status.get("name") != cluster:
            continue
        for h in status.get("host_statuses", []):
            health = h.get("health_status", {})
            hosts[h.get("hostname", "")] = HostView(
                int(h.get("weight", 1)),
                health.get("eds_health_status", "UNKNOWN"),
                bool(health.get("failed_outlier_check", False)),
            )
    return hosts


class EnvoyEds:
    """One model's endpoints as Envoy's load balancer holds them."""

    def __init__(self, admin_socket: Path, model: str):
        self._socket = admin_socket
        self._cluster = f"model.{model}"
        self._path = f"/clusters?format=json&filter=%5Emodel%5C.{model}%24"
        self.round_trips: list[float] = []

    async def read(self) -> EdsReading:
        sent = time.monotonic()
        _, body = await admin_request_async(self._socket, self._path)
        doc = json.loads(body)
        at = time.monotonic()
        self.round_trips.append(at - sent)
        return EdsReading(at, parse_clusters(doc, self._cluster))

    async def wait(self, wanted: Callable[[EdsReading], bool], timeout_s: float) -> EdsReading | None:
        deadline = time.monotonic() + timeout_s
        while True:
            reading = await self.read()
            if wanted(reading):
                return reading
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(POLL_S)


def host(reading: EdsReading | None, instance: str) -> HostView | None:
    return None if reading is None else reading.hosts.get(instance)


def known_host(reading: EdsReading, instance: str) -> HostView:
    """`instance`'s host in a reading known to hold it: one a wait returned, whose condition saw the host."""
    h = reading.hosts.get(instance)
    assert h is not None, f"{instance} is not in this reading of Envoy's hosts"
    return h


def draining(reading: EdsReading | None, instance: str) -> bool:
    h = host(reading, instance)
    return h is not None and h.health == "DRAINING"


def healthy(reading: EdsReading | None, instance: str) -> bool:
    h = host(reading, instance)
    return h is not None and h.health == "HEALTHY" and not h.ejected
