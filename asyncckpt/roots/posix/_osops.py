"""The raw, blocking OS calls of the save path (:class:`OsOps`): the one place tests wrap to
inject faults or record the operation log; nothing above it calls ``os`` directly on the save
path. Also the platform's open flags and ``fallocate`` (found in libc once)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Any

_FALLOC_FL_KEEP_SIZE = 1

#: os's open flags; 0 where this platform lacks one.
O_DIRECT = getattr(os, "O_DIRECT", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


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
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | O_DIRECT) if on else (flags & ~O_DIRECT))

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
        nofollow = O_NOFOLLOW if dir_fd is not None else 0
        return os.open(name, os.O_RDONLY | O_DIRECTORY | nofollow | O_CLOEXEC, dir_fd=dir_fd)

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
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC)
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


def with_path(e: OSError, path: str) -> OSError:
    """The same error naming ``path`` (pwrite/fsync errors carry no file name)."""
    return OSError(e.errno, e.strerror or os.strerror(e.errno or 0), path)
