"""Turning xds_server's /v1/status into the table `sie up` and `sie status` print (pure)."""

from __future__ import annotations

from typing import Any

from sie.records import cut


def model_rows(status: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for m in status.get("models", []):
        instances = m.get("instances", [])
        counts: dict[str, int] = {}
        for inst in instances:
            state = inst.get("state", "unknown")
            counts[state] = counts.get(state, 0) + 1
        state = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "placing"
        rows.append(
            {
                "MODEL": m.get("model_id", "?"),
                "PRIORITY": m.get("priority", "?"),
                "TYPE": m.get("service_type", "?"),
                "BACKEND": m.get("backend", "?"),
                "INSTANCES": f"{counts.get('ready', 0)}/{m.get('desired_replicas', len(instances))}",
                "STATE": state,
                "ROLLOUT": rollout_cell(m.get("rollout")),
                "SCALING": scaling_cell(m.get("autoscale")),
            }
        )
    return rows


def scaling_cell(autoscale: dict[str, Any] | None) -> str:
    """`sie: up: demand ... ` for an autoscaled model, `-` for a fixed one."""
    if not autoscale:
        return "-"
    return f"{autoscale.get('by')} -> {autoscale.get('desired')}: {str(autoscale.get('reason', ''))[:60]}"


def rollout_cell(rollout: dict[str, Any] | None) -> str:
    """`1.0->2.0 50% (step 1/2)` while a rollout runs, its outcome once it ended, `-` without one."""
    if not rollout:
        return "-"
    versions = f"{rollout.get('from_version')}->{rollout.get('to_version')}"
    phase = rollout.get("phase")
    if phase in ("progressing", "paused"):
        paused = " paused" if phase == "paused" else ""
        return f"{versions} {rollout.get('share', 0)}% (step {rollout.get('step')}/{rollout.get('steps')}){paused}"
    return f"{versions} {phase}"


def instance_rows(status: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for m in status.get("models", []):
        for inst in m.get("instances", []):
            rows.append(
                {
                    "INSTANCE": inst.get("instance_id", "?"),
                    "STATE": inst.get("state", "?"),
                    "ADDRESS": inst.get("address") or "-",
                    "NODE": inst.get("node") or "-",
                    "CPUS": cpus_cell(inst),
                    "BUILD": inst.get("build", "-"),
                    "WEIGHT": str(inst.get("weight", "-")),
                    "IN-FLIGHT": str(inst.get("in_flight", "-")),
                    # The engine's own figures (sie.engines): its KV cache in use and its queue.
                    "KV": f"{100 * inst['kv_usage']:.0f}%" if inst.get("kv_usage") is not None else "-",
                    "ENGINE-Q": str(inst["engine_waiting"]) if inst.get("engine_waiting") is not None else "-",
                    "CACHE-HIT": f"{100 * inst['cache_hit_rate']:.0f}%"
                    if inst.get("cache_hit_rate") is not None
                    else "-",
                    # Why it waits, sleeps or failed; else why it is where it is (placement's reason).
                    "DETAIL": _short(inst.get("detail") or inst.get("placement") or ""),
                }
            )
    return rows


def cpus_cell(inst: dict[str, Any]) -> str:
    """The cores an instance may use: its node host's CPU list when it pins it (--tier-cpus), `all` when it
    runs unpinned, `-` when no node host reports it (pending, or a Kubernetes pod)."""
    cpus = inst.get("cpus")
    if cpus is None:
        return "-"
    return str(cpus) or "all"


def node_rows(status: dict[str, Any], now: float) -> list[dict[str, str]]:
    """One row per node: its health (ready, or lost since when), GPUs, instances, and its last event."""
    last: dict[str, dict[str, Any]] = {}
    for event in status.get("node_events", []):
        last[event.get("node", "?")] = event
    rows = []
    for node in status.get("nodes", []):
        name = node.get("node", "?")
        health = node.get("health") or ("ready" if node.get("live") else "lost")
        if health == "lost" and node.get("lost_at"):
            health += f" {max(0.0, now - float(node['lost_at'])):.0f}s"
        failed = [g for g in node.get("gpus") or [] if g.get("failed")]
        event = last.get(name)
        rows.append(
            {
                "NODE": name,
                "HEALTH": health,
                "SEEN": f"{node.get('last_seen_age_s', 0):.1f}s ago",
                "GPUS": f"{len(node.get('gpus') or [])}" + (f" ({len(failed)} failed)" if failed else ""),
                "INSTANCES": str(node.get("instances", 0)),
                "LAST EVENT": _short(f"{event['kind']}: {event.get('detail', '')}", 80) if event else "-",
            }
        )
    return rows


def gpu_rows(status: dict[str, Any]) -> list[dict[str, str]]:
    """One row per GPU of every node; virtual GPUs (--virtual-gpus) are labelled as such."""
    rows = []
    for node in status.get("nodes", []):
        for gpu in node.get("gpus") or []:
            total = gpu.get("total_mb") or 0
            used = gpu.get("used_mb") or 0
            util = gpu.get("utilization")
            rows.append(
                {
                    "NODE": node.get("node", "?"),
                    "GPU": str(gpu.get("index", "?")),
                    "KIND": "virtual" if gpu.get("virtual") else gpu.get("name", "gpu"),
                    "MEMORY": f"{used / 1024:.1f}/{total / 1024:.1f} GiB ({100 * used / total:.0f}%)" if total else "-",
                    "UTIL": f"{100 * util:.0f}%" if util is not None else "-",
                    "HEALTH": _short(f"failed: {gpu['failed']}", 60) if gpu.get("failed") else "ok",
                }
            )
    return rows


def _short(text: str, width: int = 110) -> str:
    """The node's detail (why an instance waits, sleeps or failed), on one line."""
    return cut(" ".join(text.split()), width)


def printable(text: str) -> str:
    """`text` with every character a terminal would act on written as its escape (ESC as \\x1b, a newline
    as \\n, a bidi override as \\u202e). What `sie` prints of the cluster comes from node hosts and specs,
    and a node may speak only for itself: raw, an instance's detail could clear the operator's screen,
    retitle the terminal or print rows that are not there."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def render(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(none)"
    headers = list(rows[0])
    cells = [{h: printable(str(r.get(h, ""))) for h in headers} for r in rows]
    widths = {h: max(len(h), *(len(c[h]) for c in cells)) for h in headers}
    lines = ["  ".join(h.ljust(widths[h]) for h in headers)]
    for c in cells:
        lines.append("  ".join(c[h].ljust(widths[h]) for h in headers))
    return "\n".join(line.rstrip() for line in lines)


def curl_examples(status: dict[str, Any], envoy_url: str) -> list[str]:
    lines = []
    for m in status.get("models", []):
        model_id = m.get("model_id")
        if m.get("service_type") == "llm":
            lines.append(
                f"curl -s {envoy_url}/v1/chat/completions -H 'content-type: application/json' "
                f'-d \'{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello"}}], '
                f'"max_tokens": 16}}\''
            )
        else:
            lines.append(
                f"curl -s {envoy_url}/v1/models/{model_id}/infer -H 'content-type: application/json' "
                f'-d \'{{"text": "wire transfer to a new account"}}\''
            )
    return lines
