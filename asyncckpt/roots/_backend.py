"""Where a save's files go and how a step commits: the storage half of the save protocol.

``_commit.run_save`` is the protocol, written once (coordination, verdicts, deadlines, the
index and the manifest's content, lifecycle); a :class:`Backend` is what differs between
storages. :class:`PosixBackend` (here) commits by rename: the attempt is a directory
``step_N.tmp-<attempt>/`` renamed to ``step_N`` once its manifest is in it, with fsyncs
around every step. ``objstore._backend.ObjectBackend`` commits by conditional create: the attempt's
objects lie under ``step_N/a-<attempt>/`` and the manifest is created once with
``If-None-Match: *``. An attempt's *location* is the tmp directory or the key prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import pathlib
import re
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any, Protocol

from .._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from .._info import CheckpointInfo
from ..format import _manifest
from ..format._layout import deleting_dir_name, step_dir_name, tmp_dir_name
from ..format._stepstates import save_action, state_of
from ..threads._deadline import Deadline
from ._filewrite import Staged, WriteResult
from .posix._discovery import observe_step, open_step, read_manifest
from .posix._fileio import copy_in
from .posix._osops import DEFAULT_OPS, OsOps
from .posix._remove_tree import remove_tree
from .posix._retention import leftovers, retire, set_aside
from .posix._storage import Storage

log = logging.getLogger("asyncckpt")


class StepJob(Protocol):
    """What a :class:`Backend` reads and updates of one save: the fields it needs of
    ``saving._savejob.SaveJob`` (which satisfies this), so that the storage half does not
    depend on the saving layer and a root can drive it alone (``_root.BackendAttempt``)."""

    step: int
    root: str
    deadline: float  # time.monotonic() by which the outcome must be known
    timeout: float
    keep_last: int | None
    by_commit_order: bool
    failed_commits: set[str]
    dead: set[str]
    retention_lock: asyncio.Lock | None
    removals: set[asyncio.Task[None]] | None


class PhaseTimeout(TimeoutError):
    """A phase of the save ran past the save's deadline (classified as a timeout by name)."""


def check_deadline(job: StepJob) -> None:
    """Raise ``PhaseTimeout`` once the save's deadline passed: e.g. this process was stopped
    mid-commit, and the other ranks have given up by now."""
    if time.monotonic() > job.deadline:
        raise PhaseTimeout("the save's deadline passed before the commit point")


def dir_timeout(job: StepJob) -> float:
    """Seconds (a duration, not a point in time) a wait inside a phase may take: ends a little
    before the phase's deadline, so the wait's own error (ensure_dir's StaleDirectoryError, a
    silent node named) reaches the caller rather than a generic phase timeout."""
    remaining = job.deadline - time.monotonic()
    return max(0.0, remaining - min(0.5, 0.1 * remaining))


#: How long a commit cancelled by the save's deadline waits for its rename to return.
LATE_RENAME_WAIT_S = 10.0


async def landed_late(rename: asyncio.Future[None], loc: str, final: str) -> bool:
    """Whether a commit rename whose waiter was cancelled took effect after all: waits (bounded)
    for the thread; a rename still running after that is judged by what the paths show."""
    try:
        await asyncio.wait_for(asyncio.shield(rename), LATE_RENAME_WAIT_S)
        return True
    except OSError:
        return False  # refused: nothing was committed
    except (TimeoutError, asyncio.CancelledError):
        # the pool is stuck in the rename: look from another thread
        return await asyncio.to_thread(lambda: os.path.isdir(final) and not os.path.exists(loc))


