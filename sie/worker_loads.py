"""Reading a worker's own load figures (pure): GET /v1/loads, falling back to GET /metrics.

Part of the worker protocol contract, so the sidecar (telemetry) and the node host (SGLang adapter) read
them the same way.

/v1/loads comes in several shapes, all accepted:
  * SIE's backends: one object {"num_running_reqs", "num_waiting_reqs", "token_usage",
    "num_used_tokens", "max_total_num_tokens", "cache_hit_rate"};
  * a real SGLang: {"loads": [ {...per dp rank...}, ... ], "aggregate": {"total_running_reqs", ...}}
    (the ranks are used; the aggregate, under its own names, only when no ranks are given), or a bare
    list of per-rank objects.
Counts are summed over ranks. KV-cache use is used/total tokens summed over ranks when both are
known (a token-weighted mean), else the plain mean of the ranks' token_usage. Scorers have no KV
cache: their token_usage is absent or null and stays None (absent, not zero).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sie import metric_names as M
from sie.errors import InputError


@dataclass(frozen=True)
class EngineLoad:
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    used_tokens: int | None = None
    max_tokens: int | None = None
    cache_hit_rate: float | None = None  # prefix-cache hits, 0..1; None: the engine has no prefix cache
    # Engines that count prefix-cache hits instead of reporting a rate (vLLM): tokens found in the cache
    # and tokens looked up, since the engine started. HitRateWindow turns them into cache_hit_rate.
    prefix_hits: float | None = None
    prefix_queries: float | None = None


class LoadsFormatError(InputError):
    """The document is not any /v1/loads shape we know; the caller falls back to /metrics."""

    def __init__(self, message: str):
        super().__init__("invalid_loads", message)


def parse_loads(doc: Any) -> EngineLoad:
    ranks = _ranks(doc)
    if not ranks:
        raise LoadsFormatError(f"no load figures in {str(doc)[:200]!r}")
    running = _sum_int(r.get("num_running_reqs") for r in ranks)
    waiting = _sum_int(r.get("num_waiting_reqs", r.get("num_queue_reqs")) for r in ranks)
    used = _sum_int(r.get("num_used_tokens") for r in ranks)
    total = _sum_int(r.get("max_total_num_tokens") for r in ranks)
    mean_usage = _mean(r.get("token_usage") for r in ranks)
    if running is None and waiting is None and used is None and mean_usage is None:
        raise LoadsFormatError(f"no known load fields in {str(doc)[:200]!r}")
    kv = used / total if used is not None and total else mean_usage
    hit_rate = _mean(r.get("cache_hit_rate") for r in ranks)
    return EngineLoad(running, waiting, _clamp01(kv), used, total, _clamp01(hit_rate))


def parse_metrics_text(text: str) -> EngineLoad:
    """SGLang's Prometheus gauges, summed over label sets (dp ranks); token_usage averaged."""
    sums: dict[str, float] = {}
    usage: list[float] = []
    hits: list[float] = []
    wanted = {M.SGLANG_RUNNING, M.SGLANG_QUEUE, M.SGLANG_USED_TOKENS, M.SGLANG_MAX_TOTAL_TOKENS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == M.SGLANG_TOKEN_USAGE:
                if math.isfinite(sample.value):
                    usage.append(sample.value)
            elif sample.name == M.SGLANG_CACHE_HIT_RATE:
                if math.isfinite(sample.value):
                    hits.append(sample.value)
            elif sample.name in wanted and math.isfinite(sample.value):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    if not sums and not usage:
        raise LoadsFormatError("no sglang:* load gauges in the /metrics text")

    def count(name: str) -> int | None:
        return int(sums[name]) if name in sums else None

    used, total = count(M.SGLANG_USED_TOKENS), count(M.SGLANG_MAX_TOTAL_TOKENS)
    kv = used / total if used is not None and total else (sum(usage) / len(usage) if usage else None)
    hit_rate = sum(hits) / len(hits) if hits else None
    return EngineLoad(count(M.SGLANG_RUNNING), count(M.SGLANG_QUEUE), _clamp01(kv), used, total, _clamp01(hit_rate))


def metric_samples(text: str, names: set[str]) -> dict[str, list[tuple[Mapping[str, str], float]]]:
    """The finite samples of the metrics `names` in Prometheus text, as (labels, value) per name."""
    out: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and math.isfinite(sample.value):
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


class HitRateWindow:
    """The prefix-cache hit rate over the last `window_s` seconds, from an engine's cumulative counters
    (tokens hit, tokens looked up). No lookup in the window keeps the last rate (an idle engine's cache
    is as good as it was); counters that go back (the engine restarted) start the window again."""

    def __init__(self, window_s: float = 30.0):
        self._window = window_s
        self._samples: deque[tuple[float, float, float]] = deque()
        self._rate: float | None = None

    def add(self, now: float, hits: float, queries: float) -> float | None:
        if self._samples and (hits < self._samples[-1][1] or queries < self._samples[-1][2]):
            self._samples.clear()
        self._samples.append((now, hits, queries))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self._window:
            self._samples.popleft()
        _, first_hits, first_queries = self._samples[0]
        looked_up = queries - first_queries
        if looked_up > 0:
            self._rate = _clamp01((hits - first_hits) / looked_up)
        return self._rate


def _ranks(doc: Any) -> list[dict[Any, Any]]:
    # Per-rank figures are exact and add up; SGLang's "aggregate" uses other names (total_running_reqs,
    # avg_token_usage, ...) and is only a fallback for a document without ranks.
    if isinstance(doc, list):
        return [r for r in doc if isinstance(r, dict)]
    if not isinstance(doc, dict):
        return []
    loads = doc.get("loads")
    if isinstance(loads, list) and any(isinstance(r, dict) for r in loads):
        return [r for r in loads if isinstance(r, dict)]
    if isinstance(loads, dict):
        return [loads]
    aggregate = doc.get("aggregate")
    if isinstance(aggregate, dict) and aggregate:
        return [{_AGGREGATE_NAMES.get(k, k): v for k, v in aggregate.items()}]
    return [doc]


_AGGREGATE_NAMES = {
    "total_running_reqs": "num_running_reqs",
    "total_waiting_reqs": "num_waiting_reqs",
    "avg_token_usage": "token_usage",
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _sum_int(values: Iterable[Any]) -> int | None:
    numbers = [n for n in map(_number, values) if n is not None]
    return int(sum(numbers)) if numbers else None


def _mean(values: Iterable[Any]) -> float | None:
    numbers = [n for n in map(_number, values) if n is not None]
    return sum(numbers) / len(numbers) if numbers else None


def _clamp01(value: float | None) -> float | None:
    return None if value is None else min(1.0, max(0.0, value))
