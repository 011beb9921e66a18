"""Pausing Python's cyclic garbage collector around work that allocates many small objects.

A save's structure walk and a load's parse, pairing and rebuild allocate tens of thousands
of containers for a state of many tensors; each allocation burst triggers collections that
traverse every live object, tensors included (70 % of the save's walk for 10,000 tensors).
None of that work creates garbage cycles, so nothing is lost by deferring the collector.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic GC for the block and re-enable it after, only if it was on (a GC the
    caller switched off stays off; another thread's pause that ends first may re-enable it
    early, which costs time, never correctness)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
