"""Loading a checkpoint straight from an object store: the file system's loader on ranged GETs.

A step on a store is read by the same code as a local one (``_resume.load_files_as``, so
``_load.load_files`` and ``_load_global.load_indexed_files``), through :class:`StoreFiles`:
each object of the step a ``_readinto.RangeSource`` whose reads are ranged GETs (at most
``_readinto.BOUNCE`` bytes each, :data:`GETS_IN_FLIGHT` at once), every byte landing once in
its destination. So everything a local load does, a store load does: ``into=`` targets read
straight into and CRC-32C'd as they land (``verify_first`` to write none before all
verified), a step holding DTensors assembled or resharded onto the targets' meshes reading
only the blocks that overlap them, deduplicated tensors from the rank that holds them, the
same bounds on hostile headers. Every defect is ``CheckpointCorruptError`` naming the
object's URL. A store that fails (503s through every retry, no answer within the deadline, a
refused permission) is an I/O fault, not damage (``_readfault``): ``CheckpointReadError``
naming the URL, the store's error as its ``__cause__``, never a fallback to an older step.
An object gone mid-read means the step was retired: ``CheckpointNotFoundError`` for an
explicit step, look again for ``step=None``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
)
from ..format._checksum import crc32c
from ..format._layout import check_step, token_of
from ..format._manifest import Manifest
from ..format._state_prefixes import check_strip_prefixes
from ..roots._badmarks import record_on_store, store_marks
from ..roots._runs import check_choice
from ..roots.objstore._client import ObjectStore
from ..roots.objstore._remote import (
    DEFAULT_DEADLINE_S,
    candidate_steps,
    data_prefix,
    manifest_key,
    open_step,
    open_store,
)
from ..roots.posix._discovery import KnownBad
from ..threads._sync import run_sync
from . import _load
from ._load_global import PER_RANK, PerRank, Reader
from ._resume import load_files_as
from ._stepfiles import NoSuchShard

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

#: Ranged GETs of one load in flight (the I/O threads of its reads).
GETS_IN_FLIGHT = 16
#: Listings of a load(step=None) whose choice was retired while being read, before giving up.
_LIST_ROUNDS = 16


def blocking(aw: Awaitable[T]) -> T:
    """Run ``aw`` to its end from synchronous code, on the shared event loop (``threads._sync``:
    also from a thread that runs a loop of its own, a notebook caller's)."""
    return run_sync(lambda: aw)


class _ObjectSource:
    """One object of a step, read by ranged GETs (a ``_readinto.RangeSource``)."""

    threads = GETS_IN_FLIGHT

    def __init__(self, store: ObjectStore, key: str, deadline: float, order: int) -> None:
        self.store, self.key, self.deadline, self.order = store, key, deadline, order

    def read_exact(self, views: list[memoryview], offset: int) -> None:
        try:
            blocking(self.store.get_range_scatter(self.key, offset, views, self.deadline))
        except ObjectIntegrityError as e:  # shorter than the manifest says: damage, not a store fault
            raise CheckpointCorruptError(f"object ended early ({e.args[1] if len(e.args) > 1 else e})",
                                         self.store.object_url(self.key)) from None


class StoreFiles:
    """The objects of complete step ``manifest`` on ``store`` as ``_stepfiles.StepFiles``;
    every read bounded by ``deadline`` (``time.monotonic()`` seconds)."""

    def __init__(self, store: ObjectStore, manifest: Manifest, deadline: float) -> None:
        self.store, self.manifest, self.deadline = store, manifest, deadline
        self.prefix = data_prefix(manifest.step, manifest.attempt)
        self._sources: dict[str, _ObjectSource] = {}

    def path(self, name: str) -> str:
        return self.store.object_url(self.prefix + name)

    def size(self, name: str) -> int:
        try:
            return self.manifest.file(name).size
        except CheckpointCorruptError:
            where = self.store.object_url(manifest_key(self.manifest.step))
            raise CheckpointCorruptError(f"manifest does not list {name}", where) from None

    def source(self, name: str) -> _ObjectSource:
        self.size(name)
        if name not in self._sources:
            self._sources[name] = _ObjectSource(self.store, self.prefix + name, self.deadline, len(self._sources))
        return self._sources[name]

    def read(self, name: str, expected_crc: int | None) -> bytes:
        size = self.size(name)
        try:
            raw = blocking(self.store.get_bytes(self.prefix + name, self.deadline, limit=size))
        except ObjectIntegrityError:
            raise CheckpointCorruptError(f"object is not of its listed {size} bytes", self.path(name)) from None
        if len(raw) != size or (expected_crc is not None and crc32c(raw) != expected_crc):
            raise CheckpointCorruptError("checksum mismatch", self.path(name))
        return raw

    def close(self) -> None:
        self._sources.clear()


def load_step(
    store: ObjectStore,
    m: Manifest,
    rank: int,
    verify: bool,
    deadline: float,
    *,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
) -> Any:
    """Rank ``rank``'s state of complete step ``m`` on ``store`` (``_resume.load_files_as``)."""
    return load_files_as(StoreFiles(store, m, deadline), rank, verify, world_size, into, strip_prefixes, reader)


def load_error(e: ObjectStoreError) -> CheckpointError:
    """What a store's error means to a load: an object that is not what the manifest says is
    damage (``CheckpointCorruptError``), any other failure an I/O fault
    (``CheckpointReadError``, same errno and URL). A missing object is not passed here: it
    means the step was retired."""
    if isinstance(e, ObjectIntegrityError):
        return CheckpointCorruptError(str(e.strerror), None if e.filename is None else str(e.filename))
    return CheckpointReadError(e.errno, str(e.strerror), None if e.filename is None else str(e.filename))


def _check_rank(rank: object) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise (TypeError if not isinstance(rank, int) else ValueError)(f"rank must be a non-negative int, not {rank!r}")
    return rank


def load(
    url: str,
    step: int | None = None,
    *,
    into: Any = None,
    verify: bool = True,
    rank: int | None = None,
    strip_prefixes: Sequence[str] = (),
    per_rank: PerRank = "error",
    verify_first: bool = False,
    storage_options: Mapping[str, str] | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    reader: Reader | None = None,
    world_size: int | None = None,
    expect: str | None = None,
) -> Any:
    """:func:`asyncckpt.load` for ``s3://bucket/prefix``: the same rules (``step=None`` loads the
    newest complete checkpoint that verifies, logging and skipping a corrupt newer one; an
    explicit step raises ``CheckpointNotFoundError`` / ``CheckpointCorruptError``), the same
    in-place reads into ``into=`` and the same resharding of DTensors.

    ``reader`` (a Checkpointer's: its world, rank, collective deferral) replaces the one
    built from ``rank`` / ``per_rank`` / ``into`` / ``verify_first``, and ``into`` then names
    only what a step without a global index reads into in place; ``world_size``: such a step
    must have been saved at it. The caller of ``reader`` restores into its targets; otherwise
    this function does. ``expect`` (with an explicit ``step``): the manifest attempt of the commit
    a collective load agreed on; another commit of the step raises ``CheckpointError`` before anything is read."""
    prefixes = check_strip_prefixes(strip_prefixes)
    if step is not None:
        check_step(step)
    if rank is not None:
        _check_rank(rank)
    if per_rank not in PER_RANK:
        raise ValueError(f"per_rank must be one of {PER_RANK}, not {per_rank!r}")
    if type(verify_first) is not bool:
        raise TypeError(f"verify_first must be a bool, not {type(verify_first).__name__}")
    own = reader is None
    if reader is None:
        reader = Reader(1, 0, rank, per_rank, into, prefixes, verify_first=verify_first)
    shard = 0 if rank is None else rank
    store = open_store(url, storage_options)
    deadline = time.monotonic() + deadline_s

    expected = expect if step is not None else None

    def attempt(s: int, known: dict[tuple[int, str], Any] | None = None) -> Any:
        m, _ = run_sync(lambda: open_step(store, s, deadline))
        check_choice(m, expected, store.object_url(manifest_key(s)))
        mark = None if known is None else known.get((s, token_of(m.attempt)))
        if mark is not None:  # known bad (_stepstates): passed over, as discovery does
            raise KnownBad(f"known bad: verification failed: {mark.reason}", mark.path or None)
        try:
            return load_step(store, m, shard, verify, deadline, world_size=world_size, into=into,
                             strip_prefixes=prefixes, reader=reader)
        except KnownBad:
            raise
        except CheckpointCorruptError as e:  # a proven content fault: remembered on the store (best effort)
            where, why = e.path or "", str(e)
            run_sync(lambda: record_on_store(store, s, m.attempt, where, why, deadline))
            raise

    def go() -> Any:
        if step is not None:
            try:
                return attempt(step)
            except NoSuchShard as e:
                raise CheckpointNotFoundError(str(e)) from None
            except ObjectNotFoundError as e:  # retired while being read (manifest first, then objects)
                msg = f"step {step} under {store.url} vanished while being read ({e})"
                raise CheckpointNotFoundError(msg) from None
        for _ in range(_LIST_ROUNDS):
            vanished = False
            known = run_sync(lambda: store_marks(store, deadline))
            for s in run_sync(lambda: candidate_steps(store, deadline)):
                try:
                    return attempt(s, known)
                except NoSuchShard as e:
                    raise CheckpointNotFoundError(str(e)) from None
                except CheckpointNotFoundError:
                    continue
                except ObjectNotFoundError:
                    vanished = True  # retired while being read: a newer step exists now, list again
                    break
                except CheckpointCorruptError as e:
                    log.warning("remote step %d does not verify, trying an older one: %s", s, e)
            if not vanished:
                break
        raise CheckpointNotFoundError(f"no complete checkpoint under {store.url}")

    def typed() -> Any:
        try:
            return go()
        except ObjectNotFoundError:
            raise
        except ObjectStoreError as e:
            raise load_error(e) from e

    if not own:
        return typed()
    with _load.noting_partial_targets(reader):
        state = typed()
        if into is not None:
            with torch.no_grad():
                _load.restore_into(into, state, strip_prefixes=prefixes)
    return state
