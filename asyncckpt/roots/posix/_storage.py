"""The storage seam: every file-system call a save makes goes through here.

Two layers:

* :class:`OsOps` - the raw, blocking OS calls (open, pwrite, fsync, rename, mkdir, ...).
  It is the one place tests wrap to inject faults or record the operation log; nothing
  above it calls ``os`` directly on the save path.
* :class:`Storage` - async methods the writer awaits. Each runs its blocking work on the
  bounded I/O pool (via aiofiles' executor wrapper), so the event loop never blocks.

:func:`ensure_dir` is the race-tolerant directory primitive (see its docstring).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiofiles.os

from ...format._checksum import crc32c
from ...format._header import ALIGN, round_up

T = TypeVar("T")
log = logging.getLogger("asyncckpt")

#: Size of one write call: large enough that the GIL is held for microseconds per call.
CHUNK = 16 * 1024 * 1024
#: Shard writes in flight at once (each on its own I/O thread): the device always has the
#: next request queued while the previous one completes.
INFLIGHT = 2
_FALLOC_FL_KEEP_SIZE = 1
# "this file system cannot preallocate": the write goes on without it
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}

_DIRECT = getattr(os, "O_DIRECT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# errors a stat() may report transiently on network/FUSE file systems
_TRANSIENT_STAT = {errno.ESTALE, errno.EIO, errno.EINTR, errno.EAGAIN}


def _libc_fallocate() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):  # not glibc/musl Linux: no preallocation
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


class CpuMeter:
    """CPU seconds the I/O threads spent on one save's calls, each measured on the thread
    that ran it with its own clock (``CLOCK_THREAD_CPUTIME_ID``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def add(self, s: float) -> None:
        with self._lock:
            self.seconds += s


#: The meter of the save whose task is running (a context variable: each asyncio task of
#: the writer loop sees its own save's meter).
current_meter: contextvars.ContextVar[CpuMeter | None] = contextvars.ContextVar("asyncckpt_meter", default=None)


def thread_cpu() -> float:
    """This thread's CPU time in seconds."""
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)


class Staged(Protocol):
    """What the writer needs of a staging in progress (``_staging.StageProgress``)."""

    def wait_for(self, pos: int, deadline: float) -> None: ...

    def reached(self, pos: int) -> bool: ...

    def when_reached(self, pos: int, wake: Callable[[], None]) -> None: ...

    def abandon(self) -> None: ...


class StaleDirectoryError(FileExistsError):
    """mkdir said the directory exists, but it never became visible before the deadline."""


