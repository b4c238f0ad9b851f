"""When a crashed child is started again (pure: times in, decisions out).

Exponential backoff: the first crash waits `initial_s`, each further crash in a row doubles the wait,
up to `max_s`. A child that ran `stable_after_s` or longer before it crashed counts as a fresh first
crash, so an instance that crashes once a day restarts at once, and one that crashes at start does not
spin. Every crash is kept as a reason (exit code or signal) for the instance report and the logs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffPolicy:
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 10.0
    stable_after_s: float = 30.0

    def delay(self, consecutive_crashes: int) -> float:
        """Wait before restart number `consecutive_crashes` (1 for the first crash in a row)."""
        if consecutive_crashes < 1:
            return 0.0
        return min(self.max_s, self.initial_s * self.factor ** (consecutive_crashes - 1))


@dataclass(frozen=True)
class Slot:
    """One supervised child's life so far. `started_at` is set while it runs, `restart_at` while it
    waits to be started again after a crash; never both."""

    started_at: float | None = None
    restart_at: float | None = None
    crashes_in_a_row: int = 0
    restarts: int = 0
    last_exit: str | None = None  # "exit code 1", "killed by SIGKILL"
    last_exit_at: float | None = None
    last_words: str | None = None  # the end of its log when it exited with an error code (process.last_words)

    @property
    def running(self) -> bool:
        return self.started_at is not None


def started(slot: Slot, now: float) -> Slot:
    was_restart = slot.restart_at is not None
    return dataclasses.replace(
        slot, started_at=now, restart_at=None, restarts=slot.restarts + (1 if was_restart else 0)
    )


def exited(slot: Slot, now: float, reason: str, policy: BackoffPolicy, words: str | None = None) -> Slot:
    """The child ended on its own (we did not stop it): schedule the restart. `words`: what it said last."""
    if slot.started_at is None:
        raise ValueError("exited() on a slot that is not running")
    stable = now - slot.started_at >= policy.stable_after_s
    crashes = 1 if stable else slot.crashes_in_a_row + 1
    return dataclasses.replace(
        slot,
        started_at=None,
        restart_at=now + policy.delay(crashes),
        crashes_in_a_row=crashes,
        last_exit=reason,
        last_exit_at=now,
        last_words=words,
    )


def stopped(slot: Slot) -> Slot:
    """We stopped the child on purpose: nothing to restart."""
    return dataclasses.replace(slot, started_at=None, restart_at=None)


def restart_due(slot: Slot, now: float) -> bool:
    return slot.restart_at is not None and now >= slot.restart_at
