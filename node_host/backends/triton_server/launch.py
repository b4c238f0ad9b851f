"""How the node host starts one Triton server for one model (pure but for reading the venv's files).

The server is PyPI nvidia-pytriton's `tritonserver` 2.51 binary, in a venv of its own under the node's
engines directory (node_host.engines; FACTS.md "Triton"). What it needs there, measured:

- `--backend-directory`: the binary looks for backends in /opt/tritonserver/backends by default, and the
  wheel ships the Python backend without its stub (pytriton copies the stub of its own interpreter's
  version in at run time); repository.write_backends makes a directory with both (`backend_directory`).
- PATH with the venv's bin first: the Python stub imports the packages of the `python3` it finds on PATH
  (it ignores PYTHONPATH), and numpy from anywhere else makes every answer fail.
- LD_LIBRARY_PATH with the venv interpreter's LIBDIR first: the stub links the system's libpython 3.11
  but imports the interpreter's own standard library; a mismatch fails every model load
  (`'_thread.RLock' object has no attribute '_recursion_count'`). Then the wheel's own libraries
  (`nvidia_pytriton.libs`), which the stub finds by a relative RPATH only where it was installed.

The worker key: `--http-restricted-api` makes every HTTP API but health (inference, the model repository
with its load/unload, metadata, model config, statistics, shared memory, trace and log settings) answer
403 unless the header KEY_HEADER carries the key; `GET /v2/health/*`, `GET /v2/models/M/ready` and the
metrics port stay open. Triton reads the key from its command line only, so a local user who can read
/proc can see it, as with SGLang's --api-key; the server listens on loopback (standalone) or the pod's
loopback (Kubernetes), which bounds who could use it. GRPC is off: it would need a restriction of its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from sie.engines.triton import KEY_HEADER

# Every HTTP API of 2.51 but `health` (tritonserver --help lists them).
RESTRICTED_APIS = (
    "inference",
    "model-repository",
    "metadata",
    "model-config",
    "statistics",
    "shared-memory",
    "trace",
    "logging",
)
# The flag is `<apis>:<header>=<value>`, so a key holding ':', ',', '=' or a space would be cut: SIE's worker
# keys are URL-safe base64 (secrets.token_urlsafe), which never does.
_KEY = re.compile(r"^[A-Za-z0-9._~-]{16,512}$")
EXIT_TIMEOUT_S = 5  # Triton waits this long for requests in flight on SIGTERM (its default, 30, outlasts
# sie.processes' 10 s grace); the sidecar has drained the instance before the node host stops it
_BINARY = "pytriton/tritonserver/bin/tritonserver"


def launch_command(
    *,
    tritonserver: str,
    repository: Path,
    model_id: str,
    host: str,
    http_port: int,
    metrics_port: int,
    api_key: str,
    backend_directory: Path,
) -> list[str]:
    """`tritonserver ...` serving `model_id` from `repository` (repository.write_repository) on `host`:
    HTTP on `http_port`, metrics on `metrics_port` (same address), GRPC off; only the model given loaded
    (explicit control: the repository API loads and unloads it later, which is how it sleeps)."""
    if not _KEY.match(api_key):
        raise ValueError("the worker key must be 16 to 512 characters of A-Z a-z 0-9 . _ ~ - (a token_urlsafe)")
    for name, port in (("http_port", http_port), ("metrics_port", metrics_port)):
        if not 0 < port < 65536:
            raise ValueError(f"{name} must be a TCP port (1-65535), got {port}")
    if http_port == metrics_port:
        raise ValueError(f"http_port and metrics_port must differ, both are {http_port}")
    return [
        tritonserver,
        "--model-repository",
        str(repository),
        "--model-control-mode",
        "explicit",
        "--load-model",
        model_id,
        "--backend-directory",
        str(backend_directory),
        # SIE writes every field of config.pbtxt; auto-completion would start a stub per load to ask the model
        "--disable-auto-complete-config",
        "--http-address",
        host,
        "--http-port",
        str(http_port),
        "--allow-grpc",
        "false",
        "--allow-metrics",
        "true",
        "--metrics-address",
        host,
        "--metrics-port",
        str(metrics_port),
        "--log-verbose",
        "0",
        "--exit-timeout-secs",
        str(EXIT_TIMEOUT_S),
        f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{KEY_HEADER}={api_key}",
    ]


def find_tritonserver(venv: Path) -> Path | None:
    """The `tritonserver` binary nvidia-pytriton installed in `venv`, or None."""
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        binary = site / _BINARY
        if binary.is_file():
            return binary
    return None


def python_version(tritonserver: Path) -> str:
    """The venv's Python version ("3.11"), from the site-packages the binary was installed in."""
    for part in tritonserver.parts:
        if re.fullmatch(r"python3\.[0-9]{1,2}", part):
            return part.removeprefix("python")
    raise ValueError(f"{tritonserver} is not inside a venv's lib/python3.X/site-packages")


def launch_env(*, venv: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set for the server (over `base`, the node host's environment, whose PATH and
    LD_LIBRARY_PATH come after): see the module docstring."""
    base = base or {}
    libs = [str(d) for d in (_interpreter_libdir(venv),) if d is not None]
    binary = find_tritonserver(venv)
    if binary is not None:
        site = binary.parents[3]  # site-packages/pytriton/tritonserver/bin/tritonserver
        libs.append(str(site / "nvidia_pytriton.libs"))
    return {
        "PATH": ":".join(p for p in (str(venv / "bin"), base.get("PATH", "/usr/local/bin:/usr/bin:/bin")) if p),
        "LD_LIBRARY_PATH": ":".join(p for p in (*libs, base.get("LD_LIBRARY_PATH", "")) if p),
        "PYTHONNOUSERSITE": "1",  # the stub imports the venv's packages, not a user's ~/.local ones
    }


def _interpreter_libdir(venv: Path) -> Path | None:
    """The LIBDIR of the interpreter the venv was made from (sysconfig's LIBDIR, read without running it):
    `home` in pyvenv.cfg is its bin directory, LIBDIR the lib beside it when a libpython is there. None when
    it is not (a system interpreter, whose libpython is the one the stub links anyway)."""
    try:
        text = (venv / "pyvenv.cfg").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home":
            libdir = Path(value.strip()).parent / "lib"
            if any(libdir.glob("libpython3*.so*")):
                return libdir
    return None
