"""Building the telemetry record and the metrics exposition from live figures."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar.gpu import GpuSample
from sidecar.metrics import Metrics, metric_labels
from sidecar.reporter import Identity, Live, Reporter, build_record
from sidecar.window import EMPTY, WindowSummary
from sie import metric_names as M
from sie.telemetry import InstanceState, TelemetryRecord
from sie.worker_loads import EngineLoad

IDENTITY = Identity("m-0", "m", "1.0.0", "127.0.0.1:9000", "node-a", "P0", "scoring", 1, 8, False)


@pytest.mark.parametrize(
    "live, expected",
    [
        (
            Live(
                InstanceState.READY,
                3,
                2,
                40,
                WindowSummary(40, 0.012, 0.2, 0.05, 0.025, service_p50_s=0.01, service_p99_s=0.15),
                EngineLoad(3, 1, 0.5),
                GpuSample(0.7, 1000.0, 80000.0),
            ),
            {
                "in_flight": 3,
                "queued": 2,
                "requests_total": 40,
                "latency_p50_ms": 12.0,
                "latency_p99_ms": 200.0,
                "queue_time_ms": 50.0,
                "service_p50_ms": 10.0,
                "service_p99_ms": 150.0,
                "error_rate": 0.025,
                "kv_cache_usage": 0.5,
                "engine_running": 3,
                "engine_waiting": 1,
                "gpu_utilization": 0.7,
                "gpu_memory_used_mb": 1000.0,
                "gpu_memory_total_mb": 80000.0,
            },
        ),
        # nothing measured yet: absent (None), never zero
        (
            Live(InstanceState.LOADING, 0, 0, 0, EMPTY, None, None),
            {
                "latency_p50_ms": None,
                "latency_p99_ms": None,
                "queue_time_ms": None,
                "service_p99_ms": None,
                "kv_cache_usage": None,
                "engine_running": None,
                "gpu_utilization": None,
                "gpu_memory_used_mb": None,
                "error_rate": 0.0,
            },
        ),
    ],
)
def test_build_record(live, expected):
    record = build_record(IDENTITY, live, timestamp=123.0, seq=7)
    doc = record.to_json()
    for key, value in expected.items():
        assert doc[key] == value, key
    assert (doc["instance_id"], doc["priority"], doc["service_type"], doc["gpu_index"], doc["max_concurrent"]) == (
        "m-0",
        "P0",
        "scoring",
        1,
        8,
    )
    assert (doc["timestamp"], doc["seq"], doc["state"]) == (123.0, 7, live.state.value)
    assert TelemetryRecord.from_json(doc) == record  # the control plane's parser accepts it


def test_seq_grows_per_record():
    live = Live(InstanceState.READY, 0, 0, 0, EMPTY, None, None)
    reporter = Reporter(IDENTITY, lambda: live, lambda: 5.0, asyncio.Event(), 0.5)
    assert [reporter.current().seq for _ in range(3)] == [1, 2, 3]


async def test_send_without_control_plane_is_a_no_op():
    live = Live(InstanceState.READY, 0, 0, 0, EMPTY, None, None)
    assert await Reporter(IDENTITY, lambda: live, lambda: 5.0, asyncio.Event(), 0.5).send() is False


def _samples(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_exposition_has_the_unified_names_and_labels():
    figures = {"kv": 0.3}
    metrics = Metrics(metric_labels("m", "llm", "P1", "2.0"), live=lambda: (2, 1, figures["kv"], figures.get("hits")))
    metrics.answered(200)
    metrics.answered(200)
    metrics.answered(429)
    metrics.served(0.02, 0.0)
    metrics.invalid_schema()
    metrics.evicted()
    samples = _samples(metrics.exposition().decode())
    base = (("model_id", "m"), ("priority_level", "P1"), ("service_type", "llm"), ("version", "2.0"))
    assert samples[(M.REQUESTS, tuple(sorted((*base, ("code", "200")))))] == 2.0
    assert samples[(M.REQUESTS, tuple(sorted((*base, ("code", "429")))))] == 1.0
    assert samples[(M.LATENCY + "_count", base)] == 1.0
    assert samples[(M.LATENCY + "_bucket", tuple(sorted((*base, ("le", "0.025")))))] == 1.0
    assert samples[(M.LATENCY + "_bucket", tuple(sorted((*base, ("le", "0.01")))))] == 0.0
    assert samples[(M.QUEUE_TIME + "_count", base)] == 1.0
    assert samples[(M.INVALID_SCHEMA, base)] == 1.0
    assert samples[(M.EVICTIONS, base)] == 1.0
    assert samples[(M.IN_FLIGHT, base)] == 2.0
    assert samples[(M.QUEUED, base)] == 1.0
    assert samples[(M.KV_CACHE_USAGE, base)] == 0.3
    # unknown KV use is left out, not exported as 0
    figures["kv"] = None
    assert (M.KV_CACHE_USAGE, base) not in _samples(metrics.exposition().decode())


def test_labels_must_be_the_schema():
    with pytest.raises(ValueError, match="labels"):
        Metrics({"model_id": "m"}, live=lambda: (0, 0, None, None))
