"""The asyncio shell around admission: timers, hand-back and slots that must not leak on cancel."""

import asyncio

from sidecar.admission import Gate, Limits, Verdict


async def test_queued_request_times_out_at_its_deadline():
    gate = Gate(Limits(1, 2, 0.05), asyncio.get_running_loop())
    assert gate.arrive()[0] is Verdict.ADMITTED
    verdict, waiter = gate.arrive()
    assert verdict is Verdict.QUEUED
    assert await asyncio.wait_for(gate.wait(waiter), 2.0) is Verdict.QUEUE_TIMEOUT
    assert gate.core.queued == 0 and gate.core.in_flight == 1
    gate.close()


async def test_release_hands_the_slot_to_the_next_in_line():
    gate = Gate(Limits(1, 2, 5.0), asyncio.get_running_loop())
    gate.arrive()
    _, waiter = gate.arrive()
    gate.release()
    assert await asyncio.wait_for(gate.wait(waiter), 1.0) is Verdict.ADMITTED
    assert gate.core.in_flight == 1
    gate.close()


async def test_cancelled_waiter_does_not_leak_its_slot():
    loop = asyncio.get_running_loop()
    gate = Gate(Limits(1, 2, 5.0), loop)
    gate.arrive()
    _, waiter = gate.arrive()
    task = asyncio.create_task(gate.wait(waiter))
    await asyncio.sleep(0)
    # The slot is granted and the waiting task is cancelled before it runs again.
    gate.release()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert gate.core.in_flight == 0 and gate.core.idle
    gate.close()


async def test_waiter_cancelled_before_release_gives_its_turn_away():
    gate = Gate(Limits(1, 3, 5.0), asyncio.get_running_loop())
    gate.arrive()
    _, first = gate.arrive()
    _, second = gate.arrive()
    gone = asyncio.create_task(gate.wait(first))
    stays = asyncio.create_task(gate.wait(second))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    gate.release()
    assert await asyncio.wait_for(stays, 1.0) is Verdict.ADMITTED
    assert gate.core.in_flight == 1 and gate.core.queued == 0
    gate.close()


async def test_wait_idle_and_hand_back():
    gate = Gate(Limits(1, 2, 5.0), asyncio.get_running_loop())
    gate.arrive()
    _, waiter = gate.arrive()
    assert await gate.wait_idle(0.02) is False
    assert gate.hand_back_all() == 1
    assert await gate.wait(waiter) is Verdict.HANDED_BACK
    idle = asyncio.create_task(gate.wait_idle(2.0))
    await asyncio.sleep(0)
    gate.release()
    assert await idle is True
    gate.close()
