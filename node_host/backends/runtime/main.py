"""Serving a worker: the command line every backend shares, and the server loop.

    python -m node_host.backends.<engine> --spec-file SPEC.json --host 127.0.0.1 --port PORT \
        --api-key-file KEYFILE [--model-root DIR ...] [--allow-unsafe-model-formats] [--allow-remote-code]

where <engine> is an engine package (sim, torch_engine, sklearn_engine; registry.py maps backend types
to them) whose __main__ hands its engine factory to `run_worker`.

The server listens before the model loads, so /health answers "loading" while weights load. A load that
fails ends the process with exit code 1: node_host records the crash and restarts the worker with
backoff. SIGTERM/SIGINT stop it cleanly (close the listener, then the engine) with exit code 0.

Trust (DESIGN §10): every endpoint but /health needs `Authorization: Bearer <key>`, the key in
--api-key-file (0600), which only this worker's node host and sidecar hold; model files load only from
under --model-root, in a safe format unless the node host allows unsafe ones (sie.model_files).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from node_host.backends.protocol import OOM_EXIT_CODE, Engine, EngineState
from node_host.backends.runtime.app import MAX_BODY_BYTES, WorkerApp
from node_host.backends.runtime.batching import BatchLimits
from sie import model_files, strict_json, strict_yaml
from sie.auth import CredentialError, read_secret
from sie.errors import InputError, Problem, SpecError
from sie.heap import freeze_startup_heap
from sie.model_files import ModelFilePolicy
from sie.spec import ModelService
from sie.spec_loader import parse_model_service

log = logging.getLogger(__name__)

# After SIGTERM, aiohttp waits this long for a request still in flight, then cancels its handler and
# waits as long again for it to end (its default is 60 s each). The node host stops the sidecar first,
# which drains the instance, so what is left is a straggler; and it SIGKILLs the worker 10 s after the
# SIGTERM (supervisor.WORKER_GRACE_S): 2 x 1.5 s leaves the engine's own close its time (torch: 5 s).
HANDLER_GRACE_S = 1.5


def read_spec(path: str | Path) -> ModelService:
    """The ModelService a worker serves, from the JSON file node_host wrote (YAML works too)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError(str(path), [Problem("", f"cannot read the file: {exc.strerror}")]) from None
    try:
        if path.suffix in (".yaml", ".yml"):
            doc = strict_yaml.load(raw.decode("utf-8", errors="replace"), what=str(path))
        else:
            doc = strict_json.loads(raw, what=str(path))
    except InputError as exc:
        raise SpecError(str(path), [Problem("", str(exc))]) from None
    return parse_model_service(doc, str(path))


@dataclass(frozen=True)
class WorkerOptions:
    """What the node host tells a worker besides its spec: its key and what it may load."""

    api_key: str | None = None  # None only in tests and embedding: then no endpoint asks for a key
    files: ModelFilePolicy = ModelFilePolicy()
    max_new_tokens: int | None = None  # the spec's limits.max_new_tokens
    batching: BatchLimits = BatchLimits()  # the spec's batching block (scorers)
    # The spec's limits.max_body_bytes: what the sidecar accepts is all the worker needs to take; more
    # would let a caller that reaches the worker directly make it read and parse up to 64 MiB.
    max_body_bytes: int = MAX_BODY_BYTES

    def app_options(self) -> dict[str, Any]:
        return {
            "api_key": self.api_key,
            "max_new_tokens": self.max_new_tokens,
            "batching": self.batching,
            "max_body_bytes": self.max_body_bytes,
        }


AppBuilder = Callable[..., web.Application]


