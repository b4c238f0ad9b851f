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
from sie.endpoints import Endpoints, admin_certificate_names
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


# ---- a damaged bundle is refused, never read as one without its CA ------------------------------------------

_SIGNER = Signer.generate()
_CA = CertificateAuthority.generate("sie-admin-ca")
_GOOD = trust_bundle(public_pem(_SIGNER.public), _CA.cert_pem)


@pytest.mark.parametrize(
    ("damaged", "named"),
    [
        (_GOOD.rstrip(b"\n").rsplit(b"\n", 1)[0] + b"\n", "no END line"),  # its last line lost
        (_GOOD.replace(b"CERTIFICATE-----", b"TRUSTED CERTIFICATE-----"), "begins a TRUSTED CERTIFICATE block"),
        (_GOOD.replace(b"-----BEGIN CERTIFICATE-----\n", b"-----BEGIN CERTIFICATE----- \n"), "is not the BEGIN line"),
        (_GOOD.replace(b"-----BEGIN CERTIFICATE-----\n", b""), "is not the BEGIN line"),  # an END line alone
        (_GOOD.replace(b"-----END PUBLIC KEY-----\n", b""), "no END line"),  # a block runs into the next
        (_GOOD + _CA.key_pem, "begins a PRIVATE KEY block"),
        (_GOOD.replace(b"\n-----END CERTIFICATE-----", b"-----END CERTIFICATE-----"), "no END line"),
    ],
    ids=["cut-short", "trusted-certificate", "space-after-begin", "begin-lost", "end-lost", "private-key", "joined"],
)
def test_a_damaged_bundle_is_refused_not_read_as_one_naming_no_ca(tmp_path, damaged, named):
    """Each of these once read as a bundle with no CA, and its client trusted the system's CAs instead."""
    with pytest.raises(ValueError, match=named):
        bundle_certificates(damaged)
    with pytest.raises(ValueError, match=named):
        client_context(damaged)
    path = tmp_path / "trust.pem"
    path.write_bytes(damaged)
    path.chmod(0o600)
    with pytest.raises(CredentialError, match=f"{path}: .*{named}"):
        read_trust_bundle(path)


def test_a_bundle_read_whole_the_way_openssl_writes_them(tmp_path):
    """What stays allowed: line ends of either kind, text between the blocks, and a bundle without a
    certificate, which is the documented fallback to the system's CAs (a publicly-signed control plane)."""
    for bundle in (_GOOD.replace(b"\n", b"\r\n"), b"# SIE\n" + _GOOD.replace(b"-----\n-----", b"-----\nca:\n-----")):
        assert [c.replace(b"\r", b"") for c in bundle_certificates(bundle)] == [_CA.cert_pem]
    keys_only = public_pem(_SIGNER.public)
    assert bundle_certificates(keys_only) == []
    path = tmp_path / "trust.pem"
    path.write_bytes(keys_only)
    path.chmod(0o600)
    assert not read_trust_bundle(path).pinned


def _ca_der_with(edit) -> bytes:
    """A CA certificate of SIE's CA whose DER `edit` changed, as PEM (not signed again: no parser here checks)."""
    import base64

    from cryptography.hazmat.primitives import serialization

    der = edit(_CA.cert.public_bytes(serialization.Encoding.DER))
    body = b"\n".join(base64.encodebytes(der).split())
    return b"-----BEGIN CERTIFICATE-----\n" + body + b"\n-----END CERTIFICATE-----\n"


def _duplicated_extension() -> bytes:
    """A CA certificate carrying basicConstraints twice (cryptography raises x509.DuplicateExtension)."""
    import base64
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID, ObjectIdentifier

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ca")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.UnrecognizedExtension(ObjectIdentifier("2.5.29.99"), b"\x30\x03\x01\x01\xff"), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    # 2.5.29.99 -> 2.5.29.19 (basicConstraints): the same extension twice.
    der = cert.public_bytes(serialization.Encoding.DER).replace(b"\x06\x03\x55\x1d\x63", b"\x06\x03\x55\x1d\x13", 1)
    return (
        b"-----BEGIN CERTIFICATE-----\n"
        + b"\n".join(base64.encodebytes(der).split())
        + b"\n-----END CERTIFICATE-----\n"
    )


