"""Admission decisions with an explicit clock: slots, FIFO queue, queue bound, queue timeout."""

import pytest

from sidecar.admission import AdmissionQueue, Limits, Verdict

A, Q, FULL, TIMEOUT = Verdict.ADMITTED, Verdict.QUEUED, Verdict.QUEUE_FULL, Verdict.QUEUE_TIMEOUT


@pytest.mark.parametrize(
    "limits, arrivals, verdicts, in_flight, queued",
    [
        # (max_concurrent, max_queue, max_wait_s), arrival times, verdicts in order
        ((2, 2, 1.0), [0, 0], [A, A], 2, 0),
        ((2, 2, 1.0), [0, 0, 0, 0], [A, A, Q, Q], 2, 2),
        ((2, 2, 1.0), [0, 0, 0, 0, 0], [A, A, Q, Q, FULL], 2, 2),
        ((1, 0, 1.0), [0, 0], [A, FULL], 1, 0),  # no queue at all: refuse at once
        ((1, 3, 0.0), [0, 0], [A, TIMEOUT], 1, 0),  # may not wait at all: queue timeout at once
    ],
)
def test_arrivals(limits, arrivals, verdicts, in_flight, queued):
    core = AdmissionQueue(Limits(*limits))
    assert [core.arrive(t)[0] for t in arrivals] == verdicts
    assert (core.in_flight, core.queued) == (in_flight, queued)


def test_release_admits_in_arrival_order():
    core = AdmissionQueue(Limits(1, 3, 10.0))
    core.arrive(0.0)
    waiters = [core.arrive(t)[1] for t in (1.0, 2.0, 3.0)]
    for expected in waiters:
        admitted, expired = core.release(4.0)
        assert admitted == [expected] and expired == []
    assert core.in_flight == 1 and core.queued == 0


def test_waiter_past_its_deadline_is_expired_not_admitted():
    core = AdmissionQueue(Limits(1, 3, 1.0))
    core.arrive(0.0)
    late = core.arrive(0.0)[1]  # deadline 1.0
    on_time = core.arrive(0.5)[1]  # deadline 1.5
    admitted, expired = core.release(1.2)
    assert expired == [late] and admitted == [on_time]
    assert core.in_flight == 1 and core.queued == 0


@pytest.mark.parametrize(
    "now, expired_count",
    [(0.99, 0), (1.0, 1), (1.49, 1), (1.5, 2), (9.0, 3)],
)
def test_expire_by_fake_clock(now, expired_count):
    core = AdmissionQueue(Limits(1, 5, 1.0))
    core.arrive(0.0)
    for t in (0.0, 0.5, 0.9):
        core.arrive(t)
    assert len(core.expire(now)) == expired_count
    assert core.queued == 3 - expired_count
    assert core.in_flight == 1  # expiring never touches the slots


def test_deadlines_never_decrease_along_the_queue():
    # The Gate keeps one timer at the head's deadline; that is only right if the head expires first.
    core = AdmissionQueue(Limits(1, 50, 0.3))
    core.arrive(0.0)
    for i in range(50):
        core.arrive(i * 0.01)
    deadlines = [w.deadline for w in core.waiting]
    assert deadlines == sorted(deadlines)
    assert core.next_deadline == deadlines[0]


def test_withdraw_and_hand_back():
    core = AdmissionQueue(Limits(1, 3, 5.0))
    core.arrive(0.0)
    w1, w2, w3 = (core.arrive(0.0)[1] for _ in range(3))
    assert core.withdraw(w2) is True
    assert core.withdraw(w2) is False  # leaves the queue exactly once
    assert core.hand_back_all() == [w1, w3]
    assert core.queued == 0 and core.in_flight == 1 and not core.idle
    core.release(1.0)
    assert core.idle and core.completed == 1


def test_release_without_admission_is_a_bug_not_a_negative_count():
    with pytest.raises(RuntimeError, match="negative"):
        AdmissionQueue(Limits(1, 1, 1.0)).release(0.0)


def test_queue_is_used_only_when_no_slot_is_free():
    core = AdmissionQueue(Limits(2, 5, 1.0))
    assert core.arrive(0.0)[0] is A
    core.release(0.1)
    assert [core.arrive(0.2)[0] for _ in range(3)] == [A, A, Q]


@pytest.mark.parametrize("limits", [(0, 1, 1.0), (1, -1, 1.0)])
def test_bad_limits_are_refused(limits):
    with pytest.raises(ValueError):
        Limits(*limits)


def test_invariants_hold_over_a_random_schedule():
    import random

    rng = random.Random(7)
    limits = Limits(3, 4, 0.5)
    core = AdmissionQueue(limits)
    now, holding, outcomes = 0.0, 0, 0
    for _ in range(5000):
        now += rng.random() * 0.05
        if holding and rng.random() < 0.45:
            admitted, _ = core.release(now)
            holding += len(admitted) - 1
        else:
            verdict, _ = core.arrive(now)
            holding += verdict is A
            outcomes += 1
        core.expire(now) if rng.random() < 0.1 else None
        assert core.in_flight == holding <= limits.max_concurrent
        assert core.queued <= limits.max_queue
        assert all(w.deadline > w.enqueued_at for w in core.waiting)
    assert outcomes > 1000
