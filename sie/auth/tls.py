"""TLS for the admin API: the server's context, and the one every SIE client of it verifies with.

SIE's trust bundle (trust.pem) says whom a component trusts, as a SPIFFE trust bundle does: the
control plane's token-signing public keys (`PUBLIC KEY` blocks, tokens.load_public_keys) and, when its
admin API serves TLS, the CA its certificate chains to (`CERTIFICATE` blocks). A client of an https
control URL (node host, sidecar, endpoint picker, the `sie` CLI) verifies the server against the
bundle's certificates only, so a node host sends its token to no one that merely holds some public
CA's certificate for that name; a bundle with no certificate falls back to the system's CAs (a control
plane behind a certificate a public or company CA signed). So a damaged bundle is an error, never read
as one without its CA (bundle_blocks): every BEGIN line must open a complete block of a type SIE reads.

    bundle = trust_bundle(public_pem(signer.public), ca.cert_pem)     # what `sie up` writes
    aiohttp.TCPConnector(ssl=client_context(bundle))                   # a client of https://...
    server_context(Path(dir))                                          # the admin API's (tls.crt, tls.key;
                                                                       # xds_server/admin_listener.py serves it)
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

from cryptography import x509

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.DOTALL)

# The PEM types a trust bundle may hold: the token keys (tokens.load_public_keys) and the CA certificates.
BUNDLE_LABELS = ("PUBLIC KEY", "CERTIFICATE")
_BEGIN_LINE = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----")


def pem_blocks(pem: bytes, label: str) -> list[bytes]:
    """Every PEM block of type `label` (e.g. "CERTIFICATE") in `pem`, each with its BEGIN and END lines.
    Lenient: what is not a complete block is skipped, so a reader of a trust bundle checks it first
    (bundle_blocks)."""
    return [m.group(0).rstrip(b"\r\n") + b"\n" for m in _BLOCK.finditer(pem) if m.group(1) == label.encode()]


def _shown(line: bytes) -> str:
    return repr(line[:80].decode(errors="replace"))


def bundle_blocks(pem: bytes) -> list[tuple[str, bytes]]:
    """The blocks of a trust bundle, (type, PEM) in order; ValueError names the line of one that is not a
    complete block SIE reads. Every BEGIN line must be exactly `-----BEGIN <type>-----` of a type in
    BUNDLE_LABELS and be closed by its END line, and no END line may stand alone. A damaged block is
    never skipped: a CA certificate skipped would leave a bundle with none, and its client would trust the
    system's CAs instead (client_context) without a word. Text outside the blocks is ignored, as OpenSSL
    ignores it."""
    found: list[tuple[str, bytes]] = []
    opened: tuple[int, str, list[bytes]] | None = None  # (line number, type, the lines so far)
    for number, raw in enumerate(pem.split(b"\n"), 1):
        line = raw.removesuffix(b"\r")
        marker = b"-----BEGIN" in line or b"-----END" in line
        if opened is None:
            if not marker:
                continue
            begin = _BEGIN_LINE.fullmatch(line)
            if begin is None:
                raise ValueError(
                    f"line {number}, {_shown(line)}, is not the BEGIN line of a block: each block of a trust bundle "
                    "starts with `-----BEGIN PUBLIC KEY-----` or `-----BEGIN CERTIFICATE-----`, alone on its line "
                    "(copy the bundle again)"
                )
            label = begin.group(1).decode()
            if label not in BUNDLE_LABELS:
                raise ValueError(
                    f"line {number} begins a {label} block; a trust bundle holds PUBLIC KEY and CERTIFICATE blocks only"
                )
            opened = (number, label, [line])
            continue
        start, label, lines = opened
        lines.append(line)
        if line == f"-----END {label}-----".encode():
            found.append((label, b"\n".join(lines) + b"\n"))
            opened = None
        elif marker:
            raise ValueError(
                f"the {label} block on line {start} has no END line (`-----END {label}-----`) "
                f"before line {number}, {_shown(line)} (copy the bundle again)"
            )
    if opened is not None:
        start, label, _ = opened
        raise ValueError(
            f"the {label} block on line {start} has no END line (`-----END {label}-----`): "
            "the file is cut short (copy the bundle again)"
        )
    return found


def bundle_certificates(pem: bytes) -> list[bytes]:
    """The CA certificates (PEM) of a trust bundle (bundle_blocks: every block complete and of a type SIE
    reads); a ValueError names what is wrong, a block that is not a CA's certificate among it."""
    found = [block for label, block in bundle_blocks(pem) if label == "CERTIFICATE"]
    for i, block in enumerate(found, 1):
        try:
            cert = x509.load_pem_x509_certificate(block)
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            raise ValueError(
                f"certificate {i} of the trust bundle is not a CA certificate (no basic constraints)"
            ) from None
        except (ValueError, x509.InvalidVersion, x509.DuplicateExtension, x509.UnsupportedGeneralNameType) as exc:
            # cryptography's parse errors are not all ValueErrors: each is a bundle that is not one.
            raise ValueError(
                f"certificate {i} of the trust bundle is not a CA certificate SIE can read ({exc})"
            ) from None
        if not constraints.ca:
            raise ValueError(f"certificate {i} of the trust bundle is not a CA certificate (it may sign nothing)")
    return found


def trust_bundle(public_keys_pem: bytes, *ca_certs_pem: bytes) -> bytes:
    """A trust bundle: the token-signing public keys, then the CA certificates of SIE's TLS."""
    parts = [public_keys_pem.rstrip(b"\n") + b"\n"] + [c.rstrip(b"\n") + b"\n" for c in ca_certs_pem]
    return b"".join(parts)


def client_context(bundle_pem: bytes | None) -> ssl.SSLContext:
    """How an SIE client verifies an https control plane: only against the bundle's CA certificates when
    it has any (pinned), else the system's; the host name always checked, TLS 1.2 at least."""
    certs = bundle_certificates(bundle_pem) if bundle_pem else []
    if certs:
        try:
            context = ssl.create_default_context(cadata=b"".join(certs).decode())
        except ssl.SSLError as exc:  # parsed above, yet OpenSSL refuses it (a PEM header line, for one)
            raise ValueError(f"OpenSSL cannot load the trust bundle's CA certificates ({exc})") from None
    else:
        context = ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_context(directory: Path) -> ssl.SSLContext:
    """The admin API's TLS from DIR/tls.crt (its certificate, then any intermediates) and DIR/tls.key.
    Clients authenticate with bearer tokens inside the connection, so none is asked for a certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(directory / CERT_FILE, directory / KEY_FILE)
    return context
