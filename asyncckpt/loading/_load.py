"""Loading: read one rank's shard back, verify it, rebuild the state, restore in place.

Nothing here unpickles. Every byte read is bounded by the sizes the manifest recorded and
the file actually has, and by the limits of ``_bounds`` checked before anything is parsed or
allocated; every defect becomes ``CheckpointCorruptError`` naming the file, an I/O fault of
the storage ``CheckpointReadError`` naming it (``_readfault``: not damage), and a state too
large for this machine's memory a ``CheckpointError`` saying how much it needs. Reads are
parallel (``_readinto``). :func:`load_files` reads a step's ``StepFiles``: the step a root
holds open (``Root.open_reader``), so a checkpoint retired meanwhile is reported as gone, not
as corrupt.

Where the bytes land. With ``load(into=)``, ``_targets.plan_targets`` finds the target
tensors that take a saved tensor as it is (same dtype and shape, CPU or CUDA) and the shard
is read straight into them; the other saved tensors go to fresh tensors, restored by
``_restore.restore_into`` as before. Peak extra memory: the I/O threads' bounce buffers, plus
the fresh tensors.

The contract on damage. By default the read is one pass: every piece lands in its target
and is checksummed there, on the thread that read it, while it is still in cache; a
checkpoint that then fails verification raises ``CheckpointCorruptError`` with the targets
partly overwritten. That is safe for ``load(step=None)``: its fallback loads an older step
over the same targets, and restoring is strict (every target key must be in the step, with
its shape), so a fallback that succeeds rewrote every target. With ``verify_first`` a
checkpoint that fails verification writes no target: the first pass reads the fresh
tensors' bytes into them and only checksums the targets' bytes through the bounce buffers
(leaving the pages in the page cache); only when the whole file verified does the second
pass read the targets' bytes into the targets, from the page cache. Its price is that
second, in-memory pass (and a shard larger than the page cache is read from disk twice).
``verify=False`` is one pass without checksums.

Lazy loads (``load(..., mmap=True)``, :func:`map_shard`): the tensors are views of a private
(copy-on-write) mapping of the shard, so nothing is copied and the pages are read when first
touched; writes to them stay in this process, never reach the file. With ``verify`` the
whole shard's CRC-32C is checked once, up front, through the I/O threads' bounce buffers
(the pages pass through the page cache, nothing is kept: no copy of the state in memory);
``verify=False`` skips it and reads nothing. The mapping holds the file's inode, so the
tensors stay valid after retention removes the step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointCorruptError, CheckpointError
from ..format._bounds import check_structure_size, parse_structure
from ..format._gcpause import paused_gc
from ..format._manifest import shard_name, tree_name
from ..format._structure_decode import UnknownTensorError, compact_node, resolving_node, unflatten
from ._shard import ShardHeader, map_shard, noted, read_shard_fd, shard_header, unreadable
from ._shard import read_header as read_header  # (``_export``'s)
from ._stepfiles import StepFiles
from ._targets import Plan, Skeleton, plan_targets, unflatten_named


def check_tree_size(path: str, size: int) -> None:
    check_structure_size(size, path)  # (the bound every reader shares)


def _rebuild(
    tree: Any,
    tensors: dict[str, torch.Tensor],
    tree_path: str,
    shard_path: str,
    names_checked: bool = False,
    resolved: list[torch.Tensor] | None = None,
) -> Any:
    """The state of ``tree`` over ``tensors`` (one per name of the shard); the tree is
    emptied as the state is built (``unflatten``'s ``consume``). ``names_checked``:
    :func:`plan_targets` already compared the tree's tensor names with the shard's.
    ``resolved``: the tensors ``resolving_node`` put in place of the tree's tensor nodes,
    which count as named (``CheckpointCorruptError`` unless the tree names every tensor)."""
    try:
        with paused_gc():  # the state's containers, rebuilt: many small objects
            if names_checked:
                return unflatten(tree, tensors, consume=True)
            if resolved is None:
                state, _ = unflatten_named(tree, tensors, shard_path, consume=True)
                return state
            named: list[str] = []
            try:
                state = unflatten(tree, tensors, named, consume=True)
            except UnknownTensorError:
                raise CheckpointCorruptError("structure and shard disagree on tensor names", shard_path) from None
            # every tensor named (each is one of tensors': the names were looked up), tied ones more than once
            ids = np.fromiter(map(id, itertools.chain(resolved, map(tensors.__getitem__, named))), dtype=np.int64)
            if len(np.unique(ids)) != len(tensors):
                raise CheckpointCorruptError("structure and shard disagree on tensor names", shard_path)
            return state
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise CheckpointCorruptError(f"malformed structure ({e})", tree_path) from None
    except MemoryError:
        raise CheckpointError(f"not enough memory to rebuild the state: {tree_path}") from None


def load_files(
    files: StepFiles,
    rank: int,
    verify: bool,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    mmap: bool = False,
    verify_first: bool = False,
) -> Any:
    """Rebuild rank ``rank``'s state from the files of a complete step without a global index.

    Both files are opened before either is read, so a retirement that starts afterwards
    cannot touch a local read; one that removed a file first raises ``Vanished``. With
    ``into``, the tensors of ``into`` that match a saved tensor (:func:`plan_targets`) are
    read into in place (with ``verify_first``: only after the whole shard verified); the
    returned state holds them. With ``mmap`` the tensors are views of the mapped shard
    (:func:`map_shard`; ``into`` must be ``None``, the files local).

    The collector is paused for the whole load, reads included (``_gcpause``): a pause per
    phase let each collection between them traverse everything the earlier phases built and
    still held (the tree, the slots, a destination and a tensor per saved tensor), promoting
    it towards a full pass. The temporaries die before the pause ends.
    """
    with paused_gc():
        return _load_files(files, rank, verify, into, strip_prefixes, mmap, verify_first)


def _load_files(
    files: StepFiles,
    rank: int,
    verify: bool,
    into: Any,
    strip_prefixes: Sequence[str],
    mmap: bool,
    verify_first: bool,
) -> Any:
    """:func:`load_files`' body (the collector paused by the caller)."""
    manifest = files.manifest
    tree_name_, shard_name_ = tree_name(rank), shard_name(rank)
    tree_size, shard_size = files.size(tree_name_), files.size(shard_name_)
    tree_crc, shard_crc = manifest.file(tree_name_).crc32c, manifest.file(shard_name_).crc32c
    tree_path, shard_path = files.path(tree_name_), files.path(shard_name_)
    check_tree_size(tree_path, tree_size)
    files.source(tree_name_)
    shard_fd = files.source(shard_name_)
    try:
        raw = files.read(tree_name_, None)
    except OSError as e:
        raise unreadable(e, "structure", tree_path) from None
    expected = shard_crc if verify else None
    if mmap:
        mapped_tree = parse_structure(raw, tree_path, tree_size, tree_crc if verify else None)
        del raw
        assert isinstance(shard_fd, int)
        tensors = map_shard(shard_fd, shard_path, shard_size, expected)
        return _rebuild(mapped_tree, tensors, tree_path, shard_path)
    # the shard's header parsed before the tree: its parse holds ~1 KB a tensor for a moment,
    # which the tree's parse then reuses instead of adding to
    try:
        header = shard_header(shard_fd, shard_path, shard_size)
    except OSError as e:
        raise unreadable(e, "shard", shard_path) from None
    # the state is rebuilt over the tensors once they exist, before their bytes are read, so
    # the tree is gone (emptied as the state is built) while the reads' destinations live;
    # not where a node uses its tensor's values as it is decoded (a generator's state: the
    # text names the tag, perhaps also inside a string, which only costs the order)
    early = b'"$generator"' not in raw
    # One reference to each per-tensor structure at a time, so each dies at its last use:
    # the raw tree, then its parse (pending), the slots (taken by the read), the plan's
    # targets (an argument). Without into= the tree is parsed only once the slots are gone
    # (they and the fresh tensors would otherwise all be there at once).
    pending: list[Any] = [raw]
    del raw

    def tree() -> Any:
        if type(pending[0]) is bytes:
            pending.append(parse_structure(pending.pop(), tree_path, tree_size, tree_crc if verify else None,
                                           compact_node))  # fmt: skip
        return pending[0]

    rebuilt: list[Any] = []
    plain = False  # (every target a contiguous CPU tensor)
    skeleton: list[Skeleton] = []  # plan_targets' (the tree then decoded once: it is gone)
    targets: list[dict[str, torch.Tensor]] = []  # (taken by the read)
    if into is not None:
        tree()  # (parsed: pending holds it, the plan empties pending when the skeleton is the state)
        planned = _plan(into, pending, header, strip_prefixes, tree_path, shard_path)
        targets.append(planned.targets)
        plain = planned.plain
        if planned.skeleton is not None:
            skeleton.append(planned.skeleton)
            pending.clear()
        del planned

    def rebuild(tensors: dict[str, torch.Tensor]) -> None:
        if skeleton:  # the state plan_targets rebuilt over the slots, the tensors put in their place
            rebuilt.append(skeleton.pop().filled(tensors))
            return
        if into is not None:  # parsed for plan_targets, which compared the names with the header's
            rebuilt.append(_rebuild(pending.pop(), tensors, tree_path, shard_path, names_checked=True))
            return
        # parsed now, each tensor node replaced by its tensor as it is read (no name kept)
        resolved: list[torch.Tensor] = []
        hook = resolving_node(tensors, resolved)
        parsed = parse_structure(pending.pop(), tree_path, tree_size, tree_crc if verify else None, hook)
        rebuilt.append(_rebuild(parsed, tensors, tree_path, shard_path, resolved=resolved))

    tensors, _ = read_shard_fd(
        shard_fd,
        shard_path,
        shard_size,
        expected,
        targets.pop() if targets else None,
        header,
        verify_first,
        rebuild if early else None,
        plain,
    )
    if not early:
        rebuild(tensors)
    return rebuilt[0]


def _plan(
    into: Any, pending: list[Any], header: ShardHeader, strip_prefixes: Sequence[str], tree_path: str, shard_path: str
) -> Plan:
    """:func:`plan_targets` for ``into`` over the header's slots, of the tree ``pending`` holds."""
    assert header.slots is not None
    return plan_targets(into, pending[0], header.slots, tuple(strip_prefixes), tree_path, shard_path, pending)


PARTIAL_TARGETS_NOTE = (
    " (into=: the targets may be partly overwritten by a checkpoint read into them in place;"
    " load(..., verify_first=True) verifies the whole step before writing any target)"
)


@contextlib.contextmanager
def noting_partial_targets(reader: Any) -> Iterator[None]:
    """An error leaving the block says, once ``reader.dirty`` (a read into the targets of
    ``into=`` failed or was given up: a corrupt step, an I/O error, a step another rank
    refused, a fallback), that the targets may be partly overwritten, whatever its type: a
    caller who catches it and starts afresh must not trust them, and ``verify_first`` would
    have kept them. An error that has nothing to do with such a read (a shape mismatch, a
    key the checkpoint lacks, after a read that succeeded) says nothing of it."""
    try:
        yield
    except (CheckpointError, KeyError, ValueError, RuntimeError) as exc:
        if reader.dirty:
            noted(exc, PARTIAL_TARGETS_NOTE)
        raise


# ---------------------------------------------------------------------- lazy (mapped) loads
def check_mmap(mmap: object, into: Any) -> None:
    """Refuse a bad ``mmap=`` argument at the call: ``TypeError`` for a non-bool,
    ``ValueError`` together with ``into=`` (mapped tensors are for reading; restoring copies
    into the targets anyway, so it would only add a mapping)."""
    if type(mmap) is not bool:
        raise TypeError(f"mmap must be a bool, not {type(mmap).__name__}")
    if mmap and into is not None:
        raise ValueError("mmap=True returns tensors backed by the checkpoint's file and cannot be combined with into=")


