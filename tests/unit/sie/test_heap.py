"""sie.heap.freeze_startup_heap: what exists when it runs is left out of later collections."""

from __future__ import annotations

import gc

from sie.heap import freeze_startup_heap


def test_the_startup_heap_is_frozen_and_later_objects_are_not():
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # the interpreter, pytest and SIE's modules
        later = [[] for _ in range(100)]
        assert gc.get_freeze_count() == frozen  # new objects are collected as before
        assert all(gc.is_tracked(item) for item in later)
    finally:
        gc.unfreeze()  # the test process goes on collecting everything
    assert gc.get_freeze_count() == 0
