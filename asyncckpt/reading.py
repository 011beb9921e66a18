"""What is on disk under a checkpoint root, read without torch.

The one reading layer that the ``asyncckpt`` command and tools stand on: which step
directories exist and in what state (complete, incomplete and why, a leftover, found bad by
an earlier verification), their files, sizes and checksums, and the key tree one rank saved.
Completeness is decided by the library's own discovery (:func:`find_latest`,
:func:`open_step`), so what this module calls complete is exactly what ``load()`` resumes
from. Manifests, shard headers and structure files are parsed by the same bounded parsers
the loader uses (``_manifest``, ``_header``); nothing here imports torch or unpickles.

Every defect of a file becomes a :class:`~asyncckpt.CheckpointCorruptError` naming it, and a
file the storage could not serve (EIO and the like) a :class:`~asyncckpt.CheckpointReadError`
naming it (not damage: never marked bad); one bad step never stops :func:`scan` from
describing the others.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
)
from ._info import CheckpointInfo
from .format import _index
from .format._bounds import check_structure_size, parse_structure
from .format._checksum import crc32c
from .format._header import TensorSlot, declared_length, parse_header, validate_header
from .format._keytree import Entry, outline, outline_entries
from .format._manifest import MANIFEST, FileEntry, Manifest, shard_name, tree_name
from .roots import Root
from .roots._find import describe, find_latest
from .roots._readfault import read_error, regular_file
from .roots._root import StepReader
from .roots.posix._discovery import (
    KnownBad,
    candidate_steps,
    check_files,
    newest_resumable,
    open_step,
    pause_before_looking_again,
    read_manifest,
)
from .roots.posix._listing import StepDir, scan, timestamp, usage
from .roots.posix._root import PosixRoot, PosixStepReader

__all__ = [
    "Entry",
    "StepDir",
    "candidate_steps",
    "check_files",
    "complete_checkpoints",
    "find_latest",
    "local_time",
    "open_step",
    "outline",
    "passed_over",
    "read_manifest",
    "read_rank_outline",
    "read_shard_slots",
    "read_structure",
    "resolve_step",
    "resolve_step_noting",
    "scan",
    "timestamp",
    "usage",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

def complete_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every resumable checkpoint under local ``root`` (complete, not known bad), oldest
    first, described as :func:`find_latest` describes one (none under a missing root)."""
    opened = PosixRoot(root)
    return [i for m in opened.resumable() if isinstance(i := describe(opened, m), CheckpointInfo)]


def resolve_step(root: str, step: int | None) -> tuple[str, Manifest]:
    """The directory and manifest of complete ``step``, or of the newest resumable one when ``None``.

    Raises ``CheckpointNotFoundError`` when there is no such (or no) complete checkpoint.
    """
    step_dir, manifest, _ = resolve_step_noting(root, step)
    return step_dir, manifest


def resolve_step_noting(root: str, step: int | None) -> tuple[str, Manifest, list[tuple[int, str]]]:
    """:func:`resolve_step`, and the steps newer than the newest resumable one that were passed
    over (newest first, each with why: known bad, corrupt, unreadable) when ``step`` is ``None``:
    what a tool taking "the newest" says it skipped."""
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    passed: list[tuple[int, str]] = []
    if step is None:
        skipped: dict[int, CheckpointCorruptError] = {}
        info = newest_resumable(root, skipped=skipped)
        passed = passed_over(skipped)
        if info is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {root}" + (
                f" (passed over: {'; '.join(f'step {s}: {w}' for s, w in passed[:5])}; --step N reads one anyway)"
                if passed else ""))  # fmt: skip
        step = info.step
    step_dir, manifest = open_step(root, step)
    return step_dir, manifest, passed


def passed_over(skipped: dict[int, CheckpointCorruptError]) -> list[tuple[int, str]]:
    """``skipped`` (of ``newest_resumable``) as (step, why) pairs, newest first."""
    return [(s, _why(e)) for s, e in sorted(skipped.items(), reverse=True)]


