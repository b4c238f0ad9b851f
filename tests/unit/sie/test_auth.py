"""sie.auth: signed identities, the credential directory, and the middleware every control API sits behind."""

from __future__ import annotations

import base64
import json
import os
import stat

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from sie.auth import (
    ChainAuthenticator,
    CredentialDir,
    CredentialError,
    Identity,
    Role,
    Signer,
    TokenAuthenticator,
    TokenSource,
    Verifier,
    middleware,
    read_secret,
    require,
    same_secret,
    write_private,
)
from sie.auth.tokens import SIDECAR_TOKEN_TTL_S, _b64, identity_of, public_pem
from sie.errors import Unauthenticated


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _parts(token: str) -> tuple[dict, dict, str]:
    head, body, sig = token.split(".")
    pad = lambda s: s + "=" * (-len(s) % 4)  # noqa: E731
    return json.loads(base64.urlsafe_b64decode(pad(head))), json.loads(base64.urlsafe_b64decode(pad(body))), sig


@pytest.mark.parametrize(
    "who",
    [
        Identity.admin(),
        Identity.reader(),
        Identity.envoy(),
        Identity.for_node("n1"),
        Identity.for_sidecar("chat-0", "chat", "n1"),
    ],
)
def test_a_token_carries_its_identity_and_verifies_with_the_public_key_only(who):
    signer = Signer.generate()
    token = signer.issue(who)
    verifier = Verifier.from_pem(public_pem(signer.public))
    got = verifier.verify(token)
    assert (got.role, got.name, got.node, got.model) == (who.role, who.name, who.node, who.model)
    header, claims, _ = _parts(token)
    assert header == {"alg": "EdDSA", "typ": "JWT", "kid": signer.kid} and claims["iss"] == "sie"


def _forgeries(signer: Signer, who: Identity) -> dict[str, str]:
    real = signer.issue(who)
    head, body, sig = real.split(".")
    claims = _parts(real)[1]
    admin_claims = _b64(json.dumps(claims | {"role": "admin", "sub": "admin"}).encode())
    return {
        "another key": Signer.generate().issue(who),
        "alg none": f"{_b64(json.dumps({'alg': 'none', 'kid': signer.kid}).encode())}.{body}.",
        "alg HS256": f"{_b64(json.dumps({'alg': 'HS256', 'kid': signer.kid}).encode())}.{body}.{sig}",
        "claims swapped": f"{head}.{admin_claims}.{sig}",
        "signature cut": f"{head}.{body}.",
        "two parts": f"{head}.{body}",
        "not base64": f"{head}.{body}.%%%",
        "huge": "a" * 5000,
        "empty": "",
        # json.loads met a RecursionError on these (a 500 on every authenticated server)
        "deep header": f"{_b64(b'[' * 2500)}.{body}.{sig}",
        "deep unsigned claims": f"{head}.{_b64(b'[' * 2500)}.{sig}",
        "nested header": f"{_b64(b'[' * 50 + b']' * 50)}.{body}.{sig}",
        "header not JSON": f"{_b64(b'{alg')}.{body}.{sig}",
    }


@pytest.mark.parametrize("what", list(_forgeries(Signer.generate(), Identity.for_node("n1"))))
def test_forged_and_tampered_tokens_are_refused_with_the_reason(what):
    signer = Signer.generate()
    token = _forgeries(signer, Identity.for_node("n1"))[what]
    with pytest.raises(Unauthenticated):
        signer.verifier().verify(token)


@pytest.mark.parametrize(
    "what, why",
    [
        ("deep header", "header is too long"),
        ("nested header", "malformed"),
        ("deep unsigned claims", "signature does not verify"),  # claims are read only once signed
    ],
)
def test_a_malformed_token_is_refused_before_its_claims_are_read(what, why):
    signer = Signer.generate()
    with pytest.raises(Unauthenticated, match=why):
        signer.verifier().verify(_forgeries(signer, Identity.for_node("n1"))[what])


