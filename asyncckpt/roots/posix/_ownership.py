"""Ownership of a root: one writing job at a time.

The writing Checkpointer (rank 0 of its group) takes ownership at construction, before any
clean-up: an exclusive, non-blocking ``flock`` on ``ROOT/.asyncckpt/owner.lock``, which the
kernel releases when the process dies (no stale lock after SIGKILL), plus an owner record
``ROOT/.asyncckpt/owner.json`` (host, pid, process start time, global ranks, time taken)
that names the owner in the error a second writer gets. ``flock`` locks conflict between
two descriptors of one process too, so a second Checkpointer in the same process is refused
like another job. Readers never touch any of this.

Limits: where the file system refuses locks (ENOLCK, EOPNOTSUPP, ENOSYS: some NFS set-ups,
FUSE file systems) a ``RuntimeWarning`` says so and the root is written unprotected; on NFS
``flock`` is emulated with POSIX locks by the client (it then works across clients only
with a lock manager).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

from ..._errors import RootInUseError, RootNotWritableError
from ...format._layout import META_DIR

LOCK = "owner.lock"
RECORD = "owner.json"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

# descriptors of the locks this process holds: closed in a fork child, which must not own
_held: set[int] = set()
_held_lock = threading.Lock()


def _close_in_child() -> None:
    # the child's copies of the descriptors keep the lock alive after the parent dies;
    # closing them there leaves the parent's lock intact (it is per open file description)
    global _held_lock
    for fd in list(_held):
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()
    _held_lock = threading.Lock()  # the forking thread held it (see below): a fresh one


if hasattr(os, "register_at_fork"):
    # a fork waits while a descriptor is between its open/flock and its registration in
    # _held, so no child ever inherits a lock it does not know to drop
    os.register_at_fork(
        before=lambda: _held_lock.acquire(),
        after_in_parent=lambda: _held_lock.release(),
        after_in_child=_close_in_child,
    )


def process_start_time(pid: int | str = "self") -> float | None:
    """A process's start time (epoch seconds), from /proc; ``None`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _iso(t: Any) -> str:
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return "?"
    try:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "?"


def describe_owner(record: Any) -> str:
    """The owner record as text for an error message (tolerates a missing or odd record)."""
    if not isinstance(record, dict):
        return "owner record not written yet or unreadable"
    ranks = record.get("ranks")
    role = record.get("role", "Checkpointer")
    return (
        f"{role if isinstance(role, str) else '?'!s} on host {record.get('host', '?')!s}, "
        f"pid {record.get('pid', '?')!s} "
        f"(started {_iso(record.get('start_time'))}), global ranks {ranks if isinstance(ranks, list) else '?'}, "
        f"owner since {_iso(record.get('since'))}"
    )


