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

No caller can make the control plane review tokens at the rate it sends them, nor hold its threads:
- only a token shaped like a projected one is sent (audience `sie`, bound to a pod, a service account's
  subject, neither expired nor expiring past MAX_TOKEN_LIFETIME_S from now); its claims are not
  verified here, so this stops noise, not a forger, who shapes a token at will;
- a token not yet reviewed (nor refused in the last NEGATIVE_CACHE_S) is reviewed only while fewer than
  `at_once` such reviews run and the bucket (`per_s` a second, `burst` at once) holds one; else the
  answer is 429 `too_many_token_reviews`, not cached, and the caller retries (its next beat or record).
  429, not 401: the token was not judged, and a workload whose token is new when a flood is on (it
  rotated, or the control plane restarted) must not read a verdict on its credential;
- a token the API server accepted before is reviewed again when its minute is up without either bound,
  so a flood never locks out a workload that was in;
- reviews run on their own few threads (REVIEW_THREADS), never the loop's default executor, refusals
  are kept apart from identities, and a flood of refusals never pushes an identity out of the cache.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client

from sie.auth import Identity
from sie.errors import AuthError, Unauthenticated

log = logging.getLogger(__name__)

AUDIENCE = "sie"
POD_NAME = "authentication.kubernetes.io/pod-name"
NODE_NAME = "authentication.kubernetes.io/node-name"
NODE_HOST_ACCOUNT = "sie-node-host"
K8S_CLAIM = "kubernetes.io"  # the claim every projected service-account token carries
SERVICE_ACCOUNT_SUBJECT = "system:serviceaccount:"
MAX_TOKEN_BYTES = 8192
NEGATIVE_CACHE_S = 10.0
# The longest a token may still have to live: SIE's projected tokens ask for an hour (the webhook's
# token_ttl_s, the node host's manifest); a day leaves room for an operator's longer one.
MAX_TOKEN_LIFETIME_S = 24 * 3600.0
CACHED_TOKENS = 4096  # identities, and refusals apart
# Reviews of tokens not yet reviewed: at most this many at once, and a bucket of this rate and size. A
# review takes the API server milliseconds, so a fleet restarting with the control plane (every token
# new to it) is let in at REVIEWS_PER_S after the first REVIEW_BURST.
REVIEWS_AT_ONCE = 8
REVIEWS_PER_S = 50.0
REVIEW_BURST = 200
# Threads for reviews (each up to REVIEW_TIMEOUT_S): new tokens take REVIEWS_AT_ONCE at most, the rest
# are for known ones.
REVIEW_THREADS = 2 * REVIEWS_AT_ONCE
REVIEW_TIMEOUT_S = 5

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


def _shape_problem(token: str, now: float) -> tuple[str | None, float | None]:
    """(why `token` is not shaped like a live projected service-account token for SIE, or None; its
    expiry, if it names one). Read from its unverified claims: the API server verifies (pure). A token
    without `exp` goes on to the review, which decides: requiring one would stop no forger."""
    claims = _unverified_claims(token) if len(token) <= MAX_TOKEN_BYTES else None
    bound = claims.get(K8S_CLAIM) if claims is not None else None
    if claims is None or not isinstance(bound, dict):
        return "the credential is neither an SIE token nor a Kubernetes service-account token", None
    audiences = claims.get("aud")
    audiences = [audiences] if isinstance(audiences, str) else audiences
    if not isinstance(audiences, list) or AUDIENCE not in audiences:
        return f"the service-account token is not for the audience {AUDIENCE!r}", None
    subject = claims.get("sub")
    if not isinstance(bound.get("pod"), dict) or not str(subject).startswith(SERVICE_ACCOUNT_SUBJECT):
        return "the service-account token is not bound to a pod (a projected token is)", None
    expiry = _expiry(claims)
    if expiry is not None and expiry <= now:
        return "the service-account token has expired", expiry
    if expiry is not None and expiry > now + MAX_TOKEN_LIFETIME_S:
        return f"the service-account token lives past {MAX_TOKEN_LIFETIME_S:.0f} s from now", expiry
    return None, expiry


class TooManyReviews(AuthError):
    """Tokens not yet reviewed arrive faster than the control plane sends them for review: 429, retry."""

    status = 429
    kind = "too_many_token_reviews"


class _Bucket:
    """A token bucket: `rate` a second, `burst` at most."""

    def __init__(self, rate: float, burst: int, now: float):
        self._rate, self._burst = rate, float(burst)
        self._level, self._at = float(burst), now

    def take(self, now: float) -> bool:
        self._level = min(self._burst, self._level + max(0.0, now - self._at) * self._rate)
        self._at = now
        if self._level < 1:
            return False
        self._level -= 1
        return True


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
        at_once: int = REVIEWS_AT_ONCE,
        per_s: float = REVIEWS_PER_S,
        burst: int = REVIEW_BURST,
    ):
        self._auth = client.AuthenticationV1Api(api)
        self._pods = pods
        self._namespace = system_namespace
        self._cache_s = cache_s
        self._clock = clock
        self._known: OrderedDict[str, tuple[float, Identity]] = OrderedDict()  # until when, who
        self._refused: OrderedDict[str, tuple[float, Unauthenticated]] = OrderedDict()
        self._at_once = at_once
        self._new_reviews = 0  # reviews of tokens not known, running now
        self._bucket = _Bucket(per_s, burst, clock())
        self._threads = ThreadPoolExecutor(max_workers=REVIEW_THREADS, thread_name_prefix="tokenreview")

    async def authenticate(self, token: str) -> Identity:
        now = self._clock()
        known = self._known.get(token)
        if known is not None and known[0] > now:
            return known[1]
        refused = self._refused.get(token)
        if refused is not None and refused[0] > now:
            raise refused[1]
        # Only a projected service-account token goes to the API server: anything else is refused here.
        problem, expiry = _shape_problem(token, now)
        if problem is not None:
            raise Unauthenticated(problem)
        if known is not None:  # accepted before: its minute is up, so it is reviewed again at once
            status = await self._reviewed(token)
        else:
            if self._new_reviews >= self._at_once or not self._bucket.take(now):
                raise TooManyReviews(
                    "the control plane is reviewing as many new service-account tokens as it may; retry in a second"
                )
            self._new_reviews += 1
            try:
                status = await self._reviewed(token)
            finally:
                self._new_reviews -= 1
        try:
            who = identity_from_review(status, self._namespace, self._pods)
        except Unauthenticated as exc:
            # remembered briefly: the same bad token is not reviewed again and again
            self._remember(self._refused, token, min(now + NEGATIVE_CACHE_S, expiry or now + NEGATIVE_CACHE_S), exc)
            self._known.pop(token, None)
            raise
        self._remember(self._known, token, min(now + self._cache_s, expiry or now + self._cache_s), who)
        return who

    def close(self) -> None:
        """Stop the review threads (a review under way ends at its timeout)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _remember(cache: OrderedDict[str, Any], token: str, until: float, value: Any) -> None:
        cache[token] = (until, value)
        cache.move_to_end(token)
        while len(cache) > CACHED_TOKENS:
            cache.popitem(last=False)

    async def _reviewed(self, token: str) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._review, token)

    def _review(self, token: str) -> dict[str, Any]:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[AUDIENCE]))
        try:
            review = self._auth.create_token_review(body, _request_timeout=REVIEW_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an unreachable API server authenticates no one
            log.warning("TokenReview failed: %s", exc)
            raise Unauthenticated(f"the token could not be reviewed by Kubernetes: {type(exc).__name__}") from None
        return client.ApiClient().sanitize_for_serialization(review.status) or {}
