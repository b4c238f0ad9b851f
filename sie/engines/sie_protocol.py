"""SIE's own engines (torch, sklearn, sim): they speak the worker protocol of
node_host.backends.protocol, the subset of SGLang's HTTP API SIE uses, so their dialect is SGLang's own
but for the memory calls, which take no tags (each engine releases everything it holds)."""

from __future__ import annotations

from sie.engines.dialect import Call, Dialect, MemoryRelease, Sleep
from sie.spec import INFERENCE_PATHS
from sie.worker_loads import parse_metrics_text

_OFFLOAD = Sleep(
    MemoryRelease.CALL,
    "SIE's engine moves its weights and cache to host memory; a wake copies them back",
    Call("/release_memory_occupation", {}),
    Call("/resume_memory_occupation", {}),
)

SIE = Dialect(
    name="sie",
    health_path="/health",
    loads_path="/v1/loads",
    metrics_path="/metrics",
    parse_metrics=parse_metrics_text,
    serves=frozenset(p for paths in INFERENCE_PATHS.values() for p in paths),
    sleep_on_gpu=_OFFLOAD,
    sleep_on_cpu=_OFFLOAD,
)
