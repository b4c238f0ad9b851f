"""bench.kafka's pass-through relay (bench/kafka_relay.py), on a real broker: every request reaches the
result topic unchanged, with its key and its headers (the bench's send time and id travel in them), on
the partition it came from, and SIGTERM stops the relay."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest
from aiokafka import AIOKafkaProducer

from sie_testing.tansu import TansuBroker, read_topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


async def test_the_relay_passes_each_record_on_unchanged_to_its_partition(tmp_path):
    async with TansuBroker.started(tmp_path) as broker:
        for topic in ("requests-r", "results-r"):
            await broker.create_topic(topic, partitions=2)
        sent = {}
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(60):
                value, key = json.dumps({"i": i}).encode(), f"k{i}".encode()
                headers = [("bench-sent-us", str(1_000_000 + i).encode()), ("bench-id", f"r-{i}".encode())]
                meta = await (await producer.send("requests-r", value, key=key, headers=headers, partition=i % 2))
                sent[value] = (key, headers, meta.partition)
        finally:
            await producer.stop()
        log = tmp_path / "relay.log"
        with log.open("wb") as err:  # the child has its own copy of the file
            relay = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.kafka_relay",
                    "--bootstrap",
                    broker.bootstrap,
                    "--topic",
                    "requests-r",
                    "--output-topic",
                    "results-r",
                    "--partitions",
                    "2",
                ],
                stdout=subprocess.PIPE,
                stderr=err,
            )
        try:
            line = await asyncio.wait_for(asyncio.to_thread(relay.stdout.readline), 30)
            assert line, f"the relay exited: {log.read_text()[-2000:]}"
            assert json.loads(line) == {"ready": True}
            records = await read_topic(broker.bootstrap, "results-r", expected=len(sent))
        finally:
            relay.send_signal(signal.SIGTERM)
            try:
                code = relay.wait(timeout=20)
            finally:
                relay.kill()
                relay.wait()
                relay.stdout.close()
        assert code == 0, log.read_text()[-2000:]
        got = {r.value: (r.key, [(k, v) for k, v in r.headers], r.partition) for r in records}
        assert got == sent
