"""bench/routing's figures (pure) and their outputs: the table, the JSON, the CDF plot.

One `Run` is one mode x scenario x repeat on a fresh stack. Figures of a mode x scenario are the
median over its repeats, figure by figure (so a noisy repeat moves no median by itself); the CDFs pool
the repeats' samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.stats import Sample, Summary, cdf_points, percentile, summarize

MODES = ("rr", "lr", "sie")
MODE_NAMES = {
    "rr": "Envoy ROUND_ROBIN",
    "lr": "Envoy LEAST_REQUEST, equal weights",
    "sie": "SIE weights + LEAST_REQUEST",
}
SCENARIOS = ("a", "b")
FIGURES = ("p50_ms", "p99_ms", "p999_ms", "sla_attainment", "throughput_rps", "errors")


@dataclass
class Run:
    mode: str
    scenario: str
    repeat: int
    samples: list[Sample]  # measured requests only; scheduled_s from the start of the measured part
    duration_s: float
    timeline: list[tuple[float, dict[str, dict]]] = field(default_factory=list)  # (t, Envoy's hosts)
    events: list[tuple[float, str]] = field(default_factory=list)  # (t, what) e.g. the slowdown

    def summary(self, sla_ms: float) -> Summary:
        return summarize(self.samples, sla_ms, self.duration_s)


def median_figures(runs: Sequence[Run], sla_ms: float) -> dict:
    summaries = [r.summary(sla_ms) for r in runs]
    out: dict[str, float | dict[str, float]] = {
        name: _median([getattr(s, name) for s in summaries]) for name in FIGURES
    }
    instances = sorted({k for s in summaries for k in s.share})
    out["share"] = {k: _median([s.share.get(k, 0.0) for s in summaries]) for k in instances}
    out["repeats"] = len(runs)
    return out


def per_instance(run: Run, since_s: float = float("-inf")) -> dict[str, dict]:
    """Each instance's answered requests (scheduled after `since_s`) with their p50 and p99 in ms."""
    by: dict[str, list[float]] = {}
    for s in run.samples:
        if s.status == 200 and s.scheduled_s >= since_s:
            by.setdefault(s.instance, []).append(s.latency_s * 1000)
    return {
        k: {"n": len(v), "p50_ms": round(percentile(v, 50), 1), "p99_ms": round(percentile(v, 99), 1)}
        for k, v in sorted(by.items())
    }


def share_after(run: Run, instance: str, since_s: float) -> float | None:
    """The instance's share of the requests scheduled after `since_s` that were answered 200."""
    ok = [s for s in run.samples if s.scheduled_s >= since_s and s.status == 200]
    return sum(1 for s in ok if s.instance == instance) / len(ok) if ok else None


def weight_reaction(run: Run, instance: str, since_s: float) -> dict:
    """When Envoy's weight of `instance` first fell after `since_s`, and how low it went (from the timeline)."""
    before = [hosts.get(instance, {}).get("weight") for t, hosts in run.timeline if t < since_s]
    start = next((w for w in reversed(before) if w is not None), None)
    after = [(t, hosts.get(instance, {}).get("weight")) for t, hosts in run.timeline if t >= since_s]
    first = next((t - since_s for t, w in after if w is not None and start is not None and w < start), None)
    low = min((w for _, w in after if w is not None), default=None)
    return {"weight_before": start, "first_drop_after_s": first, "lowest_weight": low}


