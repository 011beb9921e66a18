"""Removing a directory tree without ever leaving it (:func:`remove_tree`): by directory
handle, never following a link, tolerant of another remover."""

from __future__ import annotations

import errno
import logging
import os
import stat

from ._osops import DEFAULT_OPS, OsOps

log = logging.getLogger("asyncckpt")



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
