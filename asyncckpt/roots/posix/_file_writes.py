"""The blocking side of writing one file, on the I/O threads: a descriptor shared by the
threads writing its pieces, the CRC-32C chained in file order, one piece's write (padded
under O_DIRECT), the durable tail (truncate, fsync, close), and a small file in one call."""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any

from ...format._checksum import crc32c
from ...format._header import ALIGN, round_up
from .._filewrite import Staged, WriteResult
from ._osops import O_CLOEXEC, O_NOFOLLOW, OsOps

#: Size of one write call: large enough that the GIL is held for microseconds per call.
CHUNK = 16 * 1024 * 1024


class PieceAbandoned(Exception):
    """A piece gave up because an earlier one failed (never the error reported)."""


class OpenFile:
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
                raise PieceAbandoned("the file was abandoned")
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


class CrcChain:
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
                    raise PieceAbandoned("an earlier piece failed")
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


def write_piece(
    f: OpenFile,
    chain: CrcChain,
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


def finish_file(f: OpenFile, truncate: int | None) -> float:
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


def write_small(ops: OsOps, path: str, data: bytes) -> WriteResult:
    """:meth:`Storage.write_bytes` of up to :data:`CHUNK` bytes, blocking: create ``path``
    exclusively, write (short writes looped), fsync, close; any error closes the descriptor
    and is raised (a failed fsync is never retried)."""
    t0 = time.perf_counter()
    fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0o644)
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
