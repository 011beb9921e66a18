"""Retention and clean-up: retire old checkpoints, remove leftovers of failed attempts.

Retention runs only after a commit is durable, counts only complete checkpoints, and never
touches the newest one. A checkpoint is retired by renaming it to a ``.deleting-`` name
first (atomic: it stops being complete at once) and removing the files afterwards, so a
crash half-way through never leaves a half-deleted directory that looks complete. A save's
retention may leave that removal running in the background (deleting a 1 GiB shard took
0.2 s, which the save's caller has no reason to wait for): ``Checkpointer.flush()`` waits
for it, and a process that dies first leaves ``.deleting-`` leftovers for the next start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from ._discovery import complete_checkpoints
from ._info import CheckpointInfo
from ._layout import deleting_dir_name, parse_leftover, step_dir_name
from ._storage import DEFAULT_OPS, OsOps, Storage, remove_tree

log = logging.getLogger("asyncckpt")


def leftovers(root: str, step: int | None = None) -> list[str]:
    """Paths of in-progress/retiring directories under ``root`` (optionally of one step)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        s = parse_leftover(name)
        if s is not None and (step is None or s == step):
            out.append(os.path.join(root, name))
    return sorted(out)


def remove_leftovers(root: str, ops: OsOps = DEFAULT_OPS) -> list[str]:
    """Remove every leftover of crashed or failed attempts under ``root``; return them.

    Call only when no save of this root is in flight (at start-up, on the leader).
    """
    removed = []
    for path in leftovers(root):
        remove_tree(path, ops)
        removed.append(path)
    return removed


def choose_victims(steps: list[int], keep_last: int) -> list[int]:
    """Which of the complete ``steps`` (any order) to retire to keep the newest ``keep_last``."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    ordered = sorted(steps)
    return ordered[:-keep_last] if len(ordered) > keep_last else []


def choose_by_commit_order(infos: list[CheckpointInfo], keep_last: int, latest: int | None = None) -> list[int]:
    """Which steps to retire to keep the ``keep_last`` most recently committed (manifest
    ``created`` time, then step): retention of a root that allows earlier steps.

    ``latest``, the step this process just committed, counts as the most recent whatever
    the clocks say (an earlier job's clock may have run ahead), so it is never retired.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    ordered = sorted(infos, key=lambda i: (i.step == latest, i.created, i.step))
    return sorted(i.step for i in ordered[:-keep_last]) if len(ordered) > keep_last else []


async def retire(
    storage: Storage,
    root: str,
    keep_last: int,
    *,
    by_commit_order: bool = False,
    lock: asyncio.Lock | None = None,
    latest: int | None = None,
    protect: frozenset[int] = frozenset(),
    background: set[asyncio.Task[None]] | None = None,
) -> list[int]:
    """Retire complete checkpoints beyond the newest ``keep_last``; return their steps.

    Steps in ``protect`` are kept besides (tier mode: uploads pending or in flight).
    With ``background``, the retired directories' files are removed by a task added to it
    (and discarded from it when done; a failure is logged): the call returns once the victims
    are renamed away and the root fsynced. Without it, it returns once they are removed.

    Newest means the highest step, or with ``by_commit_order`` the latest committed.
    ``lock`` (one per writer loop) serializes overlapping saves' retention, so two of them
    never pick and rename the same victim. ``latest``: see :func:`choose_by_commit_order`.
    """
    if lock is None:
        return await _retire(storage, root, keep_last, by_commit_order, latest, protect, background)
    async with lock:
        return await _retire(storage, root, keep_last, by_commit_order, latest, protect, background)


async def _remove_all(storage: Storage, paths: list[str]) -> None:
    try:
        for path in paths:
            await storage.remove_tree(path)
    except Exception as e:  # noqa: BLE001 - retired already; the next start removes what is left
        log.warning("removing retired checkpoints %s failed: %s", paths, e)


async def _retire(
    storage: Storage, root: str, keep_last: int, by_commit_order: bool, latest: int | None,
    protect: frozenset[int] = frozenset(), background: set[asyncio.Task[None]] | None = None,
) -> list[int]:
    infos = await storage.run(complete_checkpoints, root)
    if by_commit_order:
        victims = choose_by_commit_order(infos, keep_last, latest)
    else:
        victims = choose_victims([i.step for i in infos], keep_last)
    victims = [s for s in victims if s not in protect]
    moved = []
    for step in victims:
        src = os.path.join(root, step_dir_name(step))
        dst = os.path.join(root, deleting_dir_name(step, uuid.uuid4().hex[:16]))
        await storage.rename(src, dst)
        moved.append(dst)
    if moved:
        await storage.fsync_dir(root)
        if background is None:
            await _remove_all(storage, moved)
        else:
            task = asyncio.ensure_future(_remove_all(storage, moved))
            background.add(task)
            task.add_done_callback(background.discard)
    return victims
