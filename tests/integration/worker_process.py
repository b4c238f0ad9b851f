"""Start a real worker process for a test and stop it afterwards (shared by the worker tests)."""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sie.auth import write_private


@contextmanager
def running_worker(
    module: str, spec: dict, tmp: Path, *, timeout_s: float = 90.0, extra: tuple[str, ...] = ()
) -> Iterator[tuple[str, dict[str, str]]]:
    """Run `python -m module --spec-file ... --port 0` with a worker key and `tmp` as its model root, as
    a node host would; wait until /health is 200; yield (base URL, the headers that carry the key).
    The process is stopped (SIGTERM, then SIGKILL) and reaped whatever happens."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    key = secrets.token_urlsafe(16)
    key_file = tmp / "worker.key"
    write_private(key_file, key.encode())
    log = open(tmp / "worker.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            "--spec-file",
            str(spec_file),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-key-file",
            str(key_file),
            "--model-root",
            str(tmp),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{_read_port(proc, timeout_s, tmp / 'worker.log')}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{module} did not become healthy; log:\n{_tail(tmp / 'worker.log')}")
            time.sleep(0.1)
        yield base, {"Authorization": f"Bearer {key}"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stdout.close()
        log.close()


def _read_port(proc: subprocess.Popen, timeout_s: float, log: Path) -> int:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("listening on "):
        raise AssertionError(f"expected 'listening on PORT', got {line!r}; log:\n{_tail(log)}")
    return int(line.split()[-1])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