class OsOps:
    """The blocking OS calls of the save path. Subclass or wrap to inject faults."""

    def mkdir(self, path: str, mode: int = 0o777) -> None:
        os.mkdir(path, mode)

    def lstat(self, path: str) -> os.stat_result:
        return os.lstat(path)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def fallocate(self, fd: int, length: int) -> None:
        """Reserve ``length`` bytes of disk for ``fd`` without changing its size
        (``FALLOC_FL_KEEP_SIZE``: a file cut short by a crash never shows zeros). Raises
        ``OSError`` (``EOPNOTSUPP`` where the file system cannot, ``ENOSPC``, ...)."""
        if _fallocate is None:
            raise OSError(errno.ENOSYS, "fallocate is not available")
        if _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, length) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def set_direct(self, fd: int, on: bool) -> None:
        import fcntl

        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _DIRECT) if on else (flags & ~_DIRECT))

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    # fd-based calls of tree removal: never follow a link, never re-walk a path
    def open_dir(self, name: str, dir_fd: int | None = None) -> int:
        """Open directory ``name``; relative to ``dir_fd`` it never follows a final symlink
        (``ELOOP``/``ENOTDIR`` if it is not a directory any more). Without ``dir_fd`` the
        path is opened as given (the root may be a symlink on purpose)."""
        nofollow = _NOFOLLOW if dir_fd is not None else 0
        return os.open(name, os.O_RDONLY | _DIRECTORY | nofollow | _CLOEXEC, dir_fd=dir_fd)

    def close_dir(self, fd: int) -> None:
        os.close(fd)

    def lstat_at(self, dir_fd: int, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)

    def listdir_fd(self, fd: int) -> list[str]:
        return os.listdir(fd)

    def unlink_at(self, dir_fd: int, name: str) -> None:
        os.unlink(name, dir_fd=dir_fd)

    def rmdir_at(self, dir_fd: int, name: str) -> None:
        os.rmdir(name, dir_fd=dir_fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as e:
            # some FUSE/network file systems refuse fsync on directories; their own
            # semantics then apply and there is nothing more we can do
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        finally:
            os.close(fd)


DEFAULT_OPS = OsOps()


def _with_path(e: OSError, path: str) -> OSError:
    """The same error naming ``path`` (pwrite/fsync errors carry no file name)."""
    return OSError(e.errno, e.strerror or os.strerror(e.errno or 0), path)


#: mkdir ENOENT after the parent was made: how many times to retry before giving up.
_MISSING_PARENT_TRIES = 3


def ensure_dir(path: str | os.PathLike[str], *, timeout: float = 30.0, ops: OsOps = DEFAULT_OPS) -> None:
    """Make sure ``path`` (and its parents) exist as directories; safe to race, on any file system.

    The drop-in replacement for ``os.makedirs(path, exist_ok=True)`` where several ranks (or
    nodes) create the same directory. That call raises ``FileExistsError`` whenever ``mkdir``
    answers EEXIST and the ``isdir()`` check after it does not see a directory, which is what
    a multi-client file system (virtiofs, NFS, Lustre, BeeGFS, FUSE) does while this client's
    attribute or negative-dentry cache is stale: another node created the directory, the
    server says it exists, ``stat`` here still says ENOENT. The seed of asyncckpt was that
    error, ``FileExistsError: [Errno 17] File exists: '.../epoch_1_step_297/rng'``, killing one
    rank of a NeMo Automodel job at step 297/300 while the others hung.

    Promises:

    * EEXIST counts as success as soon as the path is seen to be a directory;
    * if mkdir says EEXIST but ``stat`` cannot see the entry yet, it re-checks (``stat``, and
      a ``listdir`` of the parent, which goes to the server) with bounded, jittered backoff
      until ``timeout`` seconds and then raises :class:`StaleDirectoryError` (a
      ``FileExistsError`` naming the path); it never retries the mkdir itself;
    * a real non-directory at the path (a file, a dangling symlink) raises
      ``NotADirectoryError`` at once, without retrying;
    * any other mkdir error (EACCES, EROFS, ENOSPC ...) is raised unless the directory is
      already there.

    ``timeout`` bounds the whole call (parents included); ``ops`` is the OS-call layer (tests
    wrap it to inject faults). Blocking: call it from a thread that may block.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    p = os.fspath(path)
    t_end = time.monotonic() + timeout
    missing_parent = 0
    while True:
        try:
            ops.mkdir(p, 0o777)
            return
        except FileNotFoundError as e:
            parent = os.path.dirname(p.rstrip("/")) or "."
            if parent == p or not parent:
                raise
            # the parent was made or seen as a directory, yet mkdir still says ENOENT (/proc,
            # or a parent removed under us): retry a bounded number of times, within the deadline
            missing_parent += 1
            if missing_parent > _MISSING_PARENT_TRIES or (missing_parent > 1 and time.monotonic() >= t_end):
                raise FileNotFoundError(
                    errno.ENOENT,
                    f"cannot create the directory: mkdir keeps failing with ENOENT although its parent "
                    f"{parent!r} exists (a file system that refuses new directories here?)",
                    p,
                ) from e
            ensure_dir(parent, timeout=max(0.0, t_end - time.monotonic()), ops=ops)
            if missing_parent > 1:
                time.sleep(min(0.01 * missing_parent, max(0.0, t_end - time.monotonic())))
            continue  # the parent exists now: create the leaf
        except FileExistsError as e:
            _wait_until_directory(p, e, t_end, timeout, ops)
            return
        except OSError:
            # EACCES/EROFS may hide an existing directory (CPython's reason for isdir())
            try:
                if stat.S_ISDIR(ops.stat(p).st_mode):
                    return
            except OSError:
                pass
            raise


def _wait_until_directory(p: str, first: OSError, t_end: float, deadline_s: float, ops: OsOps) -> None:
    """After EEXIST: return once ``p`` is seen as a directory; re-stat, never re-mkdir."""
    delay = 0.005
    while True:
        try:
            st = ops.lstat(p)
        except FileNotFoundError:
            pass  # EEXIST from the server, not visible to us yet: a stale view
        except OSError as se:
            if se.errno not in _TRANSIENT_STAT:
                raise
        else:
            if stat.S_ISDIR(st.st_mode):
                return
            if stat.S_ISLNK(st.st_mode):
                try:
                    if stat.S_ISDIR(ops.stat(p).st_mode):
                        return
                except OSError:
                    pass
                raise NotADirectoryError(errno.ENOTDIR, "exists as a symlink that is not a directory", p) from first
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", p) from first
        if time.monotonic() >= t_end:
            raise StaleDirectoryError(
                errno.EEXIST,
                f"mkdir reported EEXIST but the directory did not become visible within "
                f"{deadline_s:.1f}s (stale attribute cache on a network/FUSE file system?)",
                p,
            ) from first
        try:
            # readdir goes to the server on FUSE/NFS and can refresh a stale view sooner
            ops.listdir(os.path.dirname(p) or ".")
        except OSError:
            pass
        time.sleep(min(delay * (1 + random.random()), max(0.0, t_end - time.monotonic())))
        delay = min(delay * 2, 0.5)


@dataclass
class WriteResult:
    """What writing one file produced."""

    size: int
    crc32c: int
    direct: bool
    write_s: float
    fsync_s: float


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
        self._direct = direct_io != "off" and bool(_DIRECT)
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
            raise _with_path(e, path) from e

    async def ensure_dir(self, path: str, deadline_s: float) -> None:
        await self._run_on(path, lambda: ensure_dir(path, timeout=deadline_s, ops=self.ops))

    async def fsync_dir(self, path: str) -> None:
        await self._run_on(path, self.ops.fsync_dir, path)

    async def ensure_dir_durable(self, path: str, parent: str, deadline_s: float) -> None:
        """:meth:`ensure_dir` then :meth:`fsync_dir` of ``parent``, in one call on the I/O pool."""

        def run() -> None:
            where = path
            try:
                ensure_dir(path, timeout=deadline_s, ops=self.ops)
                where = parent
                self.ops.fsync_dir(parent)
            except OSError as e:
                if e.filename is not None:
                    raise
                raise _with_path(e, where) from e

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
        return await self._run_on(path, _write_small, self.ops, path, data)

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
        pieces, :data:`INFLIGHT` at a time on the I/O threads. With ``staged``, each piece
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
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC | _NOFOLLOW
        until = deadline if deadline is not None else time.monotonic() + 3600.0
        t0 = time.perf_counter()
        f: _OpenFile | None = None
        later: asyncio.Future[int] | None = None  # the checksum, once everything is staged
        try:
            try:
                fd = await self.run(self.ops.open, path, flags | (_DIRECT if use_direct else 0), 0o644)
            except OSError as e:
                if not (use_direct and e.errno == errno.EINVAL) or self._direct_required:
                    raise
                use_direct = False
                fd = await self.run(self.ops.open, path, flags, 0o644)
            f = _OpenFile(self.ops, fd)
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
            pieces = [(off, min(off + CHUNK, size)) for off in range(0, size, CHUNK)]
            chain = _CrcChain(len(pieces))
            if staged is not None and not staged.reached(size):
                later = asyncio.ensure_future(self._checksum_once_staged(buf, size, staged, until))
            first = 0
            if use_direct and pieces:
                # the first piece alone: a file system that took O_DIRECT at open may refuse the I/O
                try:
                    await until_staged(staged, pieces[0][1], until)
                    await self.run(
                        _write_piece, f, chain, staged, buf, 0, *pieces[0], use_direct, until, later is None
                    )
                except OSError as e:
                    if e.errno != errno.EINVAL or self._direct_required:
                        raise
                    use_direct = False
                    self._direct = False
                    await self.run(self.ops.set_direct, fd, False)
                    chain = _CrcChain(len(pieces))
                else:
                    first = 1
            await self._write_pieces(f, chain, staged, buf, pieces, first, use_direct, until, later is None)
            t1 = time.perf_counter()
            # the tail in one call on the pool: truncate the O_DIRECT padding, fsync, close
            closing, f = f, None
            t2 = await self.run(_finish, closing, size if use_direct and size % ALIGN else None)
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
                raise _with_path(e, path) from e
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
        f: _OpenFile,
        chain: _CrcChain,
        staged: Staged | None,
        buf: memoryview,
        i: int,
        piece: tuple[int, int],
        direct: bool,
        until: float,
        checksum: bool,
    ) -> None:
        await until_staged(staged, piece[1], until)
        await self.run(_write_piece, f, chain, staged, buf, i, *piece, direct, until, checksum)

    async def _write_pieces(
        self,
        f: _OpenFile,
        chain: _CrcChain,
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
            real = [e for e in errors if not isinstance(e, _Broken)]
            raise (real or errors)[0]


def _finish(f: _OpenFile, truncate: int | None) -> float:
    """The end of a written file: cut it to ``truncate`` bytes (if given), fsync, close. Returns
    when the fsync ended (``perf_counter``). Any error closes the descriptor (quietly) and is raised."""
    try:
        if truncate is not None:
            f.ops.ftruncate(f.fd, truncate)
        f.ops.fsync(f.fd)
    except BaseException:
        f.stop_and_close()
        raise
    t = time.perf_counter()
    f.close()
    return t


def _write_small(ops: OsOps, path: str, data: bytes) -> WriteResult:
    """:meth:`Storage.write_bytes` of up to :data:`CHUNK` bytes, blocking: create ``path``
    exclusively, write (short writes looped), fsync, close; any error closes the descriptor
    and is raised (a failed fsync is never retried)."""
    t0 = time.perf_counter()
    fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC | _NOFOLLOW, 0o644)
    try:
        view, pos = memoryview(data), 0
        while pos < len(view):
            n = ops.pwrite(fd, view[pos:], pos)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            pos += n
        t1 = time.perf_counter()
        ops.fsync(fd)
        t2 = time.perf_counter()
    except BaseException:
        try:
            ops.close(fd)
        except OSError:
            pass
        raise
    ops.close(fd)
    return WriteResult(len(data), crc32c(data), False, t1 - t0, t2 - t1)


def metered(fn: Callable[..., T], meter: CpuMeter) -> Callable[..., T]:
    def run(*args: Any) -> T:
        c0 = thread_cpu()
        try:
            return fn(*args)
        finally:
            meter.add(thread_cpu() - c0)

    return run


class _Broken(Exception):
    """A piece gave up because an earlier one failed (never the error reported)."""


class _OpenFile:
    """A descriptor shared by the I/O threads writing pieces of it. It is closed by whoever
    is last: after a failure or cancellation no thread may write to a descriptor number the
    process has reused for another file."""

    def __init__(self, ops: OsOps, fd: int) -> None:
        self.ops, self.fd = ops, fd
        self._lock = threading.Lock()
        self._users = 0
        self._stopped = False
        self._closed = False

    def enter(self) -> None:
        with self._lock:
            if self._stopped:
                raise _Broken("the file was abandoned")
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._stopped and self._users == 0 and not self._closed
            if last:
                self._closed = True
        if last:
            self._quiet_close()

    def close(self) -> None:
        """Close after a successful write (no piece in flight); errors are raised."""
        with self._lock:
            self._stopped = True
            self._closed = True
        self.ops.close(self.fd)

    def stop_and_close(self) -> None:
        """Failure path: no new piece starts; closed now, or by the last piece in flight."""
        with self._lock:
            self._stopped = True
            now = self._users == 0 and not self._closed
            if now:
                self._closed = True
        if now:
            self._quiet_close()

    def _quiet_close(self) -> None:
        try:
            self.ops.close(self.fd)
        except OSError:
            pass


class _CrcChain:
    """The CRC-32C of a file written piece by piece on several threads, computed in file
    order: piece ``i`` continues from piece ``i - 1``'s value (a cache-hot pass per piece)."""

    def __init__(self, n: int) -> None:
        self._cond = threading.Condition()
        self._values: list[int | None] = [None] * n
        self._failed = False

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def extend(self, i: int, data: Any, until: float) -> None:
        with self._cond:
            while i > 0 and self._values[i - 1] is None:
                if self._failed:
                    raise _Broken("an earlier piece failed")
                left = until - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the previous piece was not checksummed before the save's deadline")
                self._cond.wait(left)
            prev = self._values[i - 1] if i > 0 else 0
        value = crc32c(data, prev or 0)  # outside the lock: releases the GIL
        with self._cond:
            self._values[i] = value
            self._cond.notify_all()

    def value(self, i: int) -> int:
        v = self._values[i]
        assert v is not None
        return v


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


def _write_piece(
    f: _OpenFile,
    chain: _CrcChain,
    staged: Staged | None,
    buf: memoryview,
    i: int,
    off: int,
    end: int,
    direct: bool,
    until: float,
    checksum: bool = True,
) -> None:
    """Wait until ``buf[off:end]`` is staged, checksum it in file order (with ``checksum``),
    write it at ``off`` (padded to ALIGN under O_DIRECT)."""
    try:
        if staged is not None:
            staged.wait_for(end, until)
        if checksum:
            chain.extend(i, buf[off:end], until)
    except BaseException:
        chain.fail()
        raise
    stop = round_up(end) if direct else end
    pos = off
    f.enter()
    try:
        while pos < stop:
            n = f.ops.pwrite(f.fd, buf[pos:stop], pos)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            if direct and n % ALIGN and pos + n < stop:
                raise OSError(errno.EIO, "unaligned short write under O_DIRECT")
            pos += n
    finally:
        f.leave()


def remove_tree(path: str, ops: OsOps = DEFAULT_OPS) -> bool:
    """Remove the tree at ``path`` without ever leaving it; ``False`` if ``path`` was absent.

    Works by directory handle: the parent of ``path`` is opened once, and every directory
    below is opened relative to its parent's descriptor with ``O_NOFOLLOW``, listed by
    descriptor and emptied with ``unlinkat``/``unlinkat(AT_REMOVEDIR)``. A symlink is
    removed as a link, never followed, so a directory swapped for a link to somewhere else
    (a race, or a hostile process) can make this fail but never delete outside ``path``.
    An entry that vanishes under the removal (another remover) is logged as a warning
    naming it; other errors raise.
    """
    parent, name = os.path.split(os.path.normpath(path))
    if not name or name in (".", ".."):
        raise ValueError(f"refusing to remove {path!r}")
    try:
        pfd = ops.open_dir(parent or ".")
    except FileNotFoundError:
        return False
    try:
        return _remove_at(pfd, name, path, ops, top=True)
    finally:
        ops.close_dir(pfd)


#: how often one entry may turn from directory to non-directory and back under us
_MAX_FLIPS = 100


def _remove_at(dir_fd: int, name: str, shown: str, ops: OsOps, top: bool = False) -> bool:
    """Remove entry ``name`` of the directory open as ``dir_fd`` (``shown``: its path, for messages)."""
    try:
        return _remove_entry(dir_fd, name, shown, ops, top)
    except OSError as e:
        # the *at() calls name only the entry: the deepest frame gives it its full path
        if not getattr(e, "_asyncckpt_named", False):
            e.filename = shown
            e._asyncckpt_named = True  # type: ignore[attr-defined]
        raise


def _remove_entry(dir_fd: int, name: str, shown: str, ops: OsOps, top: bool) -> bool:
    for _ in range(_MAX_FLIPS):
        try:
            st = ops.lstat_at(dir_fd, name)
        except FileNotFoundError:
            if not top:
                _vanished(shown)
            return False
        if not stat.S_ISDIR(st.st_mode):
            try:
                ops.unlink_at(dir_fd, name)  # a file, or a symlink itself (never its target)
                return True
            except FileNotFoundError:
                _vanished(shown)
                return False
            except IsADirectoryError:
                continue  # became a directory since the lstat: look again
        try:
            fd = ops.open_dir(name, dir_fd)
        except FileNotFoundError:
            _vanished(shown)
            return False
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                continue  # swapped for a link or a file since the lstat: look again
            raise
        try:
            for child in ops.listdir_fd(fd):
                _remove_at(fd, child, os.path.join(shown, child), ops)
        finally:
            ops.close_dir(fd)
        try:
            ops.rmdir_at(dir_fd, name)
            return True
        except FileNotFoundError:
            _vanished(shown)
            return False
        except NotADirectoryError:
            continue  # the emptied directory was moved away and replaced: remove what is there now
    raise OSError(errno.EAGAIN, "entry keeps changing between directory and non-directory while removed", shown)


def _vanished(path: str) -> None:
    log.warning("asyncckpt: %s vanished while it was being removed (another process removing it?)", path)
