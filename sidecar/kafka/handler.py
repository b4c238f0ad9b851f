"""What the connector does with one request: decode, validate, take a worker slot, call the worker, and
decide what to write (a result, a dead-letter record, or nothing).

Collaborators are handed in, so this file knows neither aiohttp nor the sidecar's internals:

- `validate(body) -> reason | None`: the sidecar's input-schema check (the same one HTTP requests pass).
- `admission.slot(priority)`: an async context manager holding one of the instance's worker slots. The
  sidecar's admission controller serves waiters by priority, so Kafka work queues behind HTTP work of
  a higher priority instead of starving it; Kafka work never bypasses it.
- `call_worker(raw_json) -> raw_json`: POST to the local worker's /infer (not through Envoy).

What happens to a request the worker does not answer with 2xx:

    WorkerRejected     (4xx)                 its own fault: dead-lettered at once, never retried
    WorkerFailed       (5xx, timeout)        retried `server_error_attempts` times, then dead-lettered
    WorkerUnavailable  (503, 429, refused)   the instance cannot take work now: retried until it can,
    RetryableError     (admission refused)   or until the session stops (then `Abandoned`: the message
                                             is left uncommitted and the group redelivers it)

A dead-letter record needs `kafka_input.dead_letter_topic`; without one the request is counted and
skipped (its offset is committed), which is the only way a request is dropped, and only by choice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from sidecar.kafka.metrics import KafkaMetrics
from sidecar.kafka.records import OutRecord, SourceMessage, dead_letter_record, decode_json_object, result_record
from sie.errors import RetryableError, SIEError
from sie.spec import KafkaInput, Priority

log = logging.getLogger("sie.sidecar.kafka")


class Admission(Protocol):
    def slot(self, priority: Priority) -> AbstractAsyncContextManager[Any]:
        """Wait for a worker slot at `priority` (more important waiters first) and hold it for the block.
        May raise RetryableError when the instance cannot take work now (draining, queue too long)."""
        ...


Validate = Callable[[dict[str, Any]], str | None]  # why the body is refused, or None
CallWorker = Callable[[bytes], Awaitable[bytes]]


class WorkerRejected(SIEError):
    """The worker refused this request (4xx): sending it again cannot help."""

    def __init__(self, status: int, detail: str):
        self.status = status
        super().__init__(f"worker answered {status}: {detail}")


class WorkerFailed(SIEError):
    """The worker failed on this request (5xx, timeout): it may be the request, so retries are bounded."""

    def __init__(self, status: int | None, detail: str):
        self.status = status
        super().__init__(f"worker failed ({status or 'no answer'}): {detail}")


class WorkerUnavailable(RetryableError):
    """The worker cannot take work now (503, 429, connection refused): retry until it can."""


class Abandoned(RetryableError):
    """The session stopped while the request waited for the worker; it stays uncommitted, so the group
    redelivers it (to this instance when it rejoins, or to another): the request is retried, not lost."""


@dataclass(frozen=True)
class RetryPolicy:
    initial_s: float = 0.05
    max_s: float = 2.0
    server_error_attempts: int = 3

    def next_delay(self, delay_s: float) -> float:
        return min(self.max_s, delay_s * 2)


def split_predictions(raw: bytes, expected: int) -> list[bytes]:
    """The worker's answer to a batched call, one result body per request, each encoded as the worker
    encodes a single answer (compact JSON). Raises WorkerFailed when the answer is not
    `{"predictions": [expected]}`. orjson: the stdlib's json.dumps cost 2.8 us per prediction here,
    more than the rest of a message's handling in this function."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise WorkerFailed(200, f"the batched answer is not JSON: {exc}") from None
    predictions = body.get("predictions") if isinstance(body, dict) else None
    if not isinstance(predictions, list) or len(predictions) != expected:
        got = len(predictions) if isinstance(predictions, list) else "no list of"
        raise WorkerFailed(200, f"the batched answer has {got} predictions for {expected} requests")
    dumps = orjson.dumps
    return [dumps(prediction) for prediction in predictions]


