"""bench.reaction's figures (pure): percentiles per (event, endpoints), the time split, the judged line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.stats import percentile

LIMIT_MS = 1000.0  # issue #3: reaction p99 at most 1 s with 1000 endpoints
AIM_MS = 300.0
PARTS = ("sidecar_to_intake", "intake_to_rebuild", "rebuild_to_push", "push_to_seen")  # they add up to the reaction
INFO_PARTS = ("push_to_ack",)
EVENTS = ("drain-post", "drain-sidecar", "slowdown")


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p99, max (ms); None where there is nothing to summarise."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), 1),
        "p99": round(percentile(values, 99), 1),
        "max": round(max(values), 1),
    }


@dataclass(frozen=True)
class Table:
    text: str
    judged: dict[str, Any]


def mismatched(trial: dict) -> bool:
    """Envoy cannot show a change before the control plane pushed it: a split that says so matched the
    wrong events of the timeline (its figures are then left out of the split's percentiles)."""
    push_to_seen = (trial.get("breakdown_ms") or {}).get("push_to_seen")
    return push_to_seen is not None and push_to_seen < 0


def event_figures(trials: list[dict], event: str) -> dict[str, Any]:
    everything = [t for t in trials if t["event"] == event]
    mine = [t for t in everything if not mismatched(t)]
    seen = [t["reaction_ms"] for t in everything if t["reaction_ms"] is not None]
    parts = {
        p: summarize([t["breakdown_ms"][p] for t in mine if t["breakdown_ms"].get(p) is not None])
        for p in PARTS + INFO_PARTS
    }
    extra = {}
    if event == "slowdown":
        extra["to_half_weight"] = summarize([t["half_ms"] for t in mine if t.get("half_ms") is not None])
    return {
        "trials": len(everything),
        "missed": len(everything) - len(seen),
        "split_mismatched": len(everything) - len(mine),
        "reaction": summarize(seen),
        "parts": parts,
        **extra,
    }


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def render(doc: dict) -> Table:
    lines = [
        "Reaction: trigger -> Envoy's admin shows the new health/weight (ms; p50 / p99 / max over trials)",
        "",
        "| event | endpoints | trials | missed | p50 | p99 | max | p50 of each part: to intake / to rebuild / to push / to seen |",
        "|---|---|---|---|---|---|---|---|",
    ]
    judged: dict[str, Any] = {"limit_ms": LIMIT_MS, "aim_ms": AIM_MS, "endpoints": None, "p99_ms": {}, "pass": None}
    for scale in doc["scales"]:
        for event in EVENTS:
            f = event_figures(scale["trials"], event)
            if not f["trials"]:
                continue
            r = f["reaction"]
            split = " / ".join(_cell(f["parts"][p]["p50"]) for p in PARTS)
            lines.append(
                f"| {event} | {scale['endpoints']} | {f['trials']} | {f['missed']} | {_cell(r['p50'])} | "
                f"{_cell(r['p99'])} | {_cell(r['max'])} | {split} |"
            )
            scale.setdefault("figures", {})[event] = f
            if scale["endpoints"] >= 1000:
                judged["endpoints"] = scale["endpoints"]
                judged["p99_ms"][event] = r["p99"] if not f["missed"] else None
    if judged["p99_ms"]:
        judged["pass"] = all(v is not None and v <= LIMIT_MS for v in judged["p99_ms"].values())
    lines.append("")
    for scale in doc["scales"]:
        cpu = ", ".join(f"{k} {v}" for k, v in scale["cpu_cores"].items())
        lines.append(
            f"{scale['endpoints']} endpoints: telemetry intake {scale['telemetry_records_per_s']}/s; "
            f"CPU cores: {cpu}; load {scale['load']['statuses']}"
        )
        pauses = scale.get("control_plane_pauses")
        if pauses:
            stall, gcs = pauses["stall"], pauses["gc"]
            lines.append(
                f"  control plane event loop late by >= 100 ms: {stall['count']} times (max {_cell(stall['max'])} ms); "
                f"GC pauses >= 20 ms: {gcs['count']} (max {_cell(gcs['max'])} ms)"
            )
        profile = scale.get("control_plane_profile") or {}
        if profile.get("parts"):
            top = ", ".join(f"{k} {v:.0%}" for k, v in profile["parts"].items())
            lines.append(f"  control plane on CPU {profile['busy_fraction']:.0%} of the time: {top}")
        slow = scale.get("figures", {}).get("slowdown")
        if slow and slow.get("to_half_weight", {}).get("n"):
            h = slow["to_half_weight"]
            lines.append(
                f"  slowdown to half weight: p50 {_cell(h['p50'])}, p99 {_cell(h['p99'])}, max {_cell(h['max'])} ms"
            )
    if judged["pass"] is not None:
        verdict = "PASS" if judged["pass"] else "MISS"
        lines.append(
            f"\nJudged (p99 <= {LIMIT_MS:.0f} ms at {judged['endpoints']} endpoints, aim {AIM_MS:.0f}): "
            f"{verdict} {judged['p99_ms']}"
        )
    return Table("\n".join(lines), judged)


def plot(doc: dict, path) -> None:
    """CDF of the reaction per (event, endpoints), log time axis, the 1 s limit and the 300 ms aim marked."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(EVENTS), figsize=(4.2 * len(EVENTS), 3.6), sharey=True)
    for ax, event in zip(axes, EVENTS):
        for scale in doc["scales"]:
            values = sorted(t["reaction_ms"] for t in scale["trials"] if t["event"] == event and t["reaction_ms"])
            if values:
                ax.step(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    where="post",
                    label=f"{scale['endpoints']} endpoints",
                )
        ax.axvline(LIMIT_MS, color="red", linestyle="--", linewidth=1, label="limit 1 s")
        ax.axvline(AIM_MS, color="grey", linestyle=":", linewidth=1, label="aim 300 ms")
        ax.set_xscale("log")
        ax.set_xlim(20, 5000)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(event)
        ax.set_xlabel("trigger -> Envoy holds it (ms)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of trials")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("bench.reaction (xds_server + Envoy 1.40, 2 shared cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
