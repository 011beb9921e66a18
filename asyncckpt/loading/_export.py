"""Streaming export of one step's tensors as a single safetensors file (``asyncckpt export``).

The output's header is planned from sizes the checkpoint records (shard headers, the global
index) and written first; then each tensor's bytes are read, checksummed and written to their
place in the output, one bounded piece at a time. Peak memory is two buffers of ``_BAND``
bytes (plus the structure and index files), never a tensor or the state, so a model larger
than memory exports.

Where the bytes come from, and what verifies them:

- a tensor of a step without a global index (``asyncckpt/1``, one process or DDP), or of a
  rank that held no DTensor, lies in the rank's shard, whose one CRC-32C (in the manifest)
  covers the whole file: the shard is read through in file order, every byte checksummed,
  the selected tensors' bytes written on the way;
- a plain tensor of an indexed step has its own CRC in the index (possibly in another rank's
  file, when deduplicated);
- a DTensor is assembled from its chunks (the index: boxes, files, byte ranges, one CRC per
  chunk) band by band: a band is a run of the output that is contiguous and at most
  ``_BAND`` bytes (a range of rows, or of a row's elements), and each chunk's share of a band
  is one contiguous byte run of its file. Bands advance in the output's order, so every
  chunk is read exactly once, front to back, and its CRC is continued across bands and
  compared when the tensor is done.

Any mismatch raises ``CheckpointCorruptError`` naming the file; an I/O error (EIO, a full
disk) is an ``OSError`` naming the file, not a sign of corruption. Files are read with
``pread`` and written with ``pwrite`` (never mapped: a fault cannot become a SIGBUS), the
output's size reserved before its first byte. The caller writes to a temporary file and
publishes it only when everything verified.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import CheckpointCorruptError
from ..format import _index
from ..format._bounds import parse_structure
from ..format._checksum import crc32c
from ..format._header import TensorSlot
from ..format._manifest import MANIFEST, Manifest, shard_name, tree_name
from ..format._reshard import Box, SavedChunk, intersect
from ..format._safetensors import ST_TO_DTYPE, ShardLayout, plan_layout
from ..format._structure_decode import unflatten
from ..format._structure_names import resolve_dtensor_aliases
from ..roots._readfault import read_error
from ..roots.posix._discovery import PinnedStep, pin_step
from ..roots.posix._fileio import read_exact, reserve, write_all
from ._load import check_tree_size, read_header
from ._load_global import indexed
from ._readinto import byte_view
from ._stepfiles import read_all

#: The size of one piece in flight (there are two: the band and the bounce buffer).
_BAND = 8 * 1024 * 1024


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
class _Whole:
    """A shard file verified by its whole-file CRC: its header bytes and tensor slots."""

    file: str
    size: int
    crc: int
    head: bytes
    data_start: int
    slots: list[TensorSlot]


@dataclass
class Export:
    """One rank's view of a pinned step, ready to stream any selection of its tensors.

    ``named``: ``(dotted name, source)`` in saved order (a tied tensor appears under each of
    its names with the same source); ``keys``: the key path of each of them, in the same
    order; ``skipped``: the key paths of non-tensor values (numbers, strings, numpy arrays,
    generators, sets). Close it (or use ``with``).
    """

    pinned: PinnedStep
    rank: int
    named: list[tuple[str, Source]]
    skipped: list[tuple[str, ...]]
    keys: list[tuple[str, ...]] = field(default_factory=list)
    _wholes: dict[str, _Whole] = field(default_factory=dict)
    _fds: dict[str, int] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.pinned.step

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.pinned.close()

    def __enter__(self) -> Export:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _manifest(self) -> Manifest:
        m = self.pinned.manifest
        assert m is not None
        return m

    def _path(self, name: str) -> str:
        return os.path.join(self.pinned.path, name)

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            try:
                size = self._manifest().file(name).size
            except CheckpointCorruptError:
                raise CheckpointCorruptError(f"manifest does not list {name}", self._path(MANIFEST)) from None
            self._fds[name] = self.pinned.open_file(name, size)
        return self._fds[name]

    @staticmethod
    def plan(tensors: Sequence[tuple[str, Source]]) -> ShardLayout:
        """The layout of the output of ``tensors``; ``ValueError`` naming the longest name when
        its header would be longer than safetensors readers take (the rule ``save()`` keeps:
        ``_header.check_header_length``). No I/O: call it before creating anything."""
        return plan_layout([(n, ST_TO_DTYPE[s.dtype], s.shape) for n, s in tensors], {"format": "pt"})

    def write(self, path: str, tensors: Sequence[tuple[str, Source]], layout: ShardLayout | None = None) -> int:
        """Write ``tensors`` (output name, source) as one safetensors file at ``path`` (created
        exclusively, its whole size reserved first, fsynced), laid out as ``layout`` (default:
        :meth:`plan`'s, whose ``ValueError`` comes before ``path`` is created); return its size.
        ``CheckpointCorruptError`` if any byte read fails its checksum; an ``OSError`` naming
        the file for an I/O error, reading or writing (a full disk: ENOSPC before the first
        byte where the file system can preallocate). Either way ``path`` then holds garbage
        and the caller must remove it."""
        if layout is None:
            layout = self.plan(tensors)
        where = {s.name: layout.data_start + s.begin for s in layout.slots}
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            reserve(out, layout.file_size, path)  # a disk without room: ENOSPC before the first byte
            write_all(out, memoryview(layout.header), 0, path)
            io = _Buffers(_BAND, path)  # pages are touched only as far as the pieces reach
            by_file: dict[str, list[tuple[Slot, int]]] = {}
            for name, src in tensors:
                if isinstance(src, Slot):
                    by_file.setdefault(src.file, []).append((src, where[name]))
            for file, wanted in by_file.items():
                self._through_whole(self._wholes[file], wanted, out, io)
            for name, src in sorted(tensors, key=lambda t: where[t[0]]):
                if isinstance(src, Plain):
                    self._plain(src, where[name], out, io)
                elif isinstance(src, Global):
                    self._global(src, where[name], out, io)
            try:
                os.fsync(out)
            except OSError as e:
                raise OSError(e.errno, f"{e.strerror} (fsync)", path) from None
        finally:
            os.close(out)
        return layout.file_size

    # -- the three kinds of source
    def _through_whole(self, whole: _Whole, wanted: list[tuple[Slot, int]], out: int, io: _Buffers) -> None:
        """Read ``whole`` front to back, checksumming all of it, writing the wanted slots."""
        fd, path = self._fd(whole.file), self._path(whole.file)
        dest = {(s.offset, s.nbytes): at for s, at in wanted}
        crc = crc32c(whole.head)
        pos = whole.data_start
        for s in sorted(whole.slots, key=lambda s: s.begin):
            begin = whole.data_start + s.begin
            crc = _checksum_only(fd, path, pos, begin - pos, crc, io)  # a gap, if the header left one
            at = dest.get((begin, s.end - s.begin))
            if at is None:
                crc = _checksum_only(fd, path, begin, s.end - s.begin, crc, io)
            else:
                crc = _copy(fd, path, begin, s.end - s.begin, crc, io, out, at)
            pos = whole.data_start + s.end
        crc = _checksum_only(fd, path, pos, whole.size - pos, crc, io)
        if crc != whole.crc:
            raise CheckpointCorruptError("checksum mismatch", path)

    def _plain(self, src: Plain, at: int, out: int, io: _Buffers) -> None:
        path = self._path(src.file)
        crc = _copy(self._fd(src.file), path, src.offset, src.nbytes, 0, io, out, at)
        if crc != src.crc:
            raise CheckpointCorruptError(f"checksum mismatch in {src.name!r}", path)

    def _global(self, src: Global, at: int, out: int, io: _Buffers) -> None:
        item = ST_TO_DTYPE[src.dtype].itemsize
        state = [[0, 0] for _ in src.chunks]  # per chunk: bytes consumed, CRC so far
        for band in bands(src.shape, item, _BAND):
            band_bytes = band.numel * item
            buf = io.band[:band_bytes]
            for i, chunk in enumerate(src.chunks):
                part = intersect(band, chunk.box)
                if part is None:
                    continue
                path = self._path(chunk.file)
                start, n = linear(part.offsets, chunk.box) * item, part.numel * item
                if state[i][0] != start:  # cannot happen for an index that tiles (checked at parse)
                    raise CheckpointCorruptError(f"chunks of {src.name!r} are not read in order", path)
                if contiguous_in(part, band):
                    rel = linear(part.offsets, band) * item
                    piece = byte_view(buf)[rel : rel + n]
                    _pread(self._fd(chunk.file), path, piece, chunk.begin + start)
                    state[i][1] = crc32c(piece, state[i][1])
                else:
                    piece = byte_view(io.bounce)[:n]
                    _pread(self._fd(chunk.file), path, piece, chunk.begin + start)
                    state[i][1] = crc32c(piece, state[i][1])
                    grid = buf.view(*band.sizes, item)
                    index = tuple(
                        slice(o - b, o - b + s) for o, b, s in zip(part.offsets, band.offsets, part.sizes, strict=True)
                    )
                    grid[index].copy_(io.bounce[:n].view(*part.sizes, item))
                state[i][0] += n
            write_all(out, byte_view(buf), at + linear(band.offsets, Box.whole(src.shape)) * item, io.out_path)
        for i, chunk in enumerate(src.chunks):
            if state[i] != [chunk.nbytes(item), src.crcs[i]]:
                raise CheckpointCorruptError(f"checksum mismatch in a chunk of {src.name!r}", self._path(chunk.file))


class _Buffers:
    """The two reused buffers of an export: the band being assembled and a bounce buffer
    (and the output's path, for its errors)."""

    def __init__(self, size: int, out_path: str) -> None:
        self.out_path = out_path
        self.band = torch.empty(size, dtype=torch.uint8)
        self.bounce = torch.empty(size, dtype=torch.uint8)


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


# ---------------------------------------------------------------------------- I/O
def _pread(fd: int, path: str, view: memoryview, offset: int) -> None:
    # an I/O error names the file and is never a bad mark (_readfault); a short file is corrupt
    try:
        read_exact(fd, view, offset, path)
    except CheckpointCorruptError:
        raise
    except OSError as e:
        raise read_error(e, "cannot read", path) from None


def _checksum_only(fd: int, path: str, offset: int, nbytes: int, crc: int, io: _Buffers) -> int:
    """Continue ``crc`` over ``nbytes`` of the file at ``offset``, keeping nothing."""
    return _copy(fd, path, offset, nbytes, crc, io, None, 0)


def _copy(fd: int, path: str, offset: int, nbytes: int, crc: int, io: _Buffers, out: int | None, at: int) -> int:
    """Copy ``nbytes`` from the file at ``offset`` to ``out`` at ``at`` piece by piece (only
    checksum them when ``out`` is None); return ``crc`` continued over them."""
    mv = byte_view(io.bounce)
    done = 0
    while done < nbytes:
        n = min(len(mv), nbytes - done)
        _pread(fd, path, mv[:n], offset + done)
        crc = crc32c(mv[:n], crc)
        if out is not None:
            write_all(out, mv[:n], at + done, io.out_path)
        done += n
    return crc


# ---------------------------------------------------------------------------- planning
def open_export(root: str, step: int, rank: int) -> Export:
    """Pin ``step`` under ``root`` and find where every tensor of rank ``rank``'s state lies.

    DTensors come back whole (global), everything else as rank ``rank`` saved it. Reads only
    the structure file, the shard header and the index (each verified) and opens every file
    the tensors lie in, so a retirement that starts later cannot remove them under the
    export; the tensors' bytes are read by :meth:`Export.write`. Raises ``CheckpointNotFoundError`` for a missing step
    and ``CheckpointCorruptError`` for any defect found so far.
    """
    pinned = pin_step(root, step)
    try:
        manifest = pinned.manifest
        assert manifest is not None
        tree = _tree(pinned, manifest, rank)
        wholes: dict[str, _Whole] = {}
        ex = Export(pinned, rank, [], [], _wholes=wholes)
        sources: dict[str, Source] = {}
        if indexed(manifest):
            index = _read_index(ex, manifest)
            tree = resolve_dtensor_aliases(tree, index["aliases"])  # tied DTensors: one source
            entries = index["plain"][rank]
            if entries is None:
                sources.update(_whole(ex, manifest, shard_name(rank), wholes))
            else:
                for name, (dtype, shape, file, begin, n, crc) in entries.items():
                    sources[name] = Plain(name, file, begin, n, crc, dtype, shape)
            for name, meta in index["tensors"].items():
                sources[name] = Global(name, meta["dtype"], meta["shape"], tuple(meta["chunks"]), tuple(meta["crcs"]))
        else:
            sources.update(_whole(ex, manifest, shard_name(rank), wholes))
        tree_path = os.path.join(pinned.path, tree_name(rank))
        placeholders = {n: torch.empty(s.shape, dtype=ST_TO_DTYPE[s.dtype], device="meta") for n, s in sources.items()}
        try:
            unflatten(tree, placeholders)  # validates every node; zero memory
        except (ValueError, TypeError, RecursionError, OverflowError) as e:
            raise CheckpointCorruptError(f"malformed structure ({e})", tree_path) from None
        for path, kind, value in walk(tree):
            if kind == "tensor":
                ex.named.append((dotted(path), sources[value]))
                ex.keys.append(path)
            else:
                ex.skipped.append(path)
        # every file this rank's tensors lie in, opened now: a retirement that starts later
        # (a job writing with keep_last) cannot take them away in the middle of the export
        for _, src in ex.named:
            for file in {c.file for c in src.chunks} if isinstance(src, Global) else {src.file}:
                ex._fd(file)
        return ex
    except BaseException:
        pinned.close()
        raise


def _tree(pinned: PinnedStep, manifest: Manifest, rank: int) -> Any:
    name = tree_name(rank)
    path = os.path.join(pinned.path, name)
    try:
        entry = manifest.file(name)
    except CheckpointCorruptError:
        raise CheckpointCorruptError(f"manifest does not list {name}", os.path.join(pinned.path, MANIFEST)) from None
    check_tree_size(path, entry.size)
    fd = pinned.open_file(name, entry.size)
    try:
        raw = read_all(fd, entry.size)
    except OSError as e:
        raise read_error(e, "cannot read structure", path) from None
    finally:
        os.close(fd)
    return parse_structure(raw, path, entry.size, entry.crc32c)


def _read_index(ex: Export, manifest: Manifest) -> dict[str, Any]:
    entry = manifest.file(_index.INDEX)
    path = ex._path(_index.INDEX)
    try:
        raw = read_all(ex._fd(_index.INDEX), entry.size)
    except OSError as e:
        raise read_error(e, "cannot read", path) from None
    if len(raw) != entry.size or crc32c(raw) != entry.crc32c:
        raise CheckpointCorruptError("checksum mismatch", path)
    try:
        return _index.parse(raw, manifest.world_size, {f.name: f.size for f in manifest.files})
    except ValueError as e:
        raise CheckpointCorruptError(f"bad global index ({e})", path) from None


def _whole(ex: Export, manifest: Manifest, file: str, wholes: dict[str, _Whole]) -> dict[str, Source]:
    entry = manifest.file(file)
    path = ex._path(file)
    try:
        head, data_start, slots, _ = read_header(ex._fd(file), path, entry.size)
    except OSError as e:
        raise read_error(e, "cannot read shard", path) from None
    wholes[file] = _Whole(file, entry.size, entry.crc32c, head, data_start, slots)
    return {s.name: Slot(s.name, file, data_start + s.begin, s.end - s.begin, s.dtype, tuple(s.shape)) for s in slots}


_CONTAINERS = ("$dict", "$odict", "$defaultdict")


def dotted(path: tuple[str, ...]) -> str:
    """A key path as export names it: its keys joined by dots (``_`` for the root itself)."""
    return ".".join(path) if path else "_"


def walk(tree: Any) -> Iterator[tuple[tuple[str, ...], str, Any]]:
    """``(key path, "tensor" | "value", tensor name | None)`` for every leaf of a (validated)
    tree, in saved order, as the loaded state would be walked: dicts and sequences are
    entered; tensors and parameters (plain or DTensor) are tensors; everything else,
    numpy arrays and generators included, is a value."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed([(v, (*path, str(i))) for i, v in enumerate(node)]))
            continue
        if not isinstance(node, dict):
            yield path, "value", None
            continue
        ((tag, val),) = node.items()
        if tag in ("$tensor", "$dtensor"):
            yield path, "tensor", val
        elif tag == "$param":
            stack.append((val[0], path))
        elif tag == "$tuple":
            stack.extend(reversed([(v, (*path, str(i))) for i, v in enumerate(val)]))
        elif tag in _CONTAINERS:
            items = val if tag == "$dict" else val[0] if tag == "$odict" else val[1]
            stack.extend(reversed([(v, (*path, str(k))) for k, v in items]))
        else:
            yield path, "value", None


def drop_aliases(tensors: dict[str, Source]) -> tuple[list[tuple[str, Source]], dict[str, str]]:
    """One name per stored tensor, as ``safetensors.torch.save_model`` keeps it: of the names
    of one tied tensor, the first in sorted order. Returns the kept ``(name, source)`` pairs in
    the given order and ``{dropped name: kept name}``."""
    groups: dict[int, list[str]] = {}
    for name, src in tensors.items():
        groups.setdefault(id(src), []).append(name)
    keep = {min(names) for names in groups.values()}
    dropped = {n: min(names) for names in groups.values() for n in names if n not in keep}
    return [(n, s) for n, s in tensors.items() if n in keep], dropped
