"""Loading for the facade: ``Checkpointer.load`` behind one request object, and the
module-level ``load()``. Every root is read by the one loader (``loading._resume``) through
:meth:`Loader.reading` (tier mode: ``roots._tier.TierRoot``); one process loads alone, many
agree on each choice (:meth:`Loader._load_agreed`); the node-local tier has its own
collective (``loading._nodeload``)."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointCorruptError, CheckpointNotFoundError, ObjectNotFoundError
from ..format._gcpause import paused_gc
from ..format._layout import check_step
from ..format._state_prefixes import check_strip_prefixes
from ..loading import _load, _load_global, _nodeload, _restore, _resume
from ..loading._stepfiles import NoSuchShard
from ..ranks import _agree
from ..roots import _nodeparts, _readfault, _runs
from ..roots._registry import open_root
from ..roots._root import Root
from ..roots._tier import TierRoot
from ..roots.posix import _discovery
from ..threads._deadline import Deadline
from ._options import is_int
from ._session import RootSession

#: Rounds of a collective load(step=None) (each one a retired choice or a corrupt fallback).
MAX_LOAD_ROUNDS = 64
log = logging.getLogger("asyncckpt")


def check_load_args(step: int | None, rank: int | None, per_rank: object, verify_first: object) -> None:
    """The checks ``Checkpointer.load`` and ``load()`` share: ``TypeError``/``ValueError``."""
    if step is not None:
        check_step(step)
    if rank is not None and (not is_int(rank) or rank < 0):
        raise (TypeError if not is_int(rank) else ValueError)(f"rank must be a non-negative int, not {rank!r}")
    if per_rank not in _load_global.PER_RANK:
        raise ValueError(f"per_rank must be one of {_load_global.PER_RANK}, not {per_rank!r}")
    if type(verify_first) is not bool:
        raise TypeError(f"verify_first must be a bool, not {type(verify_first).__name__}")


@dataclass(frozen=True)
class LoadRequest:
    """One checked ``Checkpointer.load`` call: ``step`` (``None``: the newest that verifies),
    ``shard`` the saved rank this rank reads, ``expect`` the world size the checkpoint must
    have (``None``: any, ``rank=`` named the shard), ``reader`` the targets and the deferral."""

    step: int | None
    shard: int
    verify: bool
    mmap: bool
    expect: int | None
    reader: _load_global.Reader


class Loader:
    """Loads for one Checkpointer: its root, its mirror (tier mode), its ranks."""

    def __init__(self, session: RootSession) -> None:
        self.session = session
        self.root = session.root
        self.store = session.store
        self.timeout = session.timeout
        self.strip_prefixes = session.opts.strip_prefixes
        self.store_options = session.opts.store_options
        self._reading: Root | None = None

    def reading(self) -> Root:
        """This Checkpointer's root as loads read it (``roots.open_root``; in tier mode the local
        root and the mirror's store as one ``TierRoot``); made once."""
        if self._reading is None:
            if self.store is not None:
                self._reading = open_root(self.root, storage_options=self.store_options, deadline_s=self.timeout)
            elif self.session.mirror is not None:
                m = self.session.mirror
                far = open_root(m.url, storage_options=m.storage_options, deadline_s=self.timeout)

                def far_newest(skip: frozenset[int]) -> int | None:
                    found = m.latest(skip, warn=True)  # this run's steps only (another run's: never)
                    return None if found is None else found.step

                self._reading = TierRoot(open_root(self.root), far, far_newest)
            else:
                self._reading = open_root(self.root)
        return self._reading

    def load(self, req: LoadRequest) -> Any:
        """The state of ``req`` (restored into its targets, if any)."""
        reader = req.reader
        into = reader.into
        if self.session.nodes is None and req.mmap and not self.reading().caps.mmap:
            raise ValueError(f"mmap=True needs a local root, not {self.root}")
        if self.session.nodes is not None:  # the node-local tier: each rank reads its part on its node, else the store
            state = self._load_node_part(req)
        elif self.session.dist is None:
            # into=: tensors read into in place once their shard verified (_targets.plan_targets)
            kw = {"into": into, "strip_prefixes": self.strip_prefixes, "mmap": req.mmap,
                  "deadline": time.monotonic() + self.timeout}  # an I/O fault is retried within it
            if req.step is None:
                _, state = _resume.load_newest(
                    self.reading(), rank=req.shard, verify=req.verify, world_size=req.expect, reader=reader, **kw
                )
            else:
                state = _resume.load_step(
                    self.reading(), req.step, rank=req.shard, verify=req.verify, world_size=req.expect,
                    reader=reader, **kw,
                )  # fmt: skip
        else:
            state = self._load_agreed(req)
        if into is not None:
            _restore.restore_into(into, state, strip_prefixes=self.strip_prefixes)
        return state

    def _load_node_part(self, req: LoadRequest) -> Any:
        """``load()`` on a node-local root (``loading._nodeload``): the ranks agree on the
        newest step every rank holds with one attempt; each reads its own part from its node's
        disk if it holds that attempt, else (the persistent tier) from the store."""
        session = self.session
        assert session.dist is not None
        if req.shard != session.rank or req.mmap:
            raise ValueError("node_local=True loads each rank's own part: rank= and mmap=True are not supported")
        by = Deadline.after(self.timeout)  # one for the call: the store's listing, the agreements, the reads
        store = None
        if session.mirror is not None:
            m = session.mirror
            listed = None
            if session.rank == 0:
                listed = _nodeparts.store_steps(m.url, m.storage_options, by.sub(self.timeout / 2).remaining())
            store = (m.url, m.storage_options, listed)
        if session.replica is not None and session.memory is not None:
            # the replica's rounds run in one order on every rank: the memory tier's pushes first
            concurrent.futures.wait(session.memory.pending(), by.remaining() / 4)
        session.queries += 1
        return _nodeload.load_part(session.dist, f"q/{session.queries}/node-load", self.root, req.step, req.verify,
                                   by, store, session.opts.memory, session.replica)[1]  # fmt: skip

    def _load_agreed(self, req: LoadRequest) -> Any:
        """The collective part of :meth:`load`: choose, try on every rank, agree, repeat."""
        session, step, reader = self.session, req.step, req.reader
        assert session.dist is not None
        rejected: dict[int, CheckpointCorruptError] = {}
        warned: set[int] = set()
        for _ in range(MAX_LOAD_ROUNDS):

            # rank 0 names the exact commit (step, attempt, run: _runs.choice); every rank checks
            # that the manifest it reads is that attempt, so none reads another commit's files
            def pick() -> Any:
                root = self.reading()
                chosen = step if step is not None else _resume.newest(root, rejected, warned)
                return None if chosen is None else _runs.choice_at(root, chosen)

            # an I/O fault of rank 0's look is raised on every rank (none waits for a choice)
            retry_until = time.monotonic() + self.timeout / 2
            picked = _resume.picked(session.decided_by_leader(functools.partial(_resume.leader_pick, pick,
                                                                                retry_until)))  # fmt: skip
            if picked is None:
                raise _resume.no_checkpoint(self.root, rejected)
            chosen, attempt = _runs.unpack(picked)
            state: Any = None
            error: BaseException | None = None
            report: dict[str, Any] = {}
            try:
                # one pass: straight into the targets; verify_first: fresh tensors, restored
                # once every rank verified (an indexed step defers inside the reader); an
                # I/O fault is tried again first, leaving the others time to wait for us
                into = None if reader.verify_first else reader.into
                state = _readfault.retrying(
                    functools.partial(_resume.attempt, self.reading(), chosen, req.shard, req.verify, req.expect,
                                      into, reader.strip_prefixes, reader=reader, mmap=req.mmap, report=report,
                                      expect=attempt),
                    retry_until,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported to the others, raised below if it decides
                error = e
            session.queries += 1
            try:
                verdict = _agree.agree(
                    session.dist,
                    f"q/{session.queries}/load",
                    _resume.outcome_of(error, report),
                    lambda outcomes: _resume.decide(step is not None, outcomes),
                    self.timeout,
                )
            except BaseException:
                reader.abandon()
                raise
            kind = verdict["kind"]
            if kind == "ok":
                reader.finish()
                if verdict.get("full") and session.rank == 0:  # every file of the step verified
                    _resume.unmark(self.reading(), chosen, verdict["attempt"])
                return state
            reader.abandon()
            if kind == "error":
                if error is not None:
                    if isinstance(error, _discovery.Vanished | NoSuchShard | ObjectNotFoundError):
                        raise CheckpointNotFoundError(str(error)) from None
                    raise error
                raise _resume.error_from(chosen, verdict["failures"])
            if kind == "fallback":
                failures = verdict["failures"]
                r, first = min(failures.items(), key=lambda kv: int(kv[0]))
                _resume.warn_corrupt(self.root, chosen, first["msg"], f" on rank {r}")
                rejected[chosen] = CheckpointCorruptError(f"rank {r}: {first['msg']}")
                warned.add(chosen)
                if session.rank == 0 and error is None and attempt is not None:
                    # rank 0 decides the step rules: it must know even if rank r's mark was not written
                    _resume.mark(self.reading(), chosen, attempt, CheckpointCorruptError(first["msg"], first["path"]))
            # "retry": the choice was retired meanwhile; rank 0 looks again
            del state
        raise CheckpointNotFoundError(
            f"no checkpoint under {self.root} stayed in place long enough to load ({MAX_LOAD_ROUNDS} tries)"
        )


def load(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    into: Any = None,
    verify: bool = True,
    rank: int | None = None,
    strip_prefixes: Sequence[str] = (),
    per_rank: _load_global.PerRank = "error",
    storage_options: dict[str, str] | None = None,
    mmap: bool = False,
    verify_first: bool = False,
) -> Any:
    """Load rank ``rank``'s state (default 0) of a complete checkpoint under ``root`` (no Checkpointer needed).

    A checkpoint holding DTensors comes back with full global tensors (or, into DTensors
    of ``into=``, their local shards). Its other values are per rank: ``rank=`` picks the
    saved rank; without it they load only where every saved rank holds the same values,
    else ``CheckpointError`` names the keys, unless ``per_rank="rank0"``.

    ``step=None`` loads the newest checkpoint that verifies: a corrupt newest one is logged
    (WARNING, naming the file) and the next newest is loaded. An explicit ``step`` raises
    ``CheckpointNotFoundError`` if it is missing or was retired while being read and
    ``CheckpointCorruptError`` if it fails verification. A read that fails on I/O is tried
    again a few times (about 2 s of pauses), then raises ``CheckpointReadError`` naming the
    file, whatever ``step``: never a fallback, never a bad mark. With ``into=``, restores in place
    (tensors read straight into and checksummed as they land, see :meth:`Checkpointer.load`:
    a step that fails may leave them partly overwritten; ``verify_first=True`` writes no
    target before the whole state verified). Needs no ownership of the root:
    any number of readers may run while a job writes.

    ``strip_prefixes`` as for :class:`Checkpointer`: wrapper prefixes matched at ``into=``.
    ``root`` may be an ``s3://bucket/prefix`` URL (see :mod:`asyncckpt.remote`), with
    ``storage_options`` for its store.

    ``mmap=True`` returns tensors backed by the shard file (a private, copy-on-write mapping:
    nothing is copied, pages are read when first touched, writes never reach the file), for
    inspection and export of checkpoints larger than memory. With ``verify`` (the default)
    the shard's CRC-32C is checked once, up front, by streaming it through small buffers (no
    copy kept); ``verify=False`` reads nothing until touched. The tensors stay valid after
    retention removes the step (the mapping holds the file). Raises ``ValueError`` with
    ``into=``, for an ``s3://`` root, and for a step with a global index (DTensors, dedupe).
    """
    _load.check_mmap(mmap, into)
    prefixes = check_strip_prefixes(strip_prefixes)
    check_load_args(step, rank, per_rank, verify_first)
    opened = open_root(root, storage_options=storage_options) if storage_options else open_root(root)
    try:
        if mmap and not opened.caps.mmap:
            raise ValueError(f"mmap=True needs a local root, not {opened.url}")
        return read(opened, step, into=into, verify=verify, rank=rank, strip_prefixes=prefixes, per_rank=per_rank,
                    verify_first=verify_first, mmap=mmap)  # fmt: skip
    finally:
        opened.close()


def read(
    root: Root,
    step: int | None = None,
    *,
    into: Any = None,
    verify: bool = True,
    rank: int | None = None,
    strip_prefixes: tuple[str, ...] = (),
    per_rank: _load_global.PerRank = "error",
    mmap: bool = False,
    verify_first: bool = False,
    deadline_s: float | None = None,
) -> Any:
    """:func:`load` of ``root`` (any :class:`Root`), its arguments checked: the one load of a
    process without a Checkpointer, for every kind of root. ``deadline_s``: an I/O fault is
    tried again within it (``None``: the tries bound it)."""
    reader = _load_global.Reader(1, 0, rank, per_rank, into, strip_prefixes, verify_first=verify_first)
    shard = 0 if rank is None else rank
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    kw = {"into": into, "strip_prefixes": strip_prefixes, "reader": reader, "mmap": mmap, "deadline": deadline}
    # one pause of the collector for the whole load and restore (_gcpause: see _load.load_files)
    with _load.noting_partial_targets(reader), paused_gc():
        return _load_and_restore(root, step, shard, verify, kw)


def _load_and_restore(root: Root, step: int | None, shard: int, verify: bool, kw: dict[str, Any]) -> Any:
    """:func:`read`'s body (a function: its temporaries die inside the pause)."""
    if step is None:
        _, state = _resume.load_newest(root, rank=shard, verify=verify, **kw)
    else:
        state = _resume.load_step(root, step, rank=shard, verify=verify, **kw)
    if kw["into"] is not None:
        _restore.restore_into(kw["into"], state, strip_prefixes=kw["strip_prefixes"])
    return state
