"""Serving a worker: the command line every backend shares, and the server loop.

    python -m node_host.backends.<backend>_worker --spec-file SPEC.json --host 127.0.0.1 --port PORT

The server listens before the model loads, so /health answers "loading" while weights load. A load that
fails ends the process with exit code 1: node_host records the crash and restarts the worker with
backoff. SIGTERM/SIGINT stop it cleanly (close the listener, then the engine) with exit code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Callable, Sequence

from aiohttp import web

from node_host.backends.protocol import Engine, EngineState
from node_host.backends.worker_app import WorkerApp
from sie.errors import Problem, SpecError
from sie.spec import ModelService
from sie.spec_loader import parse_model_service

log = logging.getLogger(__name__)


def read_spec(path: str | Path) -> ModelService:
    """The ModelService a worker serves, from the JSON file node_host wrote (YAML works too)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(str(path), [Problem("", f"cannot read the file: {exc.strerror}")]) from None
    if path.suffix in (".yaml", ".yml"):
        import yaml

        doc = yaml.safe_load(text)
    else:
        doc = json.loads(text)
    return parse_model_service(doc, str(path))


async def serve(
    engine: Engine,
    host: str,
    port: int,
    *,
    stop: asyncio.Event,
    on_listening: Callable[[int], None] | None = None,
    build_app: Callable[[Engine], web.Application] | None = None,
) -> int:
    """Serve `engine` on host:port until `stop` is set. Returns the exit code: 0 after a requested stop,
    1 if the engine failed to load. `on_listening(port)` reports the bound port (useful with port 0).
    `build_app(engine)` replaces the plain `WorkerApp(engine).build()`, for a backend that adds routes
    or middlewares (build a WorkerApp, call .build(), then add to the returned app)."""
    app = build_app(engine) if build_app is not None else WorkerApp(engine).build()
    # handler_cancellation: a client that goes away cancels its handler, which closes the engine's
    # generator, so an abandoned generation stops using the batch.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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
            code = 1
        elif load.done():
            log.info("model %s ready", engine.served_model_name)
            code = await _until_stopped_or_failed(engine, stopped)
    finally:
        for task in (load, stopped):
            task.cancel()
        await asyncio.gather(load, stopped, return_exceptions=True)
        await runner.cleanup()
        await engine.close()
    return code


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
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(
    build_engine: Callable[[ModelService], Engine],
    argv: Sequence[str] | None,
    *,
    description: str,
    build_app: Callable[[Engine], web.Application] | None = None,
) -> int:
    """Parse flags, read the spec, build the engine, serve until SIGTERM/SIGINT. Prints
    `listening on PORT` on stdout once bound (tests and tools that pass --port 0 read it)."""
    args = _parse(argv, description)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        spec = read_spec(args.spec_file)
        engine = build_engine(spec)
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
            engine, args.host, args.port, stop=stop, build_app=build_app,
            on_listening=lambda port: print(f"listening on {port}", flush=True),
        )

    return asyncio.run(run())
