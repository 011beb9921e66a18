"""The streaming half of ``asyncckpt export``: a planned selection of one step's tensors
written as one safetensors file, every byte read through the step's
:class:`~asyncckpt.roots._root.StepReader` (a local directory's ``preadv``, a store's ranged
GETs, memory) and checksummed on the way.

Where the bytes come from, and what verifies them:

- a :class:`Slot` (a step without a global index, or a rank that held no DTensor) lies in the
  rank's shard, whose one CRC-32C (in the manifest) covers the whole file: the shard is read
  front to back in windows of ``BAND`` bytes, every byte checksummed, the selected tensors'
  bytes written on the way;
- a :class:`Plain` tensor of an indexed step has its own CRC in the index (possibly in
  another rank's file, when deduplicated): the plain tensors of one file are read together,
  in windows of up to ``BAND`` bytes over neighbouring tensors;
- a :class:`Global` (a DTensor) of more than ``BAND`` bytes is assembled from its chunks
  band by band: a band is a run of the output that is contiguous and at most ``BAND`` bytes
  (a range of rows, or of a row's elements), and each chunk's share of a band is one
  contiguous byte run of its file, all of a band's shares read at once. Bands advance in the
  output's order, so every chunk is read exactly once, front to back, and its CRC is
  continued across bands;
- smaller DTensors are assembled together, side by side in one band's buffer: their chunks
  read in windows of each file (the chunks of many tensors in one request), each checked
  against its CRC.

Each read is a whole window or a band's share, never a tensor at a time, and one request
(``StepReader.readv``: a store's one ranged GET of at most ``BAND`` bytes), so a store
answers few, large GETs; the next window is read while one is consumed, and reads in
different files are made at once. Memory: two buffers of ``BAND`` bytes (the window being
consumed and the next one; a band and the bounce buffer of its shares). The output is
written with ``pwrite`` (never mapped: a fault cannot become a SIGBUS).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .._errors import CheckpointCorruptError
from ..format._checksum import crc32c
from ..format._header import TensorSlot
from ..format._reshard import Box, SavedChunk, intersect
from ..format._safetensors import ST_TO_DTYPE
from ..roots._root import StepReader
from ..roots.posix._fileio import write_all
from ..threads._deadline import Deadline, result_of, wait_all
from ..threads._sync import CancelScope
from ._readinto import byte_view

#: The size of one piece in flight (there are two: see the module docstring).
BAND = 8 * 1024 * 1024
#: Bytes between two plain tensors of one file still read as one window (read and dropped).
GAP = 1024 * 1024
#: Reads of one band's shares in flight at once (a store's GETs; a disk's preadv).
SHARES_IN_FLIGHT = 8
#: How long a failed or interrupted write waits for its cancelled reads to stop (they stop at
#: once: a read's request is cancelled; a disk's preadv returns): then it goes on without them.
CANCELLED_READS_S = 10.0


@dataclass(frozen=True)
class Slot:
    """A tensor inside a shard verified as a whole: ``nbytes`` at absolute ``offset`` of ``file``."""

    name: str  # as saved
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Plain:
    """A plain tensor of an indexed step with its own CRC."""

    name: str
    file: str
    offset: int
    nbytes: int
    crc: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Global:
    """A DTensor: its chunks and their CRCs, from the global index."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[SavedChunk, ...]
    crcs: tuple[int, ...]


Source = Slot | Plain | Global


def nbytes_of(src: Source) -> int:
    """The bytes ``src`` takes in the output."""
    if isinstance(src, Global):
        return math.prod(src.shape) * ST_TO_DTYPE[src.dtype].itemsize
    return src.nbytes


@dataclass
class Whole:
    """A shard file verified by its whole-file CRC: its header bytes and tensor slots."""

    file: str
    size: int
    crc: int
    head: bytes
    data_start: int
    slots: list[TensorSlot]


