"""The handle ``save()`` returns: a view of one save's future and lifecycle state."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Generator
from typing import Any

from .._info import CheckpointInfo, SaveStatistics
from ..format._lifecycle import SaveState


class SaveRecord:
    """Shared bookkeeping of one save: its future, state, and who has seen its failure."""

    def __init__(self, step: int, future: concurrent.futures.Future[CheckpointInfo], reported: bool = False) -> None:
        self.step = step
        self.future = future
        self.state = SaveState.STAGED
        self.reported = reported  # the failure reached the caller through some API call
        self.silent = False  # its copy failed inside save(), which raised that instead
        # deferred staging: the save's guard, run by a wait on the thread that saved (else the
        # wait could only end at the save's deadline: the guard is what lets it commit)
        self.before_wait: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def failure(self) -> BaseException | None:
        """The save's exception if it is done and failed (does not mark it reported).

        A save the writer dropped when it was stopped (``close()`` interrupted or timed out)
        is a ``CancelledError`` that says so: never an empty message.
        """
        if self.future.cancelled():
            return concurrent.futures.CancelledError(
                f"the save of step {self.step} was abandoned before it finished: the writer was stopped "
                "(close() interrupted or timed out); nothing of it was committed"
            )
        if not self.future.done():
            return None
        return self.future.exception()

    def mark_reported(self) -> None:
        with self._lock:
            self.reported = True


class SaveHandle:
    """One background save. Awaitable; thread-safe.

    ``result()`` returns the :class:`CheckpointInfo` once committed, or raises the
    ``SaveError`` of a failed save; with a ``timeout`` that runs out it raises the builtin
    ``TimeoutError`` and the save keeps running.
    """

    def __init__(self, record: SaveRecord) -> None:
        self._record = record

    @property
    def step(self) -> int:
        return self._record.step

    @property
    def state(self) -> SaveState:
        """Where the save is now (``COMMITTED`` and ``FAILED`` are final)."""
        return self._record.state

    @property
    def statistics(self) -> SaveStatistics | None:
        """The save's statistics once it committed, else ``None``."""
        f = self._record.future
        if f.done() and not f.cancelled() and f.exception() is None:
            return f.result().statistics
        return None

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._record.future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the outcome; the info of the committed checkpoint, or raise its error.
        For a deferred save (``save(until=)``) called on the thread that saved, this is its
        guard (as ``wait_staged()``); on another thread it waits for the guard."""
        if self._record.before_wait is not None:
            self._record.before_wait()
        done, _ = concurrent.futures.wait([self._record.future], timeout)
        if not done:
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._record.future.cancelled():
            self._record.mark_reported()
            exc = self._record.failure()
            assert exc is not None
            raise exc
        try:
            return self._record.future.result()
        except BaseException:
            self._record.mark_reported()
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the outcome; the save's exception, or ``None`` if it committed."""
        done, _ = concurrent.futures.wait([self._record.future], timeout)
        if not done:
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        exc = self._record.failure()
        if exc is not None:
            self._record.mark_reported()
        return exc

    def __await__(self) -> Generator[Any, None, CheckpointInfo]:
        return self._wait().__await__()

    async def _wait(self) -> CheckpointInfo:
        # shield: cancelling the awaiting task must not cancel the save itself
        fut = asyncio.wrap_future(self._record.future)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._record.mark_reported()
            raise

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} state={self.state.value}>"
