"""The control plane's own record of what the admin API changed, so a restart keeps it (--state-dir).

Models come from the cluster file, the admin API or Kubernetes. The file is re-read at every start and
Kubernetes is re-listed; what the admin API did exists nowhere else, so it is written here, atomically
(a temporary file renamed over `models.json`, mode 0600) after every change:

- models created or replaced through the API, as their stored specs, with their build's generation,
  their current or last rollout (xds_server.rollout: its step, shares, hold start, events), the new
  build's spec while it rolls out and the build before the last rollout (for `undo`), so a restart
  resumes a rollout where it was: no second canary, no lost step;
- models of the cluster file deleted through the API (tombstones);
- each autoscaled model's count (the autoscaler's, ModelEntry.scale; `scales`), whether the file or the
  API made the model, so a restart keeps the fleet's size instead of falling back to min_replicas.

Each entry records the digest of the cluster file's spec for that model when the API acted (`base`,
"" when the file had none). At start, an entry whose base no longer matches the file (the operator
edited the file since) is dropped: the file is the newer word. Node hosts' reports never create
models after the startup sync (registry.py), so this file is what makes API-made models survive.

The file is outside input read at start: a part of it that cannot be read is left out and logged (an
entry, or a model's recorded rollout or builds, leaving its stable build serving); loading never raises.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sie import strict_json
from sie.auth import write_private
from sie.errors import InputError, SpecError
from sie.spec import ModelService
from sie.spec_loader import parse_model_service
from xds_server.rollout.machine import RolloutState

log = logging.getLogger(__name__)

STATE_FILE = "models.json"


def base_digest(service: ModelService | None) -> str:
    """What the state file records of the cluster file's spec an API change was made over ("base"), so
    that a changed file wins over the saved change; "" for none. Its own form (32 hex digits of SHA-256
    over JSON with sorted keys), kept as the state files already written have it; the node wire names
    specs by sie.spec.spec_digest."""
    if service is None:
        return ""
    return hashlib.sha256(json.dumps(service.to_dict(), sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class SavedState:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> {"spec": ..., "base": digest}
    deleted: dict[str, str] = field(default_factory=dict)  # id -> base digest of the file's spec
    scales: dict[str, int] = field(default_factory=dict)  # id -> the autoscaler's count


@dataclass(frozen=True)
class SavedModel:
    """One API-made model as recorded: its stable build and its rollout."""

    service: ModelService
    generation: int = 0
    rollout: RolloutState | None = None
    target: ModelService | None = None
    previous: ModelService | None = None

    def to_json(self, base: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"spec": self.service.to_dict(), "base": base, "generation": self.generation}
        if self.rollout is not None:
            doc["rollout"] = self.rollout.to_json()
        if self.target is not None:
            doc["target"] = self.target.to_dict()
        if self.previous is not None:
            doc["previous"] = self.previous.to_dict()
        return doc


@dataclass
class ModelState:
    directory: Path
    _saved: SavedState = field(default_factory=SavedState)

    @property
    def path(self) -> Path:
        return self.directory / STATE_FILE

    def load(self) -> SavedState:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return SavedState()
        try:
            doc = strict_json.loads_object(raw, what=str(self.path))
        except (InputError, TypeError, ValueError) as exc:
            log.error("ignoring the unreadable state file %s: %s", self.path, exc)
            return SavedState()
        models = {k: v for k, v in self._section(doc, "models").items() if self._valid(k, v, dict, "model")}
        deleted = {k: v for k, v in self._section(doc, "deleted").items() if self._valid(k, v, str, "deletion")}
        scales = {
            k: v
            for k, v in self._section(doc, "scales").items()
            if self._valid(k, v, int, "count") and not isinstance(v, bool) and v >= 0
        }
        self._saved = SavedState(models, deleted, scales)
        return self._saved

    def _section(self, doc: dict[str, Any], key: str) -> dict[str, Any]:
        section = doc.get(key) or {}
        if not isinstance(section, dict):
            log.error("ignoring %r in the state file %s: not a JSON object", key, self.path)
            return {}
        return section

    def _valid(self, mid: str, value: Any, kind: type, what: str) -> bool:
        if isinstance(value, kind):
            return True
        log.error("ignoring the %s of %s in the state file %s: it is a %s", what, mid, self.path, type(value).__name__)
        return False

    def apply(self, file_models: Mapping[str, ModelService]) -> tuple[dict[str, SavedModel], set[str]]:
        """From the loaded state: the API models to add or use instead of the file's, and the file's
        models to leave out; entries the file has moved past are dropped."""
        models: dict[str, SavedModel] = {}
        deleted: set[str] = set()
        for mid, entry in self._saved.models.items():
            if entry.get("base", "") != base_digest(file_models.get(mid)):
                log.info("model %s: the cluster file changed since the admin API replaced it; the file wins", mid)
                continue
            try:
                models[mid] = self._saved_model(mid, entry)
            except SpecError as exc:
                log.error("model %s in %s is no longer valid, left out: %s", mid, self.path, exc)
        for mid, base in self._saved.deleted.items():
            if mid in file_models and base == base_digest(file_models[mid]):
                deleted.add(mid)
        return models, deleted

    def _saved_model(self, mid: str, entry: dict[str, Any]) -> SavedModel:
        where = f"{self.path} model {mid}"
        service = parse_model_service(entry.get("spec"), where)
        rollout = None
        if entry.get("rollout") is not None:
            try:
                rollout = RolloutState.from_json(entry["rollout"])
            except Exception as exc:
                # Whatever this one record holds (a list, a step out of range, a field of another
                # type), from_json's error leaves the stable build serving, never a control plane
                # that will not start.
                log.error(
                    "model %s: the recorded rollout in %s is unreadable (%s); the stable build serves",
                    mid,
                    self.path,
                    exc,
                )
        try:
            target = parse_model_service(entry["target"], f"{where} target") if entry.get("target") else None
            previous = parse_model_service(entry["previous"], f"{where} previous") if entry.get("previous") else None
        except SpecError as exc:
            # A build this version no longer accepts (its checks grew stricter): the stable build serves
            # on, as with an unreadable rollout, rather than the whole model being left out.
            log.error(
                "model %s: a recorded build in %s is no longer valid (%s); the stable build serves", mid, self.path, exc
            )
            rollout, target, previous = None, None, None
        generation = entry.get("generation", 0)
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            log.error("model %s: the recorded generation %r in %s is not one; 0 is used", mid, generation, self.path)
            generation = 0
        return SavedModel(service, generation, rollout, target, previous)

    def save(
        self,
        api_models: Mapping[str, SavedModel],
        deleted_file_models: Mapping[str, ModelService],
        file_models: Mapping[str, ModelService],
        scales: Mapping[str, int] | None = None,
    ) -> None:
        state = {
            "models": {
                mid: saved.to_json(base_digest(file_models.get(mid))) for mid, saved in sorted(api_models.items())
            },
            "deleted": {mid: base_digest(svc) for mid, svc in sorted(deleted_file_models.items())},
            "scales": dict(sorted((scales or {}).items())),
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        write_private(self.path, json.dumps(state, indent=1, sort_keys=True).encode())
