"""The install's credentials Job against the FAKE API server (sie_testing.fake_apiserver, which speaks
the real REST protocol): it makes every credential object once, keeps them on a second run, finishes a half-done first
run, and what it makes fits together (the tokens verify with the trust ConfigMap; the ADS certificates
chain to the CA, with the control plane's DNS names and the usages each side checks; the admin API's
certificate passes a real TLS handshake verified with the trust ConfigMap's bundle, for the Service's names
and for port-forward's localhost). An install from before the admin API's TLS (a sie-trust with the public
key only) gets the CA added to its bundle, keeping its keys; one that has it is left alone."""

from __future__ import annotations

import asyncio
import base64
import copy
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from sie.auth import Role, Signer, Verifier
from sie.auth.tls import bundle_certificates, client_context, pem_blocks, server_context
from sie.auth.tokens import load_public_keys, public_pem
from sie_testing.fake_apiserver import FakeApiServer, role_rules
from xds_server.k8s.credentials import SECRETS, TRUST_CONFIG_MAP, Names, main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

OBJECTS = {("secrets", n) for n in SECRETS} | {("configmaps", TRUST_CONFIG_MAP)}


def _data(fake: FakeApiServer, resource: str, name: str) -> dict[str, str]:
    obj = fake.get(resource, "sie-system", name)
    assert obj is not None, name
    if resource == "configmaps":
        return obj["data"]
    return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}


def _versions(fake: FakeApiServer) -> dict[str, str]:
    """Each object's resourceVersion: unchanged when nothing wrote it, even a write of the same data."""
    found = {name: fake.get(r, "sie-system", name) for r, name in OBJECTS}
    return {name: obj["metadata"]["resourceVersion"] for name, obj in found.items() if obj is not None}


async def _run(fake: FakeApiServer) -> None:
    assert await asyncio.to_thread(main, ["--namespace", "sie-system", "--kube-api-url", fake.url]) == 0