class Backend(Protocol):
    """The storage operations of one save; every method runs on the writer loop."""

    def location(self, step: int, attempt: str) -> str:
        """Where the files of ``attempt`` of ``step`` go (no I/O)."""
        ...

    def info(self, step: int, **fields: Any) -> CheckpointInfo:
        """The :class:`CheckpointInfo` of committed ``step`` with ``fields``."""
        ...

    async def prepare(self, job: StepJob, attempt: str) -> None:
        """Leader: open ``attempt``; refuse a committed step (``FileExistsError``)."""
        ...

    async def join(self, job: StepJob, loc: str) -> None:
        """Follower: make sure it can write into ``loc`` (the leader prepared it)."""
        ...

    async def write_shard(
        self, job: StepJob, loc: str, name: str, buf: memoryview, size: int, staged: Staged | None
    ) -> WriteResult:
        """Store ``buf[:size]`` as ``name``, durable when this returns, checksummed.
        ``staged``: the arena is still being copied into; wait for its bytes."""
        ...

    async def write_small(self, job: StepJob, loc: str, name: str, data: bytes) -> WriteResult:
        """Store ``data`` as ``name``, durable when this returns."""
        ...

    async def write_from(
        self, job: StepJob, loc: str, name: str, size: int, read: Callable[[int, memoryview], None]
    ) -> WriteResult:
        """Store the ``size`` bytes that ``read(offset, buffer)`` fills (called on a thread,
        never on the loop) as ``name``, a bounded window at a time (never the whole file in
        memory), durable when this returns; the result's CRC-32C is of the bytes stored."""
        ...

    async def discard(self, job: StepJob, loc: str, name: str) -> None:
        """Remove this rank's file ``name`` (written, not yet committed) so that it may be
        written again; the next :meth:`seal` makes the removal durable."""
        ...

    async def seal(self, job: StepJob, loc: str) -> None:
        """Every file of this rank is written: make their names durable."""
        ...

    async def commit(self, job: StepJob, loc: str, attempt: str, manifest: bytes) -> None:
        """Leader: publish ``manifest`` and make the step complete (the commit point).
        Raises if the step did not commit as ``attempt``; then it is not complete."""
        ...

    async def abandon(self, job: StepJob, loc: str, ranks: Collection[int], leader: bool) -> None:
        """Remove the files of ``ranks`` from the failed attempt ``loc``, as this rank sees
        them, then the attempt itself once nothing is left in it (raises if it could not;
        it is collected later). The leader (``leader``) takes every rank whose I/O on the
        attempt ended, itself included (then also the manifest and the index); a rank it
        could not count on removes its own once its I/O ended. The files of a rank whose
        write may still run (stuck in the kernel, where an unlink would wait with it) are
        nobody's until the next start. On a store the leader removes the whole attempt (no
        write can hold an object) and the others nothing."""
        ...

    async def retire(self, job: StepJob) -> None:
        """Leader, after every commit: remove what the commit made dead, apply ``job.keep_last``
        (``None``: keep every step). Its failures are logged, never fail the save."""
        ...

    async def follow(self, job: StepJob, loc: str, attempt: str) -> None:
        """Follower, after reporting and before hearing the verdict: take part in the leader's
        commit (the node-local tier: commit this node's part; ``saving._nodelocal``). Bounded
        by the save's deadline; a no-op where the leader commits alone."""
        ...

    async def release(self, job: StepJob) -> None:
        """Leader, when it decided not to commit: free the followers waiting in :meth:`follow`."""
        ...


# ---------------------------------------------------------------------------------- POSIX


def _final_state(root: str, step: int, final: str, failed_attempts: set[str]) -> tuple[str, str | None]:
    """What lies at ``final``: ``failed`` (our commit reported failed), else the step rule's
    ``save_action`` (``proceed``, ``committed``, ``set-aside``, ``refuse``); and its attempt."""
    if not os.path.lexists(final):
        return "proceed", None
    try:
        if read_manifest(final).attempt in failed_attempts:
            return "failed", None
    except (CheckpointNotFoundError, CheckpointCorruptError):
        pass
    seen = observe_step(root, step)
    return save_action(None if seen is None else state_of(seen)), None if seen is None else seen.attempt


def _survey(root: str, step: int, final: str, failed_attempts: set[str]) -> tuple[list[str], tuple[str, str | None]]:
    """The leftovers of ``step`` under ``root`` and what lies at its final directory."""
    return leftovers(root, step), _final_state(root, step, final, failed_attempts)


def _check_committed(root: str, step: int, attempt: str) -> None:
    """Raise ``CheckpointCorruptError`` unless ``step_N`` is complete and holds ``attempt``."""
    step_dir, manifest = open_step(root, step)
    if manifest.attempt != attempt:
        raise CheckpointCorruptError(f"holds attempt {manifest.attempt}, not the committed {attempt}", step_dir)