def read_owner(root: str) -> Any:
    """The owner record under ``root`` (``None`` if absent or unreadable)."""
    try:
        fd = os.open(os.path.join(root, META_DIR, RECORD), os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # a hostile record must not hide the refusal
        return None


#: how long a refused writer waits for the lock holder's owner record (written just after
#: its flock) before it describes what it found
RECORD_WAIT_S = 1.0


def _current(record: Any) -> bool:
    """Whether ``record`` can be the lock holder's: from another host (cannot be checked), or
    a live process here whose start time matches (a SIGKILLed owner leaves its record)."""
    if not isinstance(record, dict):
        return False
    if record.get("host") != socket.gethostname():
        return True
    pid, started = record.get("pid"), record.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    now = process_start_time(pid)
    if now is None:
        return False  # no such process: the record is stale
    return not isinstance(started, (int, float)) or abs(now - started) < 1.0


def _lock_holder(path: str) -> int | None:
    """The pid holding a flock on ``path``, from /proc/locks (local file systems); else None."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF" (a "->" marks a blocked waiter)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[2] != "->" and parts[5] == dev:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


def _describe_holder(root: str, lock_path: str) -> str:
    """Who holds the lock: the owner record once it is current (waiting up to
    ``RECORD_WAIT_S`` for the new owner to write it), else what the kernel says."""
    deadline = time.monotonic() + RECORD_WAIT_S
    record = read_owner(root)
    while not _current(record) and time.monotonic() < deadline:
        time.sleep(0.01)
        record = read_owner(root)
    if _current(record):
        return describe_owner(record)
    holder = _lock_holder(lock_path)
    held = f"the lock is held by pid {holder} on this host" if holder is not None else "the lock holder is unknown"
    return f"{held}; its owner record is not written yet or is stale"


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def not_writable(root: str, e: OSError) -> RootNotWritableError:
    why = e.strerror or (os.strerror(e.errno) if e.errno else str(e))
    return RootNotWritableError(
        e.errno or errno.EACCES,
        f"asyncckpt: cannot write to checkpoint root {root} ({why}); a Checkpointer needs a "
        "writable root - to only read checkpoints use asyncckpt.load() / asyncckpt.find_latest()",
        getattr(e, "filename", None) or root,
    )


class Ownership:
    """A held ownership of one root; :meth:`release` (idempotent) gives it up."""

    def __init__(self, root: str, fd: int | None) -> None:
        self.root = root
        self._fd = fd
        self._lock = threading.Lock()

    @property
    def locked(self) -> bool:
        """Whether an OS lock protects the root (False where the file system refused locks)."""
        return self._fd is not None

    def release(self) -> None:
        """Remove the owner record and drop the lock (a no-op the second time)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(os.path.join(self.root, META_DIR, RECORD))  # before the unlock: never a stale record
        except OSError:
            pass
        with _held_lock:
            _held.discard(fd)
        try:
            os.close(fd)  # closing the last descriptor releases the flock
        except OSError:
            pass


def acquire(
    root: str, ranks: Sequence[int], role: str = "Checkpointer", into: Ownership | None = None
) -> Ownership:
    """Take ownership of ``root`` (an existing directory) for the group of ``ranks``.

    ``role`` names the writer in the owner record (a Checkpointer, ``asyncckpt gc``).
    ``into``: an unlocked :class:`Ownership` the caller made beforehand, filled in here, so
    that whatever interrupts this call, the caller holds what to release.

    Raises ``RootInUseError`` naming the owner if another writer holds it, and
    ``RootNotWritableError`` if the root cannot be written. Where the file system refuses
    locks, warns (``RuntimeWarning``) and returns an unlocked ownership.
    """
    if not os.access(root, os.W_OK | os.X_OK):
        err = errno.EROFS if _read_only(root) else errno.EACCES
        raise not_writable(root, OSError(err, os.strerror(err), root))
    meta = os.path.join(root, META_DIR)
    try:
        os.mkdir(meta, 0o755)
    except FileExistsError:
        pass
    except OSError as e:
        raise not_writable(root, e) from e
    try:
        st = os.lstat(meta)
    except OSError as e:
        raise not_writable(root, e) from e
    if not stat.S_ISDIR(st.st_mode):  # a link or file there would put the lock elsewhere
        raise not_writable(root, OSError(errno.ENOTDIR, f"{META_DIR} is not a directory (a link?)", meta))
    lock_path = os.path.join(meta, LOCK)
    own = into if into is not None else Ownership(root, None)
    try:
        with _held_lock:  # also keeps a fork out until the descriptor is registered
            if not _lock(root, lock_path, own):
                return own  # the file system refuses locks (warned)
    except _Busy:
        # described outside the lock: the description may wait for the owner's record
        raise RootInUseError(
            f"asyncckpt: checkpoint root {root} is already owned by another writer "
            f"({_describe_holder(root, lock_path)}); one root has one writing job at a time: close "
            "that Checkpointer, or give this job its own root (reading - asyncckpt.load(), "
            "find_latest(), the CLI - needs no ownership)"
        ) from None
    record = {
        "role": role,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_time": process_start_time(),
        "ranks": list(ranks),
        "since": time.time(),
    }
    try:
        _write_record(meta, record)
    except OSError as e:
        own.release()
        raise not_writable(root, e) from e
    except BaseException:
        own.release()
        raise
    return own


def _lock(root: str, lock_path: str, own: Ownership) -> bool:
    """Open and flock the lock file into ``own``; False where the file system refuses locks.

    The descriptor belongs to ``own`` from the statement that locks it in (an interrupt
    before that closes it here, one after leaves it to ``own.release()``); the caller holds
    ``_held_lock``.

    The file is re-checked after the lock: one deleted or replaced between the open and the
    flock would lock nothing another writer can see, so that case takes the lock again.
    """
    import fcntl

    for _ in range(100):
        try:
            # read-only: flock needs no write access, and a descriptor open for writing would
            # keep the file system from being remounted read-only while the job runs;
            # O_NONBLOCK: a FIFO planted there must not hang the open
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                e = OSError(errno.ELOOP, "the owner lock is a symbolic link (refused)", lock_path)
            raise not_writable(root, e) from e
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except BaseException:
            os.close(fd)
            raise
        if not regular:
            os.close(fd)
            raise not_writable(root, OSError(errno.EINVAL, "the owner lock is not a regular file", lock_path))
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise
                # NFS emulates flock with POSIX write locks, which need a descriptor open for writing
                rw = os.open(lock_path, os.O_RDWR | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
                os.close(fd)
                fd = rw
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine, there = os.fstat(fd), _stat_or_none(lock_path)
            if there is not None and (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                own._fd = fd
                _held.add(fd)
                return True
            os.close(fd)  # replaced or removed meanwhile: lock the file that is there now
            continue
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _Busy from None
            if e.errno in _UNSUPPORTED:
                warnings.warn(
                    f"asyncckpt: the file system of {root} refuses file locks ({os.strerror(e.errno)}); "
                    "a second writer on this root will not be detected - make sure only one job writes it",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return False
            raise not_writable(root, e) from e
        except BaseException:
            if own._fd != fd:
                os.close(fd)
            raise
    raise not_writable(root, OSError(errno.EAGAIN, "the owner lock keeps being replaced", lock_path))


class _Busy(Exception):
    """The lock is held by another writer (turned into ``RootInUseError`` by the caller)."""


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


def _write_record(meta: str, record: dict[str, Any]) -> None:
    """Write the owner record under a unique temp name, then rename it into place."""
    tmp = os.path.join(meta, f"{RECORD}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    # O_EXCL: never write through a file or link someone planted at that name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
    try:
        os.write(fd, json.dumps(record).encode())
    finally:
        os.close(fd)
    os.rename(tmp, os.path.join(meta, RECORD))
