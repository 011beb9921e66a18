"""The asyncckpt error tree.

::

    CheckpointError                      base of everything asyncckpt raises on purpose
    ├── SaveError                        a background save failed (carries step, failures)
    │   └── SaveTimeoutError             ... because a participant did not answer in time
    │                                        (also a builtin TimeoutError)
    ├── CheckpointNotFoundError          no complete checkpoint for that step / root
    │                                        (also a builtin FileNotFoundError)
    └── CheckpointCorruptError           a marker, manifest, header or checksum is wrong

Bad arguments are not in the tree: they raise ``TypeError`` / ``ValueError`` at the call
that received them. Waiting with a ``timeout=`` that runs out raises the builtin
``TimeoutError`` and leaves the save running; ``SaveTimeoutError`` means the save itself
failed.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Mapping
from dataclasses import dataclass


class CheckpointError(Exception):
    """Base class of every error asyncckpt raises on purpose."""


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
        parts = [f"rank {self.rank}: {self.exc_type}"]
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


def _rebuild_corrupt(message: str, path: str | None) -> CheckpointCorruptError:
    err = CheckpointCorruptError.__new__(CheckpointCorruptError)
    Exception.__init__(err, message)
    err.path = path
    return err
