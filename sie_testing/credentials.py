"""Real credentials for tests and benchmarks: a credential directory exactly as `sie up` makes it, and the
files a node host would write for the processes it starts (a worker key, a sidecar token).

    creds = Credentials.create(tmp_path)
    creds.headers(Identity.admin())                      # {"Authorization": "Bearer ..."} for the admin API
    key, key_file = creds.worker_key(tmp_path / "w1")    # --api-key-file for a worker, --worker-key-file for its sidecar
    creds.sidecar_token_file(tmp_path / "w1", "m-0", "m", "node-a")   # --token-file for a sidecar
    creds.trust_file                                     # --trust-file for a sidecar or node host
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from sie.auth import (
    ADMIN_TOKEN,
    ENVOY_TOKEN,
    READER_TOKEN,
    TRUST,
    CredentialDir,
    Identity,
    Signer,
    node_token_name,
    write_private,
)


@dataclass(frozen=True)
class Credentials:
    dir: CredentialDir
    signer: Signer

    @classmethod
    def create(cls, folder: Path, nodes: tuple[str, ...] = ()) -> Credentials:
        creds = CredentialDir(Path(folder) / "credentials").ensure(nodes=nodes)
        return cls(creds, creds.signer())

    @property
    def path(self) -> Path:
        return self.dir.path

    @property
    def trust_file(self) -> Path:
        return self.dir.file(TRUST)

    @property
    def admin_token(self) -> str:
        return self.dir.token(ADMIN_TOKEN)

    @property
    def reader_token_file(self) -> Path:
        return self.dir.file(READER_TOKEN)

    @property
    def envoy_token(self) -> str:
        return self.dir.token(ENVOY_TOKEN)

    def node_token_file(self, node: str) -> Path:
        path = self.dir.file(node_token_name(node))
        if not path.exists():
            write_private(path, self.signer.issue(Identity.for_node(node)).encode())
        return path

    def token(self, who: Identity) -> str:
        return self.signer.issue(who)

    def headers(self, who: Identity | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token(who or Identity.admin())}"}

    def worker_key(self, folder: Path) -> tuple[str, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(24)
        path = folder / "worker.key"
        write_private(path, key.encode())
        return key, path

    def sidecar_token_file(self, folder: Path, instance_id: str, model_id: str, node: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{instance_id}.token"
        write_private(path, self.token(Identity.for_sidecar(instance_id, model_id, node)).encode())
        return path