@dataclass
class _Run:
    """Bytes ``[begin, end)`` of one file going to output byte ``at`` (``None``: checksummed
    only), with their CRC so far and, for a plain tensor, the CRC they must end with."""

    begin: int
    end: int
    at: int | None
    want: int | None = None
    name: str = ""
    crc: int = 0


class StreamWriter:
    """Writes sources read through ``reader`` into the open output ``out`` (at ``out_path``)."""

    def __init__(self, reader: StepReader, out: int, out_path: str) -> None:
        self.reader, self.out, self.out_path = reader, out, out_path
        self.band = torch.empty(BAND, dtype=torch.uint8)
        self.bounce = torch.empty(BAND, dtype=torch.uint8)
        self._pool = ThreadPoolExecutor(SHARES_IN_FLIGHT, thread_name_prefix="asyncckpt-export")
        #: every read runs in it: a failed or interrupted write ends the reads in flight at once
        #: (a store's GET that never answers would otherwise be waited for until its deadline)
        self._scope = CancelScope()
        self._reads: list[Future[None]] = []  # submitted, not yet seen done

    def close(self) -> None:
        """Stop the read threads: after a :meth:`write` that failed or was interrupted (Ctrl-C),
        the reads still in flight are cancelled, and waited for until they stopped (at most
        ``CANCELLED_READS_S``; every wait in slices, so a Ctrl-C is raised at once)."""
        self._scope.cancel()  # (none in flight after a write that returned)
        for f in self._reads:
            f.cancel()  # a read not started never starts
        stopped = wait_all(self._reads, Deadline.after(CANCELLED_READS_S))
        self._pool.shutdown(wait=stopped, cancel_futures=True)

    def _submit(self, file: str, offset: int, views: list[memoryview]) -> Future[None]:
        """:meth:`_read` on a read thread; the future is kept until seen done (:meth:`close`)."""
        self._reads = [f for f in self._reads if not f.done()]
        fut = self._pool.submit(self._read, file, offset, views)
        self._reads.append(fut)
        return fut

    def _read(self, file: str, offset: int, views: list[memoryview]) -> None:
        """``reader.readv`` on a read thread, in this writer's scope (ended by :meth:`close`)."""
        with self._scope.entered():
            self.reader.readv(file, offset, views)

    def write(self, tensors: Sequence[tuple[str, Source]], where: dict[str, int], wholes: dict[str, Whole]) -> None:
        """Write every ``(output name, source)`` at output byte ``where[name]``."""
        slots: dict[str, list[_Run]] = {}
        plains: dict[str, list[_Run]] = {}
        for name, src in tensors:
            if isinstance(src, Slot):
                slots.setdefault(src.file, []).append(_Run(src.offset, src.offset + src.nbytes, where[name]))
            elif isinstance(src, Plain):
                run = _Run(src.offset, src.offset + src.nbytes, where[name], src.crc, src.name)
                plains.setdefault(src.file, []).append(run)
        for file, runs in slots.items():
            whole = wholes[file]
            crc = self._through(file, [_Run(whole.data_start, whole.size, None), *runs], crc32c(whole.head))
            if crc != whole.crc:
                raise CheckpointCorruptError("checksum mismatch", self.reader.locate(file))
        for file, runs in plains.items():
            self._through(file, runs, None)
        group: list[tuple[Global, int]] = []  # small DTensors assembled together
        held = 0  # their bytes
        for name, src in sorted(tensors, key=lambda t: where[t[0]]):
            if not isinstance(src, Global):
                continue
            n = nbytes_of(src)
            if n > BAND:
                self._global(src, where[name])
                continue
            if held + n > BAND:
                self._globals_together(group)
                group, held = [], 0
            group.append((src, where[name]))
            held += n
        self._globals_together(group)

    # -- runs of one file, in windows
    def _through(self, file: str, runs: list[_Run], crc: int | None) -> int:
        """Read the bytes ``runs`` cover in file ``file`` window by window (the next window
        read while this one is consumed), writing each run's bytes to its place and continuing
        its CRC; a run with an expected CRC is compared when it ends. ``crc`` (not ``None``:
        a whole file's, ``runs[0]`` covering all of it) is continued over every window."""
        runs = sorted(runs, key=lambda r: (r.begin, r.end))
        active: list[_Run] = []
        nxt = 0
        spans = self._windows(file, windows(runs, BAND, GAP))
        try:
            for start, view in spans:
                end = start + len(view)
                if crc is not None:
                    crc = crc32c(view, crc)
                while nxt < len(runs) and runs[nxt].begin < end:
                    active.append(runs[nxt])
                    nxt += 1
                still: list[_Run] = []
                for r in active:
                    lo, hi = max(r.begin, start), min(r.end, end)
                    if lo < hi:
                        piece = view[lo - start : hi - start]
                        if r.want is not None:
                            r.crc = crc32c(piece, r.crc)
                        if r.at is not None:
                            write_all(self.out, piece, r.at + lo - r.begin, self.out_path)
                    if r.end > end:
                        still.append(r)
                    else:
                        self._check(file, r)
                active = still
        finally:
            spans.close()  # now, not when a traceback lets go of it: no read outlives this call
        for r in [*active, *runs[nxt:]]:  # empty tensors past the last window
            self._check(file, r)
        return 0 if crc is None else crc

    def _check(self, file: str, r: _Run) -> None:
        if r.want is not None and r.crc != r.want:
            raise CheckpointCorruptError(f"checksum mismatch in {r.name!r}", self.reader.locate(file))

    def _windows(self, file: str, spans: list[tuple[int, int]]) -> Generator[tuple[int, memoryview], None, None]:
        """``(offset, bytes)`` of each span of ``file`` in order, read into the two buffers in
        turn: span ``i + 1`` is being read while the caller holds span ``i``."""
        bufs = (byte_view(self.band), byte_view(self.bounce))
        pending: Future[None] | None = None

        def fetch(i: int) -> Future[None]:
            off, n = spans[i]
            return self._submit(file, off, [bufs[i % 2][:n]])

        try:
            if spans:
                pending = fetch(0)
            for i, (off, n) in enumerate(spans):
                assert pending is not None
                done, pending = pending, None
                result_of(done)  # in slices: a Ctrl-C that another thread took is raised here too
                if i + 1 < len(spans):
                    pending = fetch(i + 1)
                yield off, bufs[i % 2][:n]
        finally:
            if pending is not None:  # the caller failed: no read may outlive it into a buffer
                self._scope.cancel()
                wait_all([pending], Deadline.after(CANCELLED_READS_S))

    # -- a DTensor, band by band
    def _global(self, src: Global, at: int) -> None:
        item = ST_TO_DTYPE[src.dtype].itemsize
        state = [[0, 0] for _ in src.chunks]  # per chunk: bytes consumed, CRC so far
        bounce = byte_view(self.bounce)
        for band in bands(src.shape, item, BAND):
            buf = self.band[: band.numel * item]
            # per share: chunk, part, its bytes' place (None: straight in the band) and buffer
            shares: list[tuple[int, Box, int | None, memoryview]] = []
            reads: list[tuple[str, int, memoryview]] = []
            used = 0
            for i, chunk in enumerate(src.chunks):
                part = intersect(band, chunk.box)
                if part is None:
                    continue
                start, n = linear(part.offsets, chunk.box) * item, part.numel * item
                if state[i][0] != start:  # cannot happen for an index that tiles (checked at parse)
                    raise CheckpointCorruptError(f"chunks of {src.name!r} are not read in order",
                                                 self.reader.locate(chunk.file))  # fmt: skip
                if contiguous_in(part, band):
                    rel = linear(part.offsets, band) * item
                    shares.append((i, part, None, byte_view(buf)[rel : rel + n]))
                else:  # a band's shares never add up to more than the band: the bounce holds them all
                    shares.append((i, part, used, bounce[used : used + n]))
                    used += n
                reads.append((chunk.file, chunk.begin + start, shares[-1][3]))
            self._read_all(reads)
            for i, part, off, piece in shares:
                state[i][1] = crc32c(piece, state[i][1])
                state[i][0] += len(piece)
                if off is not None:
                    grid = buf.view(*band.sizes, item)
                    index = tuple(slice(o - b, o - b + s)
                                  for o, b, s in zip(part.offsets, band.offsets, part.sizes, strict=True))  # fmt: skip
                    grid[index].copy_(self.bounce[off : off + len(piece)].view(*part.sizes, item))
            write_all(self.out, byte_view(buf), at + linear(band.offsets, Box.whole(src.shape)) * item, self.out_path)
        for i, chunk in enumerate(src.chunks):
            if state[i] != [chunk.nbytes(item), src.crcs[i]]:
                raise CheckpointCorruptError(f"checksum mismatch in a chunk of {src.name!r}",
                                             self.reader.locate(chunk.file))  # fmt: skip

    def _globals_together(self, group: list[tuple[Global, int]]) -> None:
        """Assemble DTensors of at most a band together side by side in the band buffer: the
        chunks of every tensor of ``group`` read in windows of each file (neighbouring chunks,
        of several tensors, in one request; the windows of several files at once), each chunk
        checked against its CRC and copied to its place, then each tensor written."""
        runs: dict[str, list[_Run]] = {}
        chunks: dict[int, tuple[Global, SavedChunk, int]] = {}  # id of a run: its tensor, chunk, place
        base = 0
        for g, _ in group:
            item = ST_TO_DTYPE[g.dtype].itemsize
            for chunk, crc in zip(g.chunks, g.crcs, strict=True):
                run = _Run(chunk.begin, chunk.begin + chunk.nbytes(item), None, crc, g.name)
                runs.setdefault(chunk.file, []).append(run)
                chunks[id(run)] = (g, chunk, base)
            base += nbytes_of(g)
        spans = [(f, off, n) for f, rs in runs.items()
                 for off, n in windows(sorted(rs, key=lambda r: r.begin), BAND, GAP, split=False)]  # fmt: skip
        bounce = byte_view(self.bounce)
        nxt = 0
        while nxt < len(spans):
            batch: list[tuple[str, int, int, int]] = []  # as many windows as the bounce holds, read at once
            used = 0
            while nxt < len(spans) and used + spans[nxt][2] <= BAND:
                f, off, n = spans[nxt]
                batch.append((f, off, used, n))
                used, nxt = used + n, nxt + 1
            self._read_all([(f, off, bounce[at : at + n]) for f, off, at, n in batch])
            for f, off, at, n in batch:
                for r in runs[f]:
                    if off <= r.begin and r.end <= off + n and r.end > r.begin:
                        self._place(chunks[id(r)], r, at + r.begin - off)
        for f, rs in runs.items():
            for r in rs:
                if r.crc != r.want:
                    raise CheckpointCorruptError(f"checksum mismatch in a chunk of {r.name!r}", self.reader.locate(f))
        base = 0
        for g, at in group:
            n = nbytes_of(g)
            write_all(self.out, byte_view(self.band)[base : base + n], at, self.out_path)
            base += n

    def _place(self, where: tuple[Global, SavedChunk, int], r: _Run, at: int) -> None:
        """Checksum the chunk of run ``r`` (at byte ``at`` of the bounce buffer) and copy it to
        its place in its tensor's area of the band buffer."""
        g, chunk, base = where
        item = ST_TO_DTYPE[g.dtype].itemsize
        n = r.end - r.begin
        r.crc = crc32c(byte_view(self.bounce)[at : at + n])
        whole = Box.whole(g.shape)
        area = self.band[base : base + nbytes_of(g)]
        if contiguous_in(chunk.box, whole):
            rel = linear(chunk.box.offsets, whole) * item
            area[rel : rel + n].copy_(self.bounce[at : at + n])
        else:
            index = tuple(slice(o, o + s) for o, s in zip(chunk.box.offsets, chunk.box.sizes, strict=True))
            area.view(*g.shape, item)[index].copy_(self.bounce[at : at + n].view(*chunk.box.sizes, item))

    def _read_all(self, reads: list[tuple[str, int, memoryview]]) -> None:
        """Fill every ``(file, offset, view)`` at once; the first error is raised once all ended
        (interrupted: once the reads in flight were cancelled and stopped)."""
        futures = [self._submit(f, off, [view]) for f, off, view in reads]
        try:
            wait_all(futures)  # in slices: a Ctrl-C is raised at once
        except BaseException:
            self._scope.cancel()
            wait_all(futures, Deadline.after(CANCELLED_READS_S))
            raise
        for f in futures:
            f.result()


