"""Retention and clean-up: retire old checkpoints, remove leftovers of failed attempts.

Retention runs only after a commit is durable, counts only resumable checkpoints (complete
and not known bad: ``_stepstates``), retires only those, and never the newest one; a step
known bad is left alone (set aside when its step is saved again: :func:`set_aside`). A
checkpoint is retired by renaming it to a ``.deleting-`` name first (atomic: it stops being
complete at once) and removing the files afterwards, so a crash half-way through never
leaves a half-deleted directory that looks complete. A save's retention may leave that
removal running in the background (deleting a 1 GiB shard took 0.2 s, which the save's
caller has no reason to wait for): ``Checkpointer.flush()`` waits for it, and a process that
dies first leaves ``.deleting-`` leftovers for the next start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

from ...format._layout import aside_dir_name, deleting_dir_name, parse_leftover, step_dir_name
from ...format._manifest import Manifest
from ...format._stepstates import victims as _victims
from ._discovery import resumable
from ._osops import DEFAULT_OPS, OsOps
from ._remove_tree import remove_tree
from ._storage import Storage

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


def choose_victims(infos: list[Manifest], keep_last: int, *, by_commit_order: bool = False,
                   latest: int | None = None, protect: frozenset[int] = frozenset()) -> list[int]:
    """Which of the resumable checkpoints ``infos`` to retire (``_stepstates.victims``): keep
    the newest ``keep_last`` by step or, with ``by_commit_order``, the most recently
    committed (``latest``, the step this process just committed, counting as the most recent
    whatever the clocks say); never one in ``protect``."""
    return _victims([(i.step, i.created) for i in infos], keep_last, by_commit_order=by_commit_order,
                    latest=latest, protect=protect)  # fmt: skip


async def set_aside(storage: Storage, root: str, step: int, attempt: str | None) -> str:
    """Rename known-bad ``step_N`` out of the way, to ``step_N.bad-<attempt>`` (kept for
    inspection; never a leftover, never retired: ``asyncckpt gc --remove-bad`` removes it),
    and fsync the root; return the new path. ``attempt``: its manifest's attempt id (``None``
    when the manifest does not decode: a random token stands in)."""
    src = os.path.join(root, step_dir_name(step))
    dst = os.path.join(root, aside_dir_name(step, attempt if attempt is not None else uuid.uuid4().hex[:16]))
    if await storage.run(os.path.lexists, dst):  # the same attempt set aside before (a pulled copy of it, say)
        dst = os.path.join(root, aside_dir_name(step, uuid.uuid4().hex[:16]))
    await storage.rename(src, dst)
    await storage.fsync_dir(root)
    log.warning("asyncckpt: step %d under %s is known bad; set aside as %s (kept for inspection) to save it again",
                step, root, os.path.basename(dst))  # fmt: skip
    return dst


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
    """Retire resumable checkpoints beyond the newest ``keep_last``; return their steps.

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
    infos = await storage.run(resumable, root)  # resumable ones only
    victims = choose_victims(infos, keep_last, by_commit_order=by_commit_order, latest=latest, protect=protect)
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
