"""The pass-through relay of bench.kafka: the same two hops through the broker as SIE's pipeline, with
nothing between them but a compiled client (librdkafka, through confluent-kafka) passing each request
on unchanged. No scoring, no validation, no commits: the latency this path shows at a rate is what the
broker and two client hops take on the machine then, measured in the same run as SIE's pipeline.

It is a reference, not a strict lower bound for SIE's pipeline: it passes records on as they arrive
(linger.ms 1), in smaller batches than the connector's one per fetch, so the broker works harder for
it; bench.kafka reports each process's CPU per message beside it.

It reads every partition of `--topic` from the start (assigned, no group: nothing else reads these
topics) and writes each record, its key and its headers to the same partition of `--output-topic`. It
fetches as SIE's connector does (`--fetch-wait-ms`, the connector's broker_fetch_wait_ms).

    python -m bench.kafka_relay --bootstrap HOST:PORT --topic requests-r --output-topic results-r \
        --partitions 2 [--fetch-wait-ms 10]

Prints {"ready": true} on stdout once it has its partitions; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

import confluent_kafka


def relay(args: argparse.Namespace, stop: threading.Event) -> None:
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": "bench-relay",  # required by the client; partitions are assigned, no group joins
            "enable.auto.commit": False,
            "fetch.wait.max.ms": args.fetch_wait_ms,
        }
    )
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": args.bootstrap, "acks": "all", "linger.ms": 1, "enable.idempotence": False}
    )
    consumer.assign(
        [
            confluent_kafka.TopicPartition(args.topic, p, confluent_kafka.OFFSET_BEGINNING)
            for p in range(args.partitions)
        ]
    )
    print(json.dumps({"ready": True}), flush=True)
    try:
        while not stop.is_set():
            # consume() waits for num_messages or the timeout, whichever comes first: keep it short.
            for message in consumer.consume(num_messages=10_000, timeout=0.002):
                if message.error() is not None:
                    continue
                partition = message.partition()
                assert partition is not None  # a consumed message without an error has its partition
                while True:
                    try:
                        producer.produce(
                            args.output_topic,
                            message.value(),
                            key=message.key(),
                            headers=message.headers(),
                            partition=partition,
                        )
                        break
                    except BufferError:  # the local queue is full: let deliveries drain it
                        producer.poll(0.01)
            producer.poll(0)
    finally:
        producer.flush(10)
        consumer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kafka_relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--output-topic", required=True)
    parser.add_argument("--partitions", type=int, required=True, help="of both topics")
    parser.add_argument("--fetch-wait-ms", type=int, default=10, help="the longest the broker holds a fetch")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    relay(args, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
