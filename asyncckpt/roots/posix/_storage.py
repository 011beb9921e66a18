"""The async storage seam of a POSIX root, :class:`Storage`: every file-system call a save
makes, as methods the writer awaits. Each runs its blocking work (``OsOps``
calls, ``_file_writes``) on the bounded I/O pool (via aiofiles' executor wrapper), so the
event loop never blocks; shards are written in pieces, several in flight."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import aiofiles.os

from ...format._checksum import crc32c
from ...format._header import ALIGN, round_up
from ...threads._cpumeter import current_meter, metered
from ...threads._deadline import Deadline
from .._filewrite import Staged, WriteResult, until_staged
from ._ensure_dir import ensure_dir
from ._file_writes import CHUNK, CrcChain, OpenFile, PieceAbandoned, finish_file, write_piece, write_small
from ._osops import DEFAULT_OPS, O_CLOEXEC, O_DIRECT, O_NOFOLLOW, OsOps, with_path
from ._remove_tree import remove_tree

T = TypeVar("T")

#: Shard writes in flight at once (each on its own I/O thread): the device always has the
#: next request queued while the previous one completes.
INFLIGHT = 2
#: Under O_DIRECT the first piece is written alone (a file system may take the flag at open
#: and refuse the I/O): a small one, so that the device is idle for ~0.3 ms, not a whole
#: :data:`CHUNK` (~5 ms at 3 GB/s, 5 % of a 256 MiB save).
PROBE = 1024 * 1024
# "this file system cannot preallocate": the write goes on without it
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class Storage:
    """Async file-system operations of one save, run on a bounded executor.

    All methods are called on the writer thread's event loop. ``direct_io`` is ``"auto"``
    (try O_DIRECT, fall back to buffered where the file system refuses it), ``"on"`` or
    ``"off"``.
    """

    def __init__(
        self,
        executor: Executor,
        ops: OsOps = DEFAULT_OPS,
        direct_io: str = "auto",
        compute: Executor | None = None,
        digests: Executor | None = None,
    ) -> None:
        self._executor = executor
        self._compute = compute if compute is not None else executor
        self._digests = digests if digests is not None else self._compute
        self.ops = ops
        self._direct = direct_io != "off" and bool(O_DIRECT)
        self._direct_required = direct_io == "on"

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the I/O pool; its thread CPU time counts to the current save's
        :class:`CpuMeter`, if one is set."""
        meter = current_meter.get()
        if meter is not None:
            fn = metered(fn, meter)
        result: T = await aiofiles.os.wrap(fn)(*args, executor=self._executor)
        return result

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, CPU work that does no I/O (checksums of a staged buffer), on the
        compute thread: never queued behind the pieces of a write that hold the I/O threads
        while the disk is slow. Metered as :meth:`run`."""
        return await self._on(self._compute, fn, *args)

    async def digest(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`compute` for the dedupe round's hashes, on a thread of their own: the round
        waits for them (and every rank for the round), so they never queue behind the
        checksums, which are needed only at the end of the save."""
        return await self._on(self._digests, fn, *args)

    async def _on(self, executor: Executor, fn: Callable[..., T], *args: Any) -> T:
        meter = current_meter.get()
        if meter is not None:
            fn = metered(fn, meter)
        result: T = await aiofiles.os.wrap(fn)(*args, executor=executor)
        return result

    async def _run_on(self, path: str, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`_run`, naming ``path`` in an ``OSError`` that names no file."""
        try:
            return await self.run(fn, *args)
        except OSError as e:
            if e.filename is not None:
                raise
            raise with_path(e, path) from e

    async def ensure_dir(self, path: str, by: Deadline) -> None:
        """:func:`ensure_dir` of ``path`` on the I/O pool, done by ``by``: its wait for a stale
        view gets what is left of ``by`` once a pool thread runs it (the time queued behind
        the shards' writes counts)."""
        await self._run_on(path, lambda: ensure_dir(path, timeout=by.remaining(), ops=self.ops))

    async def fsync_dir(self, path: str) -> None:
        await self._run_on(path, self.ops.fsync_dir, path)

    async def ensure_dir_durable(self, path: str, parent: str, by: Deadline) -> None:
        """:meth:`ensure_dir` (done by ``by``) then :meth:`fsync_dir` of ``parent``, in one
        call on the I/O pool."""

        def run() -> None:
            where = path
            try:
                ensure_dir(path, timeout=by.remaining(), ops=self.ops)
                where = parent
                self.ops.fsync_dir(parent)
            except OSError as e:
                if e.filename is not None:
                    raise
                raise with_path(e, where) from e

        await self.run(run)

    async def rename(self, src: str, dst: str) -> None:
        await self._run_on(dst, self.ops.rename, src, dst)

    async def remove(self, path: str) -> None:
        """Unlink the file ``path``."""
        await self._run_on(path, self.ops.unlink, path)

    async def listdir(self, path: str) -> list[str]:
        return await self._run_on(path, self.ops.listdir, path)

    async def remove_tree(self, path: str) -> bool:
        """:func:`remove_tree` on the I/O pool."""
        return await self._run_on(path, remove_tree, path, self.ops)

    async def write_bytes(self, path: str, data: bytes) -> WriteResult:
        """Create ``path`` exclusively with ``data``, fsync and close it.

        Up to :data:`CHUNK` bytes (a tree, a manifest, a marker) in one call on the I/O pool:
        each hop between the writer loop and a pool thread costs more than these calls on a
        busy machine, and the small files are written at the end of every save."""
        if len(data) > CHUNK:
            return await self.write_file(path, memoryview(data), len(data), direct=False)
        return await self._run_on(path, write_small, self.ops, path, data)

    async def write_file(
        self,
        path: str,
        buf: memoryview,
        size: int,
        *,
        direct: bool = True,
        staged: Staged | None = None,
        deadline: float | None = None,
    ) -> WriteResult:
        """Create ``path`` exclusively, write ``buf[:size]``, fsync, close; checksum as it goes.

        The file is preallocated (where the file system can) and written in :data:`CHUNK`
        pieces (:func:`_pieces`), :data:`INFLIGHT` at a time on the I/O threads. With ``staged``, each piece
        is written only once ``staged.wait_for`` says its bytes are in ``buf`` (the caller
        is still copying the rest), bounded by ``deadline`` (``time.monotonic()``), and the
        checksum waits until the whole of ``buf[:size]`` is staged (then runs on the compute
        thread beside the last pieces): the copy is what the caller waits for, the checksum
        is not, and on a busy machine they share the cores. Without ``staged`` (or once it
        is all staged) each piece is checksummed, in file order, right before it is written.
        With O_DIRECT, ``buf`` must be page-aligned and hold
        ``round_up(size)`` bytes; the padded tail is written and the file truncated to
        ``size``. Short writes are looped. Any error abandons the file (a failed fsync is
        never retried) and is raised with the path attached; the descriptor is closed only
        once no I/O thread can touch it any more.
        """
        use_direct = direct and self._direct and size >= ALIGN
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_NOFOLLOW
        until = deadline if deadline is not None else time.monotonic() + 3600.0
        t0 = time.perf_counter()
        f: OpenFile | None = None
        later: asyncio.Future[int] | None = None  # the checksum, once everything is staged
        try:
            try:
                fd = await self.run(self.ops.open, path, flags | (O_DIRECT if use_direct else 0), 0o644)
            except OSError as e:
                if not (use_direct and e.errno == errno.EINVAL) or self._direct_required:
                    raise
                use_direct = False
                fd = await self.run(self.ops.open, path, flags, 0o644)
            f = OpenFile(self.ops, fd)
            if size > CHUNK and not use_direct:
                # buffered: whole extents up front (fewer, larger allocations at writeback, and
                # ENOSPC before any write). Not under O_DIRECT: there every write allocates its
                # own extent, while preallocated (unwritten) extents must be converted at fsync,
                # which cost 0.3-1.3 s per GiB on ext4 here (benchmarks/README.md)
                try:
                    await self.run(self.ops.fallocate, fd, round_up(size) if use_direct else size)
                except OSError as e:
                    if e.errno not in _NO_FALLOCATE:
                        raise
            pieces = _pieces(size, use_direct)
            chain = CrcChain(len(pieces))
            if staged is not None and not staged.reached(size):
                later = asyncio.ensure_future(self._checksum_once_staged(buf, size, staged, until))
            first = 0
            if use_direct and pieces:
                # the first piece alone: a file system that took O_DIRECT at open may refuse the I/O
                try:
                    await until_staged(staged, pieces[0][1], until)
                    await self.run(write_piece, f, chain, staged, buf, 0, *pieces[0], use_direct, until, later is None)
                except OSError as e:
                    if e.errno != errno.EINVAL or self._direct_required:
                        raise
                    use_direct = False
                    self._direct = False
                    await self.run(self.ops.set_direct, fd, False)
                    chain = CrcChain(len(pieces))
                else:
                    first = 1
            await self._write_pieces(f, chain, staged, buf, pieces, first, use_direct, until, later is None)
            t1 = time.perf_counter()
            # the tail in one call on the pool: truncate the O_DIRECT padding, fsync, close
            closing, f = f, None
            t2 = await self.run(finish_file, closing, size if use_direct and size % ALIGN else None)
            if later is not None:
                crc = await later
            else:
                crc = chain.value(len(pieces) - 1) if pieces else 0
        except BaseException as e:
            if later is not None:
                later.cancel()
                await asyncio.gather(later, return_exceptions=True)
            if staged is not None:
                staged.abandon()
            if isinstance(e, OSError) and e.filename is None:
                raise with_path(e, path) from e
            raise
        finally:
            if f is not None:
                try:
                    await self.run(f.stop_and_close)
                except (OSError, RuntimeError):  # a pool already shut down: the process is ending
                    pass
        return WriteResult(size, crc, use_direct, t1 - t0, t2 - t1)

    async def _checksum_once_staged(self, buf: memoryview, size: int, staged: Staged, until: float) -> int:
        """The CRC-32C of ``buf[:size]`` once it is all staged, in :data:`CHUNK` calls on the
        compute thread."""
        await until_staged(staged, size, until)
        crc = 0
        for off in range(0, size, CHUNK):
            crc = await self.compute(crc32c, buf[off : min(off + CHUNK, size)], crc)
        return crc

    async def _piece(
        self,
        f: OpenFile,
        chain: CrcChain,
        staged: Staged | None,
        buf: memoryview,
        i: int,
        piece: tuple[int, int],
        direct: bool,
        until: float,
        checksum: bool,
    ) -> None:
        await until_staged(staged, piece[1], until)
        await self.run(write_piece, f, chain, staged, buf, i, *piece, direct, until, checksum)

    async def _write_pieces(
        self,
        f: OpenFile,
        chain: CrcChain,
        staged: Staged | None,
        buf: memoryview,
        pieces: list[tuple[int, int]],
        first: int,
        direct: bool,
        until: float,
        checksum: bool = True,
    ) -> None:
        """Pieces ``first:`` with up to :data:`INFLIGHT` in flight; the first error (in file
        order) is raised once every piece started has stopped."""
        window: list[asyncio.Future[None]] = []
        errors: list[BaseException] = []

        async def settle(fut: asyncio.Future[None]) -> None:
            try:
                await fut
            except BaseException as e:  # noqa: BLE001 - collected, the first one is raised
                errors.append(e)
                chain.fail()

        try:
            for i in range(first, len(pieces)):
                if errors:
                    break
                while len(window) >= INFLIGHT:
                    await settle(window.pop(0))
                window.append(
                    asyncio.ensure_future(self._piece(f, chain, staged, buf, i, pieces[i], direct, until, checksum))
                )
            while window:
                await settle(window.pop(0))
        finally:
            for pending in window:  # cancelled from outside: queued pieces never start
                pending.cancel()
        if errors:
            real = [e for e in errors if not isinstance(e, PieceAbandoned)]
            raise (real or errors)[0]


def _pieces(size: int, direct: bool) -> list[tuple[int, int]]:
    """The byte ranges a file of ``size`` bytes is written in: :data:`CHUNK` each, after a
    first piece of :data:`PROBE` bytes under O_DIRECT (both multiples of ALIGN)."""
    head = min(PROBE, size) if direct else 0
    out = [(0, head)] if head else []
    out += [(off, min(off + CHUNK, size)) for off in range(head, size, CHUNK)]
    return out
