"""Verification, written once for every root: recompute every checksum of one committed step
through a :class:`~asyncckpt.roots._root.StepReader` (``Root.open_reader``), and check every
rank's structure as a load checks it.

The rule: a step passes exactly when every rank of it loads (``verify`` and ``load`` agree).
Checked: the step's files against its manifest (at opening: names and sizes), every listed
file's CRC-32C, a global index by the loader's own validator (``_index.parse``: chunks tiling
every DTensor, no overlap, in bounds) and the CRC of every block and entry it lists (computed
in the same pass as the file's), and every rank's tree against its shard header and the index,
the tensor bytes adding up to the manifest's. Data is streamed in windows of the medium's size
(``StepReader.window``), the next window read while the last one is checksummed; a medium
that serves several reads at once (``StepReader.parallel``: a store) has that many files
read together. Memory stays at two windows per file in flight.

A content fault is remembered through the root (``Root.mark_bad``: readers pass over the step)
and a step that verified drops a mark of that very attempt (``Root.clear_bad``); best effort (a
read-only root keeps no mark). A file the medium could not serve (``CheckpointReadError``, tried
again first: ``_readfault.retrying``) is a problem with ``io`` set, never damage, never marked;
a step retired or replaced while it was read is ``vanished``, never damage. Torch-free.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError, without_path
from ..format import _index
from ..format._checksum import RangeCheck, crc32c
from ..format._manifest import MANIFEST, FileEntry
from ..reading import index_of, outline_of
from ..roots import Root, open_root
from ..roots._readfault import fault_of, retrying
from ..roots._root import StepReader

Blocks = Sequence[tuple[int, int, int, str]]


@dataclass(frozen=True)
class Problem:
    """One defect found by :func:`verify_opened`: the file and what is wrong with it."""

    path: str
    reason: str
    #: the checkpoint went away while it was verified (retired or replaced): not damage
    vanished: bool = False
    #: the storage could not serve the file (an I/O error, tried again first): not damage
    io: bool = False

    def __str__(self) -> str:
        return f"{self.reason}: {self.path}"


def step_bytes(reader: StepReader) -> int:
    """Bytes :func:`verify_opened` reads: every listed file plus the manifest."""
    return reader.manifest_size + sum(f.size for f in reader.manifest.files)


def verify_step(
    root: Root | str, step: int, advance: Callable[[int], None] | None = None, *, record: bool = True
) -> list[Problem]:
    """:func:`verify_opened` of committed ``step`` of ``root`` (a :class:`Root` or where one
    is: ``asyncckpt.roots.open_root``). Opening errors propagate (not committed, files not
    the manifest's, unreadable)."""
    if isinstance(root, str):
        opened = open_root(root)
        try:
            return verify_step(opened, step, advance, record=record)
        finally:
            opened.close()
    with root.open_reader(step) as reader:
        return verify_opened(root, reader, advance, record=record)


def verify_opened(
    root: Root, reader: StepReader, advance: Callable[[int], None] | None = None, *, record: bool = True
) -> list[Problem]:
    """Every problem of the step ``reader`` holds (module docstring; empty: every rank of it
    loads). ``advance(n)`` reports bytes read (each byte once, however often it was read
    again), from the calling thread or a reading one. With ``record``, the verdict goes to
    ``root``'s bad marks."""
    m = reader.manifest
    problems: list[Problem] = []
    lock = threading.Lock()

    def tick(n: int) -> None:
        if advance is not None:
            with lock:
                advance(n)

    tick(reader.manifest_size)
    index: Any = None
    ranges: dict[str, list[tuple[int, int, int, str]]] = {}
    if any(f.name == _index.INDEX for f in m.files):
        try:
            index = retrying(functools.partial(index_of, reader))
            ranges = _index.checked_ranges(index)
        except CheckpointError as e:
            problems.append(_problem(e, reader.locate(_index.INDEX)))
    def check(f: FileEntry) -> Problem | None:
        return _check_file(reader, f, ranges.get(f.name, ()), tick)

    workers = min(reader.parallel, len(m.files))
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="asyncckpt-verify") as pool:
            found = list(pool.map(check, m.files))
    else:  # in the calling thread: an interrupt stops it at the next window
        found = [check(f) for f in m.files]
    problems.extend(p for p in found if p is not None)
    if not problems:
        total = 0
        for rank in range(m.world_size):
            try:
                _, slots = retrying(functools.partial(outline_of, reader, rank, index))
                total += sum(s.end - s.begin for s in slots.values())
            except CheckpointError as e:
                problems.append(_problem(e, reader.locate()))
        if not problems and total != m.nbytes:
            reason = f"shards hold {total} tensor bytes, the manifest says {m.nbytes}"
            problems.append(Problem(f"{reader.locate()}/{MANIFEST}", reason))
    if not reader.still_there():
        # retired or replaced while we read it: not damage, nothing to remember; and not "ok"
        # either (the bytes read were the commit's, but no load will find it any more)
        return [Problem(reader.locate(), f"step {m.step} was retired or replaced while being verified", vanished=True)]
    damage = [p for p in problems if not p.io]
    if damage and record:
        root.mark_bad(m.step, m.attempt, damage[0].path, damage[0].reason)
    elif not problems and record:
        root.clear_bad(m.step, m.attempt)  # a stale verdict on this attempt
    return problems


