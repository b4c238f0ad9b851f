"""The plug-in example in protocol.py's docstring runs as written (so the documentation cannot rot)."""

from __future__ import annotations

import textwrap

from aiohttp.test_utils import TestClient, TestServer

from node_host.backends import protocol
from node_host.backends.runtime.app import WorkerApp
from sie.model_files import ModelFilePolicy
from sie.spec_loader import parse_model_service


def example_namespace() -> dict:
    doc = protocol.__doc__
    start = doc.index("    # node_host/backends/echo/__main__.py")
    end = doc.index('    if __name__ == "__main__":')
    namespace: dict = {}
    exec(textwrap.dedent(doc[start:end]), namespace)  # noqa: S102 - our own docstring
    return namespace


async def test_docstring_example_serves_the_protocol():
    ns = example_namespace()
    spec = parse_model_service({"spec": {"model": {"name": "echo", "path": "/x"}, "backend": {"type": "sim"}}})
    engine = ns["EchoEngine"](spec, ModelFilePolicy())
    await engine.start()
    assert callable(ns["main"])
    async with TestClient(TestServer(WorkerApp(engine).build())) as client:
        resp = await client.post("/generate", json={"text": "ping"})
        assert (await resp.json())["text"] == "ping"
        assert (await client.get("/health")).status == 200
        assert (await client.post("/release_memory_occupation")).status == 200
        assert (await (await client.get("/health")).json())["status"] == "sleeping"