@given(
    st.lists(
        st.one_of(
            st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", max_size=60),
            st.binary(max_size=60).map(_b64),
            st.recursive(st.just("1"), lambda inner: inner.map(lambda t: f"[{t}]"), max_leaves=80).map(
                lambda t: _b64(t.encode())
            ),
        ),
        min_size=1,
        max_size=4,
    ).map(".".join)
)
def test_any_token_is_an_identity_or_unauthenticated(token):
    signer = Signer.generate()
    with pytest.raises(Unauthenticated):
        signer.verifier().verify(token)


@pytest.mark.parametrize(
    "claims, why",
    [
        ({"iss": "someone", "role": "admin", "sub": "a"}, "not issued by SIE"),
        ({"iss": "sie", "role": "root", "sub": "a"}, "not valid"),
        ({"iss": "sie", "role": "node", "sub": "n1", "node": "n2"}, "must name its node"),
        ({"iss": "sie", "role": "sidecar", "sub": "chat-0", "node": "n1"}, "node and model"),
        ({"iss": "sie", "role": "admin", "sub": "a", "exp": "never"}, "integers"),
    ],
)
def test_a_signed_token_with_claims_that_are_not_an_sie_identity_is_refused(claims, why):
    signer = Signer.generate()
    head = _b64(json.dumps({"alg": "EdDSA", "kid": signer.kid}).encode())
    body = _b64(json.dumps(claims).encode())
    sig = _b64(signer._private.sign(f"{head}.{body}".encode()))
    with pytest.raises(Unauthenticated, match=why):
        signer.verifier().verify(f"{head}.{body}.{sig}")


def test_an_expired_token_is_refused_even_after_it_was_cached():
    clock = Clock()
    signer = Signer(Signer.generate()._private, clock)
    verifier = Verifier({signer.kid: signer.public}, clock)
    token = signer.issue(Identity.reader(), ttl_s=60)
    assert verifier.verify(token).role is Role.READER
    clock.now += 61
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(token)


def test_a_verifier_trusts_every_key_of_its_bundle_so_keys_can_rotate():
    old, new = Signer.generate(), Signer.generate()
    verifier = Verifier.from_pem(public_pem(old.public) + public_pem(new.public))
    assert verifier.verify(old.issue(Identity.admin())).role is Role.ADMIN
    assert verifier.verify(new.issue(Identity.admin())).role is Role.ADMIN


def test_the_credential_directory_is_private_and_kept_across_restarts(tmp_path):
    creds = CredentialDir(tmp_path / "credentials").ensure(nodes=("local",))
    names = {p.name for p in creds.path.iterdir()}
    assert names == {
        "signing.key",
        "trust.pem",
        "ca.crt",
        "ca.key",
        "admin.token",
        "reader.token",
        "envoy.token",
        "node-local.token",
    }
    assert stat.S_IMODE(creds.path.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in creds.path.iterdir())
    node = creds.verifier().verify(creds.token("node-local.token"))
    assert (node.role, node.name, node.node) == (Role.NODE, "local", "local")
    before = creds.token("admin.token")
    assert CredentialDir(creds.path).ensure(nodes=("local", "n2")).token("admin.token") == before
    assert (creds.path / "node-n2.token").exists()


def test_a_new_key_replaces_every_token_the_old_one_signed(tmp_path):
    creds = CredentialDir(tmp_path).ensure(nodes=("local",))
    old_admin = creds.token("admin.token")
    (tmp_path / "signing.key").unlink()
    creds.ensure()
    assert creds.token("admin.token") != old_admin
    assert not (tmp_path / "node-local.token").exists()
    with pytest.raises(Unauthenticated):
        creds.verifier().verify(old_admin)


def test_a_secret_that_others_may_read_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("abc\n")
    os.chmod(path, 0o644)
    with pytest.raises(CredentialError, match="readable by others"):
        read_secret(path)
    os.chmod(path, 0o620)
    with pytest.raises(CredentialError, match="readable by others"):
        read_secret(path)
    for mode in (0o600, 0o400, 0o440):  # 0440: a Kubernetes Secret for a non-root container (fsGroup)
        os.chmod(path, mode)
        assert read_secret(path) == "abc"
    os.chmod(path, 0o600)
    path.write_text("")
    with pytest.raises(CredentialError, match="empty"):
        read_secret(path)
    with pytest.raises(CredentialError, match="cannot read"):
        read_secret(tmp_path / "missing")


