"""The credentials Job's one change to an existing object (xds_server.k8s.credentials.with_ca): a trust
ConfigMap without the CA gets it appended, keeping every key and certificate; one with it is left alone."""

from __future__ import annotations

import pytest

from sie.auth import Signer
from sie.auth.pki import CertificateAuthority
from sie.auth.tls import bundle_certificates, pem_blocks, trust_bundle
from sie.auth.tokens import load_public_keys, public_pem
from xds_server.k8s.credentials import with_ca

CA = CertificateAuthority.generate()
OTHER_CA = CertificateAuthority.generate("an-older-ca")
KEY = public_pem(Signer.generate().public).decode()
ROTATED = public_pem(Signer.generate().public).decode()
BUNDLE = trust_bundle(KEY.encode(), CA.cert_pem).decode()
BROKEN_CERT = "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (None, BUNDLE),  # no trust.pem at all: derived whole
        ("", BUNDLE),
        (" \n", BUNDLE),
        (KEY, KEY + CA.cert_pem.decode()),  # an install from before the admin API's TLS
        (KEY.rstrip("\n"), KEY + CA.cert_pem.decode()),
        (KEY + ROTATED, KEY + ROTATED + CA.cert_pem.decode()),  # a key being rotated in: kept
        (KEY + OTHER_CA.cert_pem.decode(), KEY + OTHER_CA.cert_pem.decode() + CA.cert_pem.decode()),
        (KEY + BROKEN_CERT, KEY + BROKEN_CERT + CA.cert_pem.decode()),  # not judged here: kept as it was
        (BUNDLE, None),  # already names the CA: left alone
        (BUNDLE.rstrip("\n"), None),
        (BUNDLE.replace("\n", "\r\n"), None),
        (CA.cert_pem.decode() + KEY, None),  # in any order
        (KEY + OTHER_CA.cert_pem.decode() + CA.cert_pem.decode(), None),
    ],
    ids=[
        "none",
        "empty",
        "blank",
        "key",
        "key-no-newline",
        "two-keys",
        "other-ca",
        "broken-cert",
        "bundle",
        "bundle-no-newline",
        "bundle-crlf",
        "ca-first",
        "both-cas",
    ],
)
def test_with_ca(held, expected):
    assert with_ca(held, BUNDLE, CA.cert_pem) == expected


def test_what_it_writes_is_a_bundle_the_clients_read():
    upgraded = with_ca(KEY + ROTATED, BUNDLE, CA.cert_pem)
    assert upgraded is not None
    assert len(load_public_keys(upgraded.encode())) == 2
    assert bundle_certificates(upgraded.encode()) == [CA.cert_pem]
    assert with_ca(upgraded, BUNDLE, CA.cert_pem) is None  # a second run changes nothing
    assert pem_blocks(upgraded.encode(), "PUBLIC KEY") == [KEY.encode(), ROTATED.encode()]
