"""sie.auth.tls and the admin API's certificate: a trust bundle carries the token keys and the CA; a
client of an https control plane trusts that CA alone, for the names the certificate was issued for."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from sie.auth import CredentialDir, CredentialError, Signer
from sie.auth.pki import CertificateAuthority
from sie.auth.store import ADMIN_TLS_DIR, CA_CERT, TRUST, read_trust_bundle
from sie.auth.tls import (
    CERT_FILE,
    KEY_FILE,
    bundle_certificates,
    client_context,
    pem_blocks,
    server_context,
    trust_bundle,
)
from sie.auth.tokens import load_public_keys, public_pem
from sie.cluster import ClusterSettings
from sie.standalone import Endpoints, admin_certificate_names
from sie_testing.ports import free_port


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


def _served_by(tmp_path, ca: CertificateAuthority, **names) -> web.AppRunner:
    pair = ca.issue("sie-admin", server=True, **names)
    directory = tmp_path / "tls"
    directory.mkdir(exist_ok=True)
    (directory / CERT_FILE).write_bytes(pair.cert_pem)
    (directory / KEY_FILE).write_bytes(pair.key_pem)
    app = web.Application()
    app.router.add_get("/healthz", _ok)
    return web.AppRunner(app), server_context(directory)


async def _get(runner, context, tls_client: ssl.SSLContext, host: str = "127.0.0.1") -> str:
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port, ssl_context=context)
    await site.start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls_client)) as session:
            async with session.get(f"https://{host}:{port}/healthz", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return await r.text()
    finally:
        await runner.cleanup()


def test_a_bundle_holds_the_keys_and_the_ca_and_each_reader_takes_its_part():
    signer, ca = Signer.generate(), CertificateAuthority.generate()
    bundle = trust_bundle(public_pem(signer.public), ca.cert_pem)
    assert list(load_public_keys(bundle)) == list(load_public_keys(public_pem(signer.public)))
    assert bundle_certificates(bundle) == [ca.cert_pem]
    assert pem_blocks(bundle, "PRIVATE KEY") == []
    # A leaf certificate is not an authority: a bundle naming one would pin nothing sensible.
    leaf = ca.issue("x", server=True).cert_pem
    with pytest.raises(ValueError, match="not a CA certificate"):
        bundle_certificates(trust_bundle(public_pem(signer.public), leaf))
    with pytest.raises(ValueError, match="not a CA certificate"):
        bundle_certificates(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")


async def test_a_client_trusts_the_bundles_ca_alone(tmp_path):
    ca, other = CertificateAuthority.generate("ours"), CertificateAuthority.generate("theirs")
    ours = client_context(trust_bundle(public_pem(Signer.generate().public), ca.cert_pem))

    runner, server = _served_by(tmp_path, ca, dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    assert await _get(runner, server, ours) == "ok"

    # The same name, from a CA the bundle does not carry: the handshake fails before any request is sent.
    runner, server = _served_by(tmp_path, other, dns_names=["localhost"], ip_addresses=["127.0.0.1"])
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await _get(runner, server, ours)

    # Our CA, but for another name: the host name is checked.
    runner, server = _served_by(tmp_path, ca, dns_names=["elsewhere.example"])
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await _get(runner, server, ours)

    # A bundle with no certificate falls back to the system's CAs, which never signed SIE's.
    runner, server = _served_by(tmp_path, ca, ip_addresses=["127.0.0.1"])
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await _get(runner, server, client_context(public_pem(Signer.generate().public)))


def test_a_key_that_does_not_match_the_certificate_is_refused_at_start(tmp_path):
    ca = CertificateAuthority.generate()
    (tmp_path / CERT_FILE).write_bytes(ca.issue("a", server=True).cert_pem)
    (tmp_path / KEY_FILE).write_bytes(ca.issue("b", server=True).key_pem)
    with pytest.raises(ssl.SSLError):
        server_context(tmp_path)


def test_the_credential_directory_carries_the_ca_in_its_trust_bundle(tmp_path):
    creds = CredentialDir(tmp_path / "credentials").ensure()
    trust = creds.file(TRUST).read_bytes()
    assert bundle_certificates(trust) == [creds.file(CA_CERT).read_bytes()]
    read_trust_bundle(creds.file(TRUST))  # both parts parse

    # A bundle from before the CA (the public key only) is brought up to date; the CA and key are kept.
    key_only = public_pem(creds.signer().public)
    creds.file(TRUST).write_bytes(key_only)
    ca_before = creds.file(CA_CERT).read_bytes()
    creds.ensure()
    assert creds.file(TRUST).read_bytes() == trust and creds.file(CA_CERT).read_bytes() == ca_before

    # Run again with nothing to do: nothing is rewritten.
    seen = creds.file(TRUST).stat().st_mtime_ns
    creds.ensure()
    assert creds.file(TRUST).stat().st_mtime_ns == seen

    # A CA that is gone is made anew, with the bundle and the issued certificates it invalidates.
    creds.admin_certificate(["localhost"], ["127.0.0.1"])
    creds.file(CA_CERT).unlink()
    creds.ensure()
    assert creds.file(CA_CERT).read_bytes() != ca_before
    assert bundle_certificates(creds.file(TRUST).read_bytes()) == [creds.file(CA_CERT).read_bytes()]
    assert not creds.file(ADMIN_TLS_DIR).exists()


async def test_the_admin_certificate_verifies_for_its_names_against_the_bundle(tmp_path):
    creds = CredentialDir(tmp_path / "credentials").ensure()
    directory = creds.admin_certificate(["localhost"], ["127.0.0.1"])
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct((directory / KEY_FILE).stat().st_mode & 0o777) == "0o600"
    pinned = read_trust_bundle(creds.file(TRUST)).tls
    for host in ("127.0.0.1", "localhost"):
        app = web.Application()
        app.router.add_get("/healthz", _ok)
        assert await _get(web.AppRunner(app), server_context(directory), pinned, host=host) == "ok"


def test_a_trust_bundle_that_is_not_one_is_a_credential_error(tmp_path):
    path = tmp_path / "trust.pem"
    ca = CertificateAuthority.generate()
    path.write_bytes(trust_bundle(public_pem(Signer.generate().public), ca.issue("leaf", server=True).cert_pem))
    path.chmod(0o600)
    with pytest.raises(CredentialError, match="not a CA certificate"):
        read_trust_bundle(path)
    path.write_bytes(ca.cert_pem)
    with pytest.raises(CredentialError, match="no public key"):
        read_trust_bundle(path)


@pytest.mark.parametrize(
    ("host", "setting", "tls"),
    [
        ("127.0.0.1", "auto", False),
        ("::1", "auto", False),
        ("localhost", "auto", False),
        ("0.0.0.0", "auto", True),
        ("10.1.2.3", "auto", True),
        ("10.1.2.3", "off", False),
        ("127.0.0.1", "on", True),
    ],
)
def test_the_admin_api_serves_https_when_it_leaves_loopback(host, setting, tls):
    settings = ClusterSettings(host=host, admin_tls=setting)
    assert settings.serves_tls is tls
    ep = Endpoints(host, 8080, 9901, 8000, 18000, admin_tls=settings.serves_tls)
    assert ep.admin_url.startswith("https://" if tls else "http://")


def test_a_wildcard_host_is_called_on_loopback_here_and_by_name_from_elsewhere():
    ep = Endpoints("0.0.0.0", 8080, 9901, 8000, 18000, admin_tls=True)
    assert ep.admin_url == "https://127.0.0.1:8000"
    assert "0.0.0.0" not in ep.join_url
    assert Endpoints("::", 8080, 9901, 8000, 18000).admin_url == "http://[::1]:8000"


def test_the_certificate_names_cover_loopback_the_host_and_the_extra_names():
    dns, ips = admin_certificate_names("10.1.2.3", ["sie.example", "203.0.113.7"])
    assert {"localhost", "sie.example"} <= set(dns)
    assert {"127.0.0.1", "::1", "10.1.2.3", "203.0.113.7"} <= set(ips)
    dns, ips = admin_certificate_names("0.0.0.0", [])
    assert "0.0.0.0" not in ips and "localhost" in dns
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
        ClusterSettings(admin_tls_names=["not a name"])


def test_sie_up_hands_its_children_the_trust_bundle_and_the_picker_the_ingress_body_limit(tmp_path):
    from sie.auth.store import private_dir
    from sie.cluster import IngressLimits
    from sie.standalone import Stack

    run_dir = private_dir(tmp_path / "run", "run directory")
    settings = ClusterSettings(admin_tls="on", ingress=IngressLimits(max_body_bytes=32 << 20))
    stack = Stack(tmp_path / "cluster.yaml", settings, run_dir)
    stack._build_children()
    trust = str(run_dir / "credentials" / "trust.pem")
    picker = stack.children["picker"].argv
    assert picker[picker.index("--max-message-bytes") + 1] == str((32 << 20) + 65_536)
    assert picker[picker.index("--trust-file") + 1] == trust
    assert picker[picker.index("--control-url") + 1].startswith("https://127.0.0.1:")
    (node,) = stack.node_children
    assert stack.children[node].argv[stack.children[node].argv.index("--trust-file") + 1] == trust
    xds = stack.children["xds_server"].argv
    assert (Path(xds[xds.index("--admin-tls-dir") + 1]) / CERT_FILE).exists()


def test_a_client_says_how_it_verifies_its_control_plane(tmp_path):
    creds = CredentialDir(tmp_path / "credentials").ensure()
    pinned = read_trust_bundle(creds.file(TRUST))
    assert pinned.pinned and "the trust bundle's CA alone" in pinned.describe("https://cp:8000")
    assert "plain HTTP" in pinned.describe("http://cp:8000")
    old = tmp_path / "old-trust.pem"
    old.write_bytes(public_pem(creds.signer().public))
    old.chmod(0o600)
    unpinned = read_trust_bundle(old)
    assert not unpinned.pinned and "names no CA" in unpinned.describe("https://cp:8000")
