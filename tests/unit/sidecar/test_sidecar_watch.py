"""The health loop's reading of probes: a busy worker is not a dead one."""

import pytest

from sidecar import lifecycle
from sidecar.lifecycle import Lifecycle, Probe, Worker
from sidecar.status import Status
from sidecar.worker import WorkerWatch
from sie.telemetry import InstanceState


class ScriptedClient:
    def __init__(self, probes):
        self._probes = list(probes)

    async def probe(self):
        return self._probes.pop(0)


@pytest.mark.parametrize(
    "probes, last_answer_age_s, state",
    [
        # slow /health twice while requests keep being answered: busy, still ready
        ([Probe.TIMEOUT, Probe.TIMEOUT, Probe.TIMEOUT], 0.2, InstanceState.READY),
        # slow /health twice and no answers either: failed
        ([Probe.TIMEOUT, Probe.TIMEOUT], 30.0, InstanceState.FAILED),
        # a refused connection is never excused by earlier answers
        ([Probe.UNREACHABLE], 0.2, InstanceState.FAILED),
        ([Probe.NOT_READY, Probe.NOT_READY], 0.2, InstanceState.LOADING),
    ],
)
async def test_timeouts_are_excused_only_while_the_worker_answers(probes, last_answer_age_s, state):
    now = 100.0
    status = Status("i", Lifecycle(worker=Worker.UP, ever_up=True))
    watch = WorkerWatch(
        ScriptedClient(probes),
        status,
        0.5,
        clock=lambda: now,
        answered_at=lambda: now - last_answer_age_s,
        busy_grace_s=1.5,
    )
    for _ in probes:
        await watch.probe_once()
    assert status.state is state


async def test_status_reports_changes_once():
    status = Status("i")
    assert status.apply(lifecycle.on_probe, Probe.OK) is InstanceState.READY
    assert status.changed.is_set() and status.serving
    status.changed.clear()
    status.apply(lifecycle.on_probe, Probe.OK)
    assert not status.changed.is_set()  # no change, no record
    assert await status.wait_for(lambda s: s is InstanceState.READY, 0.01)
    assert not await status.wait_for(lambda s: s is InstanceState.SLEEPING, 0.01)
