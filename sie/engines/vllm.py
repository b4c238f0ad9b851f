"""vLLM's dialect (the OpenAI-compatible server, `python -m vllm.entrypoints.openai.api_server`), as
vLLM 0.32 has it, its CPU build included (measured: FACTS-style notes in docs and the tests against the
real server, tests/integration/test_vllm_e2e.py).

- `/health` is 200 once the engine serves and needs no key; `/metrics` needs none either;
- it has no `/v1/loads`: running and waiting requests are `vllm:num_requests_running` and
  `vllm:num_requests_waiting`, KV-cache use `vllm:kv_cache_usage_perc` (0..1), the cache's size
  `vllm:cache_config_info{num_gpu_blocks, block_size}` (so used and total tokens follow), and prefix
  caching two counters in tokens, `vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total`,
  whose rate over a window is the hit rate (sie.worker_loads.HitRateWindow);
- it serves the OpenAI paths, not SGLang's `/generate` nor SIE's `/infer`; its errors are OpenAI's
  shape (`"type": "BadRequestError"`), which the sidecar puts in SIE's one error shape (openai_error);
- sleep: on a GPU, sleep mode (`--enable-sleep-mode`, a development-mode endpoint): `POST /sleep?level=1`
  offloads the weights to host memory and discards the KV cache, `POST /wake_up` brings them back. The CPU
  build refuses sleep mode ("Sleep mode is not supported on current platform"), so on a CPU an instance
  sleeps by unloading: drained, then its process stopped; a wake starts it and holds the first request.
  vLLM's own drain (`--shutdown-timeout`) answers new requests with 500 while /health stays 200, so SIE
  never relies on it: the sidecar gates traffic itself before anything stops.
"""

from __future__ import annotations

from sie.engines.dialect import Call, Dialect, MemoryRelease, Sleep, openai_error
from sie.worker_loads import EngineLoad, LoadsFormatError, metric_samples

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


def parse_vllm_metrics(text: str) -> EngineLoad:
    """vLLM's gauges and prefix-cache counters, summed over label sets (one per engine of a server)."""
    samples = metric_samples(text, {RUNNING, WAITING, KV_USAGE, CACHE_CONFIG, PREFIX_HITS, PREFIX_QUERIES})
    if not samples.get(RUNNING) and not samples.get(WAITING) and not samples.get(KV_USAGE):
        raise LoadsFormatError("no vllm:* load gauges in the /metrics text")

    def total(name: str) -> float | None:
        values = [v for _, v in samples.get(name, ())]
        return sum(values) if values else None

    usage = [v for _, v in samples.get(KV_USAGE, ())]
    kv = sum(usage) / len(usage) if usage else None
    max_tokens = 0
    for labels, _ in samples.get(CACHE_CONFIG, ()):
        try:
            max_tokens += int(labels.get("num_gpu_blocks", "")) * int(labels.get("block_size", ""))
        except ValueError:
            continue
    running, waiting = total(RUNNING), total(WAITING)
    return EngineLoad(
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        kv_usage=None if kv is None else min(1.0, max(0.0, kv)),
        used_tokens=round(kv * max_tokens) if kv is not None and max_tokens else None,
        max_tokens=max_tokens or None,
        prefix_hits=total(PREFIX_HITS),
        prefix_queries=total(PREFIX_QUERIES),
    )


VLLM = Dialect(
    name="vllm",
    health_path="/health",
    loads_path=None,
    metrics_path="/metrics",
    parse_metrics=parse_vllm_metrics,
    serves=frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}),
    sleep_on_gpu=Sleep(
        MemoryRelease.CALL,
        "vLLM's sleep mode, level 1: weights offloaded to host memory, KV cache discarded",
        Call("/sleep?level=1"),
        Call("/wake_up"),
    ),
    error_shape=openai_error,
    sleep_on_cpu=Sleep(
        MemoryRelease.UNLOAD,
        "vLLM's CPU build refuses sleep mode: the instance sleeps unloaded (its worker stopped) and a wake loads it",
    ),
)
