"""The asyncckpt error tree.

::

    CheckpointError                      base of everything asyncckpt raises on purpose
    ├── SaveError                        a background save failed (carries step, failures)
    │   ├── SaveTimeoutError             ... because a participant did not answer in time
    │   │                                    (also a builtin TimeoutError)
    │   └── StateChangedError            ... because a deferred save's tensor was written before
    │                                        its copy finished (carries keys)
    ├── RanksFailedError                 on_every_rank(): the function failed on some ranks
    │   │                                    (carries failures, the same on every rank)
    │   └── RanksTimeoutError            ... or some ranks did not answer in time
    │                                        (also a builtin TimeoutError)
    ├── CheckpointNotFoundError          no complete checkpoint for that step / root
    │                                        (also a builtin FileNotFoundError)
    ├── CheckpointCorruptError           a marker, manifest, header or checksum is wrong
    ├── CheckpointReadError              reading a checkpoint failed on I/O (EIO, ETIMEDOUT, a
    │                                        store answering 503 ...): not damage; never marks
    │                                        a step bad, never makes load() fall back (also a
    │                                        builtin OSError: errno, filename)
    ├── RootInUseError                   another writer owns the root (at construction; on an
    │                                        object-store root also in a save's failures once
    │                                        its lease was taken over)
    ├── RootNotWritableError             the root cannot be written (also a PermissionError)
    └── ObjectStoreError                 an object-store operation failed (also an OSError: errno,
        │                                    filename = the object's URL)
        ├── ObjectNotFoundError          the object does not exist (also FileNotFoundError)
        ├── ObjectStorePermissionError   the store refused the credentials, 401/403 (also PermissionError)
        ├── ObjectStoreTimeoutError      the deadline passed first (also TimeoutError)
        ├── ObjectStoreUnavailableError  5xx, throttling, connection errors through every retry
        │   └── ObjectStoreFullError     ... the store refuses writes for want of space (ENOSPC)
        ├── ObjectIntegrityError         what the store holds differs from what was sent
        └── ConditionalWriteUnsupportedError  the store ignored If-None-Match: *

Bad arguments are not in the tree: they raise ``TypeError`` / ``ValueError`` at the call
that received them. Waiting with a ``timeout=`` that runs out raises the builtin
``TimeoutError`` and leaves the save running; ``SaveTimeoutError`` means the save itself
failed.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


class CheckpointError(Exception):
    """Base class of every error asyncckpt raises on purpose."""


class ObjectStoreError(CheckpointError, OSError):
    """An object-store operation failed. ``errno`` says how, ``filename`` is the object's URL."""

    def __init__(self, err: int, message: str, url: str | None = None) -> None:
        OSError.__init__(self, err, message, url)

    def __str__(self) -> str:
        return f"{self.strerror}: {self.filename}" if self.filename else str(self.strerror)


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """The object does not exist."""


class ObjectStorePermissionError(ObjectStoreError, PermissionError):
    """The store refused our credentials or their permissions (401/403)."""


class ObjectStoreTimeoutError(ObjectStoreError, TimeoutError):
    """The deadline passed before the operation finished. For a conditional create (``ObjectStore.create_once``)
    ``outcome_unknown`` is true: our create may still land (read the object to find out)."""

    outcome_unknown: bool = False


class ObjectStoreUnavailableError(ObjectStoreError):
    """The store kept failing (5xx, throttling, connection errors) through every retry."""


class ObjectStoreFullError(ObjectStoreUnavailableError):
    """The store refuses writes for want of space (ENOSPC): it said so (507, a "storage
    full" or quota code), or it refuses even a tiny write while it answers reads
    (``roots.objstore._storefull.explain``): full, or holding deleted objects it has not
    reclaimed yet."""


class ObjectIntegrityError(ObjectStoreError):
    """What the store holds differs from what we sent (size or CRC-32C on read-back)."""


class ConditionalWriteUnsupportedError(ObjectStoreError):
    """The store ignored ``If-None-Match: *``: commits could race, so it is refused."""


