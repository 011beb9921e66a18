"""The race-tolerant directory primitive, :func:`ensure_dir`: ``os.makedirs(exist_ok=True)``
that survives several ranks or nodes creating the same directory on a multi-client file system
whose view is stale (EEXIST that ``stat`` cannot see yet)."""

from __future__ import annotations

import errno
import os
import random
import stat
import time

from ._osops import DEFAULT_OPS, OsOps

# errors a stat() may report transiently on network/FUSE file systems
_TRANSIENT_STAT = {errno.ESTALE, errno.EIO, errno.EINTR, errno.EAGAIN}


class StaleDirectoryError(FileExistsError):
    """mkdir said the directory exists, but it never became visible before the deadline."""


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


def _wait_until_directory(p: str, first: OSError, t_end: float, timeout: float, ops: OsOps) -> None:
    """After EEXIST: return once ``p`` is seen as a directory, by ``t_end`` (a
    ``time.monotonic()`` point; ``timeout``, the call's duration, is for the message); re-stat,
    never re-mkdir."""
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
                f"{timeout:.1f}s (stale attribute cache on a network/FUSE file system?)",
                p,
            ) from first
        try:
            # readdir goes to the server on FUSE/NFS and can refresh a stale view sooner
            ops.listdir(os.path.dirname(p) or ".")
        except OSError:
            pass
        time.sleep(min(delay * (1 + random.random()), max(0.0, t_end - time.monotonic())))
        delay = min(delay * 2, 0.5)