_RANK_FILE = re.compile(r"rank(\d+)\.")


def remove_part(loc: str, ranks: Collection[int], leader: bool, ops: OsOps = DEFAULT_OPS) -> bool:
    """Remove the files of ``ranks`` from the attempt directory ``loc`` (``rankRRRRR.*``;
    with ``leader`` and the leader's rank 0 among them also every name no rank owns: the
    manifest, its temp file, the index),
    then ``loc`` itself if nothing else is left in it. True if ``loc`` is gone.

    Callers take disjoint parts, and the directory goes only once a listing after this
    call's removals shows it empty: whoever removes a part last sees that, and a directory
    that holds a file a stuck write is inside is never touched (a file system may make an
    ``rmdir`` wait for that write, as libfuse's path locks do)."""

    def taken(name: str) -> bool:
        owner = _RANK_FILE.match(name)
        return int(owner.group(1)) in ranks if owner else leader and 0 in ranks

    try:
        names = ops.listdir(loc)
    except FileNotFoundError:
        return True
    for name in names:
        if taken(name):
            remove_tree(os.path.join(loc, name), ops)
    try:
        if ops.listdir(loc):
            return False  # another rank's part is still there: whoever takes it takes the directory
        ops.rmdir(loc)
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False  # a late file of another rank: the same
        raise
    return True


