"""bench.triton's figures (pure): each path's summary over the rounds, the SIE/direct ratios, the rounds
no other tenant disturbed, issue 39's judged targets, and the table.

A round is one short window per path (`Measured`); the paths alternate, so the summaries pool each
path's rounds (the run's p99 per path) and the ratios compare those pools.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.stats import percentile

PATHS = ("direct", "sie")
LABELS = {"direct": "Triton called directly (KServe v2)", "sie": "through SIE (Envoy -> sidecar -> Triton)"}
RATIO_LIMIT = 1.5
# A round counts as quiet when processes outside this run used at most this many cores during each path's
# window: the machine's other tenants then left both paths alone (bench/proc_cpu.py's `others_cores`).
QUIET_CORES = 0.25


@dataclass(frozen=True)
class Measured:
    """One path's window in one round."""

    latencies_ms: tuple[float, ...]  # of the requests answered 200, from their scheduled send time
    sent: int
    ok: int  # answered 200
    span_s: float  # first send to last answer
    lag_ms: tuple[float, ...] = ()  # how late the client's event loop woke a timer, sampled meanwhile
    others_cores: float = 0.0  # cores that processes outside this run used meanwhile


def summary(windows: Sequence[Measured]) -> dict[str, Any]:
    """One path's figures over its windows: the latencies pooled, the answered rate over the time spent."""
    latencies = [x for w in windows for x in w.latencies_ms]
    lags = [x for w in windows for x in w.lag_ms]
    sent, ok, span = sum(w.sent for w in windows), sum(w.ok for w in windows), sum(w.span_s for w in windows)
    return {
        "sent": sent,
        "ok": ok,
        "errors": sent - ok,
        "achieved_rps": round(ok / span, 1) if span > 0 else 0.0,
        "p50_ms": _ms(percentile(latencies, 50)),
        "p90_ms": _ms(percentile(latencies, 90)),
        "p99_ms": _ms(percentile(latencies, 99)),
        "max_ms": _ms(max(latencies)) if latencies else None,
        "client_lag_p99_ms": _ms(percentile(lags, 99)) if lags else None,
        "others_cores": round(statistics.fmean(w.others_cores for w in windows), 3) if windows else None,
    }


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 3)


def ratio(sie: Mapping[str, Any], direct: Mapping[str, Any], key: str = "p99_ms") -> float | None:
    """sie[key] / direct[key] (3 decimals); None when either is missing or the direct one is 0."""
    s, d = sie.get(key), direct.get(key)
    if s is None or not d:
        return None
    return round(s / d, 3)


def compare(rounds: Sequence[Mapping[str, Measured]]) -> dict[str, Any]:
    """Both paths over the run, their ratios, each round's, and the same over the quiet rounds alone."""
    per_path = {p: summary([r[p] for r in rounds]) for p in PATHS}
    per_round: list[dict[str, Any]] = []
    for i, r in enumerate(rounds):
        each = {p: summary([r[p]]) for p in PATHS}
        per_round.append({"round": i, **each, "p99_ratio": ratio(each["sie"], each["direct"])})
    quiet_rounds = [r for r in rounds if all(r[p].others_cores <= QUIET_CORES for p in PATHS)]
    quiet = {p: summary([r[p] for r in quiet_rounds]) for p in PATHS}
    ratios = [r["p99_ratio"] for r in per_round if r["p99_ratio"] is not None]
    return {
        **per_path,
        "p50_ratio": ratio(per_path["sie"], per_path["direct"], "p50_ms"),
        "p90_ratio": ratio(per_path["sie"], per_path["direct"], "p90_ms"),
        "p99_ratio": ratio(per_path["sie"], per_path["direct"]),
        "p99_ratio_median_of_rounds": round(statistics.median(ratios), 3) if ratios else None,
        "quiet": {
            "max_others_cores": QUIET_CORES,
            "rounds": len(quiet_rounds),
            **quiet,
            "p99_ratio": ratio(quiet["sie"], quiet["direct"]) if quiet_rounds else None,
        },
        "rounds": per_round,
    }


def cpu_per_request(windows: Sequence[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """CPU microseconds per answered request of each process, over one path's windows: each window's
    (process -> cores used, requests answered per second). Parts that were idle on this path (the sidecar
    while Triton is called directly) show their background work: probes, telemetry."""
    rps = statistics.fmean(rate for _, rate in windows) if windows else 0.0
    if rps <= 0:
        return {}
    names = sorted({name for cores, _ in windows for name in cores})
    return {
        name: round(statistics.fmean(cores.get(name, 0.0) for cores, _ in windows) / rps * 1e6, 1) for name in names
    }


def judged(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 39's target: through SIE at 500 requests/s, p99 within 1.5x of Triton called directly, in one
    run (the run's pooled p99 per path); and nothing failed on either path."""
    value = result["p99_ratio"]
    errors = sum(result[p]["errors"] for p in PATHS)
    return [
        {
            "target": f"p99 through SIE <= {RATIO_LIMIT}x Triton called directly at {result['rate_rps']:g} requests/s",
            "value": value,
            "limit": RATIO_LIMIT,
            "holds": value is not None and value <= RATIO_LIMIT,
        },
        {"target": "no failed request (either path)", "value": errors, "limit": 0, "holds": errors == 0},
    ]


def table(result: Mapping[str, Any]) -> str:
    head = ("path", "sent", "errors", "achieved /s", "p50 ms", "p90 ms", "p99 ms", "client lag p99", "others' cores")
    keys = ("sent", "errors", "achieved_rps", "p50_ms", "p90_ms", "p99_ms", "client_lag_p99_ms", "others_cores")
    rows: list[tuple[Any, ...]] = [head]
    rows += [(LABELS[p], *(result[p][k] for k in keys)) for p in PATHS]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in rows]
    for p in PATHS:
        parts = result.get("cpu_us_per_request", {}).get(p)
        if parts:
            lines.append(f"CPU us per request, {p}: " + ", ".join(f"{k} {v}" for k, v in parts.items()))
    quiet = result["quiet"]
    lines.append(
        f"p99 SIE/direct x{result['p99_ratio']} (median of rounds x{result['p99_ratio_median_of_rounds']}; "
        f"rounds: {', '.join(str(r['p99_ratio']) for r in result['rounds'])}); "
        f"p50 x{result['p50_ratio']}, p90 x{result['p90_ratio']}"
    )
    lines.append(
        f"quiet rounds (other tenants <= {quiet['max_others_cores']} cores on both paths): {quiet['rounds']}"
        + (
            f", p99 direct {quiet['direct']['p99_ms']} ms, through SIE {quiet['sie']['p99_ms']} ms "
            f"(x{quiet['p99_ratio']})"
            if quiet["rounds"]
            else ""
        )
    )
    return "\n".join(lines)