def _unknown_key_type() -> bytes:
    import base64

    from cryptography.hazmat.primitives import serialization

    der = _SIGNER.public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    der = der.replace(bytes.fromhex("06032b6570"), bytes.fromhex("06032b657f"))  # Ed25519's OID -> 1.3.101.127
    return b"-----BEGIN PUBLIC KEY-----\n" + base64.encodebytes(der) + b"-----END PUBLIC KEY-----\n"


@pytest.mark.parametrize(
    ("bundle", "named"),
    [
        (public_pem(_SIGNER.public) + _duplicated_extension(), "Duplicate 2.5.29.19 extension"),
        (
            public_pem(_SIGNER.public)
            + _ca_der_with(lambda der: der.replace(bytes.fromhex("a003020102"), bytes.fromhex("a003020105"), 1)),
            "5 is not a valid X509 version",
        ),
        # cryptography reads past a PEM header; OpenSSL refuses the block (ssl.SSLError).
        (
            _GOOD.replace(b"-----BEGIN CERTIFICATE-----\n", b"-----BEGIN CERTIFICATE-----\nProc-Type: 4,x\n\n"),
            "OpenSSL",
        ),
    ],
    ids=["duplicate-extension", "x509-version", "pem-header"],
)
def test_a_bundle_ca_that_does_not_parse_is_a_value_error_not_a_traceback(tmp_path, bundle, named):
    with pytest.raises(ValueError, match=named):
        client_context(bundle)
    path = tmp_path / "trust.pem"
    path.write_bytes(bundle)
    path.chmod(0o600)
    with pytest.raises(CredentialError, match=named):
        read_trust_bundle(path)


def test_a_bundle_key_of_a_type_nobody_reads_is_a_credential_error(tmp_path):
    path = tmp_path / "trust.pem"
    path.write_bytes(_unknown_key_type() + _CA.cert_pem)
    path.chmod(0o600)
    with pytest.raises(CredentialError, match="Unknown key type"):
        read_trust_bundle(path)


def test_a_ca_or_signing_key_sie_cannot_use_is_a_credential_error(tmp_path):
    """`sie token` and `sie up` say what is wrong with the run directory's CA and key: no traceback."""
    from cryptography.hazmat.primitives import serialization

    from sie.auth.store import CA_KEY, SIGNING_KEY, write_private

    creds = CredentialDir(tmp_path / "credentials").ensure()
    key = serialization.load_pem_private_key(creds.file(CA_KEY).read_bytes(), None)
    encrypted = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
    )
    write_private(creds.file(CA_KEY), encrypted)
    with pytest.raises(CredentialError, match="cannot be read without a password"):
        creds.ca()
    with pytest.raises(CredentialError, match="cannot be read without a password"):
        creds.ensure()
    write_private(
        creds.file(CA_KEY),
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    creds.ca()
    ca_cert = creds.file(CA_CERT).read_bytes()
    write_private(creds.file(CA_CERT), _duplicated_extension())
    with pytest.raises(CredentialError, match="Duplicate 2.5.29.19 extension"):
        creds.ca()
    write_private(creds.file(CA_CERT), ca_cert)
    signing = serialization.load_pem_private_key(creds.file(SIGNING_KEY).read_bytes(), None)
    write_private(
        creds.file(SIGNING_KEY),
        signing.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
        ),
    )
    with pytest.raises(CredentialError, match="signing key .*encrypted"):
        creds.signer()