def _why(e: CheckpointCorruptError) -> str:
    if isinstance(e, KnownBad) or str(e).startswith("known bad"):
        return str(e)
    return f"known bad: {e}"


# ---------------------------------------------------------------------------- files of one step


def _open_regular(path: str, size: int) -> int:
    """Open a regular file of exactly ``size`` bytes, never through a link or a FIFO. A file
    the first lookup says is missing is looked up once more before it is called missing
    (``_discovery``: one ENOENT the next look contradicts is no damage)."""
    flags = os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            pause_before_looking_again()
            fd = os.open(path, flags)
    except OSError as e:
        raise read_error(e, "cannot open", path) from None
    return regular_file(fd, size, path)


def _pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    chunks: list[bytes] = []
    while n > 0:
        b = os.pread(fd, n, offset)
        if not b:
            raise CheckpointCorruptError("file ended early", path)
        chunks.append(b)
        n -= len(b)
        offset += len(b)
    return b"".join(chunks)


def read_shard_slots(path: str, size: int) -> dict[str, TensorSlot]:
    """The tensors a safetensors shard of ``size`` bytes declares, from its header alone.

    Uses the loader's header parser and validation (bounded by ``_header.MAX_HEADER``). Raises
    ``CheckpointCorruptError`` naming ``path`` if the header is unreadable or does not tile
    the data section exactly.
    """
    fd = _open_regular(path, size)
    try:
        prefix = _pread_exact(fd, 8, 0, path) if size >= 8 else b""
        n = header_length(prefix, size, path)
        return slots_of_header(prefix + _pread_exact(fd, n, 8, path), size, path)
    except OSError as e:
        raise read_error(e, "cannot read shard", path) from None
    finally:
        os.close(fd)


def header_length(prefix: bytes, size: int, where: str) -> int:
    """The header length a shard of ``size`` bytes declares in its first 8 bytes ``prefix``,
    checked against the limit and the file (``CheckpointCorruptError`` naming ``where`` and
    which of the two it breaks if not)."""
    try:
        return declared_length(prefix, size, where)
    except ValueError as e:
        raise CheckpointCorruptError(f"bad safetensors header ({e})", where) from None


def slots_of_header(head: bytes, size: int, where: str) -> dict[str, TensorSlot]:
    """The tensors that ``head`` (a shard's first 8 + n bytes) declares for a shard of ``size``
    bytes: the loader's parser and validation; every defect names ``where``."""
    try:
        _, header = parse_header(head, size, where)
        if len(head) % 8:
            raise ValueError("data section is not 8-byte aligned")
        return {s.name: s for s in validate_header(header, size - len(head))}
    except (ValueError, UnicodeDecodeError, RecursionError, OverflowError, MemoryError) as e:
        raise CheckpointCorruptError(f"bad safetensors header ({e})", where) from None


def read_structure(path: str, size: int, expected_crc: int | None) -> Any:
    """One rank's structure file (the JSON key tree), checksum verified when ``expected_crc`` is
    given; bounded as the loader bounds it (``_bounds``)."""
    check_structure_size(size, path)
    fd = _open_regular(path, size)
    try:
        raw = _pread_exact(fd, size, 0, path)
    except OSError as e:
        raise read_error(e, "cannot read structure", path) from None
    finally:
        os.close(fd)
    return parse_structure(raw, path, size, expected_crc)


def parse_index(raw: bytes, size: int, crc: int, manifest: Manifest, where: str, plain_only: bool = False) -> Any:
    """A step's global index from its bytes ``raw`` (listed with ``size`` and ``crc``), checked
    by the loader's own validator (``_index.parse``); ``CheckpointCorruptError`` naming
    ``where`` with the loader's words otherwise."""
    if len(raw) != size or crc32c(raw) != crc:
        raise CheckpointCorruptError("checksum mismatch", where)
    try:
        return _index.parse(raw, manifest.world_size, {f.name: f.size for f in manifest.files}, plain_only)
    except ValueError as e:
        raise CheckpointCorruptError(f"bad global index ({e})", where) from None