def share_series(run: Run, instance: str, bin_s: float = 1.0) -> list[tuple[float, float]]:
    """(bin start, the instance's share of the requests scheduled in that bin), for the plot."""
    bins: dict[int, list[int]] = {}
    for s in run.samples:
        if s.status == 200:
            counts = bins.setdefault(int(s.scheduled_s // bin_s), [0, 0])
            counts[0] += s.instance == instance
            counts[1] += 1
    return [(k * bin_s, c[0] / c[1]) for k, c in sorted(bins.items())]


def ratios(results: dict[str, dict[str, dict]]) -> dict:
    out = {}
    for scenario, by_mode in results.items():
        sie = by_mode.get("sie")
        for base in ("rr", "lr"):
            other = by_mode.get(base)
            if sie and other:
                out[f"{scenario}: SIE/{base.upper()} p99"] = _ratio(sie["p99_ms"], other["p99_ms"])
                out[f"{scenario}: SIE/{base.upper()} p50"] = _ratio(sie["p50_ms"], other["p50_ms"])
    return out


def judged(results: dict[str, dict[str, dict]], r: dict) -> list[dict]:
    """The targets of issue #3, each with its measured value and whether it holds."""
    checks: list[dict[str, object]] = []

    def check(name: str, value: float | None, limit: float, above: bool = False) -> None:
        ok = value is not None and not math.isnan(value) and (value >= limit if above else value <= limit)
        checks.append({"target": name, "value": value, "limit": limit, "holds": ok})

    if "b" in results:
        check("b: SIE p99 <= 0.5 x ROUND_ROBIN's", r.get("b: SIE/RR p99"), 0.5)
        check("b: SIE p99 <= 0.8 x LEAST_REQUEST's", r.get("b: SIE/LR p99"), 0.8)
        sie = results["b"].get("sie")
        check("b: SIE SLA attainment >= 99%", sie["sla_attainment"] if sie else None, 0.99, above=True)
    if "a" in results:
        value = r.get("a: SIE/LR p99")
        checks.append(
            {
                "target": "a: SIE p99 within 5% of LEAST_REQUEST's",
                "value": value,
                "limit": [0.95, 1.05],
                "holds": value is not None and abs(value - 1.0) <= 0.05,
            }
        )
    return checks


def table(results: dict[str, dict[str, dict]], sla_ms: float) -> str:
    instances = sorted({k for by_mode in results.values() for f in by_mode.values() for k in f["share"]})
    head = (
        f"{'scenario':<9}{'mode':<6}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'SLA ' + f'{sla_ms:g}ms':>12}"
        f"{'req/s':>8}{'errors':>8}  share " + " ".join(f"{i:>7}" for i in instances)
    )
    lines = [head, "-" * len(head)]
    for scenario, by_mode in results.items():
        for mode, f in by_mode.items():
            shares = " ".join(f"{f['share'].get(i, 0.0):>7.1%}" for i in instances)
            lines.append(
                f"{scenario:<9}{mode:<6}{f['p50_ms']:>9.0f}{f['p99_ms']:>9.0f}{f['p999_ms']:>10.0f}"
                f"{f['sla_attainment']:>12.2%}{f['throughput_rps']:>8.1f}{f['errors']:>8.0f}        {shares}"
            )
    return "\n".join(lines)


def plot(path: Path, runs: Sequence[Run], sla_ms: float, slowed: str, slow_at_s: float | None, title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    colors = {"rr": "tab:red", "lr": "tab:blue", "sie": "tab:green"}
    for ax, scenario in zip(axes[:2], SCENARIOS):
        for mode in MODES:
            lat = [
                s.latency_s * 1000
                for r in runs
                if (r.mode, r.scenario) == (mode, scenario)
                for s in r.samples
                if s.status == 200
            ]
            if lat:
                xs, ys = zip(*cdf_points(lat, 400))
                ax.plot(xs, ys, label=f"{mode}: {MODE_NAMES[mode]}", color=colors[mode])
        ax.axvline(sla_ms, color="grey", linestyle="--", linewidth=1, label=f"SLA p99 {sla_ms:g} ms")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator([200, 500, 1000, 2000, 5000, 10000, 20000]))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0.5, 1.001)
        ax.set_title({"a": "(a) four equal instances", "b": "(b) one 3x slower mid-run, one with 1/4 KV"}[scenario])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    ax = axes[2]
    for mode in MODES:
        first = next((r for r in runs if (r.mode, r.scenario) == (mode, "b")), None)
        if first is not None:
            xs, ys = zip(*share_series(first, slowed)) if first.samples else ((), ())
            ax.plot(xs, ys, label=mode, color=colors[mode])
    if slow_at_s is not None:
        ax.axvline(slow_at_s, color="black", linestyle=":", label="3x slowdown")
    ax.set_xlabel("time (s, scheduled send)")
    ax.set_ylabel(f"share of requests to {slowed}")
    ax.set_title("(b) traffic to the slowed instance, per second (first repeat)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _median(values: list[float]) -> float:
    known = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(known) if known else math.nan


def _ratio(a: float, b: float) -> float | None:
    return None if not b or math.isnan(a) or math.isnan(b) else round(a / b, 3)
