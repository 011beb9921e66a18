"""Resharding math for contiguous row-major chunks: which bytes of which saved chunk land where.

Pure: torch- and numpy-free (the CLI's verify validates a global index with it). A tensor
of global shape ``G`` is saved as chunks, each a :class:`Box` (per-dim offsets and sizes)
stored row-major and contiguous from byte ``begin`` of some file. Loading a target box ``T``
(a rank's local shard, or the whole tensor) means, for every saved chunk ``S`` that
overlaps ``T``, copying the overlap.

With ``j`` the last dim where the overlap is partial in ``S`` or in ``T``, every dim after
``j`` is whole on both sides, so one *run* of ``n_j * prod(n_k, k > j)`` elements is
contiguous in the file **and** in the target's row-major buffer; the runs are indexed by the
dims before ``j``. Consecutive runs can never be merged (that would need ``j`` whole on both
sides), so :meth:`ChunkRead.copies` is the minimal list of copies that each go straight from
the file into the target. :meth:`ChunkRead.reads` merges what is contiguous in the file alone
(fewer, longer reads, e.g. for a bounce buffer) and :meth:`ChunkRead.span` is the one byte
range covering the overlap.

:func:`check_tiling` and :func:`check_chunk_index` validate a chunk list read back from disk
at a cost bounded by the number of chunks, never by the tensor's size; every defect is a
``ValueError`` (the loader turns it into ``CheckpointCorruptError``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

#: Refuse chunk lists with more dims or chunks than this (hostile manifests stay cheap).
MAX_NDIM = 64
MAX_CHUNKS = 1 << 20
#: The overlap check paints a grid of the distinct cut points; a genuine layout has one cell
#: per chunk, so a grid much larger than the chunk count is refused rather than allocated.
_MAX_CELLS = 1 << 24
_CELLS_PER_CHUNK = 16


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor: ``offsets[d] <= i_d < offsets[d] + sizes[d]``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"box has {len(self.offsets)} offsets but {len(self.sizes)} sizes")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def empty(self) -> bool:
        """True when the box holds no element (a 0-d box holds one)."""
        return any(s == 0 for s in self.sizes)

    def end(self, d: int) -> int:
        return self.offsets[d] + self.sizes[d]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box of a whole tensor of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or ``None`` when they share no element."""
    if a.ndim != b.ndim:
        raise ValueError(f"boxes of {a.ndim} and {b.ndim} dims")
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    hi = tuple(min(a.end(d), b.end(d)) for d in range(a.ndim))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


@dataclass(frozen=True)
class SavedChunk:
    """One saved chunk: its box, the file that holds it and the byte where its data starts."""

    box: Box
    file: str
    begin: int

    def nbytes(self, itemsize: int) -> int:
        return self.box.numel * itemsize


@dataclass(frozen=True)
class ByteRange:
    """Copy ``length`` bytes from byte ``src`` of the chunk's file to byte ``dst`` of the target.

    ``dst`` counts from the start of the target box's row-major contiguous buffer.
    """

    src: int
    dst: int
    length: int


def _strides(sizes: Sequence[int]) -> list[int]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return out


@dataclass(frozen=True)
class ChunkRead:
    """The part of one saved chunk that a target box needs."""

    index: int  # position of the chunk in the list given to plan_reads
    chunk: SavedChunk
    target: Box
    overlap: Box
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.overlap.numel * self.itemsize

    def _last_partial(self, both: bool) -> int:
        s, n = self.chunk.box.sizes, self.overlap.sizes
        for d in range(self.overlap.ndim - 1, -1, -1):
            if n[d] < s[d] or (both and n[d] < self.target.sizes[d]):
                return d
        return -1

    def _runs(self, j: int) -> Iterator[tuple[int, int, int]]:
        """(file byte, target byte, length) of each run split at dim ``j`` (-1: one run)."""
        box, tgt, ov, e = self.chunk.box, self.target, self.overlap, self.itemsize
        ss, ts = _strides(box.sizes), _strides(tgt.sizes)
        if j < 0:
            yield self.chunk.begin, 0, self.nbytes
            return
        length = ov.sizes[j] * ss[j] * e
        src0 = self.chunk.begin + e * sum((ov.offsets[d] - box.offsets[d]) * ss[d] for d in range(j + 1))
        dst0 = e * sum((ov.offsets[d] - tgt.offsets[d]) * ts[d] for d in range(j + 1))
        # odometer over the dims before j, innermost fastest (ascending in file and target)
        idx = [0] * j
        while True:
            yield (
                src0 + e * sum(i * ss[d] for d, i in enumerate(idx)),
                dst0 + e * sum(i * ts[d] for d, i in enumerate(idx)),
                length,
            )
            d = j - 1
            while d >= 0:
                idx[d] += 1
                if idx[d] < ov.sizes[d]:
                    break
                idx[d] = 0
                d -= 1
            if d < 0:
                return

    def ncopies(self) -> int:
        """How many ranges :meth:`copies` yields (without building them)."""
        return math.prod(self.overlap.sizes[: max(self._last_partial(True), 0)])

    def copies(self) -> Iterator[ByteRange]:
        """The minimal ranges that are each contiguous in the file and in the target buffer.

        A dim-0 reshard (``Shard(0)`` saved and loaded at any world size) gives exactly one.
        """
        for src, dst, n in self._runs(self._last_partial(True)):
            yield ByteRange(src, dst, n)

    def reads(self) -> Iterator[tuple[int, int]]:
        """The minimal ``(file byte, length)`` reads covering the overlap, ascending."""
        for src, _, n in self._runs(self._last_partial(False)):
            yield src, n

    def span(self) -> tuple[int, int]:
        """``(first file byte, length)`` of the one range covering every byte of the overlap."""
        box, ov, e = self.chunk.box, self.overlap, self.itemsize
        ss = _strides(box.sizes)
        first = sum((ov.offsets[d] - box.offsets[d]) * ss[d] for d in range(ov.ndim))
        last = sum((ov.end(d) - 1 - box.offsets[d]) * ss[d] for d in range(ov.ndim))
        return self.chunk.begin + e * first, e * (last - first + 1)


