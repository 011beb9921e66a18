"""Which checkpoint a load reads, and the read itself, written once for every root (a POSIX
directory, an object store, memory: :class:`~asyncckpt.roots._root.Root`) and for a node's
part of a step on the node-local tiers (``roots._nodeparts.NodePart``, read by
``_nodeload`` and ``_peerread``).

``load(step=N)`` reads exactly step N: a checkpoint retired while it is read is "not found"
(never "corrupt"), damage raises ``CheckpointCorruptError``. ``load(step=None)`` reads the
newest resumable checkpoint (``Root.newest_resumable``: the library's one rule); if it fails
verification it logs a WARNING naming the file, remembers the verdict (``Root.mark_bad``) and
moves on to the next newest, and if it was retired meanwhile it looks again. Both read
through the step the root holds open (``Root.open_reader``: a pinned directory, an
attempt's prefix, a memory step's bytes), whatever commits or retires meanwhile.

A read that fails on I/O (``_readfault``: EIO, ETIMEDOUT, a FUSE server's ENOSPC, a store's
503s or silence, ...) is neither damage nor a retirement: it is tried again within the
load's deadline (``_readfault.retrying``), then ``CheckpointReadError`` naming the file is
raised, for an explicit step and for ``step=None`` alike: no mark, no fallback. A load that
verified every file of a step drops a mark of that same attempt (a verdict proven stale).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from .._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ObjectNotFoundError,
    ObjectStoreError,
)
from ..format._manifest import Manifest, shard_name, tree_name
from ..roots._readfault import fault_of, retrying, store_fault
from ..roots._registry import open_root
from ..roots._root import Readable, Root, StepReader
from ..roots._runs import check_choice
from ..roots.posix._discovery import Vanished
from ._load import load_files
from ._load_global import Reader, indexed, load_indexed_files
from ._stepfiles import NoSuchShard, ReaderFiles, StepFiles
from ._targets import Unfit

log = logging.getLogger("asyncckpt")
T = TypeVar("T")

#: A load(step=None) that keeps finding its choice retired gives up after this long.
_SETTLE_S = 30.0
_MIN_ROUNDS = 5


def _check_shape(manifest: Manifest, step: int, rank: int, world_size: int | None) -> None:
    if world_size is not None and manifest.world_size != world_size:
        raise CheckpointError(
            f"step {step} was saved by {manifest.world_size} rank(s) but this job has "
            f"{world_size}; resharding is not supported: pass rank= to read one shard"
        )
    if rank >= manifest.world_size:
        raise NoSuchShard(f"step {step} was saved by {manifest.world_size} rank(s); no rank {rank}")


@contextlib.contextmanager
def rooted(root: Readable | str | os.PathLike[str]) -> Iterator[Readable]:
    """``root`` itself, or the root at a path or ``memory://`` URL (``open_root``), closed after."""
    if not isinstance(root, (str, os.PathLike)):
        yield root
        return
    opened = open_root(root)
    try:
        yield opened
    finally:
        opened.close()


def typed(fn: Callable[[], T]) -> T:
    """``fn()`` with a store's own error met while opening or reading a step (its manifest,
    its listing) raised as what it means to a load (``_readfault.store_fault``); a missing
    object as it is (the step was retired: the caller looks again)."""
    try:
        return fn()
    except ObjectNotFoundError:
        raise
    except ObjectStoreError as e:
        raise store_fault(e) from e


def attempt(
    root: Readable | str | os.PathLike[str],
    step: int,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
    report: dict[str, Any] | None = None,
    expect: str | None = None,
    drop_stale_mark: bool = True,
) -> Any:
    """Load rank ``rank``'s state of ``step`` of ``root`` (a :class:`Root`, a node's part of a
    step: ``roots._nodeparts.NodePart``, or a local path);
    raises ``Vanished`` if it was retired meanwhile.

    ``expect``: the manifest attempt rank 0 chose for a collective load; a step here that
    is another commit raises ``CheckpointError`` before anything is read (``_runs``).

    ``into``: tensors to read into in place (``_load.load_files``; once the shard verified
    when ``reader.verify_first``).
    A step with a global tensor index (DTensors) loads at any world size as ``reader`` says
    (``_load_global``; default: one process taking rank ``rank``'s per-rank values); its
    state is restored into ``into`` by the caller.

    ``mmap``: tensors backed by the shard's file (``_load.map_shard``: a root whose
    ``caps.mmap`` says it has files, else ``ValueError``); a step with a global index raises
    ``ValueError`` then (its tensors are assembled from chunks, not mapped).

    A data defect found in a checkpoint whose manifest is valid is recorded as a bad mark
    (best effort) before ``CheckpointCorruptError`` is raised; an I/O fault
    (``CheckpointReadError``) is raised as it is, unmarked; either one on a step that was
    retired meanwhile is ``Vanished``. A load that verified every file of the step drops a
    mark of this attempt (unless ``drop_stale_mark`` is False: a step ``newest_resumable``
    chose carries none, and a store's drop is a write). ``report`` (a collective load's) receives the attempt id, the
    step's files and the ones this load verified in full (:func:`outcome_of`).
    """
    with rooted(root) as r:
        if mmap and not r.caps.mmap:
            raise ValueError(f"mmap=True needs a local root, not {r.url}")
        return typed(lambda: _attempt(r, step, rank, verify, world_size, into, strip_prefixes, reader, mmap, report,
                                      expect, drop_stale_mark))  # fmt: skip


