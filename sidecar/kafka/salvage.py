"""A record aiokafka cannot decode (see batches.py): `Salvager`, what a group session (session.py) does
when getmany raises on one, and beneath it the partition's bytes fetched undecoded and where each
partition had been read to.

aiokafka has no public call for undecoded records, so `fetch_raw` sends a Fetch request on the
consumer's own client (`consumer._client`: its connections, credentials and metadata) with aiokafka's
own request class, as aiokafka's fetcher does (aiokafka 0.14). tests/integration/test_kafka_connector.py
runs it against a real broker, so an aiokafka that moves these fails a test, not a deployment.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Set
from typing import Any

from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.protocol.fetch import FetchRequest

from sidecar.kafka import batches as raw_batches
from sidecar.kafka import pipeline
from sidecar.kafka.settings import ConnectorSettings

log = logging.getLogger("sie.sidecar.kafka")

RawFetch = Callable[[Any, dict[TopicPartition, int], int], Awaitable[dict[TopicPartition, bytes]]]

_READ_UNCOMMITTED = 0  # what the connector's consumer reads (it sets no isolation level)
_FETCH_WAIT_MS = 100
# aiokafka's max_partition_fetch_bytes unless the overrides set another: the raw read covers what the
# failed fetch did.
_PARTITION_FETCH_BYTES = 1_048_576


class Salvager:
    """The undecodable-record salvage of one group session. It reads the session's `ledgers` (where each
    partition has been read to) and `closing` (partitions being handed over), and hands what it rescues
    to `take`, which starts those messages as fetched ones are started and dead-letters the bad one."""

    def __init__(
        self,
        settings: ConnectorSettings,
        consumer: Any,
        ledgers: dict[TopicPartition, pipeline.PartitionLedger],
        closing: Set[TopicPartition],
        take: Callable[[TopicPartition, raw_batches.Rescue], None],
        fetch_raw: RawFetch,
    ):
        self._settings = settings
        self._consumer = consumer
        self._ledgers = ledgers
        self._closing = closing
        self._take = take
        self._fetch_raw = fetch_raw

    async def salvage(self, room: int, error: BaseException) -> bool:
        """getmany raised `error` decoding a fetched record (batches.py says why it can happen and why
        seeking past it is not enough). Read the partitions' bytes from where this session has read them
        to, take the records of the one that holds the bad record (up to `room`) through the end of its
        batch, dead-letter the bad one and go on after it. Returns whether it found one.

        Every other partition is sought back to where it has been read to: getmany may have moved it
        past records of the same call before it failed, and those records were never returned.
        Partitions being handed over are paused: the next owner reads them from the committed offset."""
        consumer = self._consumer
        reset = self._settings.kafka.auto_offset_reset
        positions: dict[TopicPartition, int] = {}
        for tp, ledger in list(self._ledgers.items()):
            if tp in self._closing:
                _quietly(consumer.pause, tp)
                continue
            last = ledger.last_offset
            positions[tp] = last + 1 if last is not None else await start_position(consumer, tp, reset)
        max_bytes = int(self._settings.client_overrides.get("max_partition_fetch_bytes", _PARTITION_FETCH_BYTES))
        try:
            raw = await self._fetch_raw(consumer, positions, max_bytes)
        except KafkaError as exc:
            log.warning(
                "reading %s undecoded failed: %r",
                ", ".join(f"{tp.topic}/{tp.partition}" for tp in sorted(positions)),
                exc,
            )
            raw = {}
        found = False
        for tp, position in positions.items():
            if tp not in self._ledgers or tp in self._closing:
                continue  # revoked or being handed over while this read: not this session's to take
            plan = None
            if not found and tp in raw:
                plan = raw_batches.rescue(tp.topic, tp.partition, position, raw_batches.read_batches(raw[tp]), room)
            if plan is None:
                _quietly(consumer.seek, tp, position)
                continue
            found = True
            log.warning(
                "%s/%s: the Kafka client cannot decode %s (%r); taking %d records up to offset %d undecoded",
                tp.topic,
                tp.partition,
                ", ".join(f"offset {o}: {why}" for o, why in plan.undecodable.items()) or "a record further on",
                error,
                len(plan.messages),
                plan.resume_at,
            )
            self._take(tp, plan)
            _quietly(consumer.seek, tp, plan.resume_at)
        return found


def _quietly(call: Callable[..., Any], *args: Any) -> None:
    """pause/seek on a partition that a rebalance took away meanwhile: nothing to do for it here."""
    try:
        call(*args)
    except IllegalStateError:
        pass


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
