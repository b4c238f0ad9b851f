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

Rollouts: a ModelService whose build changes (a new image, say) goes through the same rollout as a
standalone model (xds_server/rollout): the registry runs the state machine, and this sink is also the
controller's `Fleet`: each model's builds (a Deployment each; a rollout runs two) and the record the
controller keeps in the ModelService's `status.build` (the serving build's generation and spec, the
rollout, and the autoscaler's count, `scale`), from which a restarted control plane resumes the rollout
and keeps the model's size. (The controller hands back `status.build` only, not `status.autoscale`, so
the count travels in the build record.)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from xds_server.k8s import Endpoint
from xds_server.k8s.deployments import Build
from xds_server.registry import Registry, RolloutInProgress
from xds_server.rollout.machine import RolloutState
from xds_server.views import autoscale_json

log = logging.getLogger(__name__)

SOURCE = "kubernetes"


class RegistrySink:
    """A DiscoverySink (xds_server.k8s.controller) that writes into the registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def models_changed(
        self, models: Mapping[str, ModelService], records: Mapping[str, dict[str, Any]] | None = None
    ) -> None:
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
            if entry is None:
                self._restore(service, (records or {}).get(model_id))
                continue
            if service in (entry.service, entry.target):
                continue  # unchanged, the build rolling out, or one that was rolled back (until it changes)
            try:
                self.registry.update_model(service, SOURCE)
            except RolloutInProgress as exc:
                log.warning("ModelService %s changed during its rollout; kept for after it: %s", model_id, exc)
        for model_id in [m for m, e in self.registry.models.items() if e.source == SOURCE and m not in models]:
            self.registry.delete_model(model_id)

    def _restore(self, service: ModelService, record: dict[str, Any] | None) -> None:
        """A model new to the registry, as its ModelService's `status.build` recorded it (after a
        control-plane restart), else as its spec says. The recorded count comes back either way: the
        model's Deployment is sized from it, so a restart does not cut an autoscaled model back to
        min_replicas."""
        record = record or {}
        scale = record.get("scale")
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 0:
            scale = None
        if not isinstance(record.get("spec"), dict):
            self.registry.restore_model(service, SOURCE, scale=scale)
            return
        try:
            stable = parse_model_service(record["spec"], f"ModelService {service.model_id} status.build.spec")
            rollout = RolloutState.from_json(record["rollout"]) if record.get("rollout") else None
            generation = int(record.get("generation", 0))
        except Exception as exc:
            # Outside input: whatever the record holds (a rollout that is a list, a step out of range),
            # the model starts from its spec rather than the sync failing.
            log.warning(
                "ModelService %s: its status.build is unreadable (%s); starting from the spec", service.model_id, exc
            )
            self.registry.restore_model(service, SOURCE, scale=scale)
            return
        target = service if rollout is not None and service != stable else None
        self.registry.restore_model(stable, SOURCE, generation=generation, rollout=rollout, target=target, scale=scale)

    # ---- Fleet (what the controller runs) ----------------------------------------------------------

    def builds(self, model_id: str) -> list[Build] | None:
        entry = self.registry.models.get(model_id)
        if entry is None or entry.source != SOURCE:
            return None
        out = []
        for track in entry.tracks():
            service, _ = entry.spec_of(track.generation)
            out.append(Build(track.generation, service, track.replicas))
        return out

    def record(self, model_id: str) -> dict[str, Any] | None:
        entry = self.registry.models.get(model_id)
        if entry is None or entry.source != SOURCE:
            return None
        scaling = autoscale_json(entry)
        if entry.rollout is None and entry.generation == 0 and scaling is None:
            return None
        record: dict[str, Any] = {"autoscale": scaling}
        if entry.scale is not None and entry.service.spec.autoscaled:
            record["scale"] = entry.scale
        if entry.rollout is not None or entry.generation:
            record.update(
                generation=entry.generation,
                spec=entry.spec_dict,
                rollout=entry.rollout.to_json() if entry.rollout is not None else None,
            )
        return record

    async def endpoints_changed(self, model_id: str, endpoints: tuple[Endpoint, ...]) -> None:
        self.registry.set_k8s_ready(
            model_id,
            {e.instance_id: e.address for e in endpoints},
            {e.instance_id: e.control_address for e in endpoints if e.control_address},
            {e.instance_id: e.generation for e in endpoints},
        )
