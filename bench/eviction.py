"""Eviction under pressure: a P0 model arrives on a GPU a serving P2 model fills (DESIGN.md section 6).

    python -m bench.eviction [--quick] [--modes drain,kill,off]

The stack is `sie up -f examples/eviction.yaml` (one virtual 80 GiB GPU, `sim` workers: a simulator of
SGLang's timing, not a model): chat-p2 has two 28 GiB instances on the GPU and serves open-loop Poisson
load through Envoy. Then, in one run, once per node-host eviction mode (a fresh stack each):

  drain  SIE: the P0 model is added (POST /v1/models, 30 GiB); the node host picks a P2 instance as the
         victim, its sidecar drains it (DRAINING in EDS, in-flight requests finish), the worker releases
         its memory (sleeping), and only then the P0 instance starts;
  kill   baseline: the victim's worker is SIGKILLed at once, as an OOM kill would (no drain);
  off    baseline: no pre-eviction; the P0 instance waits for memory that never comes.

In each: a P0 burst (open loop) once P0 answers, then the P0 model is deleted and the victim should wake.
One long request is pinned on each P2 instance just before the P0 model arrives, so a drain always has
work in flight to finish (or, in "kill", to lose). The scenario itself is bench/eviction_scenario.py.

Figures per mode: P0 errors; P2 requests lost (neither 200 nor a retryable 503/429, transport errors
included); retryable refusals; time from the pressure event (P0 added) to the victim's memory released
in the ledger (node host events), to P0 serving (first 200 through Envoy), and from P0 deleted to the
victim woken. Writes bench/results/eviction.json, bench/results/eviction.png (P2 requests over time,
per mode) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.eviction_scenario import P0, QUICK, Plan, Urls, run_scenario
from sie.standalone import envoy_admin_socket
from sie_testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CLUSTER = ROOT / "examples" / "eviction.yaml"
MODES = ("drain", "kill", "off")


# ---- the stack -----------------------------------------------------------------------------------


def cluster_text(mode: str) -> str:
    text = CLUSTER.read_text()
    assert "  virtual_gpus: 1x80GB\n" in text, f"{CLUSTER} changed; update bench/eviction.py"
    return text.replace("  virtual_gpus: 1x80GB\n", f'  virtual_gpus: 1x80GB\n  eviction: "{mode}"\n')


def start_stack(workdir: Path, mode: str, timeout_s: float = 180.0) -> tuple[subprocess.Popen, Urls]:
    """`sie up` on free ports with the example cluster in `mode`; returns once every model serves."""
    cluster = workdir / "eviction.yaml"
    cluster.write_text(cluster_text(mode))
    ports = {name: free_port() for name in ("envoy", "envoy_admin", "admin", "xds")}
    log_path = workdir / "sie-up.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sie",
                "up",
                "-f",
                str(cluster),
                "--envoy-port",
                str(ports["envoy"]),
                "--envoy-admin-port",
                str(ports["envoy_admin"]),
                "--admin-port",
                str(ports["admin"]),
                "--xds-port",
                str(ports["xds"]),
                "--run-dir",
                str(workdir / "run"),
                "--timeout",
                str(timeout_s),
            ],
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.time() + timeout_s + 30
    while "SIE is up" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.time() > deadline:
            stop_stack(proc)
            raise RuntimeError(f"sie up did not come up (mode {mode}):\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    node = json.loads((workdir / "run" / "node_host.json").read_text())["address"]
    token = (workdir / "run" / "credentials" / "admin.token").read_text().strip()  # what `sie up` made
    return proc, Urls(
        f"http://127.0.0.1:{ports['envoy']}",
        envoy_admin_socket(workdir / "run"),
        f"http://127.0.0.1:{ports['admin']}",
        node,
        token,
    )


def stop_stack(proc: subprocess.Popen) -> None:
    """Ctrl-C for `sie up` (it stops its children by pid), then SIGKILL its group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# ---- main ----------------------------------------------------------------------------------------


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        ("P0 errors / P0 requests", lambda r: f"{r['p0']['errors']} / {r['p0']['requests']}"),
        ("P2 accepted requests lost", lambda r: str(r["p2"]["lost"])),
        ("P2 retryable refusals (503/429)", lambda r: str(r["p2"]["retryable_refusals"])),
        ("P2 requests", lambda r: str(r["p2"]["requests"])),
        ("long in-flight P2 requests", lambda r: " ".join(map(str, r["p2"]["long_requests"]))),
        ("P0 added -> victim memory released (s)", lambda r: _s(r["seconds_from_p0_added"]["memory_released"])),
        ("  of which drain (s)", lambda r: _s(r["drain_s"])),
        ("P0 added -> P0 serving (s)", lambda r: _s(r["seconds_from_p0_added"]["p0_serving"])),
        ("P0 deleted -> victim woken (s)", lambda r: _s(r["seconds_from_p0_deleted"]["victim_woken"])),
        ("P0 deleted -> P2 x2 in Envoy (s)", lambda r: _s(r["seconds_from_p0_deleted"]["p2_back_in_envoy"])),
        ("inference_evictions_total", lambda r: f"{r['evictions_total']:g}"),
        ("P2 p99 ms", lambda r: _s(r["p2"]["latency"].get("p99_ms"))),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{m:>12}" for m in results)]
    for name, cell in rows:
        lines.append(f"{name:{width}}  " + "  ".join(f"{cell(r):>12}" for r in results.values()))
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """P2 request latency over time per mode (red: lost), with the pressure timeline marked."""
    import matplotlib  # noqa: PLC0415 - only when writing the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.6 * len(results)), sharex=True, squeeze=False)
    for ax, (mode, r) in zip(axes[:, 0], results.items()):
        points = r["p2_points"]
        ok = [(s, ms) for s, ms, status in points if status == 200]
        bad = [(s, ms) for s, ms, status in points if status != 200]
        ax.scatter([p[0] for p in ok], [p[1] for p in ok], s=6, color="tab:blue", label="P2 200")
        ax.scatter([p[0] for p in bad], [p[1] for p in bad], s=30, color="tab:red", marker="x", label="P2 not 200")
        ax.axvline(0.0, color="black", lw=1, label="P0 added")
        for name, color in (
            ("memory_released", "tab:green"),
            ("p0_serving", "tab:orange"),
            ("p0_deleted", "tab:gray"),
            ("victim_woken", "tab:purple"),
        ):
            if r["marks"].get(name) is not None:
                ax.axvline(r["marks"][name], color=color, lw=1, ls="--", label=name.replace("_", " "))
        ax.set_title(
            f"{mode}: P0 errors {r['p0']['errors']}/{r['p0']['requests']}, P2 lost {r['p2']['lost']} "
            f"(incl. the long requests pinned on each instance: {r['p2']['long_requests']})",
            fontsize=9,
        )
        ax.set_ylabel("P2 latency ms")
    axes[-1, 0].set_xlabel("seconds from the pressure event (P0 model added); sim workers on a virtual GPU")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _s(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def judged(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets this benchmark holds SIE to, from one run's modes side by side: with drain-then-sleep
    the P0 model serves every request and no accepted P2 request is lost, while without eviction (the
    baseline) the P0 model cannot be served at all."""
    checks: list[dict[str, Any]] = []

    def check(target: str, value: float, limit: float, holds: bool) -> None:
        checks.append({"target": target, "value": value, "limit": limit, "holds": holds})

    if "drain" in results:
        drain = results["drain"]
        p0_errors = drain["p0"]["errors"] / max(1, drain["p0"]["requests"])
        check("drain: P0 error ratio == 0", round(p0_errors, 4), 0.0, p0_errors == 0)
        check("drain: P2 accepted requests lost == 0", drain["p2"]["lost"], 0, drain["p2"]["lost"] == 0)
        serving = drain["seconds_from_p0_added"].get("p0_serving")
        check(
            "drain: P0 serving <= 10 s after it was added",
            serving if serving is not None else -1,
            10.0,
            serving is not None and serving <= 10.0,
        )
    if "off" in results and "drain" in results:
        off = results["off"]
        off_errors = off["p0"]["errors"] / max(1, off["p0"]["requests"])
        check(
            "off (baseline): P0 error ratio > 0.5 (eviction is what lets P0 in)",
            round(off_errors, 4),
            0.5,
            off_errors > 0.5,
        )
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eviction", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases and lower rates")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "eviction.json")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"sie-bench-eviction-{mode}-") as tmp:
            started = time.time()
            proc, urls = start_stack(Path(tmp), mode)
            try:
                print(f"[{mode}] stack up in {time.time() - started:.1f} s; running the scenario", flush=True)
                results[mode] = asyncio.run(run_scenario(urls, plan))
            finally:
                stop_stack(proc)
    doc: dict[str, Any] = {
        "benchmark": "eviction",
        "setup": {
            "cluster": str(CLUSTER.relative_to(ROOT)),
            "plan": asdict(plan),
            "quick": args.quick,
            "gpus": "1 virtual GPU of 80 GiB (simulated; no real GPU memory is involved)",
            "workers": "sim (SGLang timing simulator), not real models",
            "p0_model": P0,
            "command": "python -m bench.eviction" + (" --quick" if args.quick else ""),
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "results": results,
        "judged": judged(results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    for c in doc["judged"]:
        print(f"{'PASS' if c['holds'] else 'FAIL'}  {c['target']}: {c['value']}")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
