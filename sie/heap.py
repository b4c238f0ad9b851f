"""Garbage collection in the long-running serving processes (sidecar, worker): start-up's heap is frozen.

CPython's full collection (generation 2) walks every object the collector tracks, and a process holds
most of them from start-up: modules, classes, the loaded model. A scikit-learn scorer worker tracks about
290,000 objects once scikit-learn, SciPy and its model are loaded; a sidecar about 65,000. Measured in
`bench.kafka` (10,500 messages/s on a 2-core machine): full collections during the 8-second sustained
phase stopped the worker for up to 190 ms and the sidecar for 60 ms three times, each a stall of every
message in flight, which is what an end-to-end p99 is made of.

`gc.freeze()` (CPython 3.7+) moves every tracked object into a permanent generation that collections
skip; objects made afterwards are collected as before. Called once a process has loaded what it serves,
after one full collection, so start-up's garbage is freed first and only live objects are frozen.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze what is left: later full collections skip it. Returns how many objects are
    frozen (all of them, over every call)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen: %d objects left out of later full collections", frozen)
    return frozen
