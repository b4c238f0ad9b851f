"""xds_server.credentials: the identities the control plane signs for heartbeat replies."""

from __future__ import annotations

import dataclasses

import pytest

from sie.auth import Role, Signer, Verifier
from sie.errors import Unauthenticated
from xds_server.credentials import TokenIssuer


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_node_tokens_are_short_lived_and_renewed_at_half_life():
    clock = Clock()
    signer = Signer(Signer.generate()._private, clock)
    issuer = TokenIssuer(signer, clock, node_ttl_s=100)
    first = issuer.node_token("n1")
    clock.now += 40
    assert issuer.node_token("n1") == first
    clock.now += 20
    second = issuer.node_token("n1")
    assert second != first
    who = Verifier({signer.kid: signer.public}, clock).verify(second)
    assert (who.role, who.name, who.expires_at) == (Role.NODE, "n1", clock.now + 100)
    assert issuer.issue("a-0", "a", "n1") == issuer.issue("a-0", "a", "n1")


def test_sidecar_tokens_expire_and_are_renewed_at_half_life_with_no_gap():
    """A sidecar token used to be signed once per binding with no expiry, so one leaked from an old
    instance spoke for every later instance of the same id (ids are reused) for ever."""
    clock = Clock()
    signer = Signer(Signer.generate()._private, clock)
    verifier = Verifier({signer.kid: signer.public}, clock)
    issuer = TokenIssuer(signer, clock, sidecar_ttl_s=100)
    first = issuer.issue("scorer-0", "scorer", "n1")
    who = verifier.verify(first)
    assert (who.role, who.name, who.model, who.node) == (Role.SIDECAR, "scorer-0", "scorer", "n1")
    assert who.expires_at == clock.now + 100
    clock.now += 49
    assert issuer.issue("scorer-0", "scorer", "n1") == first  # cached while more than half its life is left
    clock.now += 1
    second = issuer.issue("scorer-0", "scorer", "n1")
    assert second != first  # half its life gone: re-signed, the same binding
    assert verifier.verify(second) == dataclasses.replace(who, issued_at=clock.now, expires_at=clock.now + 100)
    assert verifier.verify(first).name == "scorer-0"  # both valid at the switch: the holder sees no gap
    clock.now += 50
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(first)
    assert verifier.verify(second).name == "scorer-0"
    assert issuer.issue("scorer-0", "scorer", "n1") not in (first, second)
    clock.now += 1000
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(second)  # a leaked token is worth a TTL, not for ever


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_a_token_lifetime_must_be_positive(ttl):
    signer = Signer.generate()
    with pytest.raises(ValueError, match="positive"):
        TokenIssuer(signer, sidecar_ttl_s=ttl)
    with pytest.raises(ValueError, match="positive"):
        TokenIssuer(signer, node_ttl_s=ttl)


def test_the_token_cache_stays_bounded_and_forgets_the_oldest_signed_first():
    clock = Clock()
    signer = Signer(Signer.generate()._private, clock)
    issuer = TokenIssuer(signer, clock, sidecar_ttl_s=100, limit=10)
    for i in range(10):
        issuer.issue(f"m-{i}", "m", "n1")
    clock.now += 60
    renewed = issuer.issue("m-0", "m", "n1")  # re-signed: now the newest
    issuer.issue("m-10", "m", "n1")  # one over the bound: the oldest-signed tenth (m-1) goes
    held = [iid for iid, _, _ in issuer._sidecars._held]
    assert held == [*(f"m-{i}" for i in range(2, 10)), "m-0", "m-10"]
    assert issuer.issue("m-0", "m", "n1") == renewed
    issuer.issue("m-1", "m", "n1")  # forgotten, so signed again on demand; the bound holds
    assert len(issuer._sidecars) == 10 and "m-1" in {iid for iid, _, _ in issuer._sidecars._held}
