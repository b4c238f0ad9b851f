"""A directory of credentials on disk (standalone mode): `sie up` creates it in the run directory.

    credentials/            0700
      signing.key           0600  the control plane's Ed25519 private key (only xds_server reads it)
      trust.pem             0600  the trust bundle (sie.auth.tls): its public key, what node hosts and
                                  sidecars verify callers with, and the CA certificate below
      ca.crt, ca.key        0600  the CA of the admin API's TLS (trust.pem pins node hosts to it)
      admin-tls/            0700  tls.crt, tls.key: the admin API's certificate, issued by each `sie up`
                                  that serves HTTPS (admin_certificate)
      admin.token           0600  an admin identity: `sie status`, `sie apply`, curl to the admin API
      reader.token          0600  a read-only identity: Prometheus, dashboards
      envoy.token           0600  the identity Envoy opens its ADS stream with
      node-<name>.token     0600  a node host's identity (one per node host this machine runs)

Files are created once and kept (a restarted `sie up` reuses them, so running node hosts and sidecars
keep working; trust.pem is rewritten only when it is not what the key and the CA make, as after an
upgrade from a bundle without the CA); each is written to a temporary name with mode 0600 and renamed
into place, so no reader ever sees a partial or world-readable credential.

The machine may run other users' software (DESIGN §10), and a run directory may sit in a directory they
can write too (a shared checkout, /tmp). So a directory SIE keeps credentials or state in is used only
when nobody else could have put anything there or could swap it later, as ssh's StrictModes checks
~/.ssh (`private_dir`); every file is created under a fresh name no one else can have planted
(`write_private`); and a secret is read only from a file this user or root owns (`read_secret`), since
whoever owns a file chose what it says.
"""

from __future__ import annotations

import os
import ssl
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from shutil import rmtree

from cryptography.exceptions import UnsupportedAlgorithm

from sie.auth.identity import Identity
from sie.auth.pki import CertificateAuthority
from sie.auth.tls import CERT_FILE, KEY_FILE, bundle_certificates, client_context, trust_bundle
from sie.auth.tokens import Signer, Verifier, public_pem
from sie.errors import SIEError

SIGNING_KEY = "signing.key"
TRUST = "trust.pem"
ADMIN_TOKEN = "admin.token"
READER_TOKEN = "reader.token"
ENVOY_TOKEN = "envoy.token"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
ADMIN_TLS_DIR = "admin-tls"
ADMIN_CERT_DAYS = 365


class CredentialError(SIEError):
    """A credential file is missing, unreadable or too open."""


class UnsafeDirectory(CredentialError):
    """A directory for credentials or state that another user owns, may write, or could replace (or a symbolic
    link): choose another, or fix its owner and mode as the message says."""


def node_token_name(node: str) -> str:
    return f"node-{node}.token"


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by this user only (0600), atomically. The temporary file gets a name
    no one can have planted (mkstemp: O_CREAT|O_EXCL, so never through a symbolic link left in the
    directory), and the rename replaces whatever `path` was, a planted link included, without following it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def trusted_owner(uid: int, me: int) -> bool:
    """Whether a file owned by `uid` may be believed by user `me`: its own, or root's (who could change
    anything anyway)."""
    return uid in (me, 0)


def dir_problem(path: Path, info: os.stat_result, me: int, what: str = "directory") -> str | None:
    """Why the directory `path` (its lstat) may not hold what user `me` keeps there, or None: it must be a
    real directory, not a symbolic link (whoever can change a link can point it elsewhere later), owned by
    `me`, and writable by nobody else (else they could have put files there that SIE would trust)."""
    if stat.S_ISLNK(info.st_mode):
        return f"the {what} {path} is a symbolic link; SIE uses only a real directory of yours: remove the link"
    if not stat.S_ISDIR(info.st_mode):
        return f"the {what} {path} is not a directory: remove it or choose another --run-dir"
    if info.st_uid != me:
        return (
            f"the {what} {path} belongs to uid {info.st_uid}, not to you (uid {me}), so its owner could read and "
            "replace what SIE keeps there: choose another --run-dir, or have it removed"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"others may write to the {what} {path} (mode {stat.filemode(info.st_mode)}), so what is in it "
            f"cannot be trusted: remove it (`rm -rf {path}`) and run again, or choose another --run-dir"
        )
    return None