def _attempt(
    root: Readable, step: int, rank: int, verify: bool, world_size: int | None, into: Any,
    strip_prefixes: Sequence[str], reader: Reader | None, mmap: bool, report: dict[str, Any] | None,
    expect: str | None, drop_stale_mark: bool,
) -> Any:  # fmt: skip
    opened = root.open_reader(step)
    manifest = opened.manifest
    try:
        check_choice(manifest, expect, opened.locate())
        if mmap and opened.fileno(shard_name(rank)) is None:  # a tier root's step read from the store
            raise ValueError(f"mmap=True needs a local step; step {step} is only on the store ({opened.locate()}): "
                             "load it without mmap")
    except BaseException:
        opened.close()
        raise
    try:
        state = load_files_as(ReaderFiles(opened), rank, verify, world_size, into, strip_prefixes, reader, mmap)
    except Exception as e:
        judge(root, opened, e)
        raise
    verified = verified_files(manifest, rank, verify)
    if report is not None:
        report.update(attempt=manifest.attempt, files=sorted(f.name for f in manifest.files),
                      verified=sorted(verified))  # fmt: skip
    elif drop_stale_mark and verified >= {f.name for f in manifest.files}:
        unmark(root, step, manifest.attempt)
    return state


def verified_files(manifest: Manifest, rank: int, verify: bool) -> frozenset[str]:
    """The files of ``manifest`` a load of rank ``rank`` checked in full: its structure and its
    shard when ``verify`` and the step has no global index (an indexed step is read by
    blocks, each checked on its own, and may read only part of a file)."""
    if not verify or indexed(manifest):
        return frozenset()
    return frozenset({tree_name(rank), shard_name(rank)})


def load_files_as(
    files: StepFiles,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
) -> Any:
    """:func:`attempt`'s load of a complete step's ``files``: a step with a global index as
    ``reader`` says, any other by rank ``rank``'s shard (which must exist: ``NoSuchShard``; at
    the world size ``world_size`` when given). ``files`` are closed when the read is done."""
    manifest = files.manifest
    step = manifest.step
    try:
        if not indexed(manifest):
            _check_shape(manifest, step, rank, world_size)
        if mmap and indexed(manifest):
            raise ValueError(
                f"step {step} holds DTensors or deduplicated tensors (a global index): mmap=True maps one "
                "rank's shard file and cannot serve it; load without mmap, or `asyncckpt export` it"
            )
    except BaseException:
        files.close()
        raise
    was_touched = reader is not None and reader.touched
    if reader is not None and reader.into is not None and not reader.verify_first:
        reader.touched = True  # one pass: the targets are written as the bytes land
    try:
        if indexed(manifest):
            return load_indexed_files(files, reader if reader is not None else Reader(rank=rank), verify)
        first = reader is not None and reader.verify_first
        try:
            return load_files(files, rank, verify, into, strip_prefixes, mmap, first)
        finally:
            files.close()
    except BaseException as e:
        if reader is not None and isinstance(e, Unfit):
            reader.touched = was_touched  # refused before any read: this attempt wrote nothing
        elif reader is not None and reader.touched:
            reader.dirty = True  # bytes of a failed read may be in the targets
        raise


def judge(root: Readable, reader: StepReader, err: BaseException) -> None:
    """What ``err``, raised reading the step ``reader`` holds, means (every reader of a held
    step, a load's and an export's, decides it here): a defect or an I/O fault on a step no
    longer there (retired, replaced) raises ``Vanished``, neither damage nor the storage; a
    defect of the commit still there is recorded as its bad mark. Otherwise returns, for
    the caller to raise ``err`` itself."""
    fault = fault_of(err)
    if fault in ("corrupt", "io") and not reader.still_there():
        step = reader.manifest.step
        raise Vanished(f"step {step} under {root.url} was retired or replaced while it was being read") from None
    if isinstance(err, CheckpointCorruptError):
        mark(root, reader.manifest.step, reader.manifest.attempt, err)


