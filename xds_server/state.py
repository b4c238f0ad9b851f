"""The control plane's own record of what the admin API changed, so a restart keeps it (--state-dir).

Models come from the cluster file, the admin API or Kubernetes. The file is re-read at every start and
Kubernetes is re-listed; what the admin API did exists nowhere else, so it is written here, atomically
(a temporary file renamed over `models.json`, mode 0600) after every change:

- models created or replaced through the API, as their stored specs;
- models of the cluster file deleted through the API (tombstones).

Each entry records the digest of the cluster file's spec for that model when the API acted (`base`,
"" when the file had none). At start, an entry whose base no longer matches the file (the operator
edited the file since) is dropped: the file is the newer word. Node hosts' reports never create
models after the startup sync (registry.py), so this file is what makes API-made models survive.
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

log = logging.getLogger(__name__)

STATE_FILE = "models.json"


def spec_digest(service: ModelService | None) -> str:
    if service is None:
        return ""
    return hashlib.sha256(json.dumps(service.to_dict(), sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class SavedState:
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> {"spec": ..., "base": digest}
    deleted: dict[str, str] = field(default_factory=dict)  # id -> base digest of the file's spec


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
            models = {str(k): dict(v) for k, v in (doc.get("models") or {}).items()}
            deleted = {str(k): str(v) for k, v in (doc.get("deleted") or {}).items()}
        except (InputError, TypeError, ValueError) as exc:
            log.error("ignoring the unreadable state file %s: %s", self.path, exc)
            return SavedState()
        self._saved = SavedState(models, deleted)
        return self._saved

    def apply(self, file_models: Mapping[str, ModelService]) -> tuple[dict[str, ModelService], set[str]]:
        """From the loaded state: the API models to add or use instead of the file's, and the file's
        models to leave out; entries the file has moved past are dropped."""
        models: dict[str, ModelService] = {}
        deleted: set[str] = set()
        for mid, entry in self._saved.models.items():
            if entry.get("base", "") != spec_digest(file_models.get(mid)):
                log.info("model %s: the cluster file changed since the admin API replaced it; the file wins", mid)
                continue
            try:
                models[mid] = parse_model_service(entry.get("spec"), f"{self.path} model {mid}")
            except SpecError as exc:
                log.error("model %s in %s is no longer valid, left out: %s", mid, self.path, exc)
        for mid, base in self._saved.deleted.items():
            if mid in file_models and base == spec_digest(file_models[mid]):
                deleted.add(mid)
        return models, deleted

    def save(
        self,
        api_models: Mapping[str, ModelService],
        deleted_file_models: Mapping[str, ModelService],
        file_models: Mapping[str, ModelService],
    ) -> None:
        state = {
            "models": {
                mid: {"spec": svc.to_dict(), "base": spec_digest(file_models.get(mid))}
                for mid, svc in sorted(api_models.items())
            },
            "deleted": {mid: spec_digest(svc) for mid, svc in sorted(deleted_file_models.items())},
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        write_private(self.path, json.dumps(state, indent=1, sort_keys=True).encode())