@dataclass(frozen=True)
class RankFailure:
    """What failed on one rank: enough to act on without the original traceback.

    ``errno`` and ``path`` are filled in for ``OSError`` failures.
    """

    rank: int
    exc_type: str
    message: str
    errno: int | None = None
    path: str | None = None
    #: the rank in the default (global) group, when it differs from ``rank`` (a sub-group)
    global_rank: int | None = None

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> RankFailure:
        """Describe ``exc`` as raised on ``rank``."""
        err = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
        path = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
        return cls(
            rank=rank,
            exc_type=type(exc).__name__,
            message=str(exc),
            errno=err if isinstance(err, int) else None,
            path=str(path) if path is not None else None,
        )

    def __str__(self) -> str:
        who = f"rank {self.rank}"
        if self.global_rank is not None and self.global_rank != self.rank:
            who += f" (global rank {self.global_rank})"
        parts = [f"{who}: {self.exc_type}"]
        if self.errno is not None:
            parts.append(f"[{_errno.errorcode.get(self.errno, self.errno)}]")
        parts.append(f": {self.message}")
        if self.path is not None and self.path not in self.message:
            parts.append(f" (path {self.path})")
        return "".join(parts)


class SaveError(CheckpointError):
    """A background save failed; nothing of it was committed.

    ``failures`` maps each failed rank to what failed there. Locally the original exception
    is chained as ``__cause__``.
    """

    def __init__(self, step: int, failures: Mapping[int, RankFailure], detail: str = "") -> None:
        self.step = step
        self.failures: dict[int, RankFailure] = dict(sorted(failures.items()))
        lines = "; ".join(str(f) for f in self.failures.values())
        msg = f"checkpoint save of step {step} failed: {lines or 'unknown failure'}"
        if detail:
            msg = f"{msg} ({detail})"
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.step, self.failures))


class SaveTimeoutError(SaveError, TimeoutError):
    """A save failed because a participant did not answer within the Checkpointer's timeout.

    ``missing`` lists the ranks that did not answer.
    """

    def __init__(
        self,
        step: int,
        failures: Mapping[int, RankFailure],
        detail: str = "",
        missing: tuple[int, ...] = (),
    ) -> None:
        self.missing = tuple(sorted(missing))
        super().__init__(step, failures, detail)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.step, self.failures, "", self.missing))


class StateChangedError(SaveError):
    """A deferred save (``save(..., until=optimizer)``) failed because tensors it was still
    copying were written in place before the save's guard (the optimizer step,
    ``wait_staged()``, the next ``save()``, ``flush()``): their copy may mix two states, so
    nothing of the save was committed. ``keys`` names them (the checkpoint's tensor names)."""

    def __init__(self, step: int, failures: Mapping[int, RankFailure], detail: str = "", keys: tuple[str, ...] = ()):
        self.keys = tuple(keys)
        super().__init__(step, failures, detail)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.step, self.failures, "", self.keys))


class RanksFailedError(CheckpointError):
    """:func:`asyncckpt.on_every_rank`: the function raised on some ranks; every rank of the
    group raises this same error.

    ``failures`` maps each failed rank (its rank in the group) to what failed there; on a
    rank that failed, its own exception is chained as ``__cause__``. ``missing`` lists ranks
    that did not answer in time (only on :class:`RanksTimeoutError`).
    """

    def __init__(
        self, what: str, failures: Mapping[int, RankFailure], detail: str = "", missing: tuple[int, ...] = ()
    ) -> None:
        self.what = what
        self.failures: dict[int, RankFailure] = dict(sorted(failures.items()))
        self.missing = tuple(sorted(missing))
        parts = []
        if self.failures:
            lines = "; ".join(str(f) for f in self.failures.values())
            parts.append(f"failed on rank(s) {sorted(self.failures)}: {lines}")
        if self.missing:
            parts.append(f"rank(s) {list(self.missing)} did not answer in time")
        msg = f"{what}: {'; '.join(parts) or 'failed'}"
        if detail:
            msg = f"{msg} ({detail})"
        self.detail = detail
        super().__init__(msg)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.what, self.failures, self.detail, self.missing))


