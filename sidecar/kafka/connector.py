"""The Kafka connector of one model instance: its sidecar reads the model's topic, scores each request on
the local worker, writes the result to the output topic, and commits only what is written (issue 6).

It follows the instance's life (DESIGN.md section 6):

    start()   join the model's consumer group (partitions spread over the instances that joined)
    drain()   stop fetching, finish and commit what it has, leave the group: its partitions move to the
              other instances at once, nothing lost, nothing repeated. Used for eviction, rollout, shutdown.
    pause()   the same as drain, for sleep: a sleeping instance does not consume
    resume()  rejoin after wake
    close()   drain, then close the producer; the connector is finished

The sidecar composes it (see `connector_for`); `python -m sidecar.kafka` runs it on its own beside a
worker (standalone.py). Its settings are `ConnectorSettings` (settings.py). One membership of the group
is a `GroupSession` (session.py); the connector supervises it and starts a new one, after a pause, if
it fails (the broker went away, a produce was refused), so a failure costs repeats from the last
commit, never loss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from sidecar.kafka.handler import MessageHandler
from sidecar.kafka.session import GroupSession
from sidecar.kafka.settings import ConnectorSettings
from sie.tasks import wait_event

log = logging.getLogger("sie.sidecar.kafka")


# Why aiokafka and not librdkafka (confluent-kafka), which the bench's relay and load generator use: a
# librdkafka client behind this session's calls (a thread of its own for the consumer, since
# confluent-kafka lets one thread at a time into a consumer and `consume` holds it while it waits; a
# thread for delivery reports) passed every Kafka test but took more CPU, not less, at 10,500 messages/s
# (bench.kafka --quick, 2026-12-04: the sidecar 54.5 µs a message against aiokafka's 49.4, p99 55.9 ms
# against 38.5; per thread over 5 s of the sustained phase, 0.50 cores in all, 0.34 of them on the event
# loop alone, against aiokafka's 0.33 for the whole process). aiokafka builds and parses record batches
# in C, a batch at a time; confluent-kafka's Python API is a call and an object per message each way
# (consume, produce, delivery report), plus the hand-offs between threads, and that outweighed what its
# C threads save.
def default_consumer(settings: ConnectorSettings) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(**consumer_options(settings))


def consumer_options(settings: ConnectorSettings) -> dict[str, Any]:
    kafka = settings.kafka
    return {
        "bootstrap_servers": kafka.bootstrap_servers,
        "group_id": kafka.group_id,
        "client_id": f"sie-{settings.model_id}-{settings.instance_id}",
        "enable_auto_commit": False,  # offsets are committed only after the result is acknowledged
        "auto_offset_reset": kafka.auto_offset_reset,
        "session_timeout_ms": settings.session_timeout_ms,
        "heartbeat_interval_ms": settings.heartbeat_interval_ms,
        # Revocation holds the rebalance for up to drain_timeout_s (session.py): the group must wait that
        # long for this member, and the consumer must not leave for not polling meanwhile.
        "rebalance_timeout_ms": settings.rebalance_timeout_ms,
        "max_poll_interval_ms": settings.poll_interval_ms,
        "fetch_max_wait_ms": settings.broker_fetch_wait_ms,
        **settings.client_overrides,
    }


def default_producer(settings: ConnectorSettings) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        client_id=f"sie-{settings.model_id}-{settings.instance_id}-out",
        acks="all",  # a result counts as written only when every in-sync replica has it
        # Not idempotent: Tansu refuses aiokafka's idempotent producer, and at-least-once with
        # (source topic, partition, offset) headers lets consumers deduplicate anyway.
        enable_idempotence=False,
        linger_ms=0,
        **settings.client_overrides,
    )


class KafkaConnector:
    def __init__(
        self,
        settings: ConnectorSettings,
        handler: MessageHandler,
        metrics: Any,
        *,
        clock: Callable[[], float] = time.time,
        consumer_factory: Callable[[ConnectorSettings], Any] = default_consumer,
        producer_factory: Callable[[ConnectorSettings], Any] = default_producer,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ):
        self._settings = settings
        self._on_close = on_close  # releases what the handler holds (its worker connections)
        self._handler = handler
        self._metrics = metrics
        self._clock = clock
        self._consumer_factory = consumer_factory
        self._producer_factory = producer_factory
        self._producer: Any = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._session: GroupSession | None = None
        self._closed = False
        self.sessions_failed = 0

    @property
    def state(self) -> str:
        if self._closed:
            return "closed"
        if self._task is None:
            return "stopped"
        return "draining" if self._stop.is_set() else "consuming"

    def status(self) -> dict[str, Any]:
        session = self._session.status() if self._session is not None else {"in_flight": 0, "partitions": {}}
        return {
            "state": self.state,
            "sessions_failed": self.sessions_failed,
            "topic": self._settings.kafka.topic,
            "group_id": self._settings.kafka.group_id,
            **session,
        }

    async def start(self) -> None:
        """Join the group and consume. Returns at once; joining and fetching go on in the background."""
        if self._closed:
            raise RuntimeError("the Kafka connector is closed; make a new one")
        if self._task is not None:
            if not self._stop.is_set():
                return  # already consuming
            await self.drain()  # a drain is under way: let it finish its hand-over, then rejoin
        if self._producer is None:
            producer = self._producer_factory(self._settings)
            await producer.start()
            self._producer = producer
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._supervise(), name=f"kafka-connector:{self._settings.model_id}")
        self._task.add_done_callback(self._supervisor_ended)

    async def drain(self) -> None:
        """Stop fetching, finish and commit what was taken (within drain_timeout_s), and leave the group."""
        task = self._task
        if task is None:
            return
        self._stop.set()
        # Shielded: a caller cancelled mid-drain (the sidecar shutting its tasks down) must not turn a
        # clean hand-over into an abrupt one; close() awaits the same drain to its end.
        await asyncio.shield(task)
        if self._task is task:
            self._task = None

    async def pause(self) -> None:
        """Sleep: a sleeping instance does not consume. Same as drain; resume() rejoins."""
        await self.drain()

    async def resume(self) -> None:
        await self.start()

    async def close(self) -> None:
        try:
            await self.drain()
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None
        finally:
            if self._on_close is not None:
                await self._on_close()
            self._closed = True

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            session = GroupSession(
                self._settings,
                self._consumer_factory(self._settings),
                self._producer,
                self._handler,
                self._metrics,
                self._stop,
                self._clock,
            )
            self._session = session
            try:
                await session.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.sessions_failed += 1
                log.error(
                    "Kafka session of %s/%s failed (%r); rejoining in %.1f s from the last committed offsets",
                    self._settings.model_id,
                    self._settings.instance_id,
                    exc,
                    self._settings.restart_backoff_s,
                )
                await wait_event(self._stop, self._settings.restart_backoff_s)  # not wait_for: see wait_event
            finally:
                self._session = None

    def _supervisor_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("Kafka connector of %s died: %r", self._settings.model_id, task.exception())
