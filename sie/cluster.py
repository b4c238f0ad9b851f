"""The standalone cluster file: ModelService documents plus an optional `kind: Cluster` document.

    kind: Cluster
    spec: {envoy_port: 8080, envoy_admin_port: 9901, admin_port: 8000, xds_port: 18000}
    ---
    kind: ModelService
    ...

Command-line flags of `sie up` override the Cluster document, which overrides the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sie.errors import Problem, SpecError
from sie.spec import KIND, ModelService
from sie.spec_loader import ensure_unique, load_documents, parse_model_service, problems_from_validation

CLUSTER_KIND = "Cluster"


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    envoy_port: int = Field(default=8080, ge=0, le=65535)
    envoy_admin_port: int = Field(default=9901, ge=0, le=65535)
    admin_port: int = Field(default=8000, ge=0, le=65535)
    xds_port: int = Field(default=18000, ge=0, le=65535)
    node_port: int = Field(default=0, ge=0, le=65535, description="node host API; 0 picks a free port")
    node_name: str = "local"
    virtual_gpus: str | None = Field(default=None, description="e.g. '2x80GB'; GPUs that are simulated, labelled so")
    eviction: Literal["drain", "kill", "off"] = Field(
        default="drain", description="node host pre-eviction: drain (default); kill and off are bench/eviction baselines")
    data_dir: str = Field(default=".sie/data", description="where the demo creates its tiny models")
    run_dir: str = Field(default=".sie/run", description="pid file, logs")


@dataclass(frozen=True)
class ClusterFile:
    path: Path
    settings: ClusterSettings
    services: list[ModelService]


def load_cluster(path: str | Path) -> ClusterFile:
    path = Path(path)
    settings = ClusterSettings()
    services: list[ModelService] = []
    for label, doc in load_documents(path):
        kind = doc.get("kind", KIND)
        if kind == CLUSTER_KIND:
            try:
                settings = ClusterSettings.model_validate(doc.get("spec") or {})
            except ValidationError as exc:
                raise SpecError(label, problems_from_validation(exc, "spec")) from None
        elif kind == KIND:
            services.append(parse_model_service(doc, label))
        else:
            raise SpecError(label, [Problem("kind", f"expected {KIND!r} or {CLUSTER_KIND!r}, got {kind!r}")])
    ensure_unique(services, str(path))
    return ClusterFile(path=path, settings=settings, services=services)
