"""Clean-ups around one save, none of which may delay its outcome past its deadline.

Tasks nobody awaits any more (a dropped dedupe round, index part or write: :func:`drop`,
:func:`consume`), a failed attempt's files (:func:`remove_failed_attempt`) and retention after a
commit (:func:`clean_up`): each runs until the save's deadline (at least :data:`CLEANUP_WAIT_S`),
then goes on in the background, tracked where ``flush()`` and ``close()`` wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection
from typing import Any

from ..roots._backend import Backend
from ._savejob import SaveJob

log = logging.getLogger("asyncckpt")

#: How long past the save's deadline a clean-up after the verdict (a failed attempt's removal,
#: retention) may delay the outcome; then it goes on in the background.
CLEANUP_WAIT_S = 0.5
# clean-ups going on in the background for saves that have no ``removals`` set to track them
_untracked: set[asyncio.Task[None]] = set()


async def drop(task: asyncio.Future[Any] | None) -> None:
    """Cancel a task nobody will use (a dedupe round, an index part, a file write) and collect
    its outcome (it is not this save's failure: the reason it is dropped is)."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # a cancellation of ours still propagates


def consume(task: asyncio.Task[Any]) -> None:
    """Retrieve the outcome of a task nobody awaits any more (its failure is not this save's:
    the failure that made nobody await it is)."""
    if not task.cancelled():
        task.exception()


async def _logged(aw: Awaitable[Any], what: str) -> None:
    try:
        await aw
    except Exception as e:  # noqa: BLE001 - a clean-up: the next start (or sweep) collects what is left
        log.warning("%s: %s", what, e)


def in_background(job: SaveJob, aw: Awaitable[Any], what: str) -> asyncio.Task[None]:
    """Start a clean-up as a task tracked in ``job.removals`` (what ``flush()`` and ``close()``
    wait for); its failure is logged."""
    task = asyncio.ensure_future(_logged(aw, what))
    tracked = job.removals if job.removals is not None else _untracked
    tracked.add(task)
    task.add_done_callback(tracked.discard)
    return task


async def clean_up(job: SaveJob, aw: Awaitable[Any], what: str) -> None:
    """Run a clean-up after the verdict until the save's deadline (at least
    :data:`CLEANUP_WAIT_S`), then leave it running in the background: a store that stopped
    answering, or a file a stuck write holds, never delays the save's outcome."""
    task = in_background(job, aw, what)
    await asyncio.wait({task}, timeout=max(0.0, job.deadline - time.monotonic()) + CLEANUP_WAIT_S)


async def remove_failed_attempt(backend: Backend, job: SaveJob, loc: str, ranks: Collection[int], leader: bool) -> None:
    """Remove the files of ``ranks`` from the failed attempt at ``loc`` (the leader also the
    attempt's own files and the attempt once empty: ``Backend.abandon``), as a :func:`clean_up`.
    A follower with no files to remove does nothing."""
    if ranks or leader:
        await clean_up(job, backend.abandon(job, loc, ranks, leader), f"could not remove the failed attempt {loc}")
