"""Two instances of a model consuming one topic as real processes (`python -m sidecar.kafka`,
the connector the sidecar composes), against a real Kafka-protocol broker: exactly-once results when
nothing fails, at-least-once with only uncommitted repeats after a SIGKILL, and a loss-free,
repeat-free hand-over when an instance drains (SIGTERM).

Every process started here is stopped by its pid in teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.kafka.records import HEADER_INSTANCE, header, source_of
from sie_testing.credentials import Credentials
from sie_testing.tansu import FAST_GROUP, FakeWorker, TansuBroker, produce, read_topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PARTITIONS = 4
REPO = Path(__file__).resolve().parents[2]


def write_spec(path: Path, bootstrap: str, group: str, max_in_flight: int) -> Path:
    path.write_text(
        json.dumps(
            {
                "spec": {
                    "model": {"name": "scorer", "service_type": "scoring", "priority_level": "P2"},
                    "backend": {"type": "sklearn"},
                    "resources": {"max_concurrent_requests": 8},
                    "input_schema": {"fields": [{"name": "text", "type": "string"}]},
                    "kafka_input": {
                        "bootstrap_servers": bootstrap,
                        "topic": "requests",
                        "group_id": group,
                        "output_topic": "results",
                        "dead_letter_topic": "dead",
                        "max_in_flight": max_in_flight,
                    },
                }
            }
        )
    )
    return path


class ConnectorProcess:
    def __init__(self, spec_file: Path, worker_url: str, instance_id: str, log_dir: Path, *extra: str):
        self.instance_id = instance_id
        self.log_path = log_dir / f"connector-{instance_id}.log"
        self._log = open(self.log_path, "wb")
        creds = Credentials.create(log_dir)
        _, key_file = creds.worker_key(log_dir / f"secrets-{instance_id}")
        self.headers = creds.headers()  # its control endpoints answer an admin token the control plane signed
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sidecar.kafka",
                "--spec-file",
                str(spec_file),
                "--worker-url",
                worker_url,
                "--worker-key-file",
                str(key_file),
                "--trust-file",
                str(creds.trust_file),
                "--instance-id",
                instance_id,
                "--session-timeout-ms",
                str(FAST_GROUP["session_timeout_ms"]),
                "--heartbeat-interval-ms",
                str(FAST_GROUP["heartbeat_interval_ms"]),
                "--drain-timeout-s",
                "10",
                *extra,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.control = ""

    async def ready(self, timeout_s: float = 20.0) -> None:
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), timeout_s)
        if not line:
            raise RuntimeError(f"{self.instance_id} exited early; log:\n{self.log_path.read_text()[-3000:]}")
        self.control = json.loads(line)["control"]

    async def status(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"http://{self.control}/-/kafka", headers=self.headers) as resp:
            return await resp.json()

    async def metric(self, session: aiohttp.ClientSession, name: str) -> float:
        async with session.get(f"http://{self.control}/-/metrics", headers=self.headers) as resp:
            text = await resp.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process.stdout.close()
        self._log.close()


@pytest.fixture
async def world(tmp_path):
    """A broker, a worker (a little slow, so streams last long enough to interrupt) and a way to start
    connector processes; all of them stopped at the end."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    processes: list[ConnectorProcess] = []
    async with (
        TansuBroker.started(tmp_path) as broker,
        FakeWorker(delay_s=0.01) as worker,
        aiohttp.ClientSession() as http,
    ):
        await broker.create_topic("requests", PARTITIONS)
        spec_file = write_spec(tmp_path / "scorer.json", broker.bootstrap, group, max_in_flight=4)

        async def start(instance_id: str, *extra: str) -> ConnectorProcess:
            proc = ConnectorProcess(spec_file, worker.url, instance_id, tmp_path, *extra)
            processes.append(proc)
            await proc.ready()
            return proc

        try:
            yield {"broker": broker, "worker": worker, "group": group, "start": start, "http": http}
        finally:
            for proc in processes:
                proc.stop()


