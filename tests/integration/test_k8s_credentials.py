"""The install's credentials Job against the FAKE API server (sie_testing.fake_apiserver, which speaks
the real REST protocol): it makes every credential object once, keeps them on a second run, finishes a half-done first
run, and what it makes fits together (the tokens verify with the trust ConfigMap; the ADS certificates
chain to the CA, with the control plane's DNS names and the usages each side checks)."""

from __future__ import annotations

import base64

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from sie.auth import Role, Verifier
from sie_testing.fake_apiserver import FakeApiServer, role_rules
from xds_server.k8s.credentials import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

OBJECTS = {
    ("secrets", n)
    for n in ("sie-credentials", "sie-admin-token", "sie-reader-token", "sie-ca", "sie-xds-tls", "sie-envoy-tls")
} | {("configmaps", "sie-trust")}


def _data(fake: FakeApiServer, resource: str, name: str) -> dict[str, str]:
    obj = fake.get(resource, "sie-system", name)
    assert obj is not None, name
    if resource == "configmaps":
        return obj["data"]
    return {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}


async def _run(fake: FakeApiServer) -> None:
    import asyncio

    assert await asyncio.to_thread(main, ["--namespace", "sie-system", "--kube-api-url", fake.url]) == 0


async def test_the_job_makes_every_credential_once_and_they_fit_together():
    fake = FakeApiServer(rules=role_rules("sie-credentials"))  # held to the Job's RBAC
    await fake.start()
    try:
        await _run(fake)
        found = {(r, o["metadata"]["name"]) for r in ("secrets", "configmaps") for o in fake.items(r)}
        assert found == OBJECTS
        before = {name: _data(fake, r, name) for r, name in OBJECTS}
        await _run(fake)  # a re-applied install changes nothing
        assert {name: _data(fake, r, name) for r, name in OBJECTS} == before

        verifier = Verifier.from_pem(_data(fake, "configmaps", "sie-trust")["trust.pem"].encode())
        assert verifier.verify(before["sie-admin-token"]["token"]).role is Role.ADMIN
        assert verifier.verify(before["sie-reader-token"]["token"]).role is Role.READER
        ca = x509.load_pem_x509_certificate(before["sie-ca"]["ca.crt"].encode())
        for name, usage, dns in (
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

        # A run that died after the key: the next one derives the rest from that key, never a new one.
        for resource, name in OBJECTS - {("secrets", "sie-credentials")}:
            fake.delete(resource, "sie-system", name)
        await _run(fake)
        assert _data(fake, "secrets", "sie-credentials") == before["sie-credentials"]
        assert _data(fake, "configmaps", "sie-trust") == before["sie-trust"]
        assert verifier.verify(_data(fake, "secrets", "sie-admin-token")["token"]).role is Role.ADMIN
        assert fake.denied == []
    finally:
        await fake.stop()
