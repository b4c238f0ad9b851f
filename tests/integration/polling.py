"""Waiting for a condition in async integration tests: poll, and fail with what was last seen."""

from __future__ import annotations

import asyncio
import time


async def eventually(probe, timeout: float = 10.0, what: str = "condition", interval: float = 0.05):
    """Await `probe()` every `interval` seconds until it returns something truthy, and return that;
    AssertionError naming `what` and the last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")
