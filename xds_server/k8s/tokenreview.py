"""Kubernetes workload identities for the control plane: service-account tokens checked with TokenReview.

On Kubernetes a sidecar and a node host need no secret SIE hands them: the kubelet projects a token of
their pod's service account into the pod (audience `sie`, an hour's life, rotated in place), and the
control plane asks the API server who it belongs to (TokenReview; the control plane's service account
holds `system:auth-delegator` for that). The answer names the pod (bound tokens carry
`authentication.kubernetes.io/pod-name` and, since Kubernetes 1.30, `.../node-name`), and from the pod:

- the node host DaemonSet's service account (`<namespace>:sie-node-host`) -> `node:<node-name>`;
- a pod the ModelService controller knows as an instance of a model (labelled `sie.io/model-id`, in
  that ModelService's namespace) -> `sidecar:<pod name>` of that model on its node.

Anything else is refused (Unauthenticated). Answers are cached per token for at most `cache_s` and never
past the token's own expiry, so a busy sidecar costs the API server a review a minute, not a second.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kubernetes import client

from sie.auth import Identity
from sie.errors import Unauthenticated

log = logging.getLogger(__name__)

AUDIENCE = "sie"
POD_NAME = "authentication.kubernetes.io/pod-name"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_HOST_ACCOUNT = "sie-node-host"
K8S_CLAIM = "kubernetes.io"  # the claim every projected service-account token carries
MAX_TOKEN_BYTES = 8192
NEGATIVE_CACHE_S = 10.0

# (namespace, pod name) -> (model id, node name) for a pod the controller serves as a model instance.
PodLookup = Callable[[str, str], "tuple[str, str] | None"]


def _unverified_claims(token: str) -> dict[str, Any] | None:
    """The claims of a JWT, read without verifying (the API server verifies); None if it is not one."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError, TypeError):
        return None
    return claims if isinstance(claims, dict) else None


def _expiry(claims: dict[str, Any]) -> float | None:
    exp = claims.get("exp")
    return float(exp) if isinstance(exp, (int, float)) and not isinstance(exp, bool) else None


def identity_from_review(status: dict[str, Any], system_namespace: str, pods: PodLookup) -> Identity:
    """What a TokenReview status proves, as an SIE identity (pure)."""
    if not status.get("authenticated"):
        raise Unauthenticated(f"Kubernetes did not accept the token: {status.get('error') or 'not authenticated'}")
    if AUDIENCE not in (status.get("audiences") or [AUDIENCE]):
        raise Unauthenticated(f"the token is not for the audience {AUDIENCE!r}")
    user = status.get("user") or {}
    username = str(user.get("username", ""))
    extra = user.get("extra") or {}
    pod = (extra.get(POD_NAME) or [None])[0]
    node = (extra.get(NODE_NAME) or [None])[0]
    prefix, _, account = username.partition("system:serviceaccount:")
    namespace, _, name = account.partition(":")
    if prefix or not namespace or not name or not pod:
        raise Unauthenticated(f"{username or 'the token'} is not a pod's service account (no bound pod)")
    if namespace == system_namespace and name == NODE_HOST_ACCOUNT:
        if not node:
            raise Unauthenticated("the node host's token names no node (Kubernetes 1.30 or later binds it)")
        return Identity.for_node(node)
    found = pods(namespace, pod)
    if found is None:
        raise Unauthenticated(f"pod {namespace}/{pod} is not an instance of any ModelService this control plane serves")
    model, pod_node = found
    return Identity.for_sidecar(pod, model, node or pod_node)


class TokenReviewAuthenticator:
    def __init__(
        self,
        api: client.ApiClient,
        pods: PodLookup,
        *,
        system_namespace: str = "sie-system",
        cache_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ):
        self._auth = client.AuthenticationV1Api(api)
        self._pods = pods
        self._namespace = system_namespace
        self._cache_s = cache_s
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Identity | Unauthenticated]] = OrderedDict()

    async def authenticate(self, token: str) -> Identity:
        now = self._clock()
        hit = self._cache.get(token)
        if hit is not None and hit[0] > now:
            if isinstance(hit[1], Unauthenticated):
                raise hit[1]
            return hit[1]
        # Only a projected service-account token goes to the API server: anything else is refused here,
        # so an unauthenticated caller cannot make the control plane review tokens at the rate it sends them.
        claims = _unverified_claims(token)
        if claims is None or not isinstance(claims.get(K8S_CLAIM), dict) or len(token) > MAX_TOKEN_BYTES:
            raise Unauthenticated("the credential is neither an SIE token nor a Kubernetes service-account token")
        expiry = _expiry(claims)
        if expiry is not None and expiry <= now:
            raise Unauthenticated("the service-account token has expired")
        status = await asyncio.to_thread(self._review, token)
        try:
            who: Identity | Unauthenticated = identity_from_review(status, self._namespace, self._pods)
        except Unauthenticated as exc:
            who = exc  # remembered briefly: the same bad token is not reviewed again and again
        until = now + (self._cache_s if isinstance(who, Identity) else NEGATIVE_CACHE_S)
        self._remember(token, min(until, expiry or until), who)
        if isinstance(who, Unauthenticated):
            raise who
        return who

    def _remember(self, token: str, until: float, who: Identity | Unauthenticated) -> None:
        self._cache[token] = (until, who)
        self._cache.move_to_end(token)
        while len(self._cache) > 4096:
            self._cache.popitem(last=False)

    def _review(self, token: str) -> dict[str, Any]:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[AUDIENCE]))
        try:
            review = self._auth.create_token_review(body, _request_timeout=5)
        except Exception as exc:  # noqa: BLE001 - an unreachable API server authenticates no one
            log.warning("TokenReview failed: %s", exc)
            raise Unauthenticated(f"the token could not be reviewed by Kubernetes: {type(exc).__name__}") from None
        return client.ApiClient().sanitize_for_serialization(review.status) or {}
