"""Who may call SIE's control APIs (DESIGN §10): identities, signed tokens, the credential directory,
and the aiohttp middleware every control API sits behind.

    identity.py   Identity and Role: admin, reader, node, sidecar, envoy
    tokens.py     Signer / Verifier: compact JWS with Ed25519, issued only by the control plane
    store.py      CredentialDir: the standalone credentials in <run-dir>/credentials (0700 / 0600)
    http.py       middleware(), require(), TokenSource for clients, same_secret() for worker keys
"""

from sie.auth.http import (
    Authenticator,
    ChainAuthenticator,
    IssuedToken,
    TokenAuthenticator,
    TokenSource,
    identity,
    middleware,
    require,
    same_secret,
)
from sie.auth.identity import Identity, Role
from sie.auth.store import (
    ADMIN_TOKEN,
    ENVOY_TOKEN,
    READER_TOKEN,
    TRUST,
    CredentialDir,
    CredentialError,
    node_token_name,
    read_secret,
    write_private,
)
from sie.auth.tokens import Signer, Verifier

__all__ = [
    "ADMIN_TOKEN",
    "ENVOY_TOKEN",
    "READER_TOKEN",
    "TRUST",
    "Authenticator",
    "ChainAuthenticator",
    "CredentialDir",
    "CredentialError",
    "Identity",
    "IssuedToken",
    "Role",
    "Signer",
    "TokenAuthenticator",
    "TokenSource",
    "Verifier",
    "identity",
    "middleware",
    "node_token_name",
    "read_secret",
    "require",
    "same_secret",
    "write_private",
]
