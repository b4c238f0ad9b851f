"""bench.tiers' figures, ratios, judged targets and table (pure)."""

from __future__ import annotations

import math
from typing import Any

from bench.stats import percentile

SCENARIOS = ["a", "b", "c", "c0", "a1"]  # c0 and a1, diagnostics, run in full runs only (QUICK)
QUICK = ["a", "b", "c"]
NAMES = {
    "a": "a  scorer alone",
    "b": "b  beside the loaded LLM, shared cores",
    "c": "c  beside the loaded LLM, SIE's tiers",
    "c0": "c0 same, clients on any core (diagnostic)",
    "a1": "a1 alone, on its tier's core (diagnostic)",
}
LIMIT_P99_RATIO = 1.3  # issue 16: with tiers, the scorer's p99 beside a loaded LLM <= 1.3x alone


def llm_figures(rows: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """The LLM's throughput and latency over [start, end] (requests that finished in it), and every
    failed request of its whole run."""
    inside = [r for r in rows if start <= r["end"] <= end and r["status"] == 200]
    seconds = max(end - start, 1e-9)
    lat = [(r["end"] - r["start"]) * 1000 for r in inside]
    return {
        "requests": len(inside),
        "requests_per_s": round(len(inside) / seconds, 3),
        "tokens_per_s": round(sum(r["tokens"] for r in inside) / seconds, 1),
        "p50_ms": round(percentile(lat, 50), 1) if lat else math.nan,
        "p99_ms": round(percentile(lat, 99), 1) if lat else math.nan,
        "failed": sum(1 for r in rows if r["status"] != 200),
        "sent": len(rows),
    }


def counted(runs: list[dict[str, Any]], scenario: str) -> list[dict[str, Any]]:
    """The runs of a scenario its figures count: the clean ones (another user of the machine took no
    more than the noise bound meanwhile), or every one if none was clean."""
    mine = [r for r in runs if r["scenario"] == scenario]
    return [r for r in mine if not r["noisy"]] or mine


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario's figures over its runs: the scorer's latencies pooled (a p99 over every sample), the
    LLM's and the CPU figures averaged."""
    lat = [x for r in runs for x in r["scorer_latencies_ms"]]
    out: dict[str, Any] = {
        "runs": len(runs),
        "scorer": {
            "requests": sum(r["scorer"]["requests"] for r in runs),
            "failed": sum(r["scorer_failed"] for r in runs),
            "p50_ms": round(percentile(lat, 50), 3),
            "p99_ms": round(percentile(lat, 99), 3),
            "p999_ms": round(percentile(lat, 99.9), 3),
            "mean_ms": round(sum(lat) / len(lat), 3) if lat else None,
        },
        "llm": None,
        "cores_busy": _mean_maps([r["cpu"]["cores_busy"] for r in runs]),
        "process_cores": _mean_maps([r["cpu"]["process_cores"] for r in runs]),
        "bench_cores": round(sum(r["cpu"]["ours_cores"] for r in runs) / len(runs), 3),
        "others_cores": round(sum(r["cpu"]["others_cores"] for r in runs) / len(runs), 3),
    }
    llms = [r["llm"] for r in runs if r["llm"] is not None]
    if llms:
        out["llm"] = {
            "requests_per_s": round(sum(x["requests_per_s"] for x in llms) / len(llms), 3),
            "tokens_per_s": round(sum(x["tokens_per_s"] for x in llms) / len(llms), 1),
            "p50_ms": round(sum(x["p50_ms"] for x in llms) / len(llms), 1),
            "p99_ms": round(max(x["p99_ms"] for x in llms), 1),
            "failed": sum(x["failed"] for x in llms),
        }
    return out


def _mean_maps(maps: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for m in maps for k in m})
    return {k: round(sum(m.get(k, 0.0) for m in maps) / len(maps), 3) for k in keys}


def ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The scorer's p50 and p99 beside the loaded LLM over alone, without tiers (b/a) and with (c/a); the
    LLM's throughput with tiers over without (c/b); in full runs, the diagnostics' ratios."""
    a, b, c = (figures[s]["scorer"] for s in ("a", "b", "c"))
    out = {
        "scorer_p99_b_over_a": round(b["p99_ms"] / a["p99_ms"], 3),
        "scorer_p99_c_over_a": round(c["p99_ms"] / a["p99_ms"], 3),
        "scorer_p50_b_over_a": round(b["p50_ms"] / a["p50_ms"], 3),
        "scorer_p50_c_over_a": round(c["p50_ms"] / a["p50_ms"], 3),
    }
    if "c0" in figures:  # the diagnostic: the clients left anywhere (full runs)
        out["scorer_p99_c0_over_a"] = round(figures["c0"]["scorer"]["p99_ms"] / a["p99_ms"], 3)
    if "a1" in figures:  # the diagnostic: c/a split into the pinning (a1/a) and the LLM beside it (c/a1)
        a1 = figures["a1"]["scorer"]
        out["scorer_p99_a1_over_a"] = round(a1["p99_ms"] / a["p99_ms"], 3)
        out["scorer_p99_c_over_a1"] = round(c["p99_ms"] / a1["p99_ms"], 3)
    llm_b, llm_c = figures["b"]["llm"], figures["c"]["llm"]
    if llm_b and llm_c and llm_b["tokens_per_s"]:
        out["llm_tokens_per_s_c_over_b"] = round(llm_c["tokens_per_s"] / llm_b["tokens_per_s"], 3)
    return out


def judged(
    figures: dict[str, dict[str, Any]], r: dict[str, float], noisy: list[str] | None = None
) -> list[dict[str, Any]]:
    """The issue's targets; `noisy`: scenarios with no clean run, named in a note on the ratio's target."""
    failed = sum(f["scorer"]["failed"] + ((f["llm"] or {}).get("failed") or 0) for f in figures.values())
    note = {"note": f"scenarios {', '.join(noisy)} had no clean run: another user of the machine"} if noisy else {}
    return [
        {
            "target": "with tiers, the scorer's p99 beside a loaded LLM is at most 1.3x its p99 alone (c/a); "
            f"without tiers (b/a) it is {r['scorer_p99_b_over_a']}x",
            "value": r["scorer_p99_c_over_a"],
            "limit": LIMIT_P99_RATIO,
            "holds": r["scorer_p99_c_over_a"] <= LIMIT_P99_RATIO,
            **note,
        },
        {
            "target": "no failed request (the scorer's and the LLM's, every scenario)",
            "value": failed,
            "limit": 0,
            "holds": failed == 0,
        },
    ]


def table(figures: dict[str, dict[str, Any]], r: dict[str, float]) -> str:
    head = (
        f"{'scenario':<40} {'p50 ms':>7} {'p99 ms':>7} {'p99.9':>7} {'failed':>6}  "
        f"{'LLM tok/s':>9} {'LLM p99 ms':>10}  cores busy"
    )
    lines = [head]
    for s in figures:
        f = figures[s]
        sc, llm = f["scorer"], f["llm"]
        cores = " ".join(f"cpu{c}={b:.0%}" for c, b in f["cores_busy"].items())
        lines.append(
            f"{NAMES[s]:<40} {sc['p50_ms']:>7.2f} {sc['p99_ms']:>7.2f} {sc['p999_ms']:>7.2f} {sc['failed']:>6}  "
            + (f"{llm['tokens_per_s']:>9.0f} {llm['p99_ms']:>10.0f}" if llm else f"{'-':>9} {'-':>10}")
            + f"  {cores}"
        )
    lines.append(
        f"scorer p99 beside the loaded LLM / alone: {r['scorer_p99_b_over_a']}x with shared cores, "
        f"{r['scorer_p99_c_over_a']}x with SIE's tiers (limit {LIMIT_P99_RATIO}x)"
    )
    if "scorer_p99_a1_over_a" in r:
        lines.append(
            f"diagnostic: alone on its tier's core {r['scorer_p99_a1_over_a']}x alone (a1/a); the loaded LLM on "
            f"the other cores {r['scorer_p99_c_over_a1']}x that (c/a1)"
        )
    return "\n".join(lines)
