"""Local file I/O for transfers that a disk or file-system fault cannot turn into a signal.

A file mapped into memory (``mmap``) reports a failed read (EIO from the disk or a FUSE
server) or a write into space the file system does not have (a sparse file on a full disk)
as SIGBUS at the instruction that touched the page: the process dies, nothing can catch it.
So nothing inside asyncckpt maps a file (anonymous memory, as staging uses, cannot fault this
way); every transfer reads with ``pread`` into buffers it owns and writes with ``pwrite``,
and a failure is an ``OSError`` naming the file, raised where the call was made. The one
exception is the user's own choice, ``load(..., mmap=True)`` (see the README).

:func:`reserve` allocates a new file's whole size before the first byte is written
(``fallocate``), so a full disk is ENOSPC at once rather than after minutes of download.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Callable

from ..._errors import CheckpointCorruptError
from ...format._checksum import crc32c

#: errnos that mean "this file system cannot preallocate" (then the file is only extended).
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})


def _libc_fallocate() -> Callable[[int, int, int, int], int] | None:
    """``fallocate(2)`` from the C library (Linux), or ``None``. Not ``os.posix_fallocate``:
    where the file system lacks ``fallocate`` glibc emulates it by writing one byte per block,
    millions of small writes for a large file on FUSE or NFS."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _libc_fallocate()


def reserve(fd: int, size: int, path: str) -> bool:
    """Make the new, empty file ``fd`` (at ``path``) ``size`` bytes long with its blocks
    allocated, so a disk without room fails here: ``OSError`` (ENOSPC, EDQUOT, EFBIG) naming
    ``path``, before anything was downloaded or written. Where the file system cannot
    preallocate (some FUSE servers, NFS before 4.2, systems other than Linux) the file is only
    extended and a full disk shows at the first ``pwrite`` that needs a block instead (as
    an ``OSError``, never a signal). Returns whether the space is reserved."""
    if size <= 0:
        return True
    if _FALLOCATE is not None:
        while True:
            if _FALLOCATE(fd, 0, 0, size) == 0:
                return True
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in _UNSUPPORTED:
                break
            raise OSError(err, f"{os.strerror(err)} (reserving {size} bytes)", path)
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    return False


def read_exact(fd: int, view: memoryview, offset: int, path: str, what: str = "reading") -> None:
    """Fill ``view`` from ``fd`` at ``offset``. An I/O error is an ``OSError`` naming ``path``
    (its errno kept: EIO is a fault of the disk, not of the checkpoint); a file that ends
    before ``view`` is full is ``CheckpointCorruptError`` (its size was checked on opening,
    so something truncated it)."""
    got = 0
    n = view.nbytes
    while got < n:
        try:
            k = os.preadv(fd, [view[got:]], offset + got)  # EINTR is retried by Python (PEP 475)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} ({what} at byte {offset + got})", path) from None
        if k <= 0:
            raise CheckpointCorruptError(f"file ended at byte {offset + got}, {n - got} bytes early", path)
        got += k


def write_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Write all of ``view`` to ``fd`` at ``offset`` (short writes continued); an error is
    an ``OSError`` naming ``path``."""
    done = 0
    n = view.nbytes
    while done < n:
        try:
            k = os.pwrite(fd, view[done:], offset + done)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (writing at byte {offset + done})", path) from None
        if k <= 0:  # cannot happen for a regular file; never loop forever on it
            raise OSError(errno.EIO, f"write returned {k} at byte {offset + done}", path)
        done += k


#: Bytes one :func:`copy_in` holds at a time (its one buffer).
COPY_WINDOW = 16 << 20
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def copy_in(path: str, size: int, read: Callable[[int, memoryview], None], window: int = COPY_WINDOW) -> int:
    """Write the ``size`` bytes that ``read(offset, buffer)`` fills as the file ``path``
    (created, or emptied if it exists), one ``window`` at a time through one buffer: its space
    reserved first (:func:`reserve`: a full disk fails before ``read`` is first called), each
    window ``pwrite``n, the file fsynced before this returns. Returns the CRC-32C of the bytes
    written. An exception of ``read`` is raised as it is; a file-system error is an
    ``OSError`` naming ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o644)
    try:
        reserve(fd, size, path)
        buf = memoryview(bytearray(min(max(1, window), size) if size else 0))
        crc, offset = 0, 0
        while offset < size:
            view = buf[: min(buf.nbytes, size - offset)]
            read(offset, view)
            crc = crc32c(view, crc)
            write_all(fd, view, offset, path)
            offset += view.nbytes
        try:
            os.fsync(fd)
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror} (fsync)", path) from None
        return crc
    finally:
        os.close(fd)