def plan_reads(chunks: Sequence[SavedChunk], target: Box, itemsize: int) -> list[ChunkRead]:
    """Every saved chunk that overlaps ``target``, with the overlap, in the order given.

    An empty target needs nothing. The caller has validated ``chunks`` (see
    :func:`check_chunk_index`); then the reads cover the target exactly once.
    """
    if target.empty:
        return []
    out: list[ChunkRead] = []
    for i, c in enumerate(chunks):
        ov = intersect(c.box, target)
        if ov is not None:
            out.append(ChunkRead(i, c, target, ov, itemsize))
    return out


def _uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_tiling(shape: Sequence[int], boxes: Sequence[Box], what: str = "tensor") -> None:
    """Check that ``boxes`` tile a tensor of ``shape`` exactly: in bounds, no overlap, no gap.

    Empty boxes are allowed anywhere in bounds and ignored. Duplicates count as overlap (the
    caller removes replicas first). Raises ``ValueError`` naming ``what``. Cost: the number of
    boxes times their dims, plus a grid of at most ``16 * len(boxes)`` cells, never the
    tensor's size.
    """
    nd = len(shape)
    if nd > MAX_NDIM or not all(_uint(n) for n in shape):
        raise ValueError(f"{what}: malformed global shape {list(shape)!r}")
    if len(boxes) > MAX_CHUNKS:
        raise ValueError(f"{what}: {len(boxes)} chunks (at most {MAX_CHUNKS})")
    full: list[Box] = []
    ends: list[tuple[int, ...]] = []
    covered = 0
    for b in boxes:  # one tight pass: this runs for every chunk of every tensor a load reads
        if b.ndim != nd:
            raise ValueError(f"{what}: chunk {b} has {b.ndim} dims, the tensor {nd}")
        end: list[int] = []
        numel = 1
        for o, n, lim in zip(b.offsets, b.sizes, shape, strict=True):
            if type(o) is not int or type(n) is not int or o < 0 or n < 0:
                raise ValueError(f"{what}: chunk {b} has a negative or non-integer bound")
            if o + n > lim:
                raise ValueError(f"{what}: chunk {b} exceeds the global shape {list(shape)}")
            end.append(o + n)
            numel *= n
        if numel:
            full.append(b)
            ends.append(tuple(end))
            covered += numel
    total = math.prod(shape)
    if covered != total:
        raise ValueError(f"{what}: chunks hold {covered} elements, the global shape {list(shape)} has {total}")
    if nd == 0 or total == 0:
        return  # 0-d: the count check above leaves exactly one chunk
    cuts = [sorted({0, shape[d], *(b.offsets[d] for b in full), *(e[d] for e in ends)}) for d in range(nd)]
    dims = [len(c) - 1 for c in cuts]
    cells = math.prod(dims)
    if cells > min(_MAX_CELLS, _CELLS_PER_CHUNK * len(full) + 4096):
        raise ValueError(f"{what}: chunk layout is too irregular to check ({len(full)} chunks, {cells} cells)")
    # equal volumes plus no overlap means the boxes cover everything: paint each box's cells
    # (row-major, one byte per cell), a run of the last dim at a time
    grid = bytearray(cells)
    strides = _strides(dims)
    at_cut = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    for b, stop in zip(full, ends, strict=True):
        lo = [m[o] for m, o in zip(at_cut, b.offsets, strict=True)]
        hi = [m[e] for m, e in zip(at_cut, stop, strict=True)]
        run = hi[-1] - lo[-1]
        if all(h - low == 1 for low, h in zip(lo[:-1], hi[:-1], strict=True)):
            starts: Iterable[int] = (sum(i * st for i, st in zip(lo, strides, strict=True)),)
        else:
            starts = (
                sum(i * st for i, st in zip(idx, strides, strict=False)) + lo[-1]
                for idx in itertools.product(*(range(lo[d], hi[d]) for d in range(nd - 1)))
            )
        for at in starts:
            if grid.find(1, at, at + run) >= 0:
                raise ValueError(f"{what}: chunk {b} overlaps another chunk")
            grid[at : at + run] = b"\x01" * run


def check_chunk_index(
    shape: Sequence[int],
    chunks: Sequence[SavedChunk],
    itemsize: int,
    file_sizes: Mapping[str, int] | None = None,
    what: str = "tensor",
) -> None:
    """Validate one tensor's saved chunk list as read from a manifest (``ValueError`` if bad).

    The chunks must tile ``shape`` (:func:`check_tiling`); each chunk's bytes
    ``[begin, begin + numel * itemsize)`` must lie inside its file when ``file_sizes`` names
    the files (a file it does not name is an error too).
    """
    if not (_uint(itemsize) and itemsize > 0):
        raise ValueError(f"{what}: bad element size {itemsize!r}")
    check_tiling(shape, [c.box for c in chunks], what)
    for c in chunks:
        if not _uint(c.begin) or not isinstance(c.file, str):
            raise ValueError(f"{what}: chunk {c.box} has a bad file position")
        if file_sizes is not None:
            size = file_sizes.get(c.file)
            if size is None:
                raise ValueError(f"{what}: chunk {c.box} names an unknown file {c.file!r}")
            if c.begin + c.nbytes(itemsize) > size:
                raise ValueError(f"{what}: chunk {c.box} runs past the end of {c.file!r}")
