"""The baseline of bench.kafka: a plain Kafka pipeline without SIE's connector, as a data team would
write one. It consumes the request topic, calls the scorer through Envoy's ingress over HTTP (one
request per message, up to `--concurrency` at once), produces each answer to the result topic, and
commits each partition's offsets once the results before them are acknowledged (at-least-once, like
SIE's connector, so the comparison is like for like).

    python -m bench.kafka_baseline --bootstrap HOST:PORT --url http://127.0.0.1:ENVOY/infer \
        --topic requests-b --output-topic results-b --group baseline [--concurrency 32]

The request's headers travel with the result (bench.kafka reads its send time from one). Prints
{"ready": true} on stdout once it has joined the group; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

import aiohttp
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition


class Offsets:
    """Per partition: the offsets taken, those whose results are acknowledged, and the commit point
    (the offset after the longest acknowledged prefix)."""

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, list[int]] = {}
        self.acked: dict[TopicPartition, set[int]] = {}
        self.point: dict[TopicPartition, int] = {}

    def take(self, tp: TopicPartition, offset: int) -> None:
        self.pending.setdefault(tp, []).append(offset)

    def ack(self, tp: TopicPartition, offset: int) -> None:
        self.acked.setdefault(tp, set()).add(offset)

    def commit_points(self) -> dict[TopicPartition, int]:
        out = {}
        for tp, pending in self.pending.items():
            acked = self.acked.get(tp, set())
            done = 0
            while done < len(pending) and pending[done] in acked:
                acked.discard(pending[done])
                done += 1
            if done:
                out[tp] = pending[done - 1] + 1
                del pending[:done]
        return out


async def run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    consumer = AIOKafkaConsumer(
        args.topic,
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=10,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks="all", linger_ms=0)
    await producer.start()
    await consumer.start()
    offsets = Offsets()
    slots = asyncio.Semaphore(args.concurrency)
    headers = {"Content-Type": "application/json"}
    print(json.dumps({"ready": True}), flush=True)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency)) as session:

        async def one(record) -> None:
            try:
                for _attempt in range(10):
                    async with session.post(args.url, data=record.value, headers=headers) as resp:
                        body = await resp.read()
                    if resp.status == 200:
                        break
                    await asyncio.sleep(0.05)
                delivery = await producer.send(args.output_topic, body, key=record.key, headers=list(record.headers))
                await delivery
                offsets.ack(TopicPartition(record.topic, record.partition), record.offset)
            finally:
                slots.release()

        async def committer() -> None:
            while True:
                await asyncio.sleep(0.05)
                points = offsets.commit_points()
                if points:
                    await consumer.commit(points)

        commits = asyncio.create_task(committer())
        tasks: set[asyncio.Task] = set()
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100, max_records=args.concurrency)
            for tp, records in batches.items():
                for record in records:
                    await slots.acquire()
                    offsets.take(tp, record.offset)
                    task = asyncio.create_task(one(record))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        commits.cancel()
        await asyncio.gather(*tasks, commits, return_exceptions=True)
    await consumer.stop()
    await producer.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kafka_baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument(
        "--url", required=True, help="the scorer through Envoy's ingress, e.g. http://127.0.0.1:P/infer"
    )
    parser.add_argument("--topic", required=True)
    parser.add_argument("--output-topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
