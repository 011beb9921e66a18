"""How far the copy into a staging arena got: the :class:`StageProgress` watermark.

``save()``'s copy moves it forward group by group (``_stagecopy``); the writer streams the
staged prefix of the arena and waits on it for the rest (``until_staged``), every wait with a
deadline. A copy that fails or is given up releases every waiter with :class:`StagingAborted`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from .._errors import SaveError


class StagingAborted(Exception):
    """The copy in ``save()`` did not finish (it raised, or the caller was interrupted): the
    writer streaming that arena gives the save up. Never raised to the caller of ``save()``,
    who gets the original exception."""


class StageProgress:
    """How much of an arena is staged: a watermark (file offset) the copy moves forward and
    the writer waits on. Thread-safe; every wait has a deadline."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.staging_s = 0.0
        self._cond = threading.Condition()
        self._staged = 0
        self._error: BaseException | None = None
        self._gone = False  # the writer stopped waiting: nothing more to tell it
        self._ends: list[int] = []
        self._done: set[int] = set()
        self._next = 0
        self._wakers: list[tuple[int, Callable[[], None]]] = []

    @property
    def finished(self) -> bool:
        return self._staged >= self.total

    def advance(self, pos: int) -> None:
        """The arena is staged up to file offset ``pos``."""
        with self._cond:
            if pos > self._staged:
                self._staged = pos
                self._cond.notify_all()
            due = self._due()
        _wake(due)

    def when_reached(self, pos: int, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once offset ``pos`` is staged, or the copy failed, or the writer gave
        the save up: now, or from the thread that gets there (the copying thread; ``wake``
        must be quick and must not raise). The writer loop waits on this (``until_staged``)."""
        with self._cond:
            if self._staged < pos and self._error is None and not self._gone:
                self._wakers.append((pos, wake))
                return
        wake()

    def _due(self) -> list[Callable[[], None]]:
        """Under the lock: take the wakers whose offset is staged (all of them once the copy
        failed or was abandoned)."""
        if not self._wakers:
            return []
        if self._error is not None or self._gone:
            due, self._wakers = [w for _, w in self._wakers], []
            return due
        due = [w for p, w in self._wakers if p <= self._staged]
        if due:
            self._wakers = [(p, w) for p, w in self._wakers if p > self._staged]
        return due

    def expect_groups(self, ends: Sequence[int]) -> None:
        """The copy will finish groups whose (file-order) end offsets are ``ends``."""
        with self._cond:
            # only finish() completes the staging: a copy that raises after its last group
            # must leave the writer one byte short, so that save never commits
            self._ends, self._done, self._next = [min(e, self.total - 1) for e in ends], set(), 0

    def group_done(self, g: int) -> None:
        """Group ``g`` is copied; the watermark moves over every group done in order."""
        with self._cond:
            self._done.add(g)
            moved = False
            while self._next in self._done:
                self._done.discard(self._next)
                self._staged = max(self._staged, self._ends[self._next])
                self._next += 1
                moved = True
            if moved:
                self._cond.notify_all()
            due = self._due()
        _wake(due)

    def finish(self, staging_s: float) -> None:
        """Everything is staged (called by ``save()`` once the copy returned). A no-op once
        :meth:`fail` was called: a failed copy never completes."""
        with self._cond:
            if self._error is not None:
                return
            self.staging_s = staging_s
            self._staged = self.total
            self._cond.notify_all()
            due = self._due()
        _wake(due)

    def fail(self, exc: BaseException) -> None:
        """The copy failed: every wait (now or later) raises :class:`StagingAborted`."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
            due = self._due()
        _wake(due)

    def abandon(self) -> None:
        """The writer gave the save up (failure, deadline): release its waiting threads."""
        with self._cond:
            self._gone = True
            self._cond.notify_all()
            due = self._due()
        _wake(due)

    def reached(self, pos: int) -> bool:
        """Whether offset ``pos`` is staged, without waiting; ``StagingAborted`` as :meth:`wait_for`."""
        with self._cond:
            if self._staged >= pos:
                return True
            if self._error is not None:
                raise self._aborted()
            if self._gone:
                raise StagingAborted("the save was given up before its state was staged")
            return False

    def _aborted(self) -> Exception:
        """What a wait raises once the copy failed: the failure itself when it is already the
        save's verdict (a ``SaveError``: deferred staging's ``StateChangedError``), else
        :class:`StagingAborted` describing it."""
        err = self._error
        if isinstance(err, SaveError):
            return err
        return StagingAborted(f"save() did not finish copying the state: {type(err).__name__}: {err}")

    def wait_for(self, pos: int, deadline: float) -> None:
        """Block until offset ``pos`` is staged; ``StagingAborted`` if the copy failed or the
        writer abandoned the save, ``TimeoutError`` at ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            while self._staged < pos:
                if self._error is not None:
                    raise self._aborted()
                if self._gone:
                    raise StagingAborted("the save was given up before its state was staged")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the state was not staged before the save's deadline")
                self._cond.wait(left)


def _wake(due: list[Callable[[], None]]) -> None:
    for wake in due:
        wake()