def test_sie_token_says_what_is_wrong_with_an_encrypted_ca_key(tmp_path, capsys):
    from cryptography.hazmat.primitives import serialization

    from sie.auth.store import CA_KEY, write_private
    from sie.cli import main

    run = tmp_path / "run"
    creds = CredentialDir(run / "credentials").ensure()
    key = serialization.load_pem_private_key(creds.file(CA_KEY).read_bytes(), None)
    write_private(
        creds.file(CA_KEY),
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
        ),
    )
    assert main(["token", "node", "n1", "--run-dir", str(run)]) == 1
    assert "cannot be read without a password" in capsys.readouterr().err


# ---- every URL `sie up` uses or prints is one its certificate names ------------------------------------------


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext, hostname: str) -> None:
    """A TLS handshake in memory, the client checking `hostname` as aiohttp and urllib do; SSLError if refused."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=hostname)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for name, end in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("the handshake did not end")


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0", "0000::"])
def test_every_spelling_of_the_wildcard_is_one(host):
    from sie.endpoints import is_wildcard

    assert is_wildcard(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "10.1.2.3", "localhost", "sie.example"])
def test_an_address_is_not_the_wildcard(host):
    from sie.endpoints import is_wildcard

    assert not is_wildcard(host)


@pytest.mark.parametrize(
    ("host", "machine"),
    [
        ("0.0.0.0", ("vm", "vm.example", ("192.0.2.2", "127.0.1.1"))),
        ("::0", ("vm", "vm", ("192.0.2.2",))),
        ("0:0:0:0:0:0:0:0", ("vm", "vm", ("2001:db8::2",))),
        ("0.0.0.0", ("build_box", "build_box", ("127.0.1.1", "fe80::1", "192.0.2.2"))),  # no DNS name
        ("::", ("build_box", "build_box", ("2001:db8:0:0::2",))),
        ("0.0.0.0", ("build_box", "build_box", ("127.0.1.1",))),  # nothing another machine could reach
        ("0:0:0:0:0:0:0:1", ("vm", "vm", ())),
        ("10.1.2.3", ("build_box", "build_box", ())),
        ("sie.example", ("vm", "vm", ())),
    ],
)
def test_every_url_sie_up_uses_or_prints_verifies_against_its_certificate(tmp_path, host, machine):
    """admin_url (this machine's processes) and join_url (what `sie up --control-plane` prints for other
    machines) each name a host the certificate sie up issues carries, whatever the host's spelling and
    whatever this machine is called; one that is not this machine's name says why."""
    from urllib.parse import urlsplit

    from sie.endpoints import Machine

    here = Machine(*machine)
    dns, ips = admin_certificate_names(host, [], here)
    pair = _CA.issue("sie-admin", dns_names=dns, ip_addresses=ips, server=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    (tmp_path / "c").write_bytes(pair.cert_pem)
    (tmp_path / "k").write_bytes(pair.key_pem)
    server.load_cert_chain(tmp_path / "c", tmp_path / "k")
    client = client_context(_GOOD)
    ep = Endpoints(host, 8080, 9901, 8000, 18000, admin_tls=True, machine=here)
    for url in (ep.admin_url, ep.join_url):
        name = urlsplit(url).hostname
        assert name in dns + ips, url  # written as the certificate writes it (one form of an IPv6 address)
        _handshake(client, server, name)  # SSLCertVerificationError if the certificate does not name it
    if machine[0] == "build_box" and ep.join_url != "https://10.1.2.3:8000":
        assert "build_box" not in ep.join_url and "not a DNS name" in (ep.join_note or "")
    else:
        assert ep.join_note is None


def test_a_host_no_certificate_can_name_is_refused_when_the_admin_api_serves_tls():
    with pytest.raises(ValueError, match="host: 'build_box' is neither an IP address nor a DNS name"):
        ClusterSettings(host="build_box", admin_tls="on")
    assert ClusterSettings(host="build_box", admin_tls="off").host == "build_box"
