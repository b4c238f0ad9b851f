"""The control plane's side of SIE's identities: it alone signs them (sie.auth.tokens).

- `TokenIssuer` signs each assignment's sidecar credential, bound to exactly (instance, model,
  node), once per binding: heartbeat replies carry it to the node host, which hands it to the sidecar.
- `stream_identity` authenticates an Envoy's ADS stream: a bearer token in the stream's metadata
  (Envoy's `initial_metadata`), or, when ADS runs over TLS with client certificates, the verified
  certificate itself (on Kubernetes the bootstrap is a ConfigMap and holds no secret).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sie.auth import Authenticator, Identity, Role, Signer
from sie.auth.http import bearer
from sie.errors import AuthError, Forbidden, Unauthenticated

NODE_TOKEN_TTL_S = 3600.0


class TokenIssuer:
    """Signs the identities the control plane hands out in heartbeat replies, each cached while fresh."""

    def __init__(self, signer: Signer, clock: Callable[[], float] = time.time, node_ttl_s: float = NODE_TOKEN_TTL_S):
        self._signer = signer
        self._clock = clock
        self._node_ttl = node_ttl_s
        self._issued: dict[tuple[str, str, str], str] = {}
        self._nodes: dict[str, tuple[float, str]] = {}  # node -> (reissue after, token)

    def issue(self, instance_id: str, model_id: str, node: str) -> str:
        """The sidecar credential of one assignment, bound to exactly (instance, model, node)."""
        key = (instance_id, model_id, node)
        token = self._issued.get(key)
        if token is None:
            token = self._issued[key] = self._signer.issue(Identity.for_sidecar(instance_id, model_id, node))
            if len(self._issued) > 100_000:  # bounded: forget the oldest bindings (they are re-signed on demand)
                for old in list(self._issued)[:10_000]:
                    del self._issued[old]
        return token

    def node_token(self, node: str) -> str:
        """A node's SIE credential, for calling its own sidecars. A node host on Kubernetes proves itself
        to the control plane with its service-account token, which sidecars cannot check; this one they
        can (trust.pem). Short-lived, and re-signed once half its life has passed, so a node host that
        heartbeats every second always holds a valid one."""
        now = self._clock()
        cached = self._nodes.get(node)
        if cached is None or cached[0] <= now:
            token = self._signer.issue(Identity.for_node(node), ttl_s=self._node_ttl)
            cached = self._nodes[node] = (now + self._node_ttl / 2, token)
            if len(self._nodes) > 100_000:
                self._nodes.pop(next(iter(self._nodes)))
        return cached[1]


async def stream_identity(
    authenticator: Authenticator, metadata: Any, auth_context: dict[str, list[bytes]]
) -> Identity:
    """The identity an ADS stream proves; AuthError when it proves none that may read xDS."""
    if auth_context.get("x509_common_name") or auth_context.get("x509_subject_alternative_name"):
        names = auth_context.get("x509_common_name") or auth_context.get("x509_subject_alternative_name") or [b"envoy"]
        return Identity.envoy(names[0].decode(errors="replace")[:128])  # the TLS layer verified it against the CA
    values = {k.lower(): v for k, v in (metadata or ())}
    token = bearer(values.get("authorization"))
    if token is None:
        raise Unauthenticated(
            "the ADS stream carries no credential: give Envoy's ads_config grpc_service an "
            "initial_metadata `authorization: Bearer <envoy token>`"
        )
    who = await authenticator.authenticate(token)
    if who.role not in (Role.ENVOY, Role.ADMIN):
        raise Forbidden(f"{who.subject} may not read xDS: it needs the envoy role")
    return who


__all__ = ["NODE_TOKEN_TTL_S", "AuthError", "TokenIssuer", "stream_identity"]