class PosixBackend:
    """A root directory on a POSIX file system: commit by rename (module docstring)."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root

    def location(self, step: int, attempt: str) -> str:
        return os.path.join(self.root, tmp_dir_name(step, attempt))

    def info(self, step: int, **fields: Any) -> CheckpointInfo:
        return CheckpointInfo(step=step, path=pathlib.Path(self.root) / step_dir_name(step), **fields)

    async def prepare(self, job: StepJob, attempt: str) -> None:
        storage, root = self.storage, job.root
        final = os.path.join(root, step_dir_name(job.step))
        # what lies in the way, in one call on the I/O pool (and the attempt made in one more):
        # the followers wait for this, and on a busy machine each hop to a pool thread costs
        # more than the calls themselves
        olds, (found, bad_attempt) = await storage.run(_survey, root, job.step, final, job.failed_commits)
        for old in olds:
            name = os.path.basename(old)
            if name in job.dead:
                await storage.remove_tree(old)
                job.dead.discard(name)
            else:
                # not provably dead: another writer's live attempt, say; never touch it
                log.warning("leaving %s alone: not an attempt this Checkpointer knows to be dead", old)
        if found == "committed":
            raise FileExistsError(17, f"step {job.step} is already committed", final)
        if found == "set-aside":
            # known bad (_stepstates): renamed out of the way, kept for inspection
            await set_aside(storage, root, job.step, bad_attempt)
        if found == "refuse":
            # not a checkpoint, and not provably ours: never remove it (it may hold anyone's files)
            raise FileExistsError(
                errno.EEXIST,
                f"{step_dir_name(job.step)} exists but is not a complete checkpoint this Checkpointer wrote; "
                "move it away to save this step (asyncckpt ls shows what it holds)",
                final,
            )
        if found == "failed":
            # our own commit that failed and could not be taken back: move it aside
            aside = os.path.join(root, deleting_dir_name(job.step, uuid.uuid4().hex[:16]))
            await storage.rename(final, aside)
            job.dead.add(os.path.basename(aside))
            await storage.remove_tree(aside)
            job.dead.discard(os.path.basename(aside))
        await storage.ensure_dir_durable(self.location(job.step, attempt), root, Deadline.after(dir_timeout(job)))

    async def join(self, job: StepJob, loc: str) -> None:
        await self.storage.ensure_dir(loc, Deadline.after(dir_timeout(job)))

    async def write_shard(
        self, job: StepJob, loc: str, name: str, buf: memoryview, size: int, staged: Staged | None
    ) -> WriteResult:
        return await self.storage.write_file(
            os.path.join(loc, name), buf, size, direct=True, staged=staged, deadline=job.deadline
        )

    async def write_small(self, job: StepJob, loc: str, name: str, data: bytes) -> WriteResult:
        return await self.storage.write_bytes(os.path.join(loc, name), data)

    async def write_from(
        self, job: StepJob, loc: str, name: str, size: int, read: Callable[[int, memoryview], None]
    ) -> WriteResult:
        t0 = time.perf_counter()
        crc = await self.storage.run(copy_in, os.path.join(loc, name), size, read)
        return WriteResult(size, crc, False, time.perf_counter() - t0, 0.0)

    async def discard(self, job: StepJob, loc: str, name: str) -> None:
        await self.storage.remove(os.path.join(loc, name))

    async def seal(self, job: StepJob, loc: str) -> None:
        await self.storage.fsync_dir(loc)

    async def commit(self, job: StepJob, loc: str, attempt: str, manifest: bytes) -> None:
        storage = self.storage
        tmp_marker = os.path.join(loc, _manifest.MANIFEST + ".tmp")
        await storage.write_bytes(tmp_marker, manifest)
        await storage.rename(tmp_marker, os.path.join(loc, _manifest.MANIFEST))
        await storage.fsync_dir(loc)
        final = os.path.join(job.root, step_dir_name(job.step))
        check_deadline(job)
        # retention of an overlapping save must not retire this step between its commit rename
        # and the check of what was committed (it would look like a failed commit)
        async with job.retention_lock if job.retention_lock is not None else contextlib.nullcontext():
            # commit point. The rename runs on the I/O pool: if the save's deadline cancels
            # this coroutine meanwhile, the thread goes on and may still land it, after every
            # rank was told "failed". Shielded, so its outcome is known before this returns.
            rename = asyncio.ensure_future(storage.rename(loc, final))
            try:
                await asyncio.shield(rename)
            except asyncio.CancelledError:
                if await landed_late(rename, loc, final):
                    await self._take_back(job, final, attempt)
                raise
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # another attempt's rename won (a writer that does not hold the root): this
                # one is not committed, said as a store says it
                raise FileExistsError(
                    errno.EEXIST, f"step {job.step} was committed by another attempt while this one wrote", final
                ) from e
            try:
                await storage.fsync_dir(job.root)
                # check what was committed: exactly the manifest's files with their sizes, our attempt
                await storage.run(_check_committed, job.root, job.step, attempt)
            except (OSError, CheckpointError, asyncio.CancelledError):
                # the rename may not survive a power loss, the directory is not what was written,
                # or the save's deadline cancelled us after the rename, and every rank is about to
                # hear "failed": take the commit back so disk and verdict agree
                await self._take_back(job, final, attempt)
                raise

    async def _take_back(self, job: StepJob, final: str, attempt: str) -> None:
        """Undo the commit rename of ``attempt`` (best effort: if that fails, the attempt is
        remembered as failed, and the next start collects the directory)."""
        storage = self.storage
        try:
            aside = os.path.join(job.root, deleting_dir_name(job.step, uuid.uuid4().hex[:16]))
            await storage.rename(final, aside)
            job.dead.add(os.path.basename(aside))
            await storage.remove_tree(aside)
            job.dead.discard(os.path.basename(aside))
        except OSError as e2:
            job.failed_commits.add(attempt)
            log.warning("could not take back the commit of step %d: %s", job.step, e2)

    async def abandon(self, job: StepJob, loc: str, ranks: Collection[int], leader: bool) -> None:
        # not marked dead if it stays (another rank's files in it): a retry's clean-up must not
        # touch them; the next start removes it
        await self.storage.run(remove_part, loc, ranks, leader, self.storage.ops)

    async def follow(self, job: StepJob, loc: str, attempt: str) -> None:
        return  # the leader commits alone

    async def release(self, job: StepJob) -> None:
        return

    async def retire(self, job: StepJob) -> None:
        if job.keep_last is None:
            return
        await retire(
            self.storage,
            job.root,
            job.keep_last,
            by_commit_order=job.by_commit_order,
            lock=job.retention_lock,
            latest=job.step,
            background=job.removals,
        )
