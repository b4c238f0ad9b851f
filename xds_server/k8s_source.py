"""Kubernetes as a source of models and endpoints for the registry (`python -m xds_server --kubernetes`).

The ModelService controller (xds_server/k8s/) reconciles each ModelService into a Deployment and tells
a sink two things: the valid ModelServices, and each model's ready pods. This sink turns them into
registry facts:

- every ModelService becomes a model with source "kubernetes" (node hosts are never asked to run it:
  its Deployment does), and a ModelService that disappears is deleted from the registry — but never a
  model from another source (the cluster file or the admin API) that happens to share the id;
- a model's ready pods (instance id = pod name) are the only instances of it that may enter EDS, at the
  address the API server gives each pod (podIP:sidecar port); their sidecars' telemetry (posted with
  --instance-id $(POD_NAME)) gives state and load, never the address.

The controller always hands over the full current value, so the sink is idempotent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sie.spec import ModelService
from xds_server.k8s import Endpoint
from xds_server.registry import Registry

log = logging.getLogger(__name__)

SOURCE = "kubernetes"


class RegistrySink:
    """A DiscoverySink (xds_server.k8s.controller) that writes into the registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def models_changed(self, models: Mapping[str, ModelService]) -> None:
        for model_id, service in models.items():
            entry = self.registry.models.get(model_id)
            if entry is not None and entry.source != SOURCE:
                log.warning(
                    "ModelService %s is also defined by the %s; the %s's definition stays",
                    model_id,
                    entry.source,
                    entry.source,
                )
                continue
            if entry is None or entry.service != service:
                self.registry.put_model(service, SOURCE)
        for model_id in [m for m, e in self.registry.models.items() if e.source == SOURCE and m not in models]:
            self.registry.delete_model(model_id)

    async def endpoints_changed(self, model_id: str, endpoints: tuple[Endpoint, ...]) -> None:
        self.registry.set_k8s_ready(
            model_id,
            {e.instance_id: e.address for e in endpoints},
            {e.instance_id: e.control_address for e in endpoints if e.control_address},
        )
