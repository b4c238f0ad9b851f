"""Waiting for a condition in async integration tests: poll, and fail with what was last seen."""

from __future__ import annotations

import asyncio
import inspect
import time


async def eventually(probe, timeout: float = 10.0, what: str = "condition", interval: float = 0.05):
    """Call `probe()` every `interval` seconds (awaiting it if it returns an awaitable) until it gives
    something truthy, and return that; AssertionError naming `what` and the last value after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
