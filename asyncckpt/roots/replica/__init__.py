"""The peer replica: each rank's files of a step copied into the memory of a rank on another
node, and fetched back by a rank that lost its own copy (``docs/design/replica.md``).

:class:`Replicas` (``_replicas``) over gloo groups of its own, one per pair of ranks that
talks (``_links``, :func:`open_group`): who holds whose replica (``_buddies``), the replicas a
rank holds (``_held``), the frames on the wire (``_wire``), the typed failures
(``_failures``); the memory tier's use of it (``_tier``)."""

from ._buddies import buddy_of, lost_with, sources_of
from ._failures import (
    ReplicaCorruptError,
    ReplicaError,
    ReplicaMissingError,
    ReplicaPushError,
    ReplicaPushTimeout,
    ReplicaTimeoutError,
    ReplicaTransportError,
    SingleNodeError,
)
from ._links import open_group
from ._replicas import Replicas
from ._tier import DIRECTORY, PeerTier, holdings

__all__ = [
    "DIRECTORY",
    "PeerTier",
    "ReplicaCorruptError",
    "ReplicaError",
    "ReplicaMissingError",
    "ReplicaPushError",
    "ReplicaPushTimeout",
    "ReplicaTimeoutError",
    "ReplicaTransportError",
    "Replicas",
    "SingleNodeError",
    "buddy_of",
    "holdings",
    "lost_with",
    "open_group",
    "sources_of",
]
