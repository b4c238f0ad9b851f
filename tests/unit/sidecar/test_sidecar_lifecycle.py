"""The lifecycle: health probes and commands in, the reported state out."""

import pytest

from sidecar import lifecycle as L
from sidecar.lifecycle import Lifecycle, Probe, TransitionError
from sie.telemetry import InstanceState as S

OK, NR, TO, UN = Probe.OK, Probe.NOT_READY, Probe.TIMEOUT, Probe.UNREACHABLE


def run(steps, start=None):
    lc = start or Lifecycle()
    states = []
    for step in steps:
        lc = L.on_probe(lc, step) if isinstance(step, Probe) else step(lc)
        states.append(lc.state)
    return lc, states


@pytest.mark.parametrize(
    "steps, states",
    [
        # booting: refused and 503 are both "still loading" until the first OK
        ([UN, NR, TO, OK], [S.LOADING, S.LOADING, S.LOADING, S.READY]),
        # worker killed after serving: failed at once, back to ready when it answers again
        ([OK, UN, UN, OK], [S.READY, S.FAILED, S.FAILED, S.READY]),
        # a restarted worker that answers 503 while loading its weights
        ([OK, UN, NR, OK], [S.READY, S.FAILED, S.LOADING, S.READY]),
        # one slow probe does not flap the endpoint; two in a row do
        ([OK, TO, OK], [S.READY, S.READY, S.READY]),
        ([OK, TO, TO], [S.READY, S.READY, S.FAILED]),
        # a serving worker that starts answering 503 is taken out as loading, not failed
        ([OK, NR, NR, OK], [S.READY, S.READY, S.LOADING, S.READY]),
        # the failure count restarts after every OK
        ([OK, TO, OK, TO, OK], [S.READY] * 5),
    ],
)
def test_probes(steps, states):
    assert run(steps)[1] == states


@pytest.mark.parametrize(
    "steps, states",
    [
        # drain: stays draining when the worker is fine; reports failed if the worker dies meanwhile
        ([OK, L.drain, OK], [S.READY, S.DRAINING, S.DRAINING]),
        ([OK, L.drain, UN], [S.READY, S.DRAINING, S.FAILED]),
        # a drained instance stays drained when its failed worker recovers
        ([OK, L.drain, UN, OK], [S.READY, S.DRAINING, S.FAILED, S.DRAINING]),
        # sleep: draining until memory is released; a sleeping worker's 503 keeps it sleeping
        ([OK, L.sleep, L.released, NR, NR], [S.READY, S.DRAINING, S.SLEEPING, S.SLEEPING, S.SLEEPING]),
        # wake needs a fresh OK probe after the resume: loading first, then ready
        ([OK, L.sleep, L.released, L.wake, OK], [S.READY, S.DRAINING, S.SLEEPING, S.LOADING, S.READY]),
        # wake from a plain drain: the worker never stopped, so ready at once
        ([OK, L.drain, L.wake], [S.READY, S.DRAINING, S.READY]),
        # stop wins over everything
        ([OK, L.drain, L.stop, OK, UN], [S.READY, S.DRAINING, S.STOPPED, S.STOPPED, S.STOPPED]),
        # a sleeping worker that goes away (its node host unloads it) still sleeps; a wake starts it
        ([OK, L.sleep, L.released, UN], [S.READY, S.DRAINING, S.SLEEPING, S.SLEEPING]),
        (
            [OK, L.sleep, L.released, UN, L.wake, OK],  # its node host starts the worker first
            [S.READY, S.DRAINING, S.SLEEPING, S.SLEEPING, S.LOADING, S.READY],
        ),
    ],
)
def test_commands(steps, states):
    assert run(steps)[1] == states


@pytest.mark.parametrize("command", [L.drain, L.sleep, L.wake])
def test_nothing_but_stop_after_stop(command):
    lc, _ = run([OK, L.stop])
    with pytest.raises(TransitionError, match="stopping"):
        command(lc)


def test_release_without_sleep_is_refused():
    with pytest.raises(TransitionError, match="without a sleep"):
        L.released(Lifecycle())


def test_drain_is_idempotent_and_keeps_a_sleep_in_progress():
    lc, _ = run([OK, L.sleep])
    assert L.drain(lc) == lc
    assert L.drain(L.drain(Lifecycle())) == L.drain(Lifecycle())


def test_only_ready_serves():
    assert [s for s in S if s.serves] == [S.READY]


def test_shut_down_drains_and_then_only_stop_follows():
    serving = L.on_probe(Lifecycle(), Probe.OK)
    down = L.shut_down(serving)
    assert down.state is S.DRAINING and L.drain(down) == down
    for command in (L.wake, L.sleep):
        with pytest.raises(TransitionError, match="stopping"):
            command(down)
    asleep = L.released(L.sleep(serving))
    assert L.shut_down(asleep).state is S.SLEEPING  # stays asleep, not woken to drain
    assert L.stop(down).state is S.STOPPED
    assert L.shut_down(L.stop(serving)).state is S.STOPPED
