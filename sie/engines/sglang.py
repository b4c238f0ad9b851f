"""SGLang's dialect, as its server (the version `backend.requires` pins) has it; the fixtures under
tests/fixtures/sglang/ are taken from its code and keep these names honest without a GPU.

- `/health` answers 200 without generating when the server runs with
  SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (node_host sets it);
- `/v1/loads` carries running, waiting and token figures per data-parallel rank
  (sie.worker_loads.parse_loads); `/metrics` (with --enable-metrics) the `sglang:*` gauges;
- memory: `/release_memory_occupation` and `/resume_memory_occupation` with the memory saver on; weights
  survive only with --enable-weights-cpu-backup, which node_host passes. SGLang asserts that it is idle
  on release, so the sidecar releases only after its drain (sidecar.drain).
SGLang needs a GPU, so its CPU sleep is never used; it is stated as the GPU's for completeness.
"""

from __future__ import annotations

from sie.engines.dialect import Call, Dialect, MemoryRelease, Sleep
from sie.spec import INFERENCE_PATHS, ServiceType
from sie.worker_loads import parse_metrics_text

RELEASE_PATH = "/release_memory_occupation"
RESUME_PATH = "/resume_memory_occupation"

_SAVER = Sleep(
    MemoryRelease.CALL,
    "SGLang's memory saver releases weights (kept in host memory), KV cache and CUDA graphs",
    Call(RELEASE_PATH, {}),  # no tags: all of them
    Call(RESUME_PATH, {}),
)

SGLANG = Dialect(
    name="sglang",
    health_path="/health",
    loads_path="/v1/loads",
    metrics_path="/metrics",
    parse_metrics=parse_metrics_text,
    serves=frozenset(INFERENCE_PATHS[ServiceType.LLM]) | {"/v1/embeddings"},
    sleep_on_gpu=_SAVER,
    sleep_on_cpu=_SAVER,
)