async def serve(
    engine: Engine,
    host: str,
    port: int,
    *,
    stop: asyncio.Event,
    on_listening: Callable[[int], None] | None = None,
    build_app: AppBuilder | None = None,
    options: WorkerOptions = WorkerOptions(),
    on_ready: Callable[[], object] | None = None,
) -> int:
    """Serve `engine` on host:port until `stop` is set. Returns the exit code: 0 after a requested stop,
    1 if the engine failed to load (OOM_EXIT_CODE when it ran out of memory). `on_listening(port)` reports the bound port (useful with port 0).
    `build_app(engine, **options.app_options())` replaces the plain WorkerApp, for a backend that adds
    routes or middlewares (build a WorkerApp with those options, call .build(), then add to the app).
    `on_ready()` runs once, when the engine has loaded (the worker's main freezes the start-up heap
    there: sie/heap.py)."""
    if build_app is not None:
        app = build_app(engine, **options.app_options())
    else:
        app = WorkerApp(engine, **options.app_options()).build()
    # handler_cancellation: a client that goes away cancels its handler, which closes the engine's
    # generator, so an abandoned generation stops using the batch. shutdown_timeout: see HANDLER_GRACE_S.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=HANDLER_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    bound = runner.addresses[0][1]
    log.info("worker %s (%s) listening on http://%s:%d", engine.served_model_name, engine.backend, host, bound)
    if on_listening is not None:
        on_listening(bound)
    load = asyncio.create_task(engine.start(), name=f"load:{engine.served_model_name}")
    stopped = asyncio.create_task(stop.wait(), name="stop-signal")
    code = 0
    try:
        await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if load.done() and load.exception() is not None:
            exc = load.exception()
            log.error("loading %s failed: %s", engine.served_model_name, exc, exc_info=exc)
            code = OOM_EXIT_CODE if is_out_of_memory(exc) else 1
        elif load.done():
            log.info("model %s ready", engine.served_model_name)
            if on_ready is not None:
                on_ready()
            code = await _until_stopped_or_failed(engine, stopped)
    finally:
        for task in (load, stopped):
            task.cancel()
        await asyncio.gather(load, stopped, return_exceptions=True)
        await runner.cleanup()
        await engine.close()
    return code


def is_out_of_memory(exc: BaseException | None) -> bool:
    """A host MemoryError or torch's (CUDA) OutOfMemoryError, by name: the runtime does not import torch."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


async def _until_stopped_or_failed(engine: Engine, stopped: asyncio.Task, check_every_s: float = 1.0) -> int:
    """An engine that failed for good (state FAILED, e.g. its scheduler died) ends the process with
    exit code 1, as a crashed SGLang server does, so node_host restarts it instead of keeping a worker
    that only answers 503."""
    while True:
        done, _ = await asyncio.wait({stopped}, timeout=check_every_s)
        if done:
            return 0
        if engine.state is EngineState.FAILED:
            log.error("engine of %s failed; exiting so the node host restarts the worker", engine.served_model_name)
            return 1


def _parse(argv: Sequence[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec-file", required=True, help="ModelService as JSON (node_host writes it)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks a free one")
    parser.add_argument(
        "--api-key-file",
        required=True,
        help="file (0600) with the key every caller but /health must present as a bearer token",
    )
    model_files.add_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


EngineBuilder = Callable[[ModelService, ModelFilePolicy], Engine]


def run_worker(
    build_engine: EngineBuilder,
    argv: Sequence[str] | None = None,
    *,
    description: str,
    build_app: AppBuilder | None = None,
) -> int:
    """The composition root every worker shares: parse flags, read the spec, build the engine, serve
    until SIGTERM/SIGINT. `build_engine(spec, files)` gets the validated sie.spec.ModelService and the
    node's sie.model_files.ModelFilePolicy (load model files only through it); a SpecError or ValueError
    it raises ends the process with exit code 2 and the message in the log. `build_app(engine, **options)`
    may return an aiohttp app built on `WorkerApp(engine, **options).build()` with extra routes. Prints
    `listening on PORT` on stdout once bound (tests and tools that pass --port 0 read it). Returns the
    exit code (1 when the engine failed to load, so node_host records the crash and restarts it)."""
    args = _parse(argv, description)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    files = model_files.from_arguments(args)
    try:
        api_key = read_secret(args.api_key_file, "worker key")
        spec = read_spec(args.spec_file)
        engine = build_engine(spec, files)
    except CredentialError as exc:
        log.error("%s", exc)
        return 2
    except (SpecError, ValueError) as exc:
        # Exit code 2: the input is wrong, a restart will not help (node_host still backs off).
        log.error("cannot serve the spec in %s: %s", args.spec_file, exc)
        return 2

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await serve(
            engine,
            args.host,
            args.port,
            stop=stop,
            build_app=build_app,
            on_listening=lambda port: print(f"listening on {port}", flush=True),
            on_ready=freeze_startup_heap,
            options=WorkerOptions(
                api_key=api_key,
                files=files,
                max_new_tokens=spec.spec.max_new_tokens,
                batching=BatchLimits(spec.spec.batching.max_batch_size, spec.spec.batching.max_delay_ms),
                max_body_bytes=spec.spec.limits.max_body_bytes,
            ),
        )

    return asyncio.run(run())
