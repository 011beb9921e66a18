"""One due save's files written into the memory tier from the bytes the save holds.

A save due for the memory tier (``memory_every``) carries a :class:`MemoryWrite`: while this
rank's file writer streams its shard from the staging arena (or the deduplicated image) to the
disk, the same bytes go, once the whole shard is staged (``save()`` has returned: the write
never competes with the copy the caller waits for), into ``<memory>/step_N.tmp-<attempt>/`` on
tmpfs (its tree too); the write ends before the save settles, so the staging slot goes back to the
pool only once nothing reads it any more. Each file's room is reserved first
(``posix_fallocate``): a full tmpfs is ``ENOSPC`` before a byte is copied (the files are written
with ``pwrite``, never mapped: no ``SIGBUS``). No fsync: tmpfs has no disk to make it durable on.

A write that fails never fails the save: its error is kept (:attr:`MemoryWrite.error`) and the
memory round after the disk commit (``_memtier``) drops the step from memory. The round reads
nothing from the disk: the node leaders' manifest bytes are the ones their node's disk commit
wrote (:attr:`MemoryWrite.manifest`, set by ``_nodelocal``).

A save not due for the disks (``disk_every``) commits into the memory tier itself (its root is
the memory root): its ``MemoryWrite`` is made with ``in_save=True`` and writes nothing; it
carries the attempt and the files' CRCs to the memory round (retention, the peer replica).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from ..format._layout import tmp_dir_name
from ..roots._filewrite import Staged, until_staged

#: How much of a shard one ``pwrite`` call copies.
PIECE = 32 << 20


def _open_reserved(path: str, size: int) -> int:
    """Create ``path`` (its directory too) with ``size`` bytes reserved on its file system."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


def _check_size(path: str, size: int) -> None:
    got = os.stat(path).st_size
    if got != size:
        raise OSError(f"{path}: {got} bytes written of {size}")


class MemoryWrite:
    """This rank's files of one due save, written into the memory tier ``memory`` from memory
    (module docstring). ``budget``: the memory tier's budget (a file larger than it is not
    written); ``run`` runs a blocking call on the memory tier's own threads."""

    def __init__(
        self, memory: str, step: int, budget: int | None, run: Callable[..., Any], in_save: bool = False
    ) -> None:
        self.memory, self.step, self.budget = memory, step, budget
        self._run = run
        #: the save itself commits into the memory tier (``disk_every``): nothing to write here
        self.in_save = in_save
        #: the save's attempt (set once the attempt is open: :meth:`begin`)
        self.attempt: str | None = None
        #: a node leader's: the manifest bytes its node's disk commit wrote (``_nodelocal``)
        self.manifest: bytes | None = None
        #: the first failure of the write (``None``: every file written)
        self.error: str | None = None
        #: each file's size, as the save wrote it to the disk
        self.sizes: dict[str, int] = {}
        #: each file's CRC-32C, as the save computed it while writing (the peer replica sends it)
        self.crcs: dict[str, int] = {}
        self._tasks: dict[str, asyncio.Future[None]] = {}

    @property
    def loc(self) -> str:
        """The attempt's directory in the memory tier."""
        assert self.attempt is not None
        return os.path.join(self.memory, tmp_dir_name(self.step, self.attempt))

    def begin(self, attempt: str) -> None:
        """The save's attempt is open: the files go into its directory in the memory tier."""
        self.attempt = attempt

    def write(self, name: str, buf: memoryview, size: int, staged: Staged | None, deadline: float) -> None:
        """Start writing ``buf[:size]`` as ``name``, each piece once ``staged`` reached it (on
        the writer loop; never raises). A second write of ``name`` replaces the first, after it.
        A no-op for a save that commits into the memory tier itself (``in_save``)."""
        if self.in_save:
            return
        self.sizes[name] = size
        prev = self._tasks.get(name)
        self._tasks[name] = asyncio.ensure_future(self._write(name, prev, buf, size, staged, deadline))

    async def _write(
        self, name: str, prev: asyncio.Future[None] | None, buf: memoryview, size: int, staged: Staged | None,
        deadline: float,
    ) -> None:  # fmt: skip
        if prev is not None:
            await asyncio.gather(prev, return_exceptions=True)
        if self.error is not None or self.attempt is None:
            return
        try:
            if self.budget is not None and size > self.budget:
                raise OSError(f"{name} ({size} bytes) exceeds memory_budget={self.budget}")
            path = os.path.join(self.loc, name)
            fd = await self._run(_open_reserved, path, size)
            try:
                # once the whole file is staged, not piece by piece beside the staging copy: that
                # competed with the copy save() waits for (cores, memory bandwidth), and the memory
                # commit waits for the disk's anyway
                await until_staged(staged, size, deadline)
                done = 0
                while done < size:
                    end = min(size, done + PIECE)
                    await self._run(_pwrite_all, fd, buf[done:end], done)
                    done = end
            finally:
                os.close(fd)
            await self._run(_check_size, path, size)
        except Exception as e:  # noqa: BLE001 - the memory tier never fails a save: the round drops the step
            if self.error is None:
                self.error = f"{type(e).__name__}: {e}"

    async def settle(self) -> None:
        """Wait until no write reads the save's buffers any more (never raises: a write that
        did not end is this save's failure, which drops the step from memory anyway)."""
        if self._tasks:
            await asyncio.shield(asyncio.gather(*self._tasks.values(), return_exceptions=True))
        if self.attempt is None and self.error is None:
            self.error = "the save never opened its attempt"

    def outcome(self) -> dict[str, Any]:
        """This rank's word in the memory round (run on a thread: it checks the files' sizes):
        ``ok``, ``bytes`` (its files' sizes, written or not) and the ``error`` if not ok."""
        nbytes = sum(self.sizes.values())
        if self.error is None:
            try:
                for name, size in self.sizes.items():
                    _check_size(os.path.join(self.loc, name), size)
            except OSError as e:
                self.error = f"{type(e).__name__}: {e}"
        if self.error is not None:
            return {"ok": False, "bytes": nbytes, "error": self.error}
        return {"ok": True, "bytes": nbytes}

    def discard(self) -> None:
        """The save failed: remove this rank's files of it from the memory tier, and the attempt's
        directory once it is empty (what is left is removed at the next start). A save that
        wrote into the memory tier itself (``in_save``) removed its own attempt."""
        if self.attempt is None or self.in_save:
            return
        for name in self.sizes:
            try:
                os.unlink(os.path.join(self.loc, name))
            except OSError:
                pass
        try:
            os.rmdir(self.loc)
        except OSError:
            pass
