"""Kubernetes discovery for the control plane: the ModelService controller.

What the control plane uses:

    from xds_server.k8s import Controller, ControllerSettings, DiscoverySink, Endpoint, QueueSink

    sink = QueueSink()                       # or any object with the two DiscoverySink methods
    controller = Controller(api_client, sink, ControllerSettings(namespace=None))
    await controller.start()
    async for change in sink.changes():      # ModelsChanged | EndpointsChanged, in order
        ...
    await controller.stop()

`ModelsChanged.models` maps model id -> ModelService (valid specs only); `EndpointsChanged` carries one
model's ready endpoints (`Endpoint(instance_id=pod name, address="podIP:8081", node, namespace)`), the
full current set each time. The controller also creates one Deployment per ModelService and writes its
status (see reconcile.py). The FAKE API server for tests is `sie_testing.fake_apiserver`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from sie.spec import ModelService
from xds_server.k8s.controller import Controller, ControllerSettings, DiscoverySink
from xds_server.k8s.deployments import DeploymentSettings
from xds_server.k8s.pods import Endpoint

__all__ = [
    "Controller",
    "ControllerSettings",
    "DeploymentSettings",
    "DiscoverySink",
    "Endpoint",
    "EndpointsChanged",
    "ModelsChanged",
    "QueueSink",
]


@dataclass(frozen=True)
class ModelsChanged:
    models: Mapping[str, ModelService]


@dataclass(frozen=True)
class EndpointsChanged:
    model_id: str
    endpoints: tuple[Endpoint, ...]


class QueueSink:
    """A DiscoverySink that turns the controller's calls into an async iterator of changes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[ModelsChanged | EndpointsChanged] = asyncio.Queue()

    async def models_changed(
        self, models: Mapping[str, ModelService], records: Mapping[str, dict[str, Any]] | None = None
    ) -> None:
        await self._queue.put(ModelsChanged(dict(models)))

    async def endpoints_changed(self, model_id: str, endpoints: tuple[Endpoint, ...]) -> None:
        await self._queue.put(EndpointsChanged(model_id, endpoints))

    async def changes(self) -> AsyncIterator[ModelsChanged | EndpointsChanged]:
        while True:
            yield await self._queue.get()

    async def next(self, timeout: float | None = None) -> ModelsChanged | EndpointsChanged:
        return await asyncio.wait_for(self._queue.get(), timeout)