class RanksTimeoutError(RanksFailedError, TimeoutError):
    """:func:`asyncckpt.on_every_rank`: some ranks did not answer within the timeout
    (``missing`` names them; a rank that stopped answering altogether, or one still busy
    in the function)."""


def with_global_ranks(failures: Mapping[int, RankFailure], ranks: Sequence[int] | None) -> dict[int, RankFailure]:
    """``failures`` with each group rank's global rank filled in (``ranks[group_rank]``)."""
    if not ranks:
        return dict(failures)
    out = {}
    for r, f in failures.items():
        g = ranks[f.rank] if 0 <= f.rank < len(ranks) else None
        out[r] = replace(f, global_rank=g) if g is not None and g != f.rank else f
    return out


def without_path(e: CheckpointError) -> str:
    """The message of ``e`` without the trailing ``: path`` the library appends (for a report
    that names the path in a column of its own)."""
    msg = str(e)
    path = getattr(e, "path", None)
    if path and msg.endswith(f": {path}"):
        msg = msg[: -len(path) - 2]
    return msg


def describe_ranks(group_ranks: Sequence[int], ranks: Sequence[int] | None) -> str:
    """``[1, 2]``, or ``[1, 2] (global [5, 6])`` when the group's ranks are not the global ones."""
    text = str(list(group_ranks))
    if ranks:
        glob = [ranks[r] if 0 <= r < len(ranks) else r for r in group_ranks]
        if glob != list(group_ranks):
            text += f" (global {glob})"
    return text


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint exists for the requested step (or under the root at all)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's marker, manifest, header or data does not match what was committed.

    ``path`` names the offending file when one is known.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        super().__init__(f"{message}: {path}" if path else message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_corrupt, (str(self), self.path))


class CheckpointReadError(CheckpointError, OSError):
    """Reading a checkpoint failed on I/O, not on its content: the disk, the file system or the
    object store could not serve the bytes (EIO, ETIMEDOUT, ENOSPC on a FUSE mount, a store that
    kept answering 503 or did not answer within the deadline).

    The step may be perfectly good: it is not marked bad and ``load()`` does not fall back to an
    older step (a retry later, or a fix of the storage, may load it). ``errno`` says how,
    ``filename`` names the file or object URL. Raised after the load retried the read within
    its deadline.
    """

    def __init__(self, err: int | None, message: str, path: str | None = None) -> None:
        OSError.__init__(self, err, message, path)

    @property
    def path(self) -> str | None:
        """The file or object URL that could not be read (``filename``, as on ``CheckpointCorruptError``)."""
        return None if self.filename is None else str(self.filename)

    def __str__(self) -> str:
        name = _errno.errorcode.get(self.errno) if isinstance(self.errno, int) else None
        text = f"{self.strerror} [{name}]" if name and name not in str(self.strerror) else str(self.strerror)
        return f"{text}: {self.filename}" if self.filename else text


class CoordinationLost(CheckpointError, RuntimeError):
    """The coordinator is gone: the c10d store cannot be reached (its host, rank 0 or the
    launcher, died or closed the connection). Every later store call fails at once."""


class RootInUseError(CheckpointError):
    """Another writer owns the root: one root has one writing job at a time.

    Raised at construction of the second writing Checkpointer; the message names the owner
    (host, pid, process start time, ranks). Reading needs no ownership. On an ``s3://``
    root a job whose lease was taken over (it stopped renewing it for longer than its TTL:
    paused, cut off) commits nothing more: each later save fails with a ``SaveError`` whose
    rank-0 failure is a ``RootInUseError``, on every rank.
    """


class RootNotWritableError(CheckpointError, PermissionError):
    """The root cannot be written (read-only file system, no permission): raised at
    construction. Read-only users load with ``asyncckpt.load()`` / ``find_latest()``."""


def _rebuild_corrupt(message: str, path: str | None) -> CheckpointCorruptError:
    err = CheckpointCorruptError.__new__(CheckpointCorruptError)
    Exception.__init__(err, message)
    err.path = path
    return err
