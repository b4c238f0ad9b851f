"""The connector's collaborators, made from the sidecar's own parts, and `connector_for`, which puts
them together. This is the one place that knows both the connector and the sidecar's internals.

- `GateAdmission`: Kafka work takes its worker slots from the sidecar's admission `Gate`, so the
  model's `max_concurrent_requests` bounds HTTP and Kafka work together and both show in the same
  in-flight and queue figures. A topic is a standing backlog, though, and the Gate is FIFO, so Kafka
  work is limited to a `share` of the slots (held or queued): an HTTP burst always finds the other
  slots, with at most `share` Kafka requests ahead of it in the queue, whatever the topic's depth.
  Lower-priority topics get a smaller share (`kafka_share`).
- `worker_caller`: POST /infer on the local worker (not through Envoy) over the connector's own
  keep-alive connections (sidecar/worker_http.py), the worker's answers mapped to the handler's error
  kinds.
- `schema_validator`: the sidecar's compiled input_schema check, the same one HTTP requests pass.
- `follow_lifecycle`: consume while the instance serves (ready), drain when it stops serving
  (draining, sleeping, stopped, failed) and rejoin when it serves again (wake).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from sidecar.admission import Gate, Verdict
from sidecar.kafka.handler import (
    CallWorker,
    MessageHandler,
    Validate,
    WorkerFailed,
    WorkerRejected,
    WorkerUnavailable,
)
from sidecar.kafka.metrics import KafkaMetrics, MetricLabels
from sidecar.kafka.settings import ConnectorSettings
from sidecar.status import Status
from sidecar.validation import check_document, compile_schema
from sidecar.worker_http import AnswerFailed, ConnectFailed, WorkerHTTP
from sie.errors import RetryableError
from sie.spec import IOSchema, ModelService, Priority
from sie.telemetry import InstanceState

if TYPE_CHECKING:  # aiokafka is the optional `kafka` extra: imported only for a model that uses it
    from sidecar.kafka.connector import KafkaConnector

# The fraction of the instance's worker slots Kafka work may hold or wait for, by the model's priority.
_SHARE = {Priority.P0: 0.5, Priority.P1: 0.5, Priority.P2: 0.25}


class AdmissionRefused(RetryableError):
    """The Gate did not admit the Kafka request (queue full, queue timeout, draining): try again later."""


def kafka_share(max_concurrent: int, priority: Priority) -> int:
    """Slots Kafka work may hold or queue for: at least one, and never all of them when there are two."""
    share = max(1, int(max_concurrent * _SHARE[priority]))
    return min(share, max(1, max_concurrent - 1))


class GateAdmission:
    def __init__(self, gate: Gate, share: int):
        if share < 1:
            raise ValueError(f"share must be at least 1, got {share}")
        self._gate = gate
        self._share = asyncio.Semaphore(share)
        self.share = share

    @asynccontextmanager
    async def slot(self, priority: Priority) -> AsyncIterator[None]:
        # `priority` orders nothing inside one instance (every request here is this model's); it
        # chose the share when this object was made.
        async with self._share:
            verdict, waiter = self._gate.arrive()
            if waiter is not None:
                verdict = await self._gate.wait(waiter)
            if verdict is not Verdict.ADMITTED:
                raise AdmissionRefused(f"admission said {verdict.value}")
            try:
                yield
            finally:
                self._gate.release()


def worker_caller(worker: WorkerHTTP, where: str, timeout_s: float) -> CallWorker:
    """POST the batch to the worker's /infer on the connector's own keep-alive connections
    (worker_http.py: http or https, with the worker URL's base path), its answer mapped to what the
    handler does next. `where` names the worker in error messages."""

    async def call_worker(raw: bytes) -> bytes:
        try:
            answer = await worker.post("/infer", raw, timeout_s)
        except ConnectFailed as exc:
            raise WorkerUnavailable(f"cannot connect to the worker at {where}: {exc}") from None
        except TimeoutError:
            raise WorkerFailed(None, f"no answer from {where} within {timeout_s:g} s") from None
        except AnswerFailed as exc:
            raise WorkerFailed(None, f"no answer from {where}: {exc}") from None
        return _answered(answer.status, answer.body)

    return call_worker


def _worker_headers(worker_key: str | None) -> dict[str, str]:
    """What every worker call carries: a JSON body and the worker key."""
    headers = {"Content-Type": "application/json"}
    if worker_key:
        headers["Authorization"] = f"Bearer {worker_key}"
    return headers


def _answered(status: int, body: bytes) -> bytes:
    """The worker's answer to the handler: the body of a 2xx, else the error the handler acts on."""
    if status < 300:
        return body
    detail = body[:300].decode("utf-8", errors="replace")
    if status in (429, 503):
        raise WorkerUnavailable(f"worker answered {status}: {detail}")
    if 400 <= status < 500:
        raise WorkerRejected(status, detail)
    raise WorkerFailed(status, detail)


def schema_validator(schema: IOSchema | None) -> Validate:
    compiled = compile_schema(schema)
    if compiled is None:
        return lambda _body: None

    def validate(body: dict[str, Any]) -> str | None:
        violation = check_document(compiled, body)
        if violation is None:
            return None
        return f"field {violation.field!r} {violation.reason}" if violation.field else violation.reason

    return validate


def connector_for(
    spec: ModelService,
    instance_id: str,
    *,
    worker_url: str,
    worker_key: str | None,
    gate: Gate,
    registry: CollectorRegistry,
    on_invalid_schema: Callable[[], None] | None = None,
    **settings: Any,
) -> KafkaConnector | None:
    """The instance's Kafka connector, or None when the model has no `kafka_input`. Not started."""
    if spec.spec.kafka_input is None:
        return None
    try:
        import aiokafka  # noqa: F401  the optional `kafka` extra, which connector.py and session.py need
    except ImportError as exc:
        raise RuntimeError(
            f"model {spec.model_id} has kafka_input, which needs the Kafka client: pip install 'sie[kafka]' ({exc})"
        ) from None
    from sidecar.kafka.connector import KafkaConnector

    connector_settings = ConnectorSettings.from_spec(spec, instance_id, **settings)
    model = spec.spec.model
    labels = MetricLabels(
        spec.model_id, model.service_type.value, model.priority_level.value, model.version, spec.spec.kafka_input.topic
    )
    metrics = KafkaMetrics(registry, labels, on_invalid_schema)
    share = kafka_share(gate.core.limits.max_concurrent, model.priority_level)
    timeout_s = spec.spec.sla.route_timeout_ms / 1000.0
    worker = WorkerHTTP.from_url(worker_url, _worker_headers(worker_key), max_idle=share)
    call_worker = worker_caller(worker, worker_url.rstrip("/") + "/infer", timeout_s)
    handler = MessageHandler(
        kafka=spec.spec.kafka_input,
        model_id=spec.model_id,
        instance_id=instance_id,
        priority=model.priority_level,
        validate=schema_validator(spec.spec.input_schema),
        call_worker=call_worker,
        admission=GateAdmission(gate, share),
        metrics=metrics,
    )
    return KafkaConnector(connector_settings, handler, metrics, on_close=worker.close)


def _changed_from(serving: bool) -> Callable[[InstanceState], bool]:
    """True once the instance's serving differs from `serving` (bound now, not read at call time)."""
    return lambda state: state.serves != serving


async def follow_lifecycle(connector: KafkaConnector, status: Status, recheck_s: float = 3600.0) -> None:
    """Keep the connector in step with the instance: consuming exactly while `status.serving`.

    Runs until cancelled (under the sidecar's sie.tasks.SupervisedTasks). A drain started here finishes even if this
    task is cancelled meanwhile (KafkaConnector.drain is shielded).
    """
    while True:
        serving = status.serving
        if serving:
            await connector.start()
        else:
            await connector.drain()
        await status.wait_for(_changed_from(serving), recheck_s)
