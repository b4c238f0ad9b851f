"""Requests held while the instance sleeps, and the one wake they all wait for (DESIGN §11).

A sleeping or loading instance is in EDS only while no instance of its model serves (xds_server's
Registry.eds_records): it is its model's holder, at zero, when every instance was evicted, or while the
only one loads for the first time. A valid request that reaches it then is held here instead of
refused, until it serves.
While it sleeps, the first held request starts a wake: POST --wake-url, the node host's /v1/instances/<id>/wake, which checks the GPU ledger, resumes
the worker through this sidecar's /-/wake and answers once the instance serves. Every request that
arrives during that wake waits for the same one. Each waits at most the spec's
autoscale.wake_timeout_s, then goes on through admission like any other request. At most `max_held`
are held at once, counted from before each body is read (so the bodies in memory are bounded too): the
admission Gate's max_concurrent + max_queue, all it could take once the instance serves. The proxy
answers any more at once with the Gate's 429 `queue_full`. A wake that fails or
times out answers every request it held with 503 `wake_failed` naming the reason (Retry-After: 1; not
marked for Envoy's retry, which would only start the same wake again), and the next request starts a
new wake.

Why the sidecar holds, not a component in front of Envoy (Knative's activator): the sidecar of a
sleeping instance is already up, already in EDS, already validates the request and counts it; the held
request needs no extra hop once the instance is awake, and the node host that decides about GPU memory
is one loopback call away. The price: a model with no sidecar left (none placed) has no holder.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from sidecar.status import Status
from sie.auth import TokenSource
from sie.telemetry import InstanceState

log = logging.getLogger(__name__)

__all__ = ["Waker"]

# States a held request stops waiting in: the instance is being drained or stopped (a SIGTERM, a drain
# request), so no wake is coming; the proxy then answers its retryable 503 and Envoy tries another one,
# where waiting on would end in a cut connection when the server shuts down.
_LEAVING = frozenset({InstanceState.DRAINING, InstanceState.STOPPED})


def _ends_hold(state: InstanceState) -> bool:
    return state is InstanceState.READY or state in _LEAVING


class Waker:
    def __init__(
        self,
        status: Status,
        session: aiohttp.ClientSession,
        url: str,
        credential: TokenSource,
        timeout_s: float,
        clock: Callable[[], float],
        max_held: int,
    ):
        if max_held < 1:
            raise ValueError(f"max_held must be at least 1, got {max_held}")
        self._status = status
        self._session = session
        self._url = url
        self._credential = credential
        self.timeout_s = timeout_s
        self._clock = clock
        self._wake: asyncio.Task[str | None] | None = None  # the wake under way; its result: None or why not
        self.max_held = max_held
        self.held = 0  # requests holding a place now, their bodies read or not (reported as queued)
        self.wakes = 0  # wakes started (one per burst of held requests)

    def holds(self) -> bool:
        """Whether a request arriving now is held: the instance sleeps, or is loading for the first time
        or for a wake this holds requests for. An instance that served and now reads loading (its worker
        missed probes under load, or restarts) refuses instead, with a retryable 503: Envoy retries on
        another instance at once, where a hold could keep the request for up to wake_timeout_s."""
        state = self._status.state
        if state is InstanceState.SLEEPING:
            return True
        return state is InstanceState.LOADING and (self._waking() or not self._status.lifecycle.ever_up)

    def enter(self) -> bool:
        """Take a place for a request to hold, before its body is read; False when all `max_held` are
        taken. Whoever took one gives it back with leave(), held or not."""
        if self.held >= self.max_held:
            return False
        self.held += 1
        return True

    def leave(self) -> None:
        self.held -= 1

    async def hold(self) -> str | None:
        """Wait until the instance serves, or is drained or stopped instead: None, or why it will not
        serve (the wake failed or timed out). The caller holds a place (enter)."""
        if self._status.serving:
            return None
        deadline = self._clock() + self.timeout_s
        if self._status.state is InstanceState.SLEEPING and not self._waking():
            self.wakes += 1
            log.info("a request is held while the instance sleeps: waking it (%s)", self._url)
            self._wake = asyncio.ensure_future(self._call())
        wake = self._wake if self._waking() else None
        ready = asyncio.ensure_future(self._status.wait_for(_ends_hold, self.timeout_s))
        try:
            waits = {ready} if wake is None else {wake, ready}
            await asyncio.wait(waits, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if wake is not None and wake.done() and not ready.done():
                why = wake.result()
                if why is not None:
                    return why
                left = max(0.0, deadline - self._clock())
                await asyncio.wait({ready}, timeout=left)
        finally:
            if not ready.done():
                ready.cancel()
        if self._status.serving or self._status.state in _LEAVING:
            return None  # served, or the proxy's retryable 503 sends it to another instance
        return f"the instance was not serving within wake_timeout_s={self.timeout_s:g} (now {self._status.state.value})"

    def _waking(self) -> bool:
        return self._wake is not None and not self._wake.done()

    async def _call(self) -> str | None:
        try:
            async with self._session.post(
                self._url,
                headers=self._credential.headers(),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s + 1.0),
            ) as resp:
                if resp.status == 200:
                    return None
                try:
                    doc = await resp.json(content_type=None)
                    message = str(doc["error"]["message"])[:500]
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    message = f"HTTP {resp.status}"
                return f"the node host could not wake it: {message}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"the node host did not answer the wake ({type(exc).__name__}: {exc})"[:500]
