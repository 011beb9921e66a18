"""The staging buffers the library owns: a :class:`StagingPool` of at most ``slots`` arenas
(one per save in flight), bounded and reused across saves, growing one only when the state
grows; and its read-only snapshot (``Checkpointer.staging_statistics``).
"""

from __future__ import annotations

import threading
import time

from .._info import StagingBuffer, StagingStatistics
from ..format._header import round_up
from ._arena import Arena


class StagingPool:
    """At most ``slots`` arenas, handed out one per save in flight and reused."""

    def __init__(self, slots: int, huge_pages: bool = False) -> None:
        self.huge_pages = huge_pages
        self._cond = threading.Condition()
        self._free: list[Arena | None] = [None] * slots
        #: arenas allocated so far (tests and ``reserve()`` check that saves reuse them)
        self.allocations = 0

    def _new_arena(self, nbytes: int, huge_pages: bool | None = None) -> Arena:
        arena = Arena(nbytes, self.huge_pages if huge_pages is None else huge_pages)
        self.allocations += 1
        return arena

    def acquire(self, nbytes: int, timeout: float) -> tuple[Arena, float]:
        """Wait (up to ``timeout`` s) for a free slot; return an arena of >= ``nbytes``.

        Returns the arena and the seconds spent waiting. Raises ``TimeoutError``.
        """
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), max(0.0, timeout)):
                raise TimeoutError(f"no staging slot became free within {timeout:.1f}s")
            # prefer an arena that is already big enough
            idx = next(
                (i for i, a in enumerate(self._free) if a is not None and a.capacity >= nbytes),
                len(self._free) - 1,
            )
            arena = self._free.pop(idx)
        waited = time.perf_counter() - t0
        if arena is None or arena.capacity < round_up(nbytes):
            if arena is not None:
                arena.release()
                del arena
            arena = self._new_arena(nbytes)
        return arena, waited

    def reserve(self, nbytes: int, pin: bool) -> int:
        """Make every free slot hold an arena of >= ``nbytes`` (pinned if ``pin``), allocating
        only what is missing or too small; returns how many arenas were allocated. Slots held
        by saves in flight are left alone (they grow when they come back, at their next use)."""
        made = 0
        with self._cond:
            for i, a in enumerate(self._free):
                if a is None or a.capacity < round_up(nbytes):
                    if a is not None:
                        a.release()
                    a = self._free[i] = self._new_arena(nbytes)
                    made += 1
                if pin:
                    a.pin()
        return made

    def spare(self, nbytes: int) -> Arena:
        """A fresh arena outside the slots, for a save that must not wait for one (the final
        save of a SIGTERM handler that interrupted a save holding the slot). Never on huge
        pages: their allocation can take seconds, and this save runs against a grace period."""
        arena = self._new_arena(nbytes, huge_pages=False)
        arena.spare = True
        return arena

    def give_back(self, arena: Arena) -> None:
        """Return an arena to the pool (called when its save committed or failed)."""
        if arena.spare:
            arena.release()
            return
        with self._cond:
            self._free.append(arena)
            self._cond.notify()

    def snapshot(self, layouts_planned: int) -> StagingStatistics:
        """A read-only snapshot of the pool (``Checkpointer.staging_statistics``)."""
        with self._cond:
            free = [a for a in self._free if a is not None]
            buffers = tuple(StagingBuffer(a.tensor.data_ptr(), a.capacity, a.huge_pages, a.pinned, a.copy_plans)
                            for a in free)  # fmt: skip
            return StagingStatistics(self.allocations, len(self._free), buffers, layouts_planned)

    def close(self) -> None:
        """Release the free arenas."""
        with self._cond:
            for a in self._free:
                if a is not None:
                    a.release()
            self._free = [None] * len(self._free)
