"""Which checkpoint a load reads: an explicit step, or the newest one that verifies.

``load(step=N)`` reads exactly step N: a checkpoint retired while it is read is "not found"
(never "corrupt"), damage raises ``CheckpointCorruptError``. ``load(step=None)`` reads the
newest complete checkpoint; if it fails verification it logs a WARNING naming the file,
remembers the verdict (``_badmarks``) and moves on to the next newest, and if it was
retired meanwhile it looks again. Both read through a pinned directory (``_discovery``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ._badmarks import record_bad
from ._discovery import Vanished, newest_complete, pin_step
from ._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ._load import load_files
from ._load_global import Reader, indexed, load_indexed_files
from ._manifest import Manifest
from ._runs import check_choice
from ._stepfiles import PinnedFiles, StepFiles

log = logging.getLogger("asyncckpt")

#: A load(step=None) that keeps finding its choice retired gives up after this long.
_SETTLE_S = 30.0
_MIN_ROUNDS = 5


class NoSuchShard(CheckpointNotFoundError):
    """The step exists but holds no shard for the rank asked for (no fallback for that)."""


def _check_shape(manifest: Manifest, step: int, rank: int, world_size: int | None) -> None:
    if world_size is not None and manifest.world_size != world_size:
        raise CheckpointError(
            f"step {step} was saved by {manifest.world_size} rank(s) but this job has "
            f"{world_size}; resharding is not supported: pass rank= to read one shard"
        )
    if rank >= manifest.world_size:
        raise NoSuchShard(f"step {step} was saved by {manifest.world_size} rank(s); no rank {rank}")


def attempt(
    root: str,
    step: int,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
    expect: str | None = None,
) -> Any:
    """Load rank ``rank``'s state of ``step``; raises ``Vanished`` if it was retired meanwhile.

    ``expect``: the manifest attempt rank 0 chose for a collective load; a step here that
    is another commit raises ``CheckpointError`` before anything is read (``_runs``).

    ``into``: tensors to read into in place (``_load.load_files``; once the shard verified
    when ``reader.verify_first``).
    A step with a global tensor index (DTensors) loads at any world size as ``reader`` says
    (``_load_global``; default: one process taking rank ``rank``'s per-rank values); its
    state is restored into ``into`` by the caller.

    ``mmap``: tensors backed by the shard's file (``_load.map_shard``); a step with a global
    index raises ``ValueError`` then (its tensors are assembled from chunks, not mapped).

    A data defect found in a checkpoint whose manifest is valid is recorded as a bad mark
    (best effort) before ``CheckpointCorruptError`` is raised.
    """
    with pin_step(root, step) as pinned:
        manifest = pinned.manifest
        assert manifest is not None
        check_choice(manifest, expect, pinned.path)
        try:
            return load_files_as(PinnedFiles(pinned, manifest), rank, verify, world_size, into, strip_prefixes,
                                 reader, mmap)  # fmt: skip
        except CheckpointCorruptError as e:
            if pinned.still_there():
                mark(root, step, manifest.attempt, e)
            raise


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
    """:func:`attempt`'s load of a complete step's ``files`` (local or on an object store):
    a step with a global index as ``reader`` says, any other by rank ``rank``'s shard (which
    must exist: ``NoSuchShard``; at the world size ``world_size`` when given). ``files`` are
    closed when the read is done."""
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
    if reader is not None and reader.into is not None and not reader.verify_first:
        reader.touched = True  # one pass: the targets are written as the bytes land
    if indexed(manifest):
        return load_indexed_files(files, reader if reader is not None else Reader(rank=rank), verify)
    first = reader is not None and reader.verify_first
    try:
        return load_files(files, rank, verify, into, strip_prefixes, mmap, first)
    finally:
        files.close()


def mark(root: str, step: int, attempt_id: str, err: CheckpointCorruptError) -> None:
    """Remember that ``step`` failed verification (never raises: readers may be read-only)."""
    try:
        record_bad(root, step, attempt_id, err.path or "", str(err))
    except Exception:  # best effort by contract
        log.debug("asyncckpt: could not record the bad mark of step %d under %s", step, root, exc_info=True)


def load_step(
    root: str,
    step: int,
    *,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
) -> Any:
    """Load exactly ``step``: ``CheckpointNotFoundError`` if it is missing or was retired."""
    try:
        return attempt(root, step, rank, verify, world_size, into, strip_prefixes, reader, mmap)
    except Vanished as e:
        raise CheckpointNotFoundError(str(e)) from None
    except NoSuchShard as e:
        raise CheckpointNotFoundError(str(e)) from None


def warn_corrupt(root: str, step: int, err: object, where: str = "") -> None:
    log.warning(
        "asyncckpt: checkpoint step %d under %s is corrupt%s (%s); falling back to the next newest",
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


def load_newest(
    root: str,
    *,
    rank: int,
    verify: bool,
    world_size: int | None = None,
    into: Any = None,
    strip_prefixes: Sequence[str] = (),
    reader: Reader | None = None,
    mmap: bool = False,
) -> tuple[int, Any]:
    """Load the newest complete checkpoint that verifies; return its step and the state."""
    rejected: dict[int, CheckpointCorruptError] = {}
    warned: set[int] = set()
    deadline = time.monotonic() + _SETTLE_S
    rounds = 0
    while True:
        rounds += 1
        skipped: dict[int, CheckpointCorruptError] = {}
        info = newest_complete(root, frozenset(rejected), skipped)
        for s, e in sorted(skipped.items(), reverse=True):
            if s not in warned:
                warned.add(s)
                warn_corrupt(root, s, e)
        if info is None:
            raise no_checkpoint(root, {**skipped, **rejected})
        try:
            return info.step, attempt(root, info.step, rank, verify, world_size, into, strip_prefixes, reader, mmap)
        except NoSuchShard as e:
            raise CheckpointNotFoundError(str(e)) from None
        except CheckpointNotFoundError:  # retired (or replaced) since it was found: look again
            if rounds >= _MIN_ROUNDS and time.monotonic() > deadline:
                raise CheckpointNotFoundError(
                    f"every checkpoint found under {root} was retired before it could be read "
                    f"({rounds} tries in {_SETTLE_S:.0f}s)"
                ) from None
        except CheckpointCorruptError as e:
            rejected[info.step] = e
            warned.add(info.step)
            warn_corrupt(root, info.step, e)


def outcome_of(exc: BaseException | None) -> dict[str, Any]:
    """A JSON description of one rank's load attempt, for the agreement between ranks."""
    if exc is None:
        return {"kind": "ok"}
    kind = (
        "error" if isinstance(exc, NoSuchShard)
        else "gone" if isinstance(exc, CheckpointNotFoundError)
        else "bad" if isinstance(exc, CheckpointCorruptError)
        else "error"
    )  # fmt: skip
    return {"kind": kind, "type": type(exc).__name__, "msg": str(exc), "path": getattr(exc, "path", None)}


