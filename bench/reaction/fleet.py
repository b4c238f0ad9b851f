"""bench.reaction's background fleet: many registered endpoints that report like real ones, in a process of
their own (so their posts load the control plane, not the bench's event loop).

    python -m bench.reaction.fleet --cluster-file CLUSTER.yaml --control-url http://127.0.0.1:PORT \
        --credentials-dir DIR [--prefix fleet-] [--interval-s 0.5] [--mode lean|fakes] [--no-heartbeats]

For every model of the cluster file whose id starts with `--prefix`: `desired_replicas` instances
`<model>-<n>`, each posting its TelemetryRecord to /v1/telemetry, and one node host `<model>-node`
posting a NodeHeartbeat listing them (full specs in every beat: more than node_host, which names a
spec by digest once the control plane has it); each with the credential the
control plane would give it (signed with the key in --credentials-dir). Like the real ones (sidecar/
reporter.py, node_host), each waits `--interval-s` after a post before the next, on a connection of its
own, so a slow control plane gets fewer posts rather than a growing backlog. Their first posts are
spread over one interval, as independent processes' would be.

Two ways to send the same posts:

- `lean` (default): a minimal HTTP/1.1 client on a keep-alive connection per instance, records encoded
  with json.dumps, about 0.1 core for 1000 instances. The instances have no server behind their address
  (nothing routes traffic to the fleet's models; Envoy only needs the address in EDS).
- `fakes`: sie_testing.control_plane_harness.FakeSidecar (an aiohttp server each) and FakeNodeHost. On this 2-core
  machine their aiohttp client costs about as much CPU as the control plane itself and competes with it
  for the same cores, which a real fleet (its own machines) would not.

Prints {"event": "ready", ...} on stdout once every instance has posted once; runs until SIGTERM, then
prints {"event": "stopped", "posts_ok", "posts_failed", "post_ms_p50", "post_ms_p99"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import urllib.parse
from typing import Any

from bench.stats import percentile
from sie.auth import CredentialDir, Identity, Signer
from sie.cluster import load_cluster
from sie.spec import ModelService
from sie.telemetry import InstanceState, TelemetryRecord
from sie.wire import InstanceReport, NodeHeartbeat

log = logging.getLogger("bench.reaction.fleet")

FIRST_FAKE_PORT = 20000  # lean instances' EDS addresses: 127.0.0.1:<port>, never dialled


class _Conn:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, host: str, port: int):
        self._host, self._port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, token: str) -> int:
        if self._reader is None or self._writer is None:  # both are set and cleared together
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._reader, self._writer
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            writer.write(head + body)
            header = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in header.split(b"\r\n")[1:]:
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            return int(header[9:12])
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.close()
            raise

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class LeanFleet:
    def __init__(
        self, services: list[ModelService], control_url: str, interval_s: float, signer: Signer, heartbeats: bool = True
    ):
        self._signer = signer
        url = urllib.parse.urlsplit(control_url)
        if url.hostname is None or url.port is None:
            raise ValueError(f"the control plane's URL needs a host and a port (http://HOST:PORT), got {control_url!r}")
        self._host, self._port = url.hostname, url.port
        self._interval = interval_s
        self._heartbeats = heartbeats
        self._services = services
        self.posts_ok = 0
        self.posts_failed = 0
        self.post_s: list[float] = []
        self.first_posts: set[str] = set()
        self.senders = 0

    async def _send(self, conn: _Conn, path: str, body: bytes, token: str) -> bool:
        started = time.monotonic()
        try:
            ok = await conn.post(path, body, token) == 200
        except (OSError, asyncio.IncompleteReadError, ValueError):
            ok = False
        if len(self.post_s) < 200_000:
            self.post_s.append(time.monotonic() - started)
        self.posts_ok += ok
        self.posts_failed += not ok
        return ok

    async def _sidecar(self, record: dict[str, Any], phase: float) -> None:
        conn = _Conn(self._host, self._port)
        token = self._signer.issue(Identity.for_sidecar(record["instance_id"], record["model_id"], record["node"]))
        await asyncio.sleep(phase)
        seq = 0
        try:
            while True:
                seq += 1
                body = json.dumps({**record, "seq": seq, "timestamp": time.time()}).encode()
                if await self._send(conn, "/v1/telemetry", body, token):
                    self.first_posts.add(record["instance_id"])
                await asyncio.sleep(self._interval)
        finally:
            conn.close()

    async def _node(self, node: str, body: bytes, phase: float) -> None:
        conn = _Conn(self._host, self._port)
        token = self._signer.issue(Identity.for_node(node))
        await asyncio.sleep(phase)
        try:
            while True:
                await self._send(conn, "/v1/nodes/heartbeat", body, token)
                await asyncio.sleep(self._interval)
        finally:
            conn.close()

    def start(self) -> list[asyncio.Task]:
        tasks: list[asyncio.Task[None]] = []
        port = FIRST_FAKE_PORT
        total = sum(s.spec.desired_replicas + 1 for s in self._services)
        for service in self._services:
            node, reports = f"{service.model_id}-node", []
            for n in range(service.spec.desired_replicas):
                iid, address = f"{service.model_id}-{n}", f"127.0.0.1:{port}"
                port += 1
                record = TelemetryRecord(
                    iid,
                    service.model_id,
                    service.spec.model.version,
                    address,
                    node,
                    InstanceState.READY,
                    priority=service.spec.model.priority_level.value,
                    max_concurrent=service.spec.resources.max_concurrent_requests,
                    reporter=f"fleet-{iid}",
                ).to_json()
                tasks.append(
                    asyncio.create_task(self._sidecar(record, self._interval * len(tasks) / total), name=f"fleet-{iid}")
                )
                reports.append(
                    InstanceReport(
                        iid,
                        service.model_id,
                        service.spec.model.version,
                        InstanceState.READY,
                        service.to_dict(),
                        sidecar_address=address,
                    )
                )
            if not self._heartbeats:
                continue
            heartbeat = NodeHeartbeat(node=node, address="http://127.0.0.1:1", instances=reports).to_json()
            tasks.append(
                asyncio.create_task(
                    self._node(node, json.dumps(heartbeat).encode(), self._interval * len(tasks) / total),
                    name=f"fleet-{node}",
                )
            )
        self.senders = total - len(self._services)
        return tasks

    @property
    def ready(self) -> bool:
        return len(self.first_posts) >= self.senders

    def stats(self) -> dict[str, Any]:
        ms = [s * 1000 for s in self.post_s]
        return {
            "posts_ok": self.posts_ok,
            "posts_failed": self.posts_failed,
            "post_ms_p50": round(percentile(ms, 50), 2) if ms else None,
            "post_ms_p99": round(percentile(ms, 99), 2) if ms else None,
        }


async def _run_fakes(
    services: list[ModelService], control_url: str, interval_s: float, stop: asyncio.Event, signer: Signer
) -> dict:
    import aiohttp  # noqa: PLC0415 - only this mode needs it

    from sie_testing.control_plane_harness import FakeNodeHost, FakeSidecar  # noqa: PLC0415

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
    fakes: list[Any] = []
    total = sum(s.spec.desired_replicas for s in services)
    try:
        for service in services:
            reports = []
            for n in range(service.spec.desired_replicas):
                sidecar = FakeSidecar(
                    f"{service.model_id}-{n}",
                    service.model_id,
                    control_url,
                    session,
                    node=f"{service.model_id}-node",
                    interval_s=interval_s,
                    signer=signer,
                )
                fakes.append(await sidecar.start())
                reports.append(
                    InstanceReport(
                        sidecar.instance_id,
                        service.model_id,
                        service.spec.model.version,
                        InstanceState.READY,
                        service.to_dict(),
                        sidecar_address=sidecar.address,
                    )
                )
                await asyncio.sleep(interval_s / max(1, total))
            fakes.append(
                FakeNodeHost(
                    f"{service.model_id}-node", control_url, session, reports, interval_s=interval_s, signer=signer
                ).start()
            )
        sidecars = [f for f in fakes if isinstance(f, FakeSidecar)]
        while not stop.is_set() and any(s.posts_ok == 0 for s in sidecars):
            await asyncio.sleep(0.1)
        print(json.dumps({"event": "ready", "instances": len(sidecars), "mode": "fakes"}), flush=True)
        await stop.wait()
        return {"posts_ok": sum(s.posts_ok for s in sidecars)}
    finally:
        # FakeSidecar waits with asyncio.wait_for, which on Python 3.11 can swallow a cancel: bound the wait.
        stops = [asyncio.create_task(f.stop()) for f in fakes]
        if stops:
            await asyncio.wait(stops, timeout=5.0)
        await session.close()


async def run(
    cluster_file: str,
    control_url: str,
    prefix: str,
    interval_s: float,
    mode: str,
    signer: Signer,
    heartbeats: bool = True,
) -> int:
    services = [s for s in load_cluster(cluster_file).services if s.model_id.startswith(prefix)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if mode == "fakes":
        stats = await _run_fakes(services, control_url, interval_s, stop, signer)
    else:
        fleet = LeanFleet(services, control_url, interval_s, signer, heartbeats)
        tasks = fleet.start()
        try:
            while not stop.is_set() and not fleet.ready:
                await asyncio.sleep(0.1)
            print(json.dumps({"event": "ready", "instances": fleet.senders, "mode": "lean"}), flush=True)
            await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        stats = fleet.stats()
    print(json.dumps({"event": "stopped", **stats}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reaction.fleet")
    p.add_argument("--cluster-file", required=True)
    p.add_argument("--control-url", required=True)
    p.add_argument("--credentials-dir", required=True, help="the control plane's credentials (its signing key)")
    p.add_argument("--prefix", default="fleet-")
    p.add_argument("--interval-s", type=float, default=0.5, help="telemetry and heartbeat period")
    p.add_argument("--mode", choices=("lean", "fakes"), default="lean")
    p.add_argument(
        "--no-heartbeats", action="store_true", help="lean mode: no node-host heartbeats (to see their cost)"
    )
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level="WARNING", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signer = CredentialDir(args.credentials_dir).signer()
    return asyncio.run(
        run(
            args.cluster_file,
            args.control_url.rstrip("/"),
            args.prefix,
            args.interval_s,
            args.mode,
            signer,
            not args.no_heartbeats,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