def windows(runs: Sequence[_Run], bound: int, gap: int, *, split: bool = True) -> list[tuple[int, int]]:
    """``(offset, length)`` spans, in order, each at most ``bound`` bytes, covering every byte
    of ``runs`` (sorted by ``begin``): neighbouring runs less than ``gap`` bytes apart share a
    span (the bytes between read too), runs farther apart start a new one. ``split=False``:
    a run of at most ``bound`` bytes lies whole in one span."""
    out: list[tuple[int, int]] = []
    ws = we = -1  # the span being grown
    for r in runs:
        pos = r.begin if ws < 0 else max(r.begin, we)
        if not split and ws >= 0 and pos < r.end and (r.end - ws > bound or pos - we > gap):
            out.append((ws, we - ws))
            ws, pos = -1, r.begin
        while pos < r.end:
            if ws >= 0 and pos - we <= gap and pos < ws + bound:
                we = min(r.end, ws + bound)
            else:
                if ws >= 0:
                    out.append((ws, we - ws))
                ws, we = pos, min(r.end, pos + bound)
            pos = we
    if ws >= 0 and we > ws:
        out.append((ws, we - ws))
    return out


# ---------------------------------------------------------------------------- arithmetic
def bands(shape: Sequence[int], item: int, bound: int) -> Iterator[Box]:
    """The output of a tensor of ``shape`` as boxes each contiguous in row-major order and at
    most ``bound`` bytes (one element if even that is larger), in the output's order.

    A band fixes the indices of the leading dims, takes a range of dim ``d`` and all of the
    dims after it, where ``d`` is the first dim whose trailing block fits ``bound``.
    """
    n = len(shape)
    if any(s == 0 for s in shape):
        return
    if n == 0:
        yield Box((), ())
        return
    inner = [math.prod(shape[k + 1 :]) * item for k in range(n)]
    d = next((k for k in range(n) if inner[k] <= bound), n - 1)
    rows = max(1, bound // inner[d])
    tail = tuple(shape[d + 1 :])
    for lead in itertools.product(*(range(s) for s in shape[:d])):
        for r in range(0, shape[d], rows):
            size = min(rows, shape[d] - r)
            yield Box((*lead, r, *(0,) * len(tail)), ((1,) * d + (size, *tail)))


def linear(index: Sequence[int], box: Box) -> int:
    """The row-major position of element ``index`` (global coordinates) inside ``box``."""
    pos = 0
    for i, o, s in zip(index, box.offsets, box.sizes, strict=True):
        pos = pos * s + (i - o)
    return pos


def contiguous_in(part: Box, box: Box) -> bool:
    """Whether ``part`` (inside ``box``) is one contiguous run of ``box``'s row-major layout:
    size 1 up to some dim, any size there, and all of ``box`` after it."""
    k = 0
    while k < part.ndim and part.sizes[k] == 1:
        k += 1
    return all(part.sizes[j] == box.sizes[j] for j in range(k + 1, part.ndim))