async def _handshake(tls_dir: Path, bundle: str, name: str) -> None:
    """A real TLS connection to a server with the admin API's certificate, verified as the control plane's
    clients verify it (sie.auth.tls.client_context of the trust bundle), for host name `name`."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_context(tls_dir))
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context(bundle.encode()), server_hostname=name
        )
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_job_makes_every_credential_once_and_they_fit_together(tmp_path):
    fake = FakeApiServer(rules=role_rules("sie-credentials"))  # held to the Job's RBAC
    await fake.start()
    try:
        await _run(fake)
        found = {(r, o["metadata"]["name"]) for r in ("secrets", "configmaps") for o in fake.items(r)}
        assert found == OBJECTS
        before = {name: _data(fake, r, name) for r, name in OBJECTS}
        versions = _versions(fake)
        await _run(fake)  # a re-applied install changes nothing, and writes nothing
        assert {name: _data(fake, r, name) for r, name in OBJECTS} == before
        assert _versions(fake) == versions

        # The trust bundle: the public key (tokens verify) and the CA's certificate, nothing else.
        trust = before["sie-trust"]["trust.pem"]
        verifier = Verifier.from_pem(trust.encode())
        assert verifier.verify(before["sie-admin-token"]["token"]).role is Role.ADMIN
        assert verifier.verify(before["sie-reader-token"]["token"]).role is Role.READER
        assert pem_blocks(trust.encode(), "PUBLIC KEY") == pem_blocks(
            before["sie-credentials"]["trust.pem"].encode(), "PUBLIC KEY"
        )
        assert bundle_certificates(trust.encode()) == [before["sie-ca"]["ca.crt"].encode()]

        ca = x509.load_pem_x509_certificate(before["sie-ca"]["ca.crt"].encode())
        for name, usage, dns in (
            ("sie-admin-tls", ExtendedKeyUsageOID.SERVER_AUTH, "sie-xds.sie-system.svc"),
            ("sie-xds-tls", ExtendedKeyUsageOID.SERVER_AUTH, "sie-xds.sie-system.svc"),
            ("sie-envoy-tls", ExtendedKeyUsageOID.CLIENT_AUTH, "sie-envoy"),
        ):
            cert = x509.load_pem_x509_certificate(before[name]["tls.crt"].encode())
            cert.verify_directly_issued_by(ca)
            assert usage in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            assert dns in cert.extensions.get_extension_for_class(
                x509.SubjectAlternativeName
            ).value.get_values_for_type(x509.DNSName)
            assert before[name]["ca.crt"] == before["sie-ca"]["ca.crt"]

        # The admin API's certificate, served for real and verified with the ConfigMap's bundle: every name
        # the Service is reached by, and port-forward's localhost and 127.0.0.1; no other name.
        admin_tls = tmp_path / "admin-tls"
        admin_tls.mkdir()
        for file in ("tls.crt", "tls.key"):
            (admin_tls / file).write_text(before["sie-admin-tls"][file])
        for name in [*Names().xds_dns, "localhost", "127.0.0.1"]:
            await _handshake(admin_tls, trust, name)
        for name in ("sie-envoy", "sie-xds", "127.0.0.2", "evil.example"):
            with pytest.raises(ssl.SSLCertVerificationError):
                await _handshake(admin_tls, trust, name)
        # The bundle is what makes it verify: the public key alone (an old sie-trust) falls back to the
        # system's CAs, which never signed it.
        with pytest.raises(ssl.SSLCertVerificationError):
            await _handshake(admin_tls, before["sie-credentials"]["trust.pem"], "sie-xds.sie-system.svc")

        # A run that died after the key: the next one derives the rest from that key, never a new one.
        for resource, name in OBJECTS - {("secrets", "sie-credentials")}:
            fake.delete(resource, "sie-system", name)
        await _run(fake)
        assert _data(fake, "secrets", "sie-credentials") == before["sie-credentials"]
        rebuilt = _data(fake, "configmaps", "sie-trust")["trust.pem"].encode()
        assert pem_blocks(rebuilt, "PUBLIC KEY") == pem_blocks(trust.encode(), "PUBLIC KEY")
        assert bundle_certificates(rebuilt) == [_data(fake, "secrets", "sie-ca")["ca.crt"].encode()]  # the new CA
        assert verifier.verify(_data(fake, "secrets", "sie-admin-token")["token"]).role is Role.ADMIN
        assert fake.denied == []
    finally:
        await fake.stop()


async def test_an_install_from_before_the_admin_tls_gets_the_ca_added_to_its_trust_bundle():
    """The upgrade path: sie-trust held the public key(s) only, and sie-admin-tls did not exist."""
    fake = FakeApiServer(rules=role_rules("sie-credentials"))
    await fake.start()
    try:
        await _run(fake)
        before = {name: _data(fake, r, name) for r, name in OBJECTS}
        fake.delete("secrets", "sie-system", "sie-admin-tls")
        # The old bundle: the install's key, and a second one being rotated in, which must be kept.
        rotated = public_pem(Signer.generate().public).decode()
        old = before["sie-credentials"]["trust.pem"].rstrip("\n") + "\n" + rotated
        stored = copy.deepcopy(fake.get("configmaps", "sie-system", "sie-trust"))
        assert stored is not None
        stored["data"]["trust.pem"] = old
        stored["metadata"]["labels"]["team"] = "platform"  # someone's label: kept by the replace
        fake.put("configmaps", stored)

        await _run(fake)
        upgraded = fake.get("configmaps", "sie-system", "sie-trust")
        assert upgraded is not None
        trust = upgraded["data"]["trust.pem"]
        assert trust == old.rstrip("\n") + "\n" + before["sie-ca"]["ca.crt"]  # appended, nothing dropped
        assert upgraded["metadata"]["labels"]["team"] == "platform"
        assert len(load_public_keys(trust.encode())) == 2
        assert bundle_certificates(trust.encode()) == [before["sie-ca"]["ca.crt"].encode()]
        assert fake.get("secrets", "sie-system", "sie-admin-tls") is not None
        # Every other credential is the one it was.
        for resource, name in OBJECTS - {("configmaps", "sie-trust"), ("secrets", "sie-admin-tls")}:
            assert _data(fake, resource, name) == before[name], name

        versions = _versions(fake)
        await _run(fake)  # now it holds the CA: left alone
        assert _versions(fake) == versions
        assert fake.denied == []
    finally:
        await fake.stop()
