"""sie.heap.freeze_startup_heap: what exists when it runs is left out of later collections."""

from __future__ import annotations

import gc

from sie.heap import freeze_startup_heap


def tracked_ids() -> set[int]:
    """Objects the collector still walks: those in generations 0-2 (the frozen ones are in none)."""
    return {id(o) for generation in range(3) for o in gc.get_objects(generation)}


def test_the_startup_heap_is_frozen_and_later_objects_are_not():
    early = [[] for _ in range(100)]
    try:
        frozen = freeze_startup_heap()
        assert frozen > 1000  # the interpreter, pytest and SIE's modules
        later = [[] for _ in range(100)]
        walked = tracked_ids()
        assert not any(id(item) in walked for item in early), "what existed at the freeze is left out"
        assert all(id(item) in walked for item in later), "new objects are collected as before"
        # Nothing is added to the frozen set; it shrinks when a frozen object is freed (another thread of
        # this test process may free one at any time), so the count is not compared for equality.
        assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()  # the test process goes on collecting everything
    assert gc.get_freeze_count() == 0
    walked = tracked_ids()
    assert all(id(item) in walked for item in early)
