"""What a group session (session.py) commits, and when: each partition's commit point
(pipeline.commit_point: acknowledged, with every earlier offset) handed to the consumer, and the lag
behind the partition's end that follows from it.

`Committer` is the session's and lives and dies with it. It shares the session's ledgers (a commit
advances them) and commits when the session's `wanted` event is set (an acknowledgement, or a message
that finished with nothing to produce), coalescing what arrives meanwhile; a hand-over or a drain
commits its partitions at once (`commit`). A commit the group refuses while it rebalances is left to
the revocation, which commits what is done before the partitions move.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from sidecar.kafka import pipeline

if TYPE_CHECKING:
    from sidecar.kafka.metrics import KafkaMetrics

log = logging.getLogger("sie.sidecar.kafka")


class Committer:
    """Commits the session's `ledgers` through `consumer` when `wanted` is set, at most once per
    `interval_s` (ConnectorSettings.commit_interval_s), and reports commits and lag to `metrics`."""

    def __init__(
        self,
        consumer: Any,
        ledgers: dict[TopicPartition, pipeline.PartitionLedger],
        metrics: KafkaMetrics,
        wanted: asyncio.Event,
        interval_s: float,
    ):
        self._consumer = consumer
        self._ledgers = ledgers
        self._metrics = metrics
        self._wanted = wanted
        self._interval_s = interval_s
        self._lock = asyncio.Lock()
        self._committed_count: dict[TopicPartition, int] = defaultdict(int)

    async def run(self) -> None:
        # Commits coalesce: while one is on the wire (or during commit_interval_s after it), further
        # acknowledgements pile up for the next. Hand-overs and drains commit on their own, at once.
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            await self.commit(list(self._ledgers))
            if self._interval_s > 0:
                await asyncio.sleep(self._interval_s)

    async def commit(self, tps: list[TopicPartition]) -> None:
        async with self._lock:
            points = {}
            for tp in tps:
                ledger = self._ledgers.get(tp)
                if ledger is None:
                    continue
                point = pipeline.commit_point(ledger)
                if point is not None:
                    points[tp] = (point, ledger.done_count)
            if not points:
                return
            try:
                await self._consumer.commit({tp: point for tp, (point, _count) in points.items()})
            except (CommitFailedError, IllegalStateError) as exc:
                # The group is rebalancing; the revocation handler commits what is done before handing over.
                log.info("commit of %s deferred: %s", sorted(f"{tp.topic}/{tp.partition}" for tp in points), exc)
                return
            except KafkaError as exc:
                log.warning("commit failed, will retry with the next one: %s", exc)
                return
            for tp, (point, count) in points.items():
                if tp in self._ledgers:
                    self._ledgers[tp] = pipeline.committed(self._ledgers[tp], point)
                self._metrics.committed.inc(count - self._committed_count[tp])
                self._committed_count[tp] = count
            self.update_lag({tp: () for tp in points})

    def update_lag(self, batches: dict[TopicPartition, Any]) -> None:
        for tp in batches:
            ledger = self._ledgers.get(tp)
            if ledger is None:
                continue
            value = pipeline.lag(self._consumer.highwater(tp), ledger.committed)
            if value is not None:
                self._metrics.set_lag(tp.partition, value)

    def forget(self, tp: TopicPartition) -> None:
        """`tp` was handed over: should it come back, its new ledger's commits are counted from none."""
        self._committed_count.pop(tp, None)
