"""The typed failures of the peer replica (every one a :class:`~asyncckpt.CheckpointError`).

``failed`` on each: the ranks the failure is about, each with a short reason, the same on every
rank that raises it (an agreement's verdict). ``broken``: the replica group's pairs may hold a
closed connection or a message nobody received, so the :class:`Replicas` object refuses any
further round (build a new group and a new object).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._errors import CheckpointError


class ReplicaError(CheckpointError):
    """A replica round failed; ``failed`` maps a rank to what went wrong for it."""

    def __init__(self, message: str, failed: Mapping[int, str] | None = None, broken: bool = False) -> None:
        super().__init__(message)
        self.failed: dict[int, str] = dict(failed or {})
        self.broken = broken
        #: a fetch's own files when this rank got them but failed to serve its source's
        self.files: dict[str, memoryview] | None = None


class SingleNodeError(ReplicaError, ValueError):
    """Every rank is on one node: there is no other node to hold a replica."""


class ReplicaPushError(ReplicaError):
    """A push did not land on every buddy (a dead or silent peer, a refused or failed write)."""


class ReplicaPushTimeout(ReplicaPushError, TimeoutError):
    """A push's agreement did not complete by its deadline (a rank is dead or hung)."""


class ReplicaMissingError(ReplicaError):
    """A rank's buddy holds no replica of the step asked for (never pushed, retired, wiped, or
    one of another run or attempt)."""


class ReplicaCorruptError(ReplicaError):
    """A replica's bytes do not match the sizes and CRC-32C they were pushed with."""


class ReplicaTransportError(ReplicaError):
    """The replica group failed (a dead peer, a wait past its deadline): ``broken`` is true."""


class ReplicaTimeoutError(ReplicaTransportError, TimeoutError):
    """A round's agreement did not complete by its deadline."""


def kind_error(kind: str) -> type[ReplicaError]:
    """The error class of a failure ``kind`` (``missing``, ``corrupt``, else transport)."""
    return {"missing": ReplicaMissingError, "corrupt": ReplicaCorruptError}.get(kind, ReplicaTransportError)


def worst(kinds: Any) -> str:
    """The kind that names a set of failures: transport over corrupt over missing."""
    ks = set(kinds)
    for k in ("transport", "corrupt", "missing"):
        if k in ks:
            return k
    return "transport"
