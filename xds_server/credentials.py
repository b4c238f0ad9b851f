"""The control plane's side of SIE's identities: it alone signs them (sie.auth.tokens).

- `TokenIssuer` signs each assignment's sidecar credential, bound to exactly (instance, model,
  node), and each node's credential; heartbeat replies carry them to the node host, which hands the
  sidecar's to the sidecar (its token file). Both expire, and are re-signed once half their life has
  passed, so a node host that heartbeats always holds valid ones, and a leaked one is worth at most its
  TTL: instance ids are reused (`scorer-0` again after a model comes back, or a node re-joins), and
  without an expiry an old instance's token would speak for every later instance of that id.
- `stream_identity` authenticates an Envoy's ADS stream: a bearer token in the stream's metadata
  (Envoy's `initial_metadata`), or, when ADS runs over TLS with client certificates, the verified
  certificate itself (on Kubernetes the bootstrap is a ConfigMap and holds no secret).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sie.auth import Authenticator, Identity, Role, Signer
from sie.auth.http import bearer
from sie.auth.tokens import SIDECAR_TOKEN_TTL_S
from sie.errors import AuthError, Forbidden, Unauthenticated

_K = TypeVar("_K", bound=Hashable)  # a binding: (instance, model, node), or a node

# Why an hour, for both this and sie.auth.tokens.SIDECAR_TOKEN_TTL_S: a node host renews its tokens with
# every heartbeat the control plane answers
# (sie.wire.HEARTBEAT_INTERVAL_S, half a second), and re-signing starts at half life, so thousands of
# beats carry the fresh token before the old one expires. The half left over covers a control plane
# outage or a network partition of at least half an hour, and clock skew between the control plane and
# the nodes (a node host checks its sidecars' tokens and sidecars check the node's, each by its own
# clock, and the verifier allows no leeway: skew must stay under TTL/2). Shorter would shrink what a
# stolen token (a log, a core dump, a read of the run directory) is worth, at the price of how long a
# node may be cut off; an hour is worth little to a thief and more than any restart takes. A node host
# cut off for longer loses them: its sidecars' telemetry gets 401, as do its own calls to its sidecars
# (sleep, wake) and theirs to it, until the next answered heartbeat brings fresh ones (by then the
# control plane has forgotten the node and what it registered, registry.NODE_FORGET_AFTER_S, so that
# telemetry routed nothing anyway).
NODE_TOKEN_TTL_S = 3600.0
# Tokens held per kind; over it the oldest-signed tenth is forgotten (re-signed when next asked for).
MAX_CACHED_TOKENS = 100_000


@dataclass(frozen=True)
class _Signed:
    token: str
    renew_at: float  # half its life: the holder gets the next one long before this one expires


class _Renewing(Generic[_K]):
    """Tokens by binding, each re-signed once half its `ttl_s` has passed; at most `limit` held."""

    def __init__(self, ttl_s: float, limit: int):
        if ttl_s <= 0:
            raise ValueError(f"a token TTL must be positive, got {ttl_s}")
        self._ttl = ttl_s
        self._limit = limit
        self._held: dict[_K, _Signed] = {}

    def get(self, key: _K, now: float, sign: Callable[[float], str]) -> str:
        cached = self._held.get(key)
        if cached is None or now >= cached.renew_at:
            # Popped and re-inserted: the dict's order is signing order, so the bound drops the oldest.
            self._held.pop(key, None)
            cached = self._held[key] = _Signed(sign(self._ttl), now + self._ttl / 2)
            if len(self._held) > self._limit:
                for old in list(itertools.islice(self._held, max(1, self._limit // 10))):
                    del self._held[old]
        return cached.token

    def __len__(self) -> int:
        return len(self._held)


class TokenIssuer:
    """Signs the identities the control plane hands out in heartbeat replies, each cached while fresh.

    `clock` decides when to re-sign; the signer's own clock stamps `iat`/`exp` (the same time.time in
    production, one fake clock in tests)."""

    def __init__(
        self,
        signer: Signer,
        clock: Callable[[], float] = time.time,
        node_ttl_s: float = NODE_TOKEN_TTL_S,
        sidecar_ttl_s: float = SIDECAR_TOKEN_TTL_S,
        limit: int = MAX_CACHED_TOKENS,
    ):
        self._signer = signer
        self._clock = clock
        self._sidecars: _Renewing[tuple[str, str, str]] = _Renewing(sidecar_ttl_s, limit)
        self._nodes: _Renewing[str] = _Renewing(node_ttl_s, limit)

    def issue(self, instance_id: str, model_id: str, node: str) -> str:
        """The sidecar credential of one assignment, bound to exactly (instance, model, node). Short-lived,
        and re-signed once half its life has passed: every heartbeat reply carries it, and the node host
        rewrites the sidecar's token file when it changes (node_host.supervisor.update_token)."""
        identity = Identity.for_sidecar(instance_id, model_id, node)
        return self._sidecars.get(
            (instance_id, model_id, node), self._clock(), lambda ttl: self._signer.issue(identity, ttl_s=ttl)
        )

    def node_token(self, node: str) -> str:
        """A node's SIE credential, for calling its own sidecars. A node host on Kubernetes proves itself
        to the control plane with its service-account token, which sidecars cannot check; this one they
        can (trust.pem). Short-lived, and re-signed once half its life has passed, so a node host that
        heartbeats every second always holds a valid one."""
        return self._nodes.get(node, self._clock(), lambda ttl: self._signer.issue(Identity.for_node(node), ttl_s=ttl))


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


__all__ = ["NODE_TOKEN_TTL_S", "SIDECAR_TOKEN_TTL_S", "AuthError", "TokenIssuer", "stream_identity"]