def _problem(e: CheckpointError, where: str) -> Problem:
    """``e`` as the problem of a file (``where`` if it names none)."""
    path = getattr(e, "path", None) or getattr(e, "filename", None) or where
    if fault_of(e) == "io":
        return Problem(path, f"I/O error, not damage ({without_path(e)})", io=True)
    return Problem(path, without_path(e))


def _check_file(reader: StepReader, f: FileEntry, blocks: Blocks, tick: Callable[[int], None]) -> Problem | None:
    """The problem of listed file ``f`` (``None``: its CRC and every block of ``blocks`` in it
    match), read again from its start after an I/O error (``_readfault.retrying``)."""
    high = 0

    def once() -> tuple[int, RangeCheck]:
        pos = 0

        def seen(n: int) -> None:  # count each byte once however often it was read
            nonlocal pos, high
            pos += n
            if pos > high:
                tick(pos - high)
                high = pos

        check = RangeCheck(blocks)
        return file_crc(reader, f, seen, check), check

    try:
        crc, check = retrying(once)
    except CheckpointError as e:
        return _problem(e, reader.locate(f.name))
    if crc != f.crc32c:
        return Problem(reader.locate(f.name), "checksum mismatch")
    if check.bad:
        more = f" and {len(check.bad) - 3} more" if len(check.bad) > 3 else ""
        return Problem(reader.locate(f.name), f"checksum mismatch in {', '.join(check.bad[:3])}{more}")
    return None


def file_crc(
    reader: StepReader, f: FileEntry, advance: Callable[[int], None] | None = None, ranges: RangeCheck | None = None
) -> int:
    """CRC-32C of listed file ``f``, read in windows of ``reader.window`` bytes, the next one
    read (on a thread of its own) while this one is checksummed; ``ranges`` is fed every byte
    and finished; ``advance(n)`` is told of each window. Errors of the reads propagate."""
    size = f.size
    window = max(1, min(reader.window, size))
    bufs = [memoryview(bytearray(window)) for _ in range(2 if size > window else 1)]
    crc = 0
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-verify-read") as ahead:
        def fill(off: int, i: int) -> concurrent.futures.Future[None]:
            return ahead.submit(reader.read_into, f.name, off, bufs[i][: min(window, size - off)])

        pending = fill(0, 0) if size else None
        off, i = 0, 0
        while pending is not None:
            pending.result()
            n = min(window, size - off)
            view = bufs[i][:n]
            nxt = off + n
            pending = fill(nxt, 1 - i) if nxt < size else None
            crc = crc32c(view, crc)
            if ranges is not None:
                ranges.feed(off, view)
            if advance is not None:
                advance(n)
            off, i = nxt, 1 - i
    if ranges is not None:
        ranges.finish()
    return crc
