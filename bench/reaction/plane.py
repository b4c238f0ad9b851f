"""bench.reaction's control plane: a real xds_server (its XdsServer, in a process of its own) that also writes
a timeline of what happens to the watched instances, so a reaction time can be split into its parts.

    python -m bench.reaction.plane --timeline OUT.jsonl --watch sim-0,sim-1,probe-0 [xds_server flags...]

Every other flag is xds_server's own (python -m xds_server --help). One JSON object per line in the
timeline, `t` on CLOCK_MONOTONIC (time.monotonic(), the same clock in every process on this host):

    {"ev": "telemetry", "t", "iid", "state", "p50", "p99", "seq",   a watched instance's record was stored
     "recent_n", "recent_mean", "recent_std", "running", "oldest", "max", "window_n"}
    {"ev": "rebuild", "t0", "t1", "published"}                      one decide-and-build round of the loop
    {"ev": "decision", "t", "iid", "weight", "health"}              a watched instance's decision changed
                                                                    (t: the end of the rebuild that changed it)
    {"ev": "push", "t", "nonce", "models"}                          an EDS response left the ADS state machine
                                                                    (models: the watched models it carries)
    {"ev": "ack", "t", "nonce", "nack"}                             Envoy's answer to that EDS response
    {"ev": "gc", "t", "ms", "generation"}                           a garbage collection of over GC_LOG_MS
    {"ev": "stall", "t", "ms"}                                      the event loop answered a 10 ms timer
                                                                    over STALL_LOG_MS late (t: when it did)

The hooks wrap methods of this process's objects (and AdsStream's two entry points); they cost a set
lookup per telemetry record and one line per event of a watched instance. Nothing here changes what
the control plane decides or sends.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2

from sie.auth import CredentialDir
from sie.cluster import load_cluster
from sie.telemetry import TelemetryRecord
from xds_server import ads
from xds_server.main import XdsServer
from xds_server.resources import ENDPOINT
from xds_server.settings import cluster_file_arg, parse_args
from xds_server.snapshots import Snapshot

log = logging.getLogger("bench.reaction.plane")

GC_LOG_MS = 20.0
STALL_LOG_MS = 100.0

# EDS responses with more resources than this are not opened to see which models they carry (the
# first push of 1000 CLAs); the watched models' changes come one or a few at a time.
_DECODE_AT_MOST = 64


class Timeline:
    def __init__(self, path: str, watch: set[str], clock: Callable[[], float] = time.monotonic):
        self._file = open(path, "a", buffering=1)  # line-buffered: the bench reads it while we run
        self.watch = watch
        self.models: set[str] = set()  # cluster names of the watched instances' models
        self._clock = clock
        self._decisions: dict[str, tuple[int, str]] = {}

    def write(self, **event: Any) -> None:
        self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        self._file.close()

    def attach(self, server: XdsServer) -> None:
        self._hook_telemetry(server)
        self._hook_rebuild(server)
        self._hook_ads()
        self._hook_gc()

    def _hook_gc(self) -> None:
        started: list[float] = []

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started[:] = [self._clock()]
            elif started:
                ms = (self._clock() - started[0]) * 1000
                if ms >= GC_LOG_MS:
                    self.write(ev="gc", t=started[0], ms=round(ms, 1), generation=info.get("generation"))

        gc.callbacks.append(on_gc)

    async def watch_loop(self, period_s: float = 0.01) -> None:
        """Log the event loop's stalls: how late a short timer fires says how long the loop was busy."""
        while True:
            before = self._clock()
            await asyncio.sleep(period_s)
            late_ms = (self._clock() - before - period_s) * 1000
            if late_ms >= STALL_LOG_MS:
                self.write(ev="stall", t=self._clock(), ms=round(late_ms, 1))

    def _hook_telemetry(self, server: XdsServer) -> None:
        registry, original = server.registry, server.registry.record_telemetry

        def record_telemetry(rec: TelemetryRecord) -> bool:
            accepted = original(rec)
            if rec.instance_id in self.watch:
                self.models.add(f"model.{rec.model_id}")
                self.write(
                    ev="telemetry",
                    t=self._clock(),
                    iid=rec.instance_id,
                    state=rec.state.value,
                    p50=rec.latency_p50_ms,
                    p99=rec.latency_p99_ms,
                    seq=rec.seq,
                    accepted=accepted,
                    # the sidecar's fast signal, where its records carry one
                    recent_n=getattr(rec, "recent_requests", None),
                    recent_mean=getattr(rec, "recent_latency_mean_ms", None),
                    recent_std=getattr(rec, "recent_latency_std_ms", None),
                    running=getattr(rec, "recent_running", None),
                    oldest=getattr(rec, "oldest_running_ms", None),
                    max=getattr(rec, "latency_max_ms", None),
                    window_n=getattr(rec, "window_requests", None),
                )
            return accepted

        # Wrapping a live object's method is the point here (module docstring); the signatures still match.
        registry.record_telemetry = record_telemetry  # type: ignore[method-assign]

    def _hook_rebuild(self, server: XdsServer) -> None:
        control, original = server.control, server.control.rebuild

        def rebuild() -> Snapshot | None:
            t0 = self._clock()
            snapshot = original()
            t1 = self._clock()
            self.write(ev="rebuild", t0=t0, t1=t1, published=snapshot is not None)
            for decision in control.decisions.values():
                for iid, ep in decision.endpoints.items():
                    if iid in self.watch and self._decisions.get(iid) != (ep.weight, ep.health.value):
                        self._decisions[iid] = (ep.weight, ep.health.value)
                        self.write(ev="decision", t=t1, iid=iid, weight=ep.weight, health=ep.health.value)
            return snapshot

        control.rebuild = rebuild  # type: ignore[method-assign]  # wrapped, as above

    def _hook_ads(self) -> None:
        timeline = self
        respond, on_request = ads.AdsStream._respond, ads.AdsStream.on_request

        def _respond(stream: ads.AdsStream, type_url: str, snap: Snapshot) -> discovery_pb2.DiscoveryResponse | None:
            response = respond(stream, type_url, snap)
            if response is not None and type_url == ENDPOINT:
                models: list[str] | None = None
                if len(response.resources) <= _DECODE_AT_MOST:
                    names: list[str] = []
                    for packed in response.resources:
                        cla = endpoint_pb2.ClusterLoadAssignment()
                        packed.Unpack(cla)
                        names.append(cla.cluster_name)
                    models = sorted(set(names) & timeline.models)
                timeline.write(
                    ev="push",
                    t=timeline._clock(),
                    nonce=response.nonce,
                    models=models,
                    resources=len(response.resources),
                )
            return response

        def _on_request(
            stream: ads.AdsStream, req: discovery_pb2.DiscoveryRequest, snapshot: Snapshot | None
        ) -> list[discovery_pb2.DiscoveryResponse]:
            if req.type_url == ENDPOINT and req.response_nonce:
                timeline.write(
                    ev="ack", t=timeline._clock(), nonce=req.response_nonce, nack=req.HasField("error_detail")
                )
            return on_request(stream, req, snapshot)

        # Wrapped as above; [assignment] too: mypy gives a method of a class from another module `self` twice
        # when it is assigned to (`def (self, self: AdsStream, ...)`), so no function could match it.
        ads.AdsStream._respond = _respond  # type: ignore[method-assign,assignment]
        ads.AdsStream.on_request = _on_request  # type: ignore[method-assign,assignment]


