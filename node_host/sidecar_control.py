"""How the node host talks to its instances' sidecars and workers on loopback (the I/O of pressure.py
and of the agent's probes).

The sidecar's control endpoints (sidecar/admin.py, on its control listener, called with this node's
credential: the sidecar accepts the node host of its own node) are the contract:
    POST /-/sleep?reason=eviction&timeout_s=S   drain (state draining at once), release the worker's
                                                memory, state sleeping -> 200; 409 when work is still in
                                                flight at the bound (it stays draining)
    POST /-/wake?timeout_s=S                    resume the memory, wait for ready -> 200; 504 if not ready
    GET  /-/state                               the sidecar's TelemetryRecord as JSON
and the worker's GET /health ({"status": "ok" | "loading" | "sleeping" | ...}).

`SidecarControl` is the seam: tests pass a fake with the same four coroutines. Nothing here raises for
a failed call; the answer says what happened, so the caller decides (and reports) what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from node_host.settings import NodeTunables
from sie import strict_json
from sie.auth.http import Credential

# The most of an answer read: a TelemetryRecord, a /health body or a drain report is under 2 KiB. A
# longer answer is no answer (the sidecar or worker is not what it should be).
MAX_ANSWER_BYTES = 64 * 1024


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status: int  # HTTP status; 0 when no answer came (connection refused, timeout)
    body: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # why it failed, for the instance report and the log

    def __str__(self) -> str:
        if self.ok:
            return f"HTTP {self.status}"
        return f"HTTP {self.status}: {self.error}" if self.status else self.error


class SidecarControl(Protocol):
    async def sleep(self, sidecar: str, *, reason: str, timeout_s: float) -> Outcome: ...

    async def wake(self, sidecar: str, *, timeout_s: float) -> Outcome: ...

    async def state(self, sidecar: str) -> dict[str, Any] | None: ...

    async def health(self, worker: str, path: str = "/health") -> str | None:
        """The worker's health at `path` (its engine's, sie.engines): "ok" when it serves, else what it says."""
        ...


class HttpSidecarControl:
    """SidecarControl over the node host's one aiohttp session. Addresses are host:port."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        credential: Credential,
        *,
        probe_timeout_s: float = NodeTunables.probe_timeout_s,
        slack_s: float = 5.0,
    ):
        self._session = session
        self._credential = credential
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._slack_s = slack_s  # beyond the sidecar's own bound, for its answer to arrive

    async def sleep(self, sidecar: str, *, reason: str, timeout_s: float) -> Outcome:
        return await self._post(
            f"http://{sidecar}/-/sleep", {"reason": reason, "timeout_s": f"{timeout_s:g}"}, timeout_s
        )

    async def wake(self, sidecar: str, *, timeout_s: float) -> Outcome:
        return await self._post(f"http://{sidecar}/-/wake", {"timeout_s": f"{timeout_s:g}"}, timeout_s)

    async def state(self, sidecar: str) -> dict[str, Any] | None:
        try:
            async with self._session.get(
                f"http://{sidecar}/-/state", timeout=self._probe_timeout, headers=self._credential.headers()
            ) as resp:
                body = strict_json.loads(await _bounded(resp), what="the sidecar's /-/state")
                return body if resp.status == 200 and isinstance(body, dict) else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    async def health(self, worker: str, path: str = "/health") -> str | None:
        """SIE's engines answer {"status": ...} (ok, loading, sleeping, failed); engines run as they are
        (vLLM, Triton) answer 200 with an empty body when they serve, and another status when not."""
        try:
            async with self._session.get(f"http://{worker}{path}", timeout=self._probe_timeout) as resp:
                raw = await _bounded(resp)
                try:
                    body = strict_json.loads(raw, what="the worker's health") if raw.strip() else None
                except ValueError:
                    body = None
                if isinstance(body, dict) and "status" in body:
                    return str(body.get("status"))[:64]
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError, ValueError):  # ValueError: past the answer bound
            return None

    async def _post(self, url: str, params: dict[str, str], timeout_s: float) -> Outcome:
        timeout = aiohttp.ClientTimeout(total=timeout_s + self._slack_s)
        try:
            async with self._session.post(
                url, params=params, timeout=timeout, headers=self._credential.headers()
            ) as resp:
                raw = await _bounded(resp)
                try:
                    body = strict_json.loads(raw, what=url)
                except ValueError:
                    body = {"text": raw[:300].decode("utf-8", errors="replace")}
                body = body if isinstance(body, dict) else {"body": body}
                if resp.status == 200:
                    return Outcome(True, 200, body)
                message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else None
                return Outcome(False, resp.status, body, message or str(body)[:300])
        except TimeoutError:
            return Outcome(False, 0, error=f"no answer from {url} within {timeout.total:g} s")
        except (aiohttp.ClientError, ValueError) as exc:  # ValueError: an answer past MAX_ANSWER_BYTES
            return Outcome(False, 0, error=f"{url}: {exc}")


async def _bounded(resp: aiohttp.ClientResponse) -> bytes:
    """The answer's body, read up to MAX_ANSWER_BYTES; ValueError for a longer one."""
    if resp.content_length is not None and resp.content_length > MAX_ANSWER_BYTES:
        raise ValueError(f"an answer of {resp.content_length} bytes, more than {MAX_ANSWER_BYTES}")
    data = bytearray()
    async for chunk in resp.content.iter_chunked(16 * 1024):
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise ValueError(f"an answer of more than {MAX_ANSWER_BYTES} bytes")
    return bytes(data)
