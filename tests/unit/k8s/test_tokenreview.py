"""TokenReview identities: what a reviewed service-account token proves, and what is never sent for review."""

from __future__ import annotations

import base64
import json

import pytest
from kubernetes import client

from sie.auth import Identity
from sie.errors import Unauthenticated
from xds_server.k8s.tokenreview import NEGATIVE_CACHE_S, TokenReviewAuthenticator, identity_from_review

PODS = {("team", "chat-abc"): ("chat", "gpu-1")}


def _status(username: str, pod: str | None = None, node: str | None = None, **over) -> dict:
    extra = {}
    if pod:
        extra["authentication.kubernetes.io/pod-name"] = [pod]
    if node:
        extra["authentication.kubernetes.io/node-name"] = [node]
    return {"authenticated": True, "audiences": ["sie"], "user": {"username": username, "extra": extra}} | over


def _lookup(namespace: str, pod: str):
    return PODS.get((namespace, pod))


def test_the_node_hosts_account_is_its_node_and_a_model_pod_is_its_instance():
    node = identity_from_review(
        _status("system:serviceaccount:sie-system:sie-node-host", "nh-x", "gpu-1"), "sie-system", _lookup
    )
    assert node == Identity.for_node("gpu-1")
    pod = identity_from_review(
        _status("system:serviceaccount:team:default", "chat-abc", "gpu-1"), "sie-system", _lookup
    )
    assert pod == Identity.for_sidecar("chat-abc", "chat", "gpu-1")


@pytest.mark.parametrize(
    "status, why",
    [
        ({"authenticated": False, "error": "expired"}, "did not accept"),
        (_status("system:serviceaccount:team:default", "chat-abc", audiences=["other"]), "audience"),
        (_status("alice", "chat-abc"), "not a pod's service account"),
        (_status("system:serviceaccount:team:default"), "no bound pod"),
        (_status("system:serviceaccount:sie-system:sie-node-host", "nh-x"), "names no node"),
        (_status("system:serviceaccount:team:sie-node-host", "nh-x", "gpu-1"), "not an instance"),  # wrong namespace
        (_status("system:serviceaccount:team:default", "stranger", "gpu-1"), "not an instance"),
    ],
)
def test_anything_else_is_unauthenticated(status, why):
    with pytest.raises(Unauthenticated, match=why):
        identity_from_review(status, "sie-system", _lookup)


def _jwt(claims: dict) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()  # noqa: E731
    return f"{enc({'alg': 'RS256'})}.{enc(claims)}.sig"


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _projected(**claims) -> str:
    """A token shaped as a projected one for SIE (what the API server is asked about)."""
    bound = {"namespace": "team", "pod": {"name": "chat-abc", "uid": "u1"}, "serviceaccount": {"name": "default"}}
    shape = {
        "aud": ["sie"],
        "sub": "system:serviceaccount:team:default",
        "exp": Clock.now + 3600,
        "kubernetes.io": bound,
    }
    return _jwt(shape | claims)


GOOD = _projected(good=1)


@pytest.fixture
def reviewer(monkeypatch):
    clock = Clock()
    auth = TokenReviewAuthenticator(client.ApiClient(), _lookup, clock=clock)
    calls: list[str] = []

    def review(token: str) -> dict:
        calls.append(token)
        return (
            _status("system:serviceaccount:team:default", "chat-abc", "gpu-1")
            if token == GOOD
            else {"authenticated": False}
        )

    monkeypatch.setattr(auth, "_review", review)
    yield auth, calls, clock
    auth.close()


async def test_only_service_account_tokens_are_sent_for_review(reviewer):
    auth, calls, clock = reviewer
    for token in ("garbage", "a.b.c", _jwt({"sub": "x"}), _jwt({"kubernetes.io": {}, "exp": clock.now - 1})):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(token)
    assert calls == []


async def test_answers_are_cached_and_bad_ones_only_briefly(reviewer):
    auth, calls, clock = reviewer
    good, bad = GOOD, _projected(bad=1)
    assert (await auth.authenticate(good)).name == "chat-abc"
    assert (await auth.authenticate(good)).name == "chat-abc"
    for _ in range(3):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(bad)
    assert calls == [good, bad]
    clock.now += NEGATIVE_CACHE_S + 1
    with pytest.raises(Unauthenticated):
        await auth.authenticate(bad)
    assert calls == [good, bad, bad]
