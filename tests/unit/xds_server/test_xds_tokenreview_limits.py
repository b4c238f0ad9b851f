"""TokenReview under a flood of forged service-account tokens (xds_server.k8s.tokenreview): only tokens
shaped as projected ones are sent, new ones at a bounded rate and number at once, on their own threads,
the rest a 429 that is not cached; a token the API server accepted before is never locked out."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import threading

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kubernetes import client

import xds_server.k8s.tokenreview as tokenreview
from sie.auth import ChainAuthenticator, Identity, Signer, TokenAuthenticator, middleware
from sie.errors import Unauthenticated
from xds_server.k8s.tokenreview import (
    MAX_TOKEN_LIFETIME_S,
    TokenReviewAuthenticator,
    TooManyReviews,
)

pytestmark = pytest.mark.timeout(60)

NOW = 1_000_000.0
POD = ("team", "chat-abc")
ACCEPTED = {
    "authenticated": True,
    "audiences": ["sie"],
    "user": {
        "username": "system:serviceaccount:team:default",
        "extra": {"authentication.kubernetes.io/pod-name": ["chat-abc"]},
    },
}
_serial = itertools.count()


def _jwt(claims: dict) -> str:
    def enc(doc: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()

    return f"{enc({'alg': 'RS256'})}.{enc(claims)}.sig"


def projected(**over) -> str:
    """A token shaped as a projected one for SIE; each a new one (a forger's changing nonce)."""
    claims = {
        "aud": ["sie"],
        "sub": "system:serviceaccount:team:default",
        "exp": NOW + 3600,
        "iat": NOW,
        "kubernetes.io": {"namespace": "team", "pod": {"name": "chat-abc", "uid": "u"}},
        "jti": str(next(_serial)),
    }
    return _jwt(claims | over)


GOOD = projected()


class Clock:
    def __init__(self):
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class FakeApiServer:
    """TokenReview as the API server answers it: GOOD is chat-abc's, anything else is not accepted."""

    def __init__(self, hold: threading.Event | None = None):
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self.running = self.most_at_once = 0
        self._hold = hold
        self._lock = threading.Lock()

    def __call__(self, token: str) -> dict:
        with self._lock:
            self.calls.append(token)
            self.threads.add(threading.current_thread().name)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self._hold is not None:
                assert self._hold.wait(timeout=10)
            return ACCEPTED if token == GOOD else {"authenticated": False, "error": "invalid bearer token"}
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def make():
    made: list[TokenReviewAuthenticator] = []

    def build(api: FakeApiServer, clock: Clock, **limits) -> TokenReviewAuthenticator:
        auth = TokenReviewAuthenticator(
            client.ApiClient(), lambda ns, pod: ("chat", "gpu-1") if (ns, pod) == POD else None, clock=clock, **limits
        )
        auth._review = api  # type: ignore[method-assign]
        made.append(auth)
        return auth

    yield build
    for auth in made:
        auth.close()


async def _outcomes(auth: TokenReviewAuthenticator, tokens: list[str]) -> list[int]:
    async def one(token: str) -> int:
        try:
            await auth.authenticate(token)
        except TooManyReviews as exc:
            return exc.status
        except Unauthenticated as exc:
            return exc.status
        return 200

    return await asyncio.gather(*(one(t) for t in tokens))


async def test_forged_tokens_cost_the_api_server_no_more_than_the_bucket(make):
    api, clock = FakeApiServer(), Clock()
    auth = make(api, clock, per_s=5, burst=10, at_once=1000)
    outcomes = await _outcomes(auth, [projected() for _ in range(200)])
    assert len(api.calls) == 10
    assert outcomes.count(401) == 10 and outcomes.count(429) == 190
    clock.now += 1
    outcomes = await _outcomes(auth, [projected() for _ in range(20)])
    assert len(api.calls) == 15 and outcomes.count(429) == 15


async def test_a_429_is_not_remembered(make):
    api, clock = FakeApiServer(), Clock()
    auth = make(api, clock, per_s=1, burst=1)
    assert await _outcomes(auth, [projected()]) == [401]
    with pytest.raises(TooManyReviews):
        await auth.authenticate(GOOD)
    clock.now += 1
    assert (await auth.authenticate(GOOD)).name == "chat-abc"


async def test_new_tokens_are_reviewed_a_few_at_a_time_on_their_own_threads(make):
    hold = threading.Event()
    api, clock = FakeApiServer(hold), Clock()
    auth = make(api, clock, at_once=3, burst=1000)
    pending = asyncio.ensure_future(_outcomes(auth, [projected() for _ in range(50)]))
    try:
        for _ in range(500):  # the three reviews under way are holding their threads
            if api.running == 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert api.running == 3
    finally:
        hold.set()
    outcomes = await pending
    assert api.most_at_once == 3 and outcomes.count(401) == 3 and outcomes.count(429) == 47
    assert all(name.startswith("tokenreview") for name in api.threads)


async def test_a_token_accepted_before_is_reviewed_again_whatever_the_flood(make):
    api, clock = FakeApiServer(), Clock()
    auth = make(api, clock, per_s=0.001, burst=1)
    assert (await auth.authenticate(GOOD)).name == "chat-abc"
    assert set(await _outcomes(auth, [projected() for _ in range(20)])) == {429}
    clock.now += 61  # its cached minute is up, and the bucket is still empty
    assert (await auth.authenticate(GOOD)).name == "chat-abc"
    assert api.calls == [GOOD, GOOD]


async def test_refusals_never_push_an_identity_out_of_the_cache(make, monkeypatch):
    monkeypatch.setattr(tokenreview, "CACHED_TOKENS", 4)
    api, clock = FakeApiServer(), Clock()
    auth = make(api, clock, burst=1000)
    await auth.authenticate(GOOD)
    for _ in range(20):
        assert await _outcomes(auth, [projected()]) == [401]
    await auth.authenticate(GOOD)
    assert api.calls.count(GOOD) == 1


@pytest.mark.parametrize(
    "token",
    [
        projected(aud=["kubernetes.default.svc"]),
        projected(aud="other"),
        projected(aud=None),
        projected(sub="alice"),
        projected(**{"kubernetes.io": {"namespace": "team"}}),  # bound to no pod
        projected(exp=NOW - 1),
        projected(exp=NOW + MAX_TOKEN_LIFETIME_S + 1),
        projected(pad="x" * 8192),
        "a.b.c",
    ],
)
async def test_a_token_not_shaped_as_a_projected_one_is_never_sent(make, token):
    api = FakeApiServer()
    auth = make(api, Clock())
    with pytest.raises(Unauthenticated):
        await auth.authenticate(token)
    assert api.calls == []


async def test_the_flood_is_answered_429_over_http_and_sie_tokens_still_pass(make):
    """Behind the SIE authenticator in the chain, as xds_server runs on Kubernetes."""
    api, signer = FakeApiServer(), Signer.generate()
    reviews = make(api, Clock(), per_s=0.001, burst=1)

    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[middleware(ChainAuthenticator(TokenAuthenticator(signer.verifier()), reviews))])
    app.router.add_get("/", hello)
    async with TestClient(TestServer(app)) as http:
        statuses = []
        for _ in range(3):
            resp = await http.get("/", headers={"Authorization": f"Bearer {projected()}"})
            statuses.append(resp.status)
            if resp.status == 429:
                assert (await resp.json())["error"]["type"] == "too_many_token_reviews"
        assert statuses == [401, 429, 429]
        admin = {"Authorization": f"Bearer {signer.issue(Identity.admin())}"}
        assert (await http.get("/", headers=admin)).status == 200
