"""One rate of bench/prefix driven by a standard LLM benchmark tool, GuideLLM (PyPI `guidellm`), against the
ingress, so its figures stand beside ours.

GuideLLM is not one of SIE's dependencies (it brings datasets, transformers and more); bench/prefix runs
this step when a `guidellm` executable is on PATH or given with --guidellm, and says so when not. It runs
offline here: its synthetic data with shared-prefix buckets (16 prefixes of 1,200 tokens, as bench/prefix's
groups) and the tokenizer of SIE's demo model (created locally, node_host/backends/torch_engine/
demo_model.py), Poisson arrivals at the given rate, streamed chat completions.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from bench.prefix_workload import Workload


def find(explicit: str | None) -> str | None:
    return explicit or shutil.which("guidellm")


def scenario(
    url: str, model: str, rate: float, duration_s: float, workload: Workload, tokenizer: Path, out: Path
) -> dict:
    return {
        "spec": {
            # No /health probe first: the ingress serves the inference API only (a 404 there, DESIGN §10).
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": model,
                "request_format": "/v1/chat/completions",
                "validate_backend": False,
            },
            "profile": {"kind": "poisson", "rate": [rate]},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": workload.query_words,
                    "output_tokens": workload.max_tokens,
                    "prefix_buckets": [{"prefix_count": workload.groups, "prefix_tokens": workload.prefix_words}],
                }
            ],
            "constraints": [{"kind": "max_duration", "seconds": duration_s}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }


def run(
    exe: str, url: str, model: str, rate: float, duration_s: float, workload: Workload, work: Path
) -> dict[str, Any]:
    """GuideLLM at `rate` for `duration_s`; its own summary figures, or why there are none."""
    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2  # noqa: PLC0415 - torch, only here

    tokenizer = ensure_tiny_qwen2(work / "demo-tokenizer")
    out = work / "guidellm.json"
    config = work / "guidellm-scenario.json"
    config.write_text(json.dumps(scenario(url, model, rate, duration_s, workload, tokenizer, out)))
    with open(work / "guidellm.log", "wb") as log:
        proc = subprocess.run(
            [exe, "run", "--config", str(config), "--disable-console-interactive"],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=duration_s + 300,
            check=False,
        )
    if proc.returncode != 0 or not out.exists():
        tail = (work / "guidellm.log").read_text(errors="replace")[-800:]
        return {"ran": False, "why": f"guidellm exited {proc.returncode}: {tail}"}
    return {"ran": True, "rate_rps": rate, **summary(json.loads(out.read_text()))}


def summary(doc: dict) -> dict[str, Any]:
    """TTFT and end-to-end percentiles, output tokens per second and request counts from GuideLLM's report
    (its schema: benchmarks[0].metrics.<name>.successful.percentiles)."""
    bench = (doc.get("benchmarks") or [{}])[0]
    metrics = bench.get("metrics") or {}

    def pct(name: str, which: str, scale: float = 1.0) -> float | None:
        block = ((metrics.get(name) or {}).get("successful") or {}).get("percentiles") or {}
        value = block.get(which)
        return round(value * scale, 1) if isinstance(value, (int, float)) else None

    def mean(name: str) -> float | None:
        value = ((metrics.get(name) or {}).get("successful") or {}).get("mean")
        return round(value, 1) if isinstance(value, (int, float)) else None

    totals = (metrics.get("request_totals") or {}) if isinstance(metrics.get("request_totals"), dict) else {}
    return {
        "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
        "ttft_p90_ms": pct("time_to_first_token_ms", "p90"),
        "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
        "e2e_p99_ms": pct("request_latency", "p99", 1000.0),
        "output_tokens_per_s": mean("output_tokens_per_second"),
        "requests": totals,
    }