def index_slots(index: Any, rank: int) -> dict[str, TensorSlot]:
    """The tensors of rank ``rank`` that a parsed global index places in other files (written
    once by another rank: ``dedupe``) or splits into chunks (DTensors), as slots to show."""
    return {
        name: TensorSlot(name, dtype, shape, 0, n)
        for name, (dtype, shape, _, _, n, _) in (index["plain"].get(rank) or {}).items()
    }


def indexed_slots(raw: bytes, size: int, crc: int, manifest: Manifest, rank: int, where: str) -> dict[str, TensorSlot]:
    """:func:`index_slots` of the index whose bytes are ``raw`` (only its plain entries checked)."""
    return index_slots(parse_index(raw, size, crc, manifest, where, plain_only=True), rank)


def check_rank(manifest: Manifest, rank: int) -> None:
    """``CheckpointNotFoundError`` unless the step has a rank ``rank``."""
    if not 0 <= rank < manifest.world_size:
        raise CheckpointNotFoundError(
            f"step {manifest.step} was saved by {manifest.world_size} rank(s); there is no rank {rank}"
        )


def read_rank_outline(
    step_dir: str, manifest: Manifest, rank: int, index: Any = None
) -> tuple[list[Entry], dict[str, TensorSlot]]:
    """Rank ``rank``'s key tree as :class:`Entry` lines, and its shard's tensor slots, of the
    step directory ``step_dir`` (``ROOT/step_N``) whose manifest is ``manifest``.

    :func:`outline_of` through the step held open (``PosixStepReader``): reads only the
    structure file (checksum verified), the shard header and the global index (``index``:
    already parsed), never the tensor data. Raises ``CheckpointNotFoundError`` if the step has
    no such rank (or is another commit by now) and ``CheckpointCorruptError`` if the files are
    malformed, the tree names a tensor the shard lacks or a DTensor the index does not store
    (what a load of that rank raises).
    """
    check_rank(manifest, rank)
    with PosixStepReader(os.path.dirname(os.path.abspath(step_dir)), manifest.step) as reader:
        if reader.manifest.attempt != manifest.attempt:
            raise CheckpointNotFoundError(f"{step_dir} was replaced while being read")
        return outline_of(reader, rank, index)


def resolve_in(root: Root, step: int | None) -> tuple[Manifest, list[tuple[int, str]]]:
    """The manifest of complete ``step`` of any root (the newest resumable when ``None``, what
    ``load()`` takes), and the newer steps passed over then (newest first, each with why).
    ``CheckpointNotFoundError`` when there is no such (or no) complete checkpoint."""
    passed: list[tuple[int, str]] = []
    if step is None:
        skipped: list[tuple[int, CheckpointCorruptError]] = []
        step = root.newest_resumable(skipped)
        passed = [(s, _why(e)) for s, e in skipped]
        if step is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {root.url}" + (
                f" (passed over: {'; '.join(f'step {s}: {w}' for s, w in passed[:5])}; --step N reads one anyway)"
                if passed else ""))  # fmt: skip
    return root.open_step(step), passed


def outline_in(root: Root, manifest: Manifest, rank: int) -> tuple[list[Entry], dict[str, TensorSlot]]:
    """:func:`read_rank_outline` of a step of any root: :func:`outline_of` through a reader of
    that step (``Root.open_reader``). ``CheckpointNotFoundError`` if the step was replaced by
    another commit since ``manifest`` was read."""
    with root.open_reader(manifest.step) as reader:
        if reader.manifest.attempt != manifest.attempt:
            raise CheckpointNotFoundError(f"step {manifest.step} under {root.url} was replaced while being read")
        return outline_of(reader, rank)


