"""The instance's lifecycle (pure): what the worker is doing, what the operator asked for, and the
state the sidecar reports.

Two inputs drive it and are kept apart, so neither can undo the other:
  * health probes of the worker (`on_probe`): is it up, still loading, or gone?
  * commands (`drain`, `sleep`, `released`, `wake`, `shut_down`, `stop`): what the control plane,
    the node host or a SIGTERM wants. A drained instance stays drained when its worker recovers; a worker that dies while
    draining is reported failed.

The reported state is derived, never stored (`Lifecycle.state`), in this order of precedence:
  stop asked              -> stopped
  memory released         -> sleeping   (whether or not the worker still runs: its node host may have
                                         stopped it to unload it, autoscale.sleep_mode unload)
  worker down             -> failed     (stopped answering after having answered)
  drain or sleep asked    -> draining
  worker up               -> ready
  otherwise               -> loading    (not answered yet, or answering 503)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from sie.errors import SIEError
from sie.telemetry import InstanceState


class Probe(Enum):
    """The outcome of one GET /health on the worker."""

    OK = "ok"  # 200
    NOT_READY = "not_ready"  # answered, but not 200 (503 while loading or sleeping)
    TIMEOUT = "timeout"  # no answer in time: may be busy, may be hung
    UNREACHABLE = "unreachable"  # connection refused or reset: the process is gone


class Worker(Enum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"


class Intent(Enum):
    SERVE = "serve"
    DRAIN = "drain"
    SLEEP = "sleep"
    STOP = "stop"


# Consecutive failed probes (TIMEOUT or NOT_READY) before an UP worker is taken out of service.
# One slow probe under load must not flap the endpoint; a refused connection needs no second opinion.
FAILURE_THRESHOLD = 2


@dataclass(frozen=True)
class Lifecycle:
    worker: Worker = Worker.STARTING
    intent: Intent = Intent.SERVE
    released: bool = False  # the worker's memory is released (sleep); only wake() clears it
    failures: int = 0  # consecutive failed probes since the last OK
    ever_up: bool = False  # has the worker ever answered OK (distinguishes booting from died)
    final: bool = False  # the process is shutting down (shut_down): only stop follows

    @property
    def state(self) -> InstanceState:
        if self.intent is Intent.STOP:
            return InstanceState.STOPPED
        if self.released:
            return InstanceState.SLEEPING
        if self.worker is Worker.DOWN:
            return InstanceState.FAILED
        if self.intent in (Intent.DRAIN, Intent.SLEEP):
            return InstanceState.DRAINING
        if self.worker is Worker.UP:
            return InstanceState.READY
        return InstanceState.LOADING


def on_probe(lc: Lifecycle, probe: Probe) -> Lifecycle:
    if probe is Probe.OK:
        return dataclasses.replace(lc, worker=Worker.UP, failures=0, ever_up=True)
    failures = lc.failures + 1
    if probe is Probe.UNREACHABLE:
        # Refused before the first OK is a worker still booting; after it, the worker has died.
        worker = Worker.DOWN if lc.ever_up else Worker.STARTING
        return dataclasses.replace(lc, worker=worker, failures=failures)
    if lc.worker is Worker.UP and failures < FAILURE_THRESHOLD:
        return dataclasses.replace(lc, failures=failures)
    if probe is Probe.NOT_READY:
        # It answers, so it is alive: a restarted worker loading its weights, or one that is asleep.
        return dataclasses.replace(lc, worker=Worker.STARTING, failures=failures)
    # TIMEOUT: an UP worker that stops answering in time has failed; otherwise keep waiting.
    worker = Worker.DOWN if lc.worker is not Worker.STARTING else Worker.STARTING
    return dataclasses.replace(lc, worker=worker, failures=failures)


class TransitionError(SIEError, ValueError):
    """A command that makes no sense in the current state; the message says what to do instead."""


def drain(lc: Lifecycle) -> Lifecycle:
    if lc.intent is Intent.STOP:
        raise TransitionError("the sidecar is stopping; it cannot drain")
    if lc.intent in (Intent.DRAIN, Intent.SLEEP):
        return lc
    return dataclasses.replace(lc, intent=Intent.DRAIN)


def shut_down(lc: Lifecycle) -> Lifecycle:
    """The process is shutting down (SIGTERM): it stops taking work as a drain does (a sleeping instance
    stays asleep), and from now on refuses a wake or a sleep: only stop follows."""
    if lc.intent is Intent.STOP:
        return lc
    intent = lc.intent if lc.intent in (Intent.DRAIN, Intent.SLEEP) else Intent.DRAIN
    return dataclasses.replace(lc, intent=intent, final=True)


def sleep(lc: Lifecycle) -> Lifecycle:
    if lc.intent is Intent.STOP or lc.final:
        raise TransitionError("the sidecar is stopping; it cannot sleep")
    return dataclasses.replace(lc, intent=Intent.SLEEP)


def released(lc: Lifecycle) -> Lifecycle:
    """The worker released its memory. Only valid while a sleep is in progress."""
    if lc.intent is not Intent.SLEEP:
        raise TransitionError(f"memory was released without a sleep in progress (intent {lc.intent.value})")
    return dataclasses.replace(lc, released=True)


def wake(lc: Lifecycle) -> Lifecycle:
    """Serve again. The worker must answer a fresh OK probe before the state reads ready, because
    after a resume (or after a drain of a worker that meanwhile failed) the last probe is stale."""
    if lc.intent is Intent.STOP or lc.final:
        raise TransitionError("the sidecar is stopping; start a new instance instead of waking this one")
    # Released, the worker was asleep or unloaded (stopped); either way it must answer afresh.
    worker = Worker.STARTING if lc.released else lc.worker
    return dataclasses.replace(lc, intent=Intent.SERVE, released=False, worker=worker, failures=0)


def stop(lc: Lifecycle) -> Lifecycle:
    return dataclasses.replace(lc, intent=Intent.STOP)
