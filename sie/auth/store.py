"""A directory of credentials on disk (standalone mode): `sie up` creates it in the run directory.

    credentials/            0700
      signing.key           0600  the control plane's Ed25519 private key (only xds_server reads it)
      trust.pem             0600  its public key: what node hosts and sidecars verify callers with
      admin.token           0600  an admin identity: `sie status`, `sie apply`, curl to the admin API
      reader.token          0600  a read-only identity: Prometheus, dashboards
      envoy.token           0600  the identity Envoy opens its ADS stream with
      node-<name>.token     0600  a node host's identity (one per node host this machine runs)

Files are created once and kept (a restarted `sie up` reuses them, so running node hosts and sidecars
keep working); each is written to a temporary name with mode 0600 and renamed into place, so no reader
ever sees a partial or world-readable credential.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sie.auth.identity import Identity
from sie.auth.tokens import Signer, Verifier, public_pem
from sie.errors import SIEError

SIGNING_KEY = "signing.key"
TRUST = "trust.pem"
ADMIN_TOKEN = "admin.token"
READER_TOKEN = "reader.token"
ENVOY_TOKEN = "envoy.token"


class CredentialError(SIEError):
    """A credential file is missing, unreadable or too open."""


def node_token_name(node: str) -> str:
    return f"node-{node}.token"


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by this user only (0600), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_secret(path: str | Path, what: str = "credential") -> str:
    """A token or key file's content, stripped. Refuses a file others may read or write (owner and group
    read only, as `chmod 600` or a Kubernetes Secret mounted 0440)."""
    path = Path(path)
    try:
        info = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise CredentialError(f"cannot read the {what} {path}: {exc.strerror}") from None
    # Group read is allowed: a Kubernetes Secret reaches a non-root container only as 0440 with the pod's
    # fsGroup. Anything more open (others at all, or group write) is refused.
    if info.st_mode & (stat.S_IRWXO | stat.S_IWGRP | stat.S_IXGRP):
        raise CredentialError(
            f"the {what} {path} is readable by others (mode {stat.filemode(info.st_mode)}); `chmod 600 {path}`"
        )
    if not text:
        raise CredentialError(f"the {what} {path} is empty")
    return text


class CredentialDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def file(self, name: str) -> Path:
        return self.path / name

    def ensure(self, nodes: tuple[str, ...] = ()) -> CredentialDir:
        """Create what is missing (the key first, then every token it signs); keep what exists."""
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)
        key = self.file(SIGNING_KEY)
        if not key.exists():
            signer = Signer.generate()
            write_private(key, signer.private_pem())
            for stale in (TRUST, ADMIN_TOKEN, READER_TOKEN, ENVOY_TOKEN):
                self.file(stale).unlink(missing_ok=True)  # signed by a key that is gone
            for old in self.path.glob("node-*.token"):
                old.unlink()
        signer = self.signer()
        wanted: dict[str, str | Identity] = {
            TRUST: public_pem(signer.public).decode(),
            ADMIN_TOKEN: Identity.admin(),
            READER_TOKEN: Identity.reader(),
            ENVOY_TOKEN: Identity.envoy(),
        }
        wanted.update({node_token_name(n): Identity.for_node(n) for n in nodes})
        for name, what in wanted.items():
            target = self.file(name)
            if target.exists():
                continue
            content = what if isinstance(what, str) else signer.issue(what)
            write_private(target, content.encode() + b"\n")
        return self

    def signer(self) -> Signer:
        return Signer.from_pem(read_secret(self.file(SIGNING_KEY), "signing key").encode())

    def verifier(self) -> Verifier:
        return Verifier.from_pem(read_secret(self.file(TRUST), "trust bundle").encode())

    def token(self, name: str) -> str:
        return read_secret(self.file(name), "token")
