"""Signed tokens: compact JWS (RFC 7515) with EdDSA over Ed25519 (RFC 8037), issued by the control plane.

Why signed tokens, and why asymmetric (the reasons in full are in DESIGN §10): every component must check
its callers, but only the control plane may mint identities. With Ed25519 the issuer alone holds the
private key; node hosts and sidecars verify with the public key and cannot forge anything by reading
their own files. A token is short, travels in `Authorization: Bearer`, and carries the identity's
bindings (node, model, instance), so authorisation needs no lookup.

Verification is strict and fixed: the header must say `alg: EdDSA` (no algorithm negotiation, so no
`alg: none` or HMAC confusion), the key id must be known, the signature must verify, and `exp`, when
present, must be in the future. A verified token is cached (bounded) so a busy caller costs a dict
lookup, not a signature check, per request; the cache still checks expiry on every hit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from sie import strict_json
from sie.auth.identity import Identity, Role
from sie.auth.tls import pem_blocks
from sie.errors import Unauthenticated

ISSUER = "sie"
MAX_TOKEN_BYTES = 4096
# SIE's header is {"alg":"EdDSA","typ":"JWT","kid":<16 hex>}, 80 characters in base64url; room to spare.
MAX_HEADER_BYTES = 256
_CACHE_SIZE = 4096
# Every sidecar token expires (xds_server.credentials re-signs it at half life through heartbeat replies):
# instance ids are reused, and a token without an end would speak for every later instance of its id.
# A sidecar identity signed without a ttl gets this one; one that names no expiry is refused.
SIDECAR_TOKEN_TTL_S = 3600.0


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    if not text or len(text) > MAX_TOKEN_BYTES or any(c not in _ALPHABET for c in text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def key_id(public: Ed25519PublicKey) -> str:
    """A short, stable id of a public key (the JWS `kid`), so keys can rotate with both trusted a while."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_keys(pem: bytes) -> dict[str, Ed25519PublicKey]:
    """Every Ed25519 public key in a PEM bundle (a trust bundle: sie.auth.tls), by key id."""
    keys: dict[str, Ed25519PublicKey] = {}
    for block in pem_blocks(pem, "PUBLIC KEY"):
        key = serialization.load_pem_public_key(block)
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("the trust bundle holds a key that is not Ed25519")
        keys[key_id(key)] = key
    if not keys:
        raise ValueError("no public key found in the trust bundle")
    return keys


def claims_of(identity: Identity) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "iss": ISSUER,
        "role": identity.role.value,
        "sub": identity.name,
        "iat": int(identity.issued_at),
    }
    if identity.node is not None:
        claims["node"] = identity.node
    if identity.model is not None:
        claims["model"] = identity.model
    if identity.expires_at is not None:
        claims["exp"] = int(identity.expires_at)
    return claims


def identity_of(claims: Mapping[str, Any]) -> Identity:
    """The identity a verified token's claims name; ValueError when they are not SIE's."""
    if claims.get("iss") != ISSUER:
        raise ValueError("not issued by SIE")
    role = Role(claims.get("role"))
    name = claims.get("sub")
    node, model = claims.get("node"), claims.get("model")
    for value in (name, node, model):
        if value is not None and (not isinstance(value, str) or not value or len(value) > 253):
            raise ValueError("a claim is not a short string")
    if not isinstance(name, str):
        raise ValueError("no subject")
    if role is Role.NODE and node != name:
        raise ValueError("a node token must name its node")
    if role is Role.SIDECAR and (node is None or model is None):
        raise ValueError("a sidecar token must name its node and model")
    iat, exp = claims.get("iat", 0), claims.get("exp")
    if role is Role.SIDECAR and exp is None:
        raise ValueError("a sidecar token must expire (one signed before they did: its node host gets a new one)")
    if not isinstance(iat, int) or (exp is not None and not isinstance(exp, int)):
        raise ValueError("iat/exp must be integers")
    return Identity(
        role, name, node=node, model=model, issued_at=float(iat), expires_at=float(exp) if exp is not None else None
    )


