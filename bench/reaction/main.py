"""Control-loop reaction time: from an instance's drain or slowdown to Envoy holding its new health or weight.

    python -m bench.reaction [--quick] [--trials N] [--out bench/results/reaction.json]

One setup per scale (10, then 1000 registered endpoints), each with real processes on loopback:

    xds_server (bench.reaction.plane: the real XdsServer plus a timeline of the watched instances)
    Envoy 1.40, bootstrapped to it over ADS
    8 real instances of model `sim`: a sim worker and a real sidecar each, under an open-loop load
      through Envoy (the sidecars post telemetry every 0.5 s and at once on a state change)
    `probe` fake sidecars in this process (sie_testing.control_plane_harness.FakeSidecar)
    at 1000: 123 models x 8 fake sidecars and 123 fake node hosts in another process
      (bench.reaction.fleet), posting telemetry and heartbeats every 0.5 s as real ones do

Events, each repeated over the instances in turn:

    drain-post     a probe's telemetry turns `draining` (it posts at once)   -> Envoy shows it DRAINING
    drain-sidecar  POST /-/drain to a real sidecar                           -> Envoy shows it DRAINING
    slowdown       POST /sim/config {"slowdown": F} to a real sim worker     -> Envoy shows its weight lower
                   (includes the sidecar noticing: slow answers must complete and move its latency window)

The time runs from just before the trigger is sent to the arrival of the first admin answer that shows
the change (trials.py explains what is polled and why). The control plane's timeline splits it:
sidecar and intake, debounce and queue, rebuild, push, Envoy's ACK. Results: bench/results/reaction.json
and a table on stdout (and reaction.md beside the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.reaction.plane_profile import PlaneProfile
from bench.reaction.procs import (
    PROBE_MODEL,
    SIM_MODEL,
    CpuMeter,
    Fleet,
    Plane,
    Scale,
    SimPair,
    stop_process,
    write_cluster,
)
from bench.reaction.report import plot, render, summarize
from bench.reaction.trials import OpenLoop, Trials
from sie.auth import Identity
from sie.telemetry import InstanceState
from sie.wire import InstanceReport
from sie_testing.control_plane_harness import FakeNodeHost, FakeSidecar
from sie_testing.credentials import Credentials
from sie_testing.ports import free_port
from xds_server.bootstrap import envoy_bootstrap
from xds_server.envoy_process import EnvoyProcess, admin_socket_in

NODE = "bench-node"


@dataclass(frozen=True)
class Options:
    scales: tuple[Scale, ...]
    trials: int
    load_rps: float = 80.0  # at model `sim`, all 8 instances together
    max_tokens: int = 16  # ~80 ms per request at normal speed (the sim's default timing)
    slowdown: float = 3.0
    debounce_ms: float = 50.0  # xds_server's default
    policy: str = "sie"
    telemetry_interval_s: float = 0.5
    timeout_s: float = 15.0  # a trial that sees nothing by then is recorded as missed
    fleet_mode: str = "lean"  # bench.reaction.fleet --mode
    heartbeats: bool = True  # the fleet's node hosts heartbeat (as node_host does); off: its endpoints never enter EDS
    profile_s: float = 0.0  # py-spy the control plane for this long from the first trial (0: off)
    keep_dir: str | None = None  # keep each scale's logs and timeline under this directory


SCALES = (
    Scale(real=8, probes=2, fleet_models=0, fleet_per_model=0),
    Scale(real=8, probes=8, fleet_models=123, fleet_per_model=8),
)


class Setup:
    """Everything of one scale, started in order and stopped in reverse, each process by its pid."""

    def __init__(self, opts: Options, scale: Scale, workdir: Path):
        self.opts, self.scale, self.workdir = opts, scale, workdir
        self.plane: Plane | None = None
        self.envoy: EnvoyProcess | None = None
        self.fleet: Fleet | None = None
        self.pairs: list[SimPair] = []
        self.probes: list[FakeSidecar] = []
        self.node: FakeNodeHost | None = None
        self.fleet_stats: dict = {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self.listener_port = free_port()
        self.creds = Credentials.create(workdir)

    async def start(self) -> None:
        s, w = self.scale, self.workdir
        cluster_file = w / "cluster.yaml"
        spec_file = w / "sim.json"
        spec_file.write_text(json.dumps(write_cluster(cluster_file, s)))
        real = [f"{SIM_MODEL}-{i}" for i in range(s.real)]
        probes = [f"{PROBE_MODEL}-{i}" for i in range(s.probes)]
        self.plane = await asyncio.to_thread(
            Plane.start,
            w,
            cluster_file,
            real + probes,
            self.opts.debounce_ms,
            self.opts.policy,
            self.listener_port,
            self.creds,
        )
        admin = self.plane.admin_url
        self.envoy = EnvoyProcess(
            envoy_bootstrap(
                "sie-reaction",
                "sie-reaction",
                "127.0.0.1",
                self.plane.xds_port,
                admin_socket_in(w / "envoy"),
                token=self.creds.envoy_token,
            ),
            w / "envoy",
            concurrency=2,
        )
        self.envoy.start()
        await self.envoy.wait_ready(60)
        if s.fleet_models:
            self.fleet = await asyncio.to_thread(
                Fleet.start,
                w,
                cluster_file,
                admin,
                self.opts.telemetry_interval_s,
                self.opts.fleet_mode,
                self.creds,
                self.opts.heartbeats,
            )
        for iid in real:
            self.pairs.append(
                await asyncio.to_thread(SimPair.start, w, spec_file, iid, admin, NODE, SIM_MODEL, self.creds)
            )
        for iid in probes:
            self.probes.append(
                await FakeSidecar(
                    iid,
                    PROBE_MODEL,
                    admin,
                    self.session,
                    node=NODE,
                    interval_s=self.opts.telemetry_interval_s,
                    signer=self.creds.signer,
                ).start()
            )
        spec = json.loads(spec_file.read_text())
        reports = [
            InstanceReport(p.instance_id, SIM_MODEL, "1.0.0", InstanceState.READY, spec, p.address, p.control_address)
            for p in self.pairs
        ]
        reports += [
            InstanceReport(p.instance_id, PROBE_MODEL, "1.0.0", InstanceState.READY, spec, p.address)
            for p in self.probes
        ]
        # The node host's heartbeats are where EDS takes every address from (DESIGN §10).
        self.node = FakeNodeHost(
            NODE, admin, self.session, reports, interval_s=self.opts.telemetry_interval_s, signer=self.creds.signer
        ).start()
        await self._wait_all_endpoints()

    async def _wait_all_endpoints(self, timeout_s: float = 120.0) -> None:
        assert self.envoy is not None  # start() runs this once Envoy is ready
        deadline = time.monotonic() + timeout_s
        while True:
            doc = await self.envoy.admin_json("/clusters?format=json")
            count = sum(
                1
                for c in doc.get("cluster_statuses", [])
                if c["name"].startswith("model.")
                for h in c.get("host_statuses", [])
                if h["health_status"].get("eds_health_status") == "HEALTHY"
            )
            if count == self.scale.endpoints:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Envoy holds {count} healthy endpoints, expected {self.scale.endpoints}")
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        for fake in (self.node, *self.probes):
            if fake is not None:
                await asyncio.wait_for(fake.stop(), 5)
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in self.pairs))
        if self.fleet is not None:
            self.fleet_stats = await asyncio.to_thread(self.fleet.stop)
        if self.envoy is not None:
            await self.envoy.stop_async()
        if self.plane is not None:
            await asyncio.to_thread(stop_process, self.plane.proc)
        await self.session.close()


async def _telemetry_records(session: aiohttp.ClientSession, admin_url: str, headers: dict[str, str]) -> float:
    async with session.get(admin_url + "/metrics", headers=headers) as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sie_telemetry_records_total")
    )


async def _control_plane_status(session: aiohttp.ClientSession, admin_url: str, headers: dict[str, str]) -> dict:
    async with session.get(admin_url + "/v1/status", headers=headers) as resp:
        cp = (await resp.json())["control_plane"]
    return {"nacks": cp["nacks"], "last_nack": cp["last_nack"]}


async def run_scale(opts: Options, scale: Scale, workdir: Path) -> dict:
    setup = Setup(opts, scale, workdir)
    load_task = None
    try:
        await setup.start()
        plane, envoy = setup.plane, setup.envoy
        assert plane is not None and envoy is not None  # start() returned, so both run
        trials = Trials(
            setup.session,
            envoy.admin_socket,
            plane,
            setup.pairs,
            setup.probes,
            opts.slowdown,
            opts.timeout_s,
            setup.creds.headers(Identity.for_node(NODE)),
        )
        load = OpenLoop(
            setup.session,
            f"http://127.0.0.1:{setup.listener_port}/v1/completions",
            opts.load_rps,
            {"model": SIM_MODEL, "prompt": "the reaction bench asks a question", "max_tokens": opts.max_tokens},
        )
        load_task = asyncio.create_task(load.run(), name="reaction-load")
        await trials.warm_up()
        envoy_pid = envoy.pid
        assert envoy_pid is not None  # setup.start() started it
        groups: dict[str, list[int]] = {
            "xds_server": [plane.proc.pid],
            "envoy": [envoy_pid],
            "sidecars": [p.sidecar_pid for p in setup.pairs],
            "sim_workers": [p.worker.pid for p in setup.pairs],
            "bench": [os.getpid()],
        }
        if setup.fleet is not None:
            groups["fleet"] = [setup.fleet.proc.pid]
        cpu = CpuMeter(groups).start()
        records0, t_start = (
            await _telemetry_records(setup.session, plane.admin_url, setup.creds.headers()),
            time.monotonic(),
        )
        profile = (
            PlaneProfile.start(plane.proc.pid, opts.profile_s, workdir / "plane.pyspy") if opts.profile_s else None
        )
        results: list[dict] = []
        for name, trial in (
            ("drain-post", trials.drain_post),
            ("drain-sidecar", trials.drain_sidecar),
            ("slowdown", trials.slowdown),
        ):
            for i in range(opts.trials):
                result = await trial(i)
                results.append(result)
                print(
                    f"  {scale.endpoints:5d} endpoints  {name:14s} #{i:<3d} {result['instance']:9s} "
                    f"{result['reaction_ms']} ms",
                    file=sys.stderr,
                    flush=True,
                )
            await trials.finish()
        records1, t_end = (
            await _telemetry_records(setup.session, plane.admin_url, setup.creds.headers()),
            time.monotonic(),
        )
        events = [e for e in plane.events() if e["ev"] in ("stall", "gc") and t_start <= e["t"] <= t_end]
        usage = cpu.read()
        statuses: dict[str, int] = {}
        for status, _ in load.results:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        out = {
            "endpoints": scale.endpoints,
            "scale": asdict(scale),
            "trials": results,
            "cpu_cores": usage,
            "telemetry_records_per_s": round((records1 - records0) / (t_end - t_start), 1),
            "control_plane": await _control_plane_status(setup.session, plane.admin_url, setup.creds.headers()),
            "control_plane_profile": await asyncio.to_thread(profile.finish) if profile else None,
            "control_plane_pauses": {
                kind: {"count": len(ms), **summarize(ms)}
                for kind in ("stall", "gc")
                for ms in [[e["ms"] for e in events if e["ev"] == kind]]
            },
            "load": {
                "rate_rps": opts.load_rps,
                "requests": len(load.results),
                "statuses": statuses,
                "failures": load.failures,
            },
            "admin_poll_round_trip_ms": summarize(
                [x * 1000 for x in trials.sim.round_trips + trials.probe.round_trips]
            ),
        }
    finally:
        if load_task is not None:
            load_task.cancel()
            await asyncio.gather(load_task, return_exceptions=True)
        await setup.stop()
    out["fleet"] = setup.fleet_stats
    return out


def _machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": len(os.sched_getaffinity(0))}


async def main_async(opts: Options, out: Path) -> dict:
    scales = []
    for scale in opts.scales:
        if opts.keep_dir is not None:
            workdir = Path(opts.keep_dir) / str(scale.endpoints)
            workdir.mkdir(parents=True, exist_ok=True)
            print(f"scale {scale.endpoints} endpoints (work dir {workdir}, kept)", file=sys.stderr, flush=True)
            scales.append(await run_scale(opts, scale, workdir))
            continue
        with tempfile.TemporaryDirectory(prefix=f"bench-reaction-{scale.endpoints}-") as tmp:
            print(f"scale {scale.endpoints} endpoints (work dir {tmp})", file=sys.stderr, flush=True)
            scales.append(await run_scale(opts, scale, Path(tmp)))
    doc = {
        "benchmark": "reaction",
        "setup": asdict(opts),
        "machine": _machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "scales": scales,
    }
    table = render(doc)
    doc["judged"] = table.judged
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(table.text + "\n")
    plot(doc, out.with_suffix(".png"))
    print(table.text)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reaction", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="5 trials per event and scale instead of 20")
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--slowdown", type=float, default=3.0)
    p.add_argument("--only", choices=("10", "1000"), default=None, help="run one scale")
    p.add_argument(
        "--fleet",
        choices=("lean", "fakes"),
        default="lean",
        help="how the 1000-endpoint fleet posts "
        "(bench.reaction.fleet); fakes = FakeSidecar/FakeNodeHost, which compete for this machine's CPU",
    )
    p.add_argument(
        "--no-heartbeats",
        action="store_true",
        help="no node host heartbeats (shows what heartbeat intake costs the control plane)",
    )
    p.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="py-spy the control plane for this long from the first trial of each scale (needs py-spy)",
    )
    p.add_argument("--keep", default=None, metavar="DIR", help="keep logs and the control plane's timeline in DIR")
    p.add_argument("--out", type=Path, default=Path("bench/results/reaction.json"))
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    trials = args.trials or (5 if args.quick else 20)
    scales = tuple(s for s in SCALES if args.only is None or s.endpoints == int(args.only))
    asyncio.run(
        main_async(
            Options(
                scales=scales,
                trials=trials,
                slowdown=args.slowdown,
                fleet_mode=args.fleet,
                heartbeats=not args.no_heartbeats,
                profile_s=args.profile,
                keep_dir=args.keep,
            ),
            args.out,
        )
    )
    return 0
