"""The node host process: composition root.

    python -m node_host --control-url http://127.0.0.1:8000 --node NAME --host 127.0.0.1 --port 0 \
        --run-dir DIR --token-file NODE.token --trust-file TRUST.pem [--model-root DIR ...] \
        [--allow-unsafe-model-formats] [--allow-remote-code] [--virtual-gpus 2x80GB] \
        [--high-watermark 0.9 --low-watermark 0.75] [--gpu-tiers 0=gold,1=gold --p0-only-tiers gold] \
        [--tier-cpus gold=0] [--eviction drain|kill|off] [--drain-timeout-s 20] [--<tunable> VALUE ...]

Every flag but sie.model_files' is a field of a dataclass in node_host/settings.py, its docstring the
--help text; the tunables are also the cluster file's `settings.node_host`.

It runs the instances the control plane assigns to this node (a worker and a sidecar each) under a
per-GPU memory ledger read once at start (NVML, or the declared --virtual-gpus), evicts lower
priorities before memory runs out, restarts what crashes, and on SIGTERM/SIGINT stops them all,
sidecars first, and exits leaving no process.
Logs of the children: DIR/logs/<instance>.worker.log and .sidecar.log. DIR/node_host.json holds this
process's pid and API address while it runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from node_host import gpus as gpu_inventory
from node_host.agent import NodeAgent
from node_host.api import build_api
from node_host.cpus import CpuPlan, least_used_core
from node_host.engines import find_engines
from node_host.gpu_manager import GPUManager, read_model_config, worker_gpu_memory
from node_host.process import PortReservations, free_port
from node_host.settings import NodeHostSettings, parse_args
from node_host.supervisor import ProcessManager
from sie.auth import CredentialError, TokenAuthenticator, TokenSource
from sie.auth.store import read_trust_bundle
from sie.errors import Problem, SpecError
from sie.spec import BackendType, ModelService
from sie.tasks import SupervisedTasks
from sie.wire import GPUInfo

log = logging.getLogger("node_host")


def gpu_source(virtual: str | None) -> Callable[[], list[GPUInfo]]:
    """The GPU inventory reader (node_host.gpus: NVML, or --virtual-gpus). A node without NVML and
    without --virtual-gpus is a CPU node (scorers run there); that is said once, not every heartbeat."""
    warned = False

    def read() -> list[GPUInfo]:
        nonlocal warned
        try:
            return gpu_inventory.inventory(virtual)
        except gpu_inventory.GPUInventoryError as exc:
            if not warned:
                log.warning("no GPU inventory (%s); reporting no GPUs", exc)
                warned = True
            return []

    return read


async def measure_workers(pids: list[int]) -> dict[int, dict[int, float]]:
    """NVML's per-process memory of each worker (by its session), off the event loop."""
    loop = asyncio.get_running_loop()
    out: dict[int, dict[int, float]] = {}
    for pid in pids:
        figure = await loop.run_in_executor(None, worker_gpu_memory, pid)
        if figure:
            out[pid] = figure
    return out


def node_facts() -> dict[str, str]:
    try:
        return gpu_inventory.node_facts()
    except Exception as exc:  # facts are advisory; a node without them still serves
        log.warning("cannot read node facts: %s", exc)
        return {}


def _write_pid_file(path: Path, address: str, node: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "address": address, "node": node}) + "\n")
    os.replace(tmp, path)