def mark(root: Readable, step: int, attempt_id: str, err: CheckpointCorruptError) -> None:
    """Remember that ``step`` failed verification (never raises: readers may be read-only)."""
    try:
        root.mark_bad(step, attempt_id, err.path or "", str(err))
    except Exception:  # best effort by contract
        log.debug("asyncckpt: could not record the bad mark of step %d under %s", step, root.url, exc_info=True)


def unmark(root: Readable, step: int, attempt_id: str) -> None:
    """Forget a mark of ``step`` that judged this very attempt: every file of it just verified
    (never raises: readers may be read-only)."""
    try:
        if root.clear_bad(step, attempt_id):
            log.info("asyncckpt: step %d under %s verified in full: its bad mark is dropped", step, root.url)
    except Exception:  # best effort by contract
        log.debug("asyncckpt: could not drop the bad mark of step %d under %s", step, root.url, exc_info=True)


def load_step(
    root: Readable,
    step: int,
    *,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
    deadline: float | None = None,
    expect: str | None = None,
) -> Any:
    """Load exactly ``step``: ``CheckpointNotFoundError`` if it is missing or was retired,
    ``CheckpointReadError`` if it could not be read within the tries (and ``deadline``,
    ``time.monotonic()`` seconds) of ``_readfault.retrying``. ``expect`` as for :func:`attempt`."""
    try:
        return retrying(lambda: attempt(root, step, rank, verify, world_size, into, strip_prefixes, reader, mmap,
                                        expect=expect), deadline)  # fmt: skip
    except (Vanished, NoSuchShard) as e:
        raise CheckpointNotFoundError(str(e)) from None
    except ObjectNotFoundError as e:  # retired while being read (manifest first, then objects)
        raise CheckpointNotFoundError(f"step {step} under {root.url} vanished while being read ({e})") from None


def warn_corrupt(root: str, step: int, err: object, where: str = "") -> None:
    log.warning(
        "asyncckpt: checkpoint step %d under %s is corrupt%s: it does not verify (%s); falling back to the next newest",
        step, root, where, err,
    )  # fmt: skip


def no_checkpoint(root: str, rejected: dict[int, CheckpointCorruptError]) -> CheckpointError:
    """The error when nothing loads: the newest verdict if every candidate was corrupt."""
    if rejected:
        newest = max(rejected)
        err = rejected[newest]
        out = CheckpointCorruptError(
            f"no checkpoint under {root} verifies ({len(rejected)} corrupt); the newest, step {newest}: {err}"
        )
        out.path = err.path
        return out
    return CheckpointNotFoundError(f"no complete checkpoint under {root}")


def newest(root: Root, rejected: dict[int, CheckpointCorruptError], warned: set[int]) -> int | None:
    """The newest resumable step of ``root`` not in ``rejected``; the damaged and known-bad
    steps passed over on the way are added to ``rejected`` and warned of once."""
    passed: list[tuple[int, CheckpointCorruptError]] = []
    # a root that cannot be listed raises its own error (a store's: ObjectStoreError, which
    # says which tier could not be read in tier mode); reads of a step are typed by attempt()
    found = root.newest_resumable(passed, frozenset(rejected))
    for s, e in passed:
        rejected.setdefault(s, e)
        if s not in warned:
            warned.add(s)
            warn_corrupt(root.url, s, e)
    return found


def load_newest(
    root: Root,
    *,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
    deadline: float | None = None,
) -> tuple[int, Any]:
    """Load the newest resumable checkpoint that verifies; return its step and the state.

    Only a content fault (``CheckpointCorruptError``) moves on to an older step; a read that
    fails on I/O is tried again (within ``deadline``, and the settling time of a root whose
    choices keep being retired), then its ``CheckpointReadError`` is raised: an older step is
    never loaded in place of one that could not be read."""
    rejected: dict[int, CheckpointCorruptError] = {}
    warned: set[int] = set()
    settle = time.monotonic() + _SETTLE_S
    io_deadline = settle if deadline is None else min(deadline, settle)
    rounds = 0
    while True:
        rounds += 1
        chosen = retrying(lambda: newest(root, rejected, warned), io_deadline)
        if chosen is None:
            raise no_checkpoint(root.url, rejected)
        try:
            return chosen, retrying(
                functools.partial(attempt, root, chosen, rank, verify, world_size, into, strip_prefixes, reader, mmap,
                                  drop_stale_mark=False),
                io_deadline,
            )
        except NoSuchShard as e:
            raise CheckpointNotFoundError(str(e)) from None
        except (CheckpointNotFoundError, ObjectNotFoundError):  # retired (or replaced) since it was found: look again
            if rounds >= _MIN_ROUNDS and time.monotonic() > settle:
                raise CheckpointNotFoundError(
                    f"every checkpoint found under {root.url} was retired before it could be read "
                    f"({rounds} tries in {_SETTLE_S:.0f}s)"
                ) from None
        except CheckpointCorruptError as e:
            rejected[chosen] = e
            warned.add(chosen)
            warn_corrupt(root.url, chosen, e)