async def wait_until(condition, timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


def messages(n: int, tag: str = "") -> list[bytes]:
    return [json.dumps({"text": f"{tag}{i}"}).encode() for i in range(n)]


async def committed_total(world: dict, n: int) -> bool:
    offsets = await world["broker"].committed(world["group"], "requests", PARTITIONS)
    return sum(max(0, offset) for offset in offsets.values()) >= n


def by_source(results: list[Any]) -> dict[tuple[int, int], list[str]]:
    """(partition, offset) -> the instances that wrote a result for it, in output order."""
    seen: dict[tuple[int, int], list[str]] = defaultdict(list)
    for record in results:
        source = source_of(record.headers)
        seen[(source.partition, source.offset)].append(header(record.headers, HEADER_INSTANCE))
    return seen


async def test_two_instances_answer_each_of_1000_requests_exactly_once(world):
    a, b = await world["start"]("a"), await world["start"]("b")
    await wait_until(lambda: _both_assigned(world["http"], a, b))
    sent = await produce(world["broker"].bootstrap, messages(1000))
    await wait_until(lambda: committed_total(world, 1000))
    results = await read_topic(world["broker"].bootstrap, "results", 1000)

    seen = by_source(results)
    assert set(seen) == set(sent), "a result for every request"
    assert all(len(writers) == 1 for writers in seen.values()), "no request answered twice"
    assert {w for writers in seen.values() for w in writers} == {"a", "b"}, "both instances took partitions"
    committed = await world["broker"].committed(world["group"], "requests", PARTITIONS)
    ends = {p: 1 + max(o for (q, o) in sent if q == p) for p in range(PARTITIONS)}
    assert committed == ends
    http = world["http"]
    assert (
        await a.metric(http, "inference_kafka_committed_total")
        + await b.metric(http, "inference_kafka_committed_total")
        == 1000
    )
    assert len(world["worker"].calls) == 1000


async def test_a_sigkilled_instance_loses_nothing_and_only_its_uncommitted_results_repeat(world):
    # a commits at most every 300 ms, so when it dies it has written results it has not committed yet.
    a, b = await world["start"]("a", "--commit-interval-s", "0.3"), await world["start"]("b")
    http = world["http"]
    await wait_until(lambda: _both_assigned(http, a, b))
    sent = await produce(world["broker"].bootstrap, messages(1000))
    await wait_until(lambda: committed_total(world, 250))
    committed_before_kill = await world["broker"].committed(world["group"], "requests", PARTITIONS)
    a_partitions = {int(name.rsplit("/", 1)[1]) for name in (await a.status(http))["partitions"]}
    os.kill(a.process.pid, signal.SIGKILL)
    a.process.wait(timeout=10)
    assert a_partitions, "a owned partitions when it was killed"
    assert sum(committed_before_kill.values()) < 1000, "the kill came mid-stream"

    await wait_until(lambda: committed_total(world, 1000))
    results = await read_topic(world["broker"].bootstrap, "results", 1000)
    seen = by_source(results)
    assert set(seen) == set(sent), "no request lost"
    repeats = {src: writers for src, writers in seen.items() if len(writers) > 1}
    for (partition, offset), writers in repeats.items():
        assert partition in a_partitions, f"{partition}/{offset} repeated, but a never owned that partition"
        assert sorted(writers) == ["a", "b"], (
            f"{partition}/{offset}: a repeat is one answer by a and one by b, got {writers}"
        )
        assert offset >= committed_before_kill[partition], (
            f"{partition}/{offset} was committed (at {committed_before_kill[partition]}) before the kill, yet repeated"
        )
    assert all(len(writers) <= 2 for writers in seen.values())
    print(f"repeats after SIGKILL: {len(repeats)} of {len(sent)}")


async def test_a_draining_instance_hands_over_without_loss_or_repeats(world):
    a, b = await world["start"]("a"), await world["start"]("b")
    http = world["http"]
    await wait_until(lambda: _both_assigned(http, a, b))
    sent = await produce(world["broker"].bootstrap, messages(600))
    await wait_until(lambda: committed_total(world, 150))
    a.process.send_signal(signal.SIGTERM)  # what a sidecar does on eviction, rollout or shutdown
    assert await asyncio.to_thread(a.process.wait, 20) == 0
    sent_after = await produce(world["broker"].bootstrap, messages(200, tag="after-"))

    await wait_until(lambda: committed_total(world, 800))
    results = await read_topic(world["broker"].bootstrap, "results", 800)
    seen = by_source(results)
    assert set(seen) == set(sent) | set(sent_after), "no request lost"
    assert all(len(writers) == 1 for writers in seen.values()), "no request answered twice"
    assert {writers[0] for src, writers in seen.items() if src in sent_after} == {"b"}
    assert len((await b.status(http))["partitions"]) == PARTITIONS, "b owns every partition after the hand-over"


async def _both_assigned(http: aiohttp.ClientSession, a: ConnectorProcess, b: ConnectorProcess) -> bool:
    parts_a = (await a.status(http))["partitions"]
    parts_b = (await b.status(http))["partitions"]
    return bool(parts_a) and bool(parts_b) and len(parts_a) + len(parts_b) == PARTITIONS
