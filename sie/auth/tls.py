"""TLS for the admin API: the server's context, and the one every SIE client of it verifies with.

SIE's trust bundle (trust.pem) says whom a component trusts, as a SPIFFE trust bundle does: the
control plane's token-signing public keys (`PUBLIC KEY` blocks, tokens.load_public_keys) and, when its
admin API serves TLS, the CA its certificate chains to (`CERTIFICATE` blocks). A client of an https
control URL (node host, sidecar, endpoint picker, the `sie` CLI) verifies the server against the
bundle's certificates only, so a node host sends its token to no one that merely holds some public
CA's certificate for that name; a bundle with no certificate falls back to the system's CAs (a control
plane behind a certificate a public or company CA signed).

    bundle = trust_bundle(public_pem(signer.public), ca.cert_pem)     # what `sie up` writes
    aiohttp.TCPConnector(ssl=client_context(bundle))                   # a client of https://...
    web.TCPSite(runner, host, port, ssl_context=server_context(dir))   # the admin API (tls.crt, tls.key)
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

from cryptography import x509

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----\r?\n.*?-----END \1-----\r?\n?", re.DOTALL)


def pem_blocks(pem: bytes, label: str) -> list[bytes]:
    """Every PEM block of type `label` (e.g. "CERTIFICATE") in `pem`, each with its BEGIN and END lines."""
    return [m.group(0).rstrip(b"\r\n") + b"\n" for m in _BLOCK.finditer(pem) if m.group(1) == label.encode()]


def bundle_certificates(pem: bytes) -> list[bytes]:
    """The CA certificates (PEM) of a trust bundle; a ValueError names a block that is not a CA's."""
    found = pem_blocks(pem, "CERTIFICATE")
    for i, block in enumerate(found, 1):
        try:
            cert = x509.load_pem_x509_certificate(block)
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except (ValueError, x509.ExtensionNotFound):
            raise ValueError(f"certificate {i} of the trust bundle is not a CA certificate") from None
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
        context = ssl.create_default_context(cadata=b"".join(certs).decode())
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
