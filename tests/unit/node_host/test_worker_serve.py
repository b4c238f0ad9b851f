"""serve(): load failures and engine failures end the worker with exit code 1 (OOM_EXIT_CODE when the load
ran out of memory, so the node host can tell); a stop ends it with 0."""

from __future__ import annotations

import asyncio

import pytest

from node_host.backends.protocol import OOM_EXIT_CODE, EngineState, Loads
from node_host.backends.runtime.main import serve


class Engine:
    backend = "fake"
    simulated = False
    served_model_name = "m"
    model_path = "/m"

    def __init__(self, load_error: Exception | None = None):
        self.state = EngineState.LOADING
        self.load_error = load_error
        self.closed = False

    async def start(self):
        if self.load_error:
            raise self.load_error
        self.state = EngineState.READY

    async def close(self):
        self.closed = True

    def loads(self):
        return Loads(0, 0)

    async def release(self, tags): ...

    async def resume(self, tags): ...


async def run(engine: Engine, action) -> int:
    stop = asyncio.Event()
    ports: list[int] = []
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, stop=stop, on_listening=ports.append))
    while not ports and not task.done():
        await asyncio.sleep(0.01)
    await action(engine, stop)
    return await asyncio.wait_for(task, 10)


async def _stop(engine, stop):
    stop.set()


async def _fail(engine, stop):
    while engine.state is not EngineState.READY:
        await asyncio.sleep(0.01)
    engine.state = EngineState.FAILED


async def _nothing(engine, stop):
    pass


@pytest.mark.parametrize(
    "engine, action, code",
    [
        (Engine(), _stop, 0),
        (Engine(load_error=FileNotFoundError("no weights")), _nothing, 1),
        (Engine(load_error=MemoryError()), _nothing, OOM_EXIT_CODE),
        (
            Engine(load_error=type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory")),
            _nothing,
            OOM_EXIT_CODE,
        ),
        (Engine(), _fail, 1),
    ],
)
async def test_exit_codes(engine, action, code):
    assert await run(engine, action) == code
    assert engine.closed


async def test_on_ready_runs_once_after_the_load_and_never_after_a_failed_one():
    calls: list[EngineState] = []

    async def check(engine, stop):
        while not calls:
            await asyncio.sleep(0.01)
        stop.set()

    engine = Engine()
    stop = asyncio.Event()
    ports: list[int] = []
    task = asyncio.create_task(
        serve(engine, "127.0.0.1", 0, stop=stop, on_listening=ports.append, on_ready=lambda: calls.append(engine.state))
    )
    await asyncio.wait_for(check(engine, stop), 10)
    assert await asyncio.wait_for(task, 10) == 0
    assert calls == [EngineState.READY]

    failed: list[str] = []
    code = await serve(
        Engine(load_error=RuntimeError("no")),
        "127.0.0.1",
        0,
        stop=asyncio.Event(),
        on_ready=lambda: failed.append("called"),
    )
    assert code == 1 and failed == []


class Hanging(Engine):
    """A generation that never yields, as a request stuck in its engine would."""

    def __init__(self):
        super().__init__()
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(self, request):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield  # an async generator, like every engine's


@pytest.mark.timeout(30)
async def test_a_stop_cancels_a_request_still_in_flight_within_the_node_hosts_grace():
    """aiohttp waits 60 s for in-flight handlers by default; the node host SIGKILLs the worker 10 s after
    its SIGTERM, and the engine's own close may need 5 of them, so a straggler is cancelled within 5 s."""
    import aiohttp

    engine = Hanging()
    stop = asyncio.Event()
    ports: list[int] = []
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, stop=stop, on_listening=ports.append))
    while not ports or engine.state is not EngineState.READY:
        await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(http.post(f"http://127.0.0.1:{ports[0]}/generate", json={"text": "x"}))
        await asyncio.wait_for(engine.started.wait(), 5)
        t0 = loop.time()
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
        assert loop.time() - t0 < 5.0
        assert engine.cancelled.is_set() and engine.closed
        await asyncio.gather(request, return_exceptions=True)
