"""xds_server.credentials: the identities the control plane signs for heartbeat replies."""

from __future__ import annotations

from sie.auth import Role, Signer, Verifier
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