def parent_problem(path: Path, info: os.stat_result, me: int, child: Path) -> str | None:
    """Why `path` (its stat; `child` lies under it) lets another user replace `child`, or None. It must be
    `me`'s or root's, and one others may write only if it is sticky, as /tmp is: there nobody but `child`'s
    owner may rename or remove it."""
    if not trusted_owner(info.st_uid, me):
        return (
            f"{path} belongs to uid {info.st_uid}, who could replace {child} in it: "
            "choose a --run-dir in a directory of yours"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return (
            f"others may write to {path} (mode {stat.filemode(info.st_mode)}) and so replace {child} in it: "
            f"`chmod go-w {path}`, or choose a --run-dir in a directory of yours"
        )
    return None


def link_problem(path: Path, info: os.stat_result, me: int, child: Path) -> str | None:
    """Why the symbolic link `path` (its lstat) on the way to `child` cannot be trusted, or None: whoever owns
    a link may point it elsewhere at any time."""
    if stat.S_ISLNK(info.st_mode) and not trusted_owner(info.st_uid, me):
        return (
            f"{path} is a symbolic link of uid {info.st_uid}, who could point it elsewhere and so replace {child}: "
            "choose a --run-dir in a directory of yours"
        )
    return None


def private_dir(path: Path, what: str = "directory", *, create: bool = True, me: int | None = None) -> Path:
    """`path` as a directory only this user can use, or UnsafeDirectory saying why not and what to do.
    With `create`, what is missing of it is made 0700; without, a missing `path` is returned as it is
    (nothing there to trust). Every directory above it is checked as well (`parent_problem`), through
    every symbolic link on the way (`link_problem`), and `path` itself is made 0700."""
    me = os.getuid() if me is None else me
    path = Path(os.path.abspath(path))
    try:
        return _private_dir(path, what, create, me)
    except OSError as exc:  # not ours to search or create in: no less a reason to stop
        raise CredentialError(
            f"cannot make sure the {what} {path} is yours alone: {exc.strerror} ({exc.filename}); "
            "choose another --run-dir"
        ) from None


def _private_dir(path: Path, what: str, create: bool, me: int) -> Path:
    if create:
        for missing in reversed([p for p in (path, *path.parents) if not os.path.lexists(p)]):
            try:
                missing.mkdir(mode=0o700)
            except FileExistsError:
                pass  # made meanwhile: checked below like any other
    elif not os.path.lexists(path):
        return path
    problems = [link_problem(p, os.lstat(p), me, path) for p in reversed(path.parents)]
    real = Path(os.path.realpath(path.parent))
    problems += [parent_problem(p, os.stat(p), me, path) for p in (*reversed(real.parents), real)]
    info = os.lstat(path)
    problems.append(dir_problem(path, info, me, what))
    problem = next((p for p in problems if p), None)
    if problem:
        raise UnsafeDirectory(problem)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours and closed to writers; closed to readers too (a 0755 of an older version)
    return path


def read_secret(path: str | Path, what: str = "credential", me: int | None = None) -> str:
    """A token or key file's content, stripped. Refuses a file others may read or write (owner and group
    read only, as `chmod 600` or a Kubernetes Secret mounted 0440), and one another user owns (root may:
    a Kubernetes Secret's files are root's), since its owner chose what it says."""
    path = Path(path)
    me = os.getuid() if me is None else me
    try:
        # Opened once and checked by its descriptor: the file read is the file checked. Links are followed
        # (a Kubernetes Secret's files are links into its ..data directory).
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            text = f.read(1 << 20).decode(errors="replace").strip()
    except OSError as exc:
        raise CredentialError(f"cannot read the {what} {path}: {exc.strerror}") from None
    # Group read is allowed: a Kubernetes Secret reaches a non-root container only as 0440 with the pod's
    # fsGroup. Anything more open (others at all, or group write) is refused.
    if info.st_mode & (stat.S_IRWXO | stat.S_IWGRP | stat.S_IXGRP):
        raise CredentialError(
            f"the {what} {path} is readable by others (mode {stat.filemode(info.st_mode)}); `chmod 600 {path}`"
        )
    if not trusted_owner(info.st_uid, me):
        raise CredentialError(
            f"the {what} {path} belongs to uid {info.st_uid}, not to you (uid {me}), so another user chose what it "
            "says: remove it (`sie up` makes new credentials where it keeps them), or use a copy of your own"
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
        """Create what is missing (the key first, then every token it signs); keep what exists. The directory
        must be one only this user can use (`private_dir`): a key someone else left there would be trusted."""
        private_dir(self.path, "credentials directory")
        key = self.file(SIGNING_KEY)
        if not key.exists():
            signer = Signer.generate()
            write_private(key, signer.private_pem())
            for stale in (TRUST, ADMIN_TOKEN, READER_TOKEN, ENVOY_TOKEN):
                self.file(stale).unlink(missing_ok=True)  # signed by a key that is gone
            for old in self.path.glob("node-*.token"):
                old.unlink()
        if not (self.file(CA_KEY).exists() and self.file(CA_CERT).exists()):
            ca = CertificateAuthority.generate("sie-admin-ca")
            write_private(self.file(CA_KEY), ca.key_pem)
            write_private(self.file(CA_CERT), ca.cert_pem)
            rmtree(self.file(ADMIN_TLS_DIR), ignore_errors=True)  # issued by a CA that is gone
        signer = self.signer()
        # The trust bundle is derived from the key and the CA: rewritten when it says anything else.
        bundle = trust_bundle(public_pem(signer.public), self.ca().cert_pem)
        if not self.file(TRUST).exists() or self.file(TRUST).read_bytes() != bundle:
            write_private(self.file(TRUST), bundle)
        wanted: dict[str, str | Identity] = {
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

    def ca(self) -> CertificateAuthority:
        """The admin TLS's CA; CredentialError says what is wrong with ca.crt or ca.key (an encrypted key,
        which SIE cannot use unattended, included), as the trust bundle's reader would (bundle_certificates)."""
        cert_pem = read_secret(self.file(CA_CERT), "CA certificate").encode()
        key_pem = read_secret(self.file(CA_KEY), "CA key").encode()
        try:
            bundle_certificates(cert_pem)  # what every client will make of it: a CA certificate that parses
            return CertificateAuthority.from_pem(cert_pem, key_pem)
        except TypeError as exc:  # cryptography: an encrypted key and no password (or the reverse)
            raise CredentialError(
                f"the CA in {self.path}: {self.file(CA_KEY)} cannot be read without a password ({exc}); "
                f"SIE needs it unencrypted: remove {self.file(CA_KEY)} and {self.file(CA_CERT)} and `sie up` "
                "makes a new CA (copy trust.pem to the node hosts again)"
            ) from None
        except ValueError as exc:
            raise CredentialError(f"the CA in {self.path}: {exc}") from None

    def admin_certificate(self, dns_names: Sequence[str], ip_addresses: Sequence[str]) -> Path:
        """Issue the admin API's server certificate for these names (a fresh one, valid ADMIN_CERT_DAYS) into
        ADMIN_TLS_DIR, as xds_server --admin-tls-dir reads it; that directory."""
        directory = self.file(ADMIN_TLS_DIR)
        private_dir(directory, "admin TLS directory")
        pair = self.ca().issue(
            "sie-admin", dns_names=dns_names, ip_addresses=ip_addresses, server=True, days=ADMIN_CERT_DAYS
        )
        write_private(directory / KEY_FILE, pair.key_pem)
        write_private(directory / CERT_FILE, pair.cert_pem)
        return directory

    def signer(self) -> Signer:
        pem = read_secret(self.file(SIGNING_KEY), "signing key").encode()
        try:
            return Signer.from_pem(pem)
        except (TypeError, ValueError) as exc:  # TypeError: an encrypted key (cryptography asks a password)
            raise CredentialError(f"the signing key {self.file(SIGNING_KEY)}: {exc}") from None

    def verifier(self) -> Verifier:
        return Verifier.from_pem(read_secret(self.file(TRUST), "trust bundle").encode())

    def token(self, name: str) -> str:
        return read_secret(self.file(name), "token")


@dataclass(frozen=True)
class TrustBundle:
    """What a trust bundle file says (sie.auth.tls): whose tokens to accept, and how to verify an https
    control plane."""

    verifier: Verifier
    tls: ssl.SSLContext
    pinned: bool  # the bundle names a CA, the only one `tls` trusts (else: the system's CAs)

    def describe(self, control_url: str) -> str:
        """How a client of `control_url` verifies it, for its start-up log."""
        if not control_url.startswith("https:"):
            return f"{control_url} is plain HTTP: nothing verifies who answers there"
        if self.pinned:
            return f"{control_url} is verified against the trust bundle's CA alone"
        return (
            f"{control_url} is verified against the system's CAs: the trust bundle names no CA (one copied "
            "from a control plane older than its admin TLS? copy its trust.pem again)"
        )


def read_trust_bundle(path: Path) -> TrustBundle:
    """Read a trust bundle (as read_secret: this user's or root's file); CredentialError names what is wrong."""
    pem = read_secret(path, "trust bundle").encode()
    try:
        tls = client_context(pem)  # first: it reads every block (bundle_blocks), so names a damaged one
        return TrustBundle(Verifier.from_pem(pem), tls, bool(bundle_certificates(pem)))
    except (ValueError, UnsupportedAlgorithm) as exc:  # UnsupportedAlgorithm: a key of a type nobody reads
        raise CredentialError(f"the trust bundle {path}: {exc}") from None