class MessageHandler:
    def __init__(
        self,
        *,
        kafka: KafkaInput,
        model_id: str,
        instance_id: str,
        priority: Priority,
        validate: Validate,
        call_worker: CallWorker,
        admission: Admission,
        metrics: KafkaMetrics,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self._kafka = kafka
        self._model_id = model_id
        self._instance_id = instance_id
        self._priority = priority
        self._validate = validate
        self._call_worker = call_worker
        self._admission = admission
        self._metrics = metrics
        self._retry = retry
        self._sleep = sleep

    async def handle(self, message: SourceMessage, stop: asyncio.Event) -> OutRecord | None:
        """The record to write for `message`, or None when there is nothing to write. Raises Abandoned."""
        body, reason = decode_json_object(message.value)
        if body is not None:
            problem = self._validate(body)
            reason = None if problem is None else f"invalid input: {problem}"
        if reason is not None:
            self._metrics.count_invalid()
            return self._dead_letter(message, reason)
        return await self._answer(message, stop)

    async def _answer(self, message: SourceMessage, stop: asyncio.Event) -> OutRecord | None:
        """A valid message's record: its result, or a dead-letter record when the worker refuses it."""
        try:
            result = await self._score(message.value or b"", stop)
        except (WorkerRejected, WorkerFailed) as exc:
            self._metrics.failed.inc()
            return self._dead_letter(message, str(exc))
        return result_record(message, result, self._kafka.output_topic, self._model_id, self._instance_id)

    async def handle_batch(self, messages: Sequence[SourceMessage], stop: asyncio.Event) -> list[OutRecord | None]:
        """`handle` for messages fetched together (of one partition or several), with one worker call for
        all the valid ones (a `{"instances": [...]}` body). The records come back in the messages' order.

        Every message ends exactly as `handle` would end it: invalid ones are dead-lettered, and when the
        worker refuses or fails the batched call, each message is sent again on its own, so one bad
        request is dead-lettered alone and server errors keep their per-message retries. Raises
        Abandoned (nothing of the batch is written) when the session stops while the worker is away.
        """
        out: list[OutRecord | None] = [None] * len(messages)
        valid: list[int] = []
        for index, message in enumerate(messages):
            body, reason = decode_json_object(message.value)
            if body is not None:
                problem = self._validate(body)
                reason = None if problem is None else f"invalid input: {problem}"
            if reason is not None:
                self._metrics.count_invalid()
                out[index] = self._dead_letter(message, reason)
            else:
                valid.append(index)
        if len(valid) == 1:
            out[valid[0]] = await self._answer(messages[valid[0]], stop)
        elif valid:
            raw = b'{"instances":[' + b",".join(messages[i].value or b"{}" for i in valid) + b"]}"
            try:
                results = split_predictions(await self._score(raw, stop), len(valid))
            except (WorkerRejected, WorkerFailed) as exc:
                log.info("a batch of %d failed (%s); sending its requests one by one", len(valid), exc)
                for index in valid:
                    out[index] = await self._answer(messages[index], stop)
                return out
            output_topic = self._kafka.output_topic
            for index, result in zip(valid, results):
                out[index] = result_record(messages[index], result, output_topic, self._model_id, self._instance_id)
        return out

    async def _score(self, raw: bytes, stop: asyncio.Event) -> bytes:
        delay = self._retry.initial_s
        failures = 0
        while True:
            try:
                async with self._admission.slot(self._priority):
                    return await self._call_worker(raw)
            except WorkerFailed:
                failures += 1
                if failures >= self._retry.server_error_attempts:
                    raise
            except RetryableError as exc:  # WorkerUnavailable, or admission saying "not now"
                log.debug("worker not available, retrying in %.2f s: %s", delay, exc)
            if stop.is_set():
                raise Abandoned()
            await self._sleep(delay)
            delay = self._retry.next_delay(delay)

    def _dead_letter(self, message: SourceMessage, reason: str) -> OutRecord | None:
        topic = self._kafka.dead_letter_topic
        if topic is None:
            log.warning(
                "skipping %s/%s@%s (no dead_letter_topic is set): %s",
                message.topic,
                message.partition,
                message.offset,
                reason,
            )
            return None
        return dead_letter_record(message, reason, topic, self._model_id, self._instance_id)
