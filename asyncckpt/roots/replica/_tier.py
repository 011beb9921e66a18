"""The peer replica as a tier of the memory tier (``Checkpointer(..., memory=..., replicate=True)``).

:class:`PeerTier` is one rank's side: its :class:`Replicas` (opened at construction on every
rank: a gloo group of its own), the directory of the replicas it holds
(``<memory>/.replicas``, :data:`DIRECTORY`), and the three uses the tiers make of it:

- :meth:`PeerTier.push`: after a memory round committed a step on every node, each rank sends
  its memory files of that step (its shard, its tree, the step's manifest) to its buddy (on the
  memory tier's thread: never in ``save()``); a failure is logged, never raised (the durable
  tiers committed first);
- :func:`holdings`: what a rank holds for its sources, reported in the agreement on the step to
  resume (a look at files only: also at construction, before the group is open);
- :meth:`PeerTier.fetch`: collective, a rank that reads its part from its buddy gets its files
  back (every CRC checked as the bytes land).

The group is used by one thread at a time (a lock): the pushes run on the memory tier's thread,
a fetch on the caller's, and every rank must call them in the same order (``load()`` waits for
the memory tier's rounds first; docs/node-local.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ...format._layout import step_dir_name
from ...format._manifest import MANIFEST, shard_name, tree_name
from ...ranks._distributed import DistContext
from ...ranks._nodes import Nodes
from ._failures import ReplicaError
from ._held import held_attempts
from ._replicas import Replicas

log = logging.getLogger("asyncckpt")

#: Where a rank keeps the replicas it holds, under the memory tier's directory.
DIRECTORY = ".replicas"


def holdings(memory: str, sources: Sequence[int]) -> dict[str, dict[str, str]]:
    """The replicas held under ``memory`` for ``sources``: source -> step -> attempt (as strings,
    for the agreement's JSON). Files only: no group, nothing made."""
    directory = os.path.join(memory, DIRECTORY)
    out = {}
    for s in sources:
        got = held_attempts(directory, s)
        if got:
            out[str(s)] = {str(step): attempt for step, attempt in got.items()}
    return out


class PeerTier:
    """This rank's peer replica of its memory tier (module docstring)."""

    def __init__(self, replicas: Replicas, memory: str) -> None:
        self.replicas, self.memory = replicas, memory
        self.lock = threading.Lock()
        #: the steps this rank's push landed on every buddy in this job (monitoring, tests)
        self.pushed: list[int] = []
        self._gave_up = False

    @classmethod
    def open(cls, dist: DistContext, nodes: Nodes, memory: str, keep: int, timeout: float) -> PeerTier:
        """Collective (every rank of the Checkpointer's, once its start agreement gave them a
        prefix of their own): this rank's side and its replica group. ``SingleNodeError`` (a
        ``ValueError``) with one node; ``ReplicaTransportError`` when the group cannot be built."""
        # a store client of its own: its agreements wait on the memory tier's thread, and the
        # job's client is the caller's (``DistContext``); no probe, the store is up
        own = dataclasses.replace(dist, store=dist.connect(probe=False))
        return cls(Replicas(own, nodes, os.path.join(memory, DIRECTORY), keep, timeout), memory)

    @property
    def sources(self) -> tuple[int, ...]:
        return self.replicas.sources

    @property
    def directory(self) -> str:
        """Where this node's ranks keep the replicas they hold (in the memory tier's directory:
        they count toward its ``memory_budget``)."""
        return os.path.join(self.memory, DIRECTORY)

    def push(self, step: int, attempt: str, crcs: Mapping[str, int] | None = None) -> bool:
        """Collective: this rank's memory files of ``step`` (made by ``attempt``) to its buddy;
        whether every rank's landed. ``crcs``: the files' CRC-32C the save computed (not
        computed again: :meth:`Replicas.push`). Never raises: a failure is logged (the memory tier's
        replica lacks that step). A broken group (a peer that died or stalled past the deadline)
        is built again at the next push, on every rank (each saw the same verdict); when that
        fails (a peer gone for good) the replica is given up for the rest of the job."""
        if self._gave_up:
            return False
        step_dir = os.path.join(self.memory, step_dir_name(step))
        rank = self.replicas.rank
        files = {n: os.path.join(step_dir, n) for n in (MANIFEST, shard_name(rank), tree_name(rank))}
        try:
            with self.lock:
                self.replicas.push(step, attempt, files, crcs)
        except ReplicaError as e:
            log.warning("asyncckpt: rank %d: step %d was not replicated to the buddies' memory: %s: %s", rank, step,
                        type(e).__name__, e)  # fmt: skip
            if self.replicas.dead is not None:
                self._gave_up = True
                log.warning("asyncckpt: rank %d: the peer replica's group is broken and could not be rebuilt: no "
                            "more replicas in this job", rank)  # fmt: skip
            elif e.broken:
                log.warning("asyncckpt: rank %d: the peer replica's group broke: the next push builds a new one",
                            rank)  # fmt: skip
            return False
        self.pushed.append(step)
        return True

    def fetch(self, step: int, attempt: str, need: bool, timeout: float) -> dict[str, Any] | None:
        """Collective: :meth:`Replicas.fetch` within ``timeout`` seconds (at most the replica's
        own timeout); raises its typed errors (``ReplicaError``)."""
        with self.lock:
            own = self.replicas.timeout
            self.replicas.timeout = max(0.1, min(own, timeout))
            try:
                return self.replicas.fetch(step, attempt, need)
            finally:
                self.replicas.timeout = own