def outcome_of(exc: BaseException | None, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON description of one rank's load attempt, for the agreement between ranks: its
    kind (``ok``, ``bad``: a content fault, ``io``: an I/O fault, ``gone``: retired meanwhile,
    ``error``: anything else) as ``_readfault.fault_of`` tells it; an ``ok`` carries
    :func:`attempt`'s ``report``."""
    if exc is None:
        return {"kind": "ok", **(report or {})}
    fault = fault_of(exc)
    kind = "error" if isinstance(exc, NoSuchShard) else {"corrupt": "bad", "io": "io", "gone": "gone"}.get(
        fault or "", "error"
    )
    out = {"kind": kind, "type": type(exc).__name__, "msg": str(exc), "path": getattr(exc, "path", None),
           "errno": None, "strerror": None}  # fmt: skip
    if isinstance(exc, OSError):
        out.update(path=out["path"] or exc.filename, errno=exc.errno, strerror=exc.strerror)
    return out


def error_from(step: int, failures: dict[str, dict[str, Any]]) -> CheckpointError:
    """The error a rank raises for another rank's failure (named by its rank and file)."""
    r, first = min(failures.items(), key=lambda kv: int(kv[0]))
    others = f" (and {len(failures) - 1} other rank(s))" if len(failures) > 1 else ""
    if first["kind"] == "io":
        what = first.get("strerror") or first["msg"]
        path = first.get("path")
        return CheckpointReadError(first.get("errno"), f"step {step}: rank {r}: {what}{others}",
                                   str(path) if path is not None else None)  # fmt: skip
    msg = f"step {step}: rank {r}: {first['msg']}{others}"
    if first["kind"] == "bad":
        err = CheckpointCorruptError(msg)
        err.path = first.get("path")
        return err
    if first["kind"] == "gone" or first["type"] in ("CheckpointNotFoundError", "NoSuchShard"):
        return CheckpointNotFoundError(msg)
    return CheckpointError(msg)


def decide(step_given: bool, outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's verdict on every rank's attempt: ``ok``, ``fallback`` (an older step: a content
    fault on some rank), ``retry`` (the same choice again: it was retired meanwhile) or
    ``error``. An I/O fault on any rank is an ``error`` naming it, never a fallback: the step
    may be good. An ``ok`` says whether the ranks together verified every file of the step
    (``full``, with its ``attempt``): a mark of that attempt is then stale."""
    failures = {str(r): o for r, o in enumerate(outcomes) if o["kind"] != "ok"}
    if not failures:
        attempts = {o.get("attempt") for o in outcomes}
        verified = {name for o in outcomes for name in o.get("verified", ())}
        files = outcomes[0].get("files")
        full = len(attempts) == 1 and None not in attempts and files is not None and set(files) <= verified
        return {"kind": "ok", "full": full, "attempt": outcomes[0].get("attempt")}
    kinds = {o["kind"] for o in failures.values()}
    if "io" in kinds:
        return {"kind": "error", "failures": {r: o for r, o in failures.items() if o["kind"] == "io"}}
    if step_given or "error" in kinds:
        return {"kind": "error", "failures": failures}
    if "bad" in kinds:
        return {"kind": "fallback", "failures": {r: o for r, o in failures.items() if o["kind"] == "bad"}}
    return {"kind": "retry", "failures": failures}


def leader_pick(pick: Callable[[], Any], deadline: float | None) -> dict[str, Any]:
    """Rank 0's choice of the step every rank tries, as JSON every rank can act on:
    ``{"step": s}`` (``None``: nothing to load), or ``{"io": outcome}`` when rank 0 could not
    read the root or a step (tried again within ``deadline`` first) and every rank must
    raise it (:func:`picked`), not wait for a choice that never comes."""
    try:
        return {"step": retrying(pick, deadline)}
    except Exception as e:
        if fault_of(e) != "io":  # CheckpointReadError, or an object store's error (503s, silence)
            raise
        return {"io": outcome_of(e)}


def picked(shared: dict[str, Any]) -> Any:
    """The choice :func:`leader_pick` shared (``_runs.choice``: step, attempt, run; ``None``:
    nothing to load); its ``CheckpointReadError`` on every rank."""
    o = shared.get("io")
    if o is not None:
        path = o.get("path")
        raise CheckpointReadError(o.get("errno"), f"rank 0, choosing the step to load: {o.get('strerror') or o['msg']}",
                                  str(path) if path is not None else None)  # fmt: skip
    return shared["step"]