class Signer:
    """Mints tokens. Only the control plane (or `sie up` creating the first credentials) holds one."""

    def __init__(self, private: Ed25519PrivateKey, clock: Callable[[], float] = time.time):
        self._private = private
        self.public = private.public_key()
        self.kid = key_id(self.public)
        self._header = _b64(json.dumps({"alg": "EdDSA", "typ": "JWT", "kid": self.kid}, separators=(",", ":")).encode())
        self._clock = clock

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes) -> Signer:
        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the signing key is not an Ed25519 private key")
        return cls(key)

    def private_pem(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def issue(self, identity: Identity, ttl_s: float | None = None) -> str:
        """A token for `identity`, expiring `ttl_s` from now (None: at identity.expires_at, or never; a
        sidecar's at SIDECAR_TOKEN_TTL_S)."""
        now = self._clock()
        if ttl_s is None and identity.expires_at is None and identity.role is Role.SIDECAR:
            ttl_s = SIDECAR_TOKEN_TTL_S
        stamped = Identity(
            identity.role,
            identity.name,
            identity.node,
            identity.model,
            issued_at=now,
            expires_at=now + ttl_s if ttl_s is not None else identity.expires_at,
        )
        payload = _b64(json.dumps(claims_of(stamped), separators=(",", ":"), sort_keys=True).encode())
        signing_input = f"{self._header}.{payload}".encode()
        return f"{self._header}.{payload}.{_b64(self._private.sign(signing_input))}"

    def verifier(self) -> Verifier:
        return Verifier({self.kid: self.public}, self._clock)


@dataclass(frozen=True)
class _Cached:
    identity: Identity


class Verifier:
    """Checks tokens against the trusted public keys. Raises Unauthenticated with the reason."""

    def __init__(self, keys: Mapping[str, Ed25519PublicKey], clock: Callable[[], float] = time.time):
        if not keys:
            raise ValueError("a verifier needs at least one public key")
        self._keys = dict(keys)
        self._clock = clock
        self._cache: OrderedDict[str, _Cached] = OrderedDict()

    @classmethod
    def from_pem(cls, pem: bytes, clock: Callable[[], float] = time.time) -> Verifier:
        return cls(load_public_keys(pem), clock)

    def verify(self, token: str) -> Identity:
        hit = self._cache.get(token)
        if hit is None:
            hit = _Cached(self._verify_signature(token))
            self._cache[token] = hit
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(token)
        expires = hit.identity.expires_at
        if expires is not None and self._clock() >= expires:
            raise Unauthenticated("the token has expired; get a new one")
        return hit.identity

    def _verify_signature(self, token: str) -> Identity:
        if len(token) > MAX_TOKEN_BYTES:
            raise Unauthenticated("the token is too long to be an SIE token")
        parts = token.split(".")
        if len(parts) != 3:
            raise Unauthenticated("the credential is not an SIE token (expected header.payload.signature)")
        if len(parts[0]) > MAX_HEADER_BYTES:
            raise Unauthenticated("the token's header is too long to be an SIE token's")
        # Nothing but the short header is read before the signature verifies; the claims only after.
        # strict_json bounds the nesting (json.loads meets a RecursionError on a deep enough header).
        try:
            header = strict_json.loads(_unb64(parts[0]), max_depth=1, what="the token's header")
            signature = _unb64(parts[2])
        except ValueError:  # InputError, or not base64url
            raise Unauthenticated("the token is malformed") from None
        if not isinstance(header, dict) or header.get("alg") != "EdDSA":
            raise Unauthenticated("the token's algorithm is not EdDSA")
        kid = header.get("kid")
        key = self._keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise Unauthenticated("the token was signed by a key this component does not trust")
        try:
            key.verify(signature, f"{parts[0]}.{parts[1]}".encode())
        except InvalidSignature:
            raise Unauthenticated("the token's signature does not verify") from None
        try:
            claims = strict_json.loads(_unb64(parts[1]), what="the token's claims")
        except ValueError:
            raise Unauthenticated("the token is malformed") from None
        if not isinstance(claims, dict):
            raise Unauthenticated("the token's claims are not an object")
        try:
            return identity_of(claims)
        except ValueError as exc:
            raise Unauthenticated(f"the token's claims are not valid: {exc}") from None
