"""Pausing Python's cyclic garbage collector for a save's or a load's critical path.

A save's structure walk and a load's parse, pairing and rebuild allocate a few containers
per tensor: for 300,000 tensors, collections between phases traversed everything the
earlier phases still held and promoted it towards full passes (2.4-3.4 s of a load, a
0.8 s pass in ``save()``). So ``save()`` is one pause, and a load is one pause from the
structure's parse to the restore, reads included (issue 32). None of that work makes garbage
cycles (the walkers' recursive closures are unbound at their end: ``_structure_nodes.spent_closure``),
so the temporaries die by reference counting before the pause ends and the first
collection afterwards sees only what the caller keeps (the loaded state).

Why the reads too: ending the pause for them would make the first allocation during the
read collect every in-flight destination, slot and tensor (the collector counts objects
made while it was off). The price: the collector is process-wide, so other threads' cyclic
garbage waits until the load returns (seconds, bounded by the load's own deadline); nothing
else waits. ``gc.freeze()`` would also skip those traversals but is rejected: it moves every
object of the process, the user's included, into a generation never collected again.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # pauses in progress, on any thread
_resume = False  # whether the last pause to end turns the collector back on


def _after_fork_in_child() -> None:
    # the threads whose pauses were in progress do not exist in the child: without this its
    # collector would stay off for good (and the lock could be held by a thread that is gone)
    global _lock, _depth, _resume
    _lock = threading.Lock()
    if _depth and _resume:
        gc.enable()
    _depth, _resume = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic GC for the block. Pauses nest and overlap across threads: the
    collector comes back on when the last one ends, and only if it was on when the first
    began (a GC the caller switched off stays off). A ``gc.disable()`` made by another thread
    *during* a pause is undone when the pause ends: the window is the block's CPU time."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
