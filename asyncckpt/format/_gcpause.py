"""Pausing Python's cyclic garbage collector around work that allocates many small objects.

A save's structure walk and a load's parse, pairing and rebuild allocate tens of thousands
of containers for a state of many tensors; each allocation burst triggers collections that
traverse every live object, tensors included (70 % of the save's walk for 10,000 tensors,
~0.15 s of a 10,000-tensor load). None of that work creates garbage cycles, so nothing is
lost by deferring the collector for those milliseconds. The pauses cover CPU work only,
never I/O: the collector is process-wide, and other threads run on during a load's reads.
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
