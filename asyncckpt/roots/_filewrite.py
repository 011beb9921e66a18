"""What one file write of any root takes and gives: the staging in progress it may wait on
(:class:`Staged`, waited for on the writer loop by :func:`until_staged`) and the record of what
it wrote (:class:`WriteResult`)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Staged(Protocol):
    """What the writer needs of a staging in progress (``_staging.StageProgress``)."""

    def wait_for(self, pos: int, deadline: float) -> None: ...

    def reached(self, pos: int) -> bool: ...

    def when_reached(self, pos: int, wake: Callable[[], None]) -> None: ...

    def abandon(self) -> None: ...


@dataclass
class WriteResult:
    """What writing one file produced."""

    size: int
    crc32c: int
    direct: bool
    write_s: float
    fsync_s: float


async def until_staged(staged: Staged | None, pos: int, until: float) -> None:
    """Wait on the writer loop, not on an I/O thread, until ``pos`` is staged: a copy paused
    (a signal handler running on the saving thread, which may itself save and flush) must not
    hold the I/O pool, or every other save's I/O would queue behind it. The copying thread
    wakes the loop when it gets there (``Staged.when_reached``): no polling."""
    if staged is None:
        return
    loop = asyncio.get_running_loop()
    while not staged.reached(pos):  # raises StagingAborted once the copy failed or was given up
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the state was not staged before the save's deadline")
        woken: asyncio.Future[None] = loop.create_future()
        staged.when_reached(pos, functools.partial(_wake_soon, loop, woken))
        try:
            await asyncio.wait_for(woken, left)
        except TimeoutError:
            pass  # checked again above


def _wake_soon(loop: asyncio.AbstractEventLoop, woken: asyncio.Future[None]) -> None:
    """From the copying thread: resolve ``woken`` on its loop (a loop already closed: nobody waits)."""
    try:
        loop.call_soon_threadsafe(_resolve, woken)
    except RuntimeError:
        pass


def _resolve(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