def error_from(step: int, failures: dict[str, dict[str, Any]]) -> CheckpointError:
    """The error a rank raises for another rank's failure (named by its rank and file)."""
    r, first = min(failures.items(), key=lambda kv: int(kv[0]))
    msg = f"step {step}: rank {r}: {first['msg']}"
    if len(failures) > 1:
        msg += f" (and {len(failures) - 1} other rank(s))"
    if first["kind"] == "bad":
        err = CheckpointCorruptError(msg)
        err.path = first.get("path")
        return err
    if first["kind"] == "gone" or first["type"] in ("CheckpointNotFoundError", "NoSuchShard"):
        return CheckpointNotFoundError(msg)
    return CheckpointError(msg)


def decide(step_given: bool, outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's verdict on every rank's attempt: ``ok``, ``fallback`` (an older step),
    ``retry`` (the same choice again: it was retired meanwhile) or ``error``."""
    failures = {str(r): o for r, o in enumerate(outcomes) if o["kind"] != "ok"}
    if not failures:
        return {"kind": "ok"}
    kinds = {o["kind"] for o in failures.values()}
    if step_given or "error" in kinds:
        return {"kind": "error", "failures": failures}
    if "bad" in kinds:
        return {"kind": "fallback", "failures": {r: o for r, o in failures.items() if o["kind"] == "bad"}}
    return {"kind": "retry", "failures": failures}
