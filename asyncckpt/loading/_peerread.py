"""Reading a rank's part from its buddy's memory (the peer replica, ``roots.replica.PeerTier``).

In ``load()`` on a node-local root with ``replicate=True`` (``_nodeload``): when some rank's
agreed tiers include ``"peer"``, every rank calls :func:`fetch` (collective: the ranks agree
who needs what; a buddy sends what it holds). A needer's files come back as bytes (the step's
manifest, its shard and its tree, each CRC-checked against what was pushed as it landed);
:func:`read_fetched` writes them into a scratch root on the memory tier, checks the manifest
is the agreed step and attempt and reads them as any node-local part (``_resume.load_step``
through a ``roots._nodeparts.NodePart``, every file's CRC-32C checked against the manifest
whatever ``verify`` says). A failure of
either is one more failed tier: the caller goes on to the next tier of the same step and
attempt.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointCorruptError
from ..format._layout import step_dir_name
from ..format._manifest import MANIFEST, shard_name, tree_name
from ..roots._nodeparts import NodePart
from ..roots.posix._discovery import read_manifest
from ..roots.replica import DIRECTORY, ReplicaError
from ._resume import load_step

if TYPE_CHECKING:
    from ..roots.replica import PeerTier

log = logging.getLogger("asyncckpt")


def fetch(peer: PeerTier, step: int, attempt: str, need: bool, timeout: float, rank: int) -> Any:
    """Collective: this rank's files of ``step`` from its buddy when it ``need``s them (else
    ``None``), or the ``ReplicaError`` that says why not (returned, not raised: the caller goes
    on to its next tier). A rank that failed only to serve its source logs it and goes on."""
    try:
        return peer.fetch(step, attempt, need, timeout)
    except ReplicaError as e:
        if need and e.files is not None:  # this rank's own files came; it failed to serve another's
            log.warning("rank %d: serving a replica of step %d failed: %s", rank, step, e)
            return e.files
        if not need:
            log.warning("rank %d: serving a replica of step %d failed: %s", rank, step, e)
            return None
        return e


def read_fetched(
    files: Mapping[str, memoryview], memory: str, step: int, attempt: str, rank: int, world_size: int | None = None
) -> Any:
    """Rank ``rank``'s state from its files fetched back from its buddy (module docstring);
    ``CheckpointCorruptError`` for a manifest of another step or attempt or a file that does
    not match it; ``CheckpointError`` for a step saved by other than ``world_size`` ranks (when given)."""
    expected = {MANIFEST, shard_name(rank), tree_name(rank)}
    if set(files) != expected:
        raise CheckpointCorruptError(f"rank {rank}'s replica of step {step} holds {sorted(files)}, not "
                                     f"{sorted(expected)}")  # fmt: skip
    scratch = os.path.join(memory, DIRECTORY, f".fetched-rank{rank:05d}")
    shutil.rmtree(scratch, ignore_errors=True)  # a killed load's
    step_dir = os.path.join(scratch, step_dir_name(step))
    os.makedirs(scratch, mode=0o700)
    os.mkdir(step_dir, mode=0o700)
    try:
        for name, view in files.items():
            with open(os.path.join(step_dir, name), "wb") as f:
                f.write(view)
        m = read_manifest(step_dir)
        if m.step != step or m.attempt != attempt:
            raise CheckpointCorruptError(f"rank {rank}'s replica holds step {m.step} of attempt {m.attempt}, not "
                                         f"step {step} of {attempt}", step_dir)  # fmt: skip
        return load_step(NodePart(scratch, [rank]), step, rank=rank, verify=True, world_size=world_size, expect=attempt)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