def index_of(reader: StepReader) -> Any:
    """The global index of the step ``reader`` holds (bounded by ``_index.MAX_INDEX_BYTES``),
    checked as a load checks it (:func:`parse_index`); ``CheckpointCorruptError`` naming it."""
    m = reader.manifest
    f = listed(reader, _index.INDEX)
    where = reader.locate(_index.INDEX)
    if f.size > _index.MAX_INDEX_BYTES:
        raise CheckpointCorruptError(f"index of {f.size} bytes is too large", where)
    return parse_index(reader.read(_index.INDEX), f.size, f.crc32c, m, where)


def listed(reader: StepReader, name: str) -> FileEntry:
    """The manifest's entry of ``name``; ``CheckpointCorruptError`` naming the manifest if it
    lists none (a step's structure needs it)."""
    try:
        return reader.manifest.file(name)
    except CheckpointCorruptError:
        raise CheckpointCorruptError(f"manifest does not list {name}", f"{reader.locate()}/{MANIFEST}") from None


def outline_of(reader: StepReader, rank: int, index: Any = None) -> tuple[list[Entry], dict[str, TensorSlot]]:
    """:func:`read_rank_outline` through ``reader``'s bounded reads: the structure file, the
    shard's 8-byte length and header, the global index (``index``: already :func:`index_of`'d);
    never the tensor data. Every defect names the file (``StepReader.locate``)."""
    m = reader.manifest
    check_rank(m, rank)
    tree, shard = listed(reader, tree_name(rank)), listed(reader, shard_name(rank))
    tree_where, shard_where = reader.locate(tree.name), reader.locate(shard.name)
    check_structure_size(tree.size, tree_where)
    parsed = parse_structure(reader.read(tree.name), tree_where, tree.size, tree.crc32c)
    head = reader.read(shard.name, 0, 8) if shard.size >= 8 else b""
    n = header_length(head, shard.size, shard_where)
    shard_slots = slots_of_header(head + reader.read(shard.name, 8, n), shard.size, shard_where)
    if index is None and any(f.name == _index.INDEX for f in m.files):
        index = index_of(reader)
    more = index_slots(index, rank) if index is not None else {}
    index_where = reader.locate(_index.INDEX)
    return rank_outline(parsed, shard_slots, more, tree_where, shard_where, index=index, index_where=index_where)


def rank_outline(
    tree: Any,
    shard_slots: dict[str, TensorSlot],
    indexed: dict[str, TensorSlot],
    tree_where: str,
    shard_where: str,
    *,
    index: Any = None,
    index_where: str | None = None,
) -> tuple[list[Entry], dict[str, TensorSlot]]:
    """The outline of one rank from its parsed structure, its shard's slots and the slots the
    global index adds; ``CheckpointCorruptError`` if the tree and the tensors disagree. With
    the fully parsed ``index`` (not ``plain_only``), every DTensor the tree names must be
    stored in it (``_index.lacking``, the loader's rule)."""
    slots = {**indexed, **shard_slots}
    dtensors: list[str] | None = [] if index is not None else None
    entries, missing = outline_entries(tree, slots, tree_where, dtensors)
    if dtensors:
        lacking = _index.lacking(index, dtensors)
        if lacking:
            raise CheckpointCorruptError(f"the index lacks DTensor {lacking[0]!r}", index_where)
    if missing:
        names = ", ".join(missing[:5])
        raise CheckpointCorruptError(f"structure names tensor(s) the shard lacks: {names}", shard_where)
    # A tensor of the shard that the tree does not name is not refused: no load refuses it
    # (verify passes exactly what loads), and a writer may store bytes for another reader
    # there (the DCP storage layer keeps DCP's serialized non-tensor values).
    return entries, shard_slots


def local_time(ts: float | None) -> str:
    """``ts`` as local ``YYYY-MM-DD HH:MM:SS``, or ``unknown`` for an implausible time."""
    ts = timestamp(ts)
    if ts is None:
        return "unknown"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "unknown"