async def _serve(argv: list[str], timeline_path: str, watch: set[str]) -> int:
    cluster_file = cluster_file_arg(argv)
    settings = parse_args(argv, load_cluster(cluster_file).settings if cluster_file else None)
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = asyncio.Event()
    if settings.credentials_dir is None:
        raise SystemExit("bench.reaction.plane needs --credentials-dir (the control plane's keys)")
    server = XdsServer(
        settings, signer=CredentialDir(settings.credentials_dir).signer(), on_fatal=lambda why: stop.set()
    )
    timeline = Timeline(timeline_path, watch)
    timeline.attach(server)
    watcher = None
    try:
        await server.start()
        watcher = asyncio.create_task(timeline.watch_loop(), name="reaction-plane-stall-watch")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(
            json.dumps(
                {
                    "event": "listening",
                    "admin_port": server.admin_port,
                    "xds_port": server.xds_port,
                    "listener_port": settings.listener_port,
                    "policy": server.policy_name,
                }
            ),
            flush=True,
        )
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await server.stop()
        timeline.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reaction.plane", add_help=False)
    parser.add_argument("--timeline", required=True)
    parser.add_argument("--watch", default="", help="comma-separated instance ids")
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return asyncio.run(_serve(rest, ours.timeline, {w for w in ours.watch.split(",") if w}))


if __name__ == "__main__":
    raise SystemExit(main())