async def run(settings: NodeHostSettings, stop: asyncio.Event, cpu_plan: CpuPlan | None = None) -> int:
    """`cpu_plan`: the tiers' cores (main reads them before it moves this process to the shared pool);
    None: none."""
    run_dir: Path = settings.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    credential = TokenSource(path=settings.token_file)
    trust_file = settings.trust_file.resolve()
    trust = read_trust_bundle(trust_file)  # whose tokens to accept; how to verify an https control plane
    log.info("control plane: %s", trust.describe(settings.control_url))
    verifier = trust.verifier
    files = settings.files.resolved()
    loop = asyncio.get_running_loop()
    read_gpus = gpu_source(settings.virtual_gpus)
    inventory = await loop.run_in_executor(None, read_gpus)  # NVML calls block
    facts = await loop.run_in_executor(None, node_facts)
    facts.update(find_engines(settings.engines_dir).facts())  # what a spec's backend.requires is checked against
    manager = GPUManager(
        inventory,
        facts=facts,
        watermarks=settings.tunables.watermarks,
        tiers=settings.tiers,
        p0_only_tiers=settings.p0_only,
        files=files,
    )
    virtual = bool(settings.virtual_gpus)
    log.info(
        "GPUs (%s): %s",
        "virtual, simulated" if virtual else "NVML",
        ", ".join(f"{g.index}: {g.name} {g.total_mb:.0f} MiB" for g in inventory) or "none (a CPU node)",
    )

    # Real GPUs: NVML's reading each heartbeat, with each GPU's health (temperature; failed on an Xid,
    # uncorrected ECC errors or the device lost: node_host.gpus.health). A failure reaches the agent in
    # the GPU list, and it moves the GPU's instances (NodeAgent.heartbeat_once -> fail_gpu).
    xids = None if virtual or not inventory else await loop.run_in_executor(None, gpu_inventory.XidWatch.start)
    last_health: dict[int, gpu_inventory.GpuHealth] = {}

    async def gpus() -> list[GPUInfo]:
        nonlocal last_health
        if virtual or not inventory:
            return manager.gpu_infos()
        real = await loop.run_in_executor(None, read_gpus)
        try:
            last_health = await loop.run_in_executor(
                None, functools.partial(gpu_inventory.health, xids=xids, before=last_health)
            )
        except gpu_inventory.GPUInventoryError as exc:
            log.warning("cannot read GPU health: %s", exc)
        real = [
            dataclasses.replace(g, temperature_c=h.temperature_c, failed=h.failed)
            if (h := last_health.get(g.index)) is not None
            else g
            for g in real
        ]
        return manager.gpu_infos(real)

    host = settings.host

    engines = find_engines(settings.engines_dir)
    if engines.facts():
        log.info("engines in %s: %s", settings.engines_dir, engines.facts())

    def worker_options(instance_id: str, service: ModelService) -> dict[str, Any]:
        backend = service.spec.backend.type
        if backend is BackendType.VLLM:
            return vllm_options(instance_id, service)
        if backend is BackendType.TRITON:
            # registry.worker_command writes the model repository under run_dir/triton/<instance>
            return {"triton_venv": engines.triton_venv, "run_dir": run_dir}
        if backend is not BackendType.SGLANG:
            return {}
        # NCCL binds its port itself, whose socket options SIE does not control: a moment-free port.
        return {**manager.engine_sizing(instance_id), "nccl_port": free_port(host)}

    def vllm_options(instance_id: str, service: ModelService) -> dict[str, Any]:
        from node_host.backends.vllm_server import launch as vllm_launch

        if engines.vllm_python is None:
            raise SpecError(
                f"ModelService {service.model_id!r}", [Problem("spec.backend.type", engines.missing("vLLM"))]
            )
        sizing = manager.engine_sizing(instance_id)
        on_gpu = bool(sizing) and not virtual  # an instance on a virtual GPU runs on the CPU
        options: dict[str, Any] = {"engine_python": engines.vllm_python, "on_gpu": on_gpu}
        if on_gpu:
            # The ledger's budget less the weights the model's config.json says (read_model_config: bounded,
            # under the model roots) is the KV cache; the budget over the GPU's memory gates vLLM's start.
            config = read_model_config(service.spec.model.path, files)
            options["kv_cache_bytes"] = vllm_launch.kv_cache_bytes_for(
                service, on_gpu=True, budget_mb=sizing["budget_mb"], config=config
            )
            options["gpu_memory_utilization"] = vllm_launch.gpu_memory_utilization_for(
                sizing["budget_mb"], sizing["total_mb"]
            )
            options["gpu_count"] = int(sizing["gpus"])
            return options
        options["kv_cache_bytes"] = vllm_launch.kv_cache_bytes_for(service, on_gpu=False)
        # One core per instance (two servers on the default binding share core 0 and halve each other), the
        # least used by the other vLLM workers here; a tier's pinned cores (cpu_share_for) take precedence.
        options["cpus"] = (least_used_core(i.engine_cpus for i in supervisor.instances.values()),)
        return options

    cpu_plan = cpu_plan or CpuPlan.none()
    if cpu_plan.isolating:
        log.info(
            "CPU cores by tier: %s; the shared pool's P1/P2 instances %s",
            ", ".join(f"{t} {c}" for t, c in cpu_plan.describe().items()),
            "in the background (SCHED_IDLE)" if cpu_plan.background_shared else "scheduled as usual",
        )

    supervisor = ProcessManager(
        run_dir=run_dir,
        node=settings.node,
        control_url=settings.control_url,
        trust_file=trust_file,
        files=files,
        host=host,
        ports=PortReservations(host),
        gpu_for=lambda instance_id, service: manager.gpu_of(instance_id),
        gpus_simulated=virtual,
        cpu_share_for=lambda service: cpu_plan.share_for(
            service.spec.scheduling.tier, service.spec.model.priority_level
        ),
        worker_options=worker_options,
    )
    pid_file = run_dir / "node_host.json"
    fatal: list[str] = []

    def on_fatal(name: str, exc: BaseException) -> None:
        fatal.append(name)
        stop.set()

    # The https control plane is verified against the trust bundle's CA (plain http URLs, the node's own
    # children on loopback, ignore it).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust.tls)) as session:
        agent = NodeAgent(
            settings.agent(),
            supervisor,
            session,
            credential=credential,
            gpus=gpus,
            facts=facts,
            manager=manager,
            measure=None if virtual or not inventory else measure_workers,
            tasks=SupervisedTasks(on_fatal=on_fatal),
        )
        runner = web.AppRunner(build_api(agent, TokenAuthenticator(verifier)), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, settings.port)
        await site.start()
        agent.address = f"http://{host}:{runner.addresses[0][1]}"
        supervisor.api_url = agent.address  # before the first heartbeat, so every sidecar gets its wake URL
        _write_pid_file(pid_file, agent.address, settings.node)
        log.info(
            "node host %s listening on %s; control plane %s; run dir %s",
            settings.node,
            agent.address,
            settings.control_url,
            run_dir,
        )
        code = 0
        try:
            problem = agent.heartbeat_problem()
            if problem is not None:
                log.error("the control plane would refuse every heartbeat of this node; fix its settings: %s", problem)
                code = 2
            else:
                agent.loops()
                await stop.wait()
                if fatal:
                    log.error("a node host loop ended unexpectedly (%s); stopping every instance and exiting", fatal[0])
                    code = 1
        finally:
            log.info("stopping %d instance(s), sidecars first", len(supervisor.instances))
            await agent.shutdown()
            await runner.cleanup()
            if xids is not None:
                await loop.run_in_executor(None, xids.close)
            pid_file.unlink(missing_ok=True)
            log.info("node host %s stopped", settings.node)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The tiers' cores (--tier-cpus, checked by parse_args) are the instances' alone: this process (its
    # heartbeats, probes and API) moves to the shared pool, before any thread starts, so all inherit it.
    cpu_plan = settings.cpu_plan(frozenset(os.sched_getaffinity(0)))
    if cpu_plan.isolating:
        os.sched_setaffinity(0, cpu_plan.shared)

    async def _main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run(settings, stop, cpu_plan)

    try:
        return asyncio.run(_main())
    except CredentialError as exc:
        log.error("%s", exc)
        return 2
