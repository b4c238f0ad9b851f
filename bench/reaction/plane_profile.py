"""Where the control plane's CPU goes while the reaction is measured: a py-spy sample of the xds_server
process, summed into the parts of its work (the summary is pure; py-spy is optional).

    profile = PlaneProfile.start(pid, seconds, out_path)   # py-spy record -f raw, in the background
    ...
    summary = profile.finish()                             # {"samples", "busy_fraction", "parts": {...}}

Each sample is one stack of the main thread while it is on CPU (py-spy leaves idle samples out), and
falls in the first part whose marker its stack contains, in the order of PARTS; `busy_fraction` is the
share of the sampling period the process was running Python code at all.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

RATE_HZ = 200
# (part, markers): a stack belongs to the first part one of whose markers it contains.
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("heartbeat intake (POST /v1/nodes/heartbeat)", ("heartbeat (xds_server/admin.py",)),
    ("telemetry intake (POST /v1/telemetry)", ("telemetry (xds_server/admin.py",)),
    ("control loop (decide, build, publish, ADS responses)", ("ControlLoop.run", "rebuild (")),
    ("sweeps", ("run_sweeps",)),
    ("ADS streams (gRPC reads and writes)", ("ads.py", "grpc")),
    ("HTTP server (aiohttp parsing, writing, keep-alive)", ("web_protocol.py", "http_parser", "http_writer")),
)


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def summarize_raw(lines: list[str], seconds: float, rate_hz: int = RATE_HZ) -> dict:
    """py-spy's raw format: `frame;frame;... COUNT` per distinct stack."""
    parts: Counter[str] = Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        for name, markers in PARTS:
            if any(m in stack for m in markers):
                parts[name] += n
                break
        else:
            parts["other"] += n
    return {
        "samples": total,
        "busy_fraction": round(total / (seconds * rate_hz), 3) if seconds > 0 else None,
        "parts": {name: round(n / total, 3) for name, n in parts.most_common()} if total else {},
    }


@dataclass
class PlaneProfile:
    proc: subprocess.Popen | None
    out: Path
    seconds: float

    @classmethod
    def start(cls, pid: int, seconds: float, out: Path) -> PlaneProfile:
        binary = py_spy()
        if binary is None:
            return cls(None, out, seconds)
        proc = subprocess.Popen(
            [
                binary,
                "record",
                "-p",
                str(pid),
                "-d",
                str(int(seconds)),
                "-r",
                str(RATE_HZ),
                "-f",
                "raw",
                "-o",
                str(out),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return cls(proc, out, seconds)

    def finish(self) -> dict:
        if self.proc is None:
            return {"skipped": "py-spy is not installed (pip install py-spy)"}
        try:
            self.proc.wait(timeout=self.seconds + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return {"skipped": "py-spy did not finish"}
        if not self.out.exists():
            return {"skipped": f"py-spy wrote nothing (exit code {self.proc.returncode})"}
        return summarize_raw(self.out.read_text().splitlines(), self.seconds)
