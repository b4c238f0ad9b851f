"""Reading a partition's bytes when aiokafka cannot decode a record in them (see batches.py): where each
partition had been read to, and a fetch that returns the records undecoded.

aiokafka has no public call for undecoded records, so `fetch_raw` sends a Fetch request on the
consumer's own client (`consumer._client`: its connections, credentials and metadata) with aiokafka's
own request class, as aiokafka's fetcher does (aiokafka 0.14). tests/integration/test_kafka_connector.py
runs it against a real broker, so an aiokafka that moves these fails a test, not a deployment.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from aiokafka import TopicPartition
from aiokafka.protocol.fetch import FetchRequest

_READ_UNCOMMITTED = 0  # what the connector's consumer reads (it sets no isolation level)
_FETCH_WAIT_MS = 100


async def fetch_raw(consumer: Any, positions: dict[TopicPartition, int], max_bytes: int) -> dict[TopicPartition, bytes]:
    """Each partition's record batches from its position on (at most `max_bytes` of them, and at least
    one batch, as Kafka answers), as the broker sent them. Partitions whose leader is not known, or
    that the broker answers with an error, are left out: the caller reads them again later."""
    client = consumer._client
    by_leader: dict[int, dict[str, list[tuple[int, int, int]]]] = defaultdict(lambda: defaultdict(list))
    for tp, offset in positions.items():
        leader = client.cluster.leader_for_partition(tp)
        if leader is not None and leader >= 0:
            by_leader[leader][tp.topic].append((tp.partition, offset, max_bytes))
    found: dict[TopicPartition, bytes] = {}
    for leader, topics in by_leader.items():
        # The failed fetch showed the log has the records, so a broker answers at once; the wait is not 0
        # because Tansu answers a fetch that may not wait with no records at all.
        wanted = sum(len(partitions) for partitions in topics.values())
        request = FetchRequest(_FETCH_WAIT_MS, 1, max_bytes * wanted, _READ_UNCOMMITTED, list(topics.items()))
        response = await client.send(leader, request)
        for topic, partitions in response.topics:
            for partition, error_code, _highwater, *rest in partitions:
                if error_code == 0 and rest[-1]:
                    found[TopicPartition(topic, partition)] = bytes(rest[-1])
    return found


async def start_position(consumer: Any, tp: TopicPartition, auto_offset_reset: str) -> int:
    """Where a partition this session has taken nothing from was read from: the group's committed
    offset, else where auto_offset_reset starts. For "latest" with nothing committed that start was the
    end of the log when the partition was assigned, which is no longer known: the consumer's position
    stands in for it, as it would on any rejoin before the first commit."""
    committed = await consumer.committed(tp)
    if committed is not None:
        return int(committed)
    if auto_offset_reset == "earliest":
        return int((await consumer.beginning_offsets([tp]))[tp])
    return int(await consumer.position(tp))
