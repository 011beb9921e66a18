"""Read faults: what a failed read of a checkpoint means, and what a load does about it.

A read fails in one of three ways, told apart here once for every reader (a local load, a
collective load's verdict, a load from an object store, ``asyncckpt verify``):

* **corrupt** (``CheckpointCorruptError``): what is there is not what was committed: a
  checksum mismatch, a malformed header or structure, a listed file missing, not a regular
  file or a symlink. A proven content fault: the step is marked bad, ``load()`` may fall back.
* **io** (``CheckpointReadError``): the storage could not serve the bytes: EIO, ETIMEDOUT,
  EAGAIN, ENOSPC or EROFS from a FUSE mount, a permission refused, a store that answered 503
  or nothing within the deadline. The step may be fine: the read is retried (:func:`retrying`,
  within the load's deadline), then the error is raised naming the file. Never a mark, never
  a fallback.
* **gone** (``CheckpointNotFoundError``): the step was retired or replaced while it was read:
  look again (``load(step=None)``) or "not found" (an explicit step).

An ``OSError`` raised by the OS while a checkpoint is read becomes one of the first two by
its errno (:func:`read_error`): the errnos of :data:`CONTENT_ERRNOS` describe the file, every
other one the storage. Torch-free.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from .._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ObjectIntegrityError,
    ObjectStoreError,
)

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

Fault = Literal["corrupt", "io", "gone"]

#: errnos that describe the file rather than the storage: not there (after the step was
#: found complete), a symlink (``O_NOFOLLOW``), a directory or not a directory.
CONTENT_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR})

#: I/O faults worth another try: a disk, network file system or FUSE server that may answer
#: the next time. A refused permission or a bad request stays as it is: raised at once.
RETRY_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO", "ETIMEDOUT", "EAGAIN", "EINTR", "ENOSPC", "EROFS", "EDQUOT", "ESTALE", "EBUSY", "ENOMEM",
        "ENOBUFS", "ENOTCONN", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EHOSTDOWN", "EHOSTUNREACH",
        "ENETDOWN", "ENETUNREACH", "ENETRESET", "EREMOTEIO", "ENOLINK", "ECOMM", "EPROTO",
    )
    if hasattr(errno, name)
)  # fmt: skip

#: Tries of one read (the first included) and the pause before the second; it doubles after
#: each try (0.25 + 0.5 + 1 s: a persistent fault is reported within about 2 s of sleeping).
READ_TRIES = 4
BACKOFF_S = 0.25


def regular_file(fd: int, size: int, path: str) -> int:
    """``fd`` when it is a regular file of exactly ``size`` bytes; otherwise it is closed and
    ``CheckpointCorruptError`` names ``path`` (a symlink target, FIFO or file of another size
    is damage, not a read fault)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise CheckpointCorruptError(f"not a regular file of {size} bytes", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_error(e: OSError, doing: str, path: str | None) -> CheckpointError:
    """The error raised when ``doing`` (``"cannot read shard"``) failed on ``path`` with ``e``.

    ``e`` itself when it is already one of ours (an object store's error keeps its type);
    ``CheckpointCorruptError`` when the errno describes the file (:data:`CONTENT_ERRNOS`);
    else ``CheckpointReadError`` (an I/O fault, not damage). Both name ``path``.
    """
    if isinstance(e, CheckpointError):
        return e
    msg = f"{doing} ({e.strerror or type(e).__name__})"
    if e.errno in CONTENT_ERRNOS:
        return CheckpointCorruptError(msg, path)
    return CheckpointReadError(e.errno, msg, path if path is not None else e.filename)


def store_fault(e: ObjectStoreError) -> CheckpointError:
    """What a store's error met while reading a step means: an object that is not what the
    manifest says is damage (``CheckpointCorruptError``), any other failure an I/O fault
    (``CheckpointReadError``, same errno and URL). A missing object is not passed here: it
    means the step was retired."""
    where = None if e.filename is None else str(e.filename)
    if isinstance(e, ObjectIntegrityError):
        return CheckpointCorruptError(str(e.strerror), where)
    return CheckpointReadError(e.errno, str(e.strerror), where)


def fault_of(exc: BaseException) -> Fault | None:
    """Which kind of read fault ``exc`` is (see the module docstring), ``None`` if none.

    An ``OSError`` that is none of ours (it escaped :func:`read_error`) counts as an I/O
    fault, never as damage.
    """
    if isinstance(exc, CheckpointReadError):
        return "io"
    if isinstance(exc, CheckpointCorruptError):
        return "corrupt"
    if isinstance(exc, (CheckpointNotFoundError, FileNotFoundError)):
        return "gone"
    if isinstance(exc, OSError):
        return "io"
    return None


def retryable(e: CheckpointReadError) -> bool:
    """Whether another try may succeed (:data:`RETRY_ERRNOS`)."""
    return e.errno in RETRY_ERRNOS


def retrying(fn: Callable[[], T], deadline: float | None = None, tries: int = READ_TRIES) -> T:
    """``fn()``, tried again after a ``CheckpointReadError`` that may pass (:func:`retryable`):
    at most ``tries`` times, pausing :data:`BACKOFF_S` (doubling) in between, and never
    pausing past ``deadline`` (``time.monotonic()`` seconds; ``None``: the tries bound it).

    The last error is raised with the tries it took in its message. ``fn`` must be safe to
    call again (a load re-reads the step from the start).
    """
    t0 = time.monotonic()
    n = 0
    while True:
        n += 1
        try:
            return fn()
        except CheckpointReadError as e:
            pause = BACKOFF_S * 2 ** (n - 1)
            late = deadline is not None and time.monotonic() + pause > deadline
            if n >= tries or late or not retryable(e):
                raise given_up(e, n, time.monotonic() - t0).with_traceback(e.__traceback__) from e.__cause__
            log.warning("asyncckpt: %s; trying again in %.2fs (try %d of %d)", e, pause, n + 1, tries)
            time.sleep(pause)


def given_up(e: CheckpointReadError, tries: int, seconds: float) -> CheckpointReadError:
    """``e`` with the tries it took in its message (a fresh error of the same type)."""
    tail = f"after {tries} tr{'y' if tries == 1 else 'ies'} in {seconds:.1f}s"
    return CheckpointReadError(e.errno, f"{e.strerror}, {tail}", e.filename)