def test_a_token_source_rereads_its_file_when_it_changes(tmp_path):
    path = tmp_path / "token"
    path.write_text("one")
    os.chmod(path, 0o600)
    source = TokenSource(path=path)
    assert source.headers() == {"Authorization": "Bearer one"}
    path.write_text("second")
    assert source.token == "second"
    path.unlink()
    assert source.token == "second"  # a file being replaced keeps the last good token
    with pytest.raises(ValueError):
        TokenSource()


def test_a_token_source_sees_a_replaced_file_even_of_the_same_size_and_time(tmp_path):
    """A renewed token has the old one's length, and two writes can share a timestamp tick: the file is
    replaced (write_private renames a new file over it), so its inode tells the change."""
    path = tmp_path / "token"
    write_private(path, b"token-1")
    source = TokenSource(path=path)
    assert source.token == "token-1"
    before = path.stat()
    write_private(path, b"token-2")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert source.token == "token-2"
    assert source.path == path and TokenSource(token="fixed").path is None


def test_worker_keys_compare_in_constant_time_and_none_never_matches():
    assert same_secret("k" * 32, "k" * 32)
    assert not same_secret("k" * 31, "k" * 32) and not same_secret(None, "k")
    # A header's non-UTF-8 bytes arrive as surrogates (aiohttp's surrogateescape): no match, no exception.
    assert not same_secret(b"\xff\xfe".decode(errors="surrogateescape"), "k" * 32)
    assert not same_secret("\ud800", "k")


class _Refuses:
    async def authenticate(self, token: str) -> Identity:
        raise Unauthenticated("not mine")


async def test_the_middleware_answers_401_and_403_as_json_and_keeps_open_paths_open():
    signer = Signer.generate()

    async def write(request: web.Request) -> web.Response:
        who = require(request, Role.ADMIN)
        return web.json_response({"by": who.subject})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(
        middlewares=[
            middleware(ChainAuthenticator(_Refuses(), TokenAuthenticator(signer.verifier())), open_paths=("/healthz",))
        ]
    )
    app.router.add_post("/write", write)
    app.router.add_get("/healthz", health)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        assert (await client.get("/healthz")).status == 200
        resp = await client.post("/write")
        body = await resp.json()
        assert resp.status == 401 and body["error"]["type"] == "unauthenticated"
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        resp = await client.post("/write", headers={"Authorization": f"Bearer {signer.issue(Identity.reader())}"})
        assert resp.status == 403 and "needs the admin role" in (await resp.json())["error"]["message"]
        resp = await client.post("/write", headers={"Authorization": f"bearer {signer.issue(Identity.admin())}"})
        assert resp.status == 200 and (await resp.json()) == {"by": "admin:admin"}
        for what in ("deep header", "deep unsigned claims"):
            crafted = _forgeries(signer, Identity.admin())[what]
            resp = await client.post("/write", headers={"Authorization": f"Bearer {crafted}"})
            assert resp.status == 401 and (await resp.json())["error"]["type"] == "unauthenticated", what
    finally:
        await client.close()


def test_every_sidecar_token_expires_and_one_that_does_not_is_refused():
    """Instance ids are reused: a sidecar token without an end would speak for every later instance of its
    id. One signed without a ttl gets SIDECAR_TOKEN_TTL_S; one naming no expiry (signed before they all
    did, or by hand) is refused."""
    clock = Clock()
    signer = Signer(Signer.generate()._private, clock)
    verifier = signer.verifier()
    who = verifier.verify(signer.issue(Identity.for_sidecar("chat-0", "chat", "n1")))
    assert who.expires_at == clock() + SIDECAR_TOKEN_TTL_S
    claims = {"iss": "sie", "role": "sidecar", "sub": "chat-0", "node": "n1", "model": "chat", "iat": 0}
    with pytest.raises(ValueError, match="must expire"):
        identity_of(claims)
    assert identity_of({**claims, "exp": 10}).expires_at == 10.0
    assert identity_of({"iss": "sie", "role": "admin", "sub": "ops", "iat": 0}).expires_at is None, (
        "other roles may be long-lived (sie up's own credentials)"
    )
