"""``asyncckpt export``'s plan: where each tensor of one rank of a step lies, and its output.

A step of any root is held open through its :class:`~asyncckpt.roots._root.StepReader`
(``Root.open_reader``: a local directory, a store's prefix, memory, a tier); the structure
file, the shard header and the global index are read (each verified) and every tensor of the
rank becomes a source (``_exportwrite``: a slot of a shard verified whole, a plain tensor with
its own CRC, a DTensor assembled from its chunks). The output's header is planned from these
sizes before anything is created, then :meth:`Export.write` streams the bytes
(``_exportwrite``: two buffers of ``BAND`` bytes, never a tensor or the state, so a model
larger than memory exports; every byte checksummed).

Any mismatch raises ``CheckpointCorruptError`` naming the file (its path or URL); an I/O
error (EIO, a store that does not answer in time) is a ``CheckpointReadError`` naming the
file, writing the output an ``OSError`` naming it: neither is a sign of corruption. The
output is written with ``pwrite`` (never mapped), its size reserved before its first byte;
the caller writes to a temporary file and publishes it only when everything verified.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import CheckpointCorruptError
from ..format._bounds import check_structure_size, parse_structure
from ..format._manifest import shard_name, tree_name
from ..format._safetensors import ST_TO_DTYPE, ShardLayout, plan_layout
from ..format._structure_decode import unflatten
from ..format._structure_names import resolve_dtensor_aliases
from ..reading import index_of, listed
from ..roots._root import Root, StepReader
from ..roots.posix._fileio import reserve, write_all
from ._exportwrite import Global, Plain, Slot, Source, StreamWriter, Whole
from ._load import read_header
from ._load_global import indexed


@dataclass
class Export:
    """One rank's view of a step held open, ready to stream any selection of its tensors.

    ``named``: ``(dotted name, source)`` in saved order (a tied tensor appears under each of
    its names with the same source); ``keys``: the key path of each of them, in the same
    order; ``skipped``: the key paths of non-tensor values (numbers, strings, numpy arrays,
    generators, sets). Close it (or use ``with``).
    """

    reader: StepReader
    rank: int
    named: list[tuple[str, Source]]
    skipped: list[tuple[str, ...]]
    keys: list[tuple[str, ...]] = field(default_factory=list)
    _wholes: dict[str, Whole] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.reader.manifest.step

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> Export:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        ``CheckpointCorruptError`` if any byte read fails its checksum; ``CheckpointReadError``
        naming the file the medium could not serve; an ``OSError`` naming ``path`` for an
        error writing it (a full disk: ENOSPC before the first byte where the file system can
        preallocate). Either way ``path`` then holds garbage and the caller must remove it."""
        if layout is None:
            layout = self.plan(tensors)
        where = {s.name: layout.data_start + s.begin for s in layout.slots}
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            reserve(out, layout.file_size, path)  # a disk without room: ENOSPC before the first byte
            write_all(out, memoryview(layout.header), 0, path)
            writer = StreamWriter(self.reader, out, path)  # pages are touched only as far as the pieces reach
            try:
                writer.write(tensors, where, self._wholes)
            finally:
                writer.close()
            try:
                os.fsync(out)
            except OSError as e:
                raise OSError(e.errno, f"{e.strerror} (fsync)", path) from None
        finally:
            os.close(out)
        return layout.file_size


# ---------------------------------------------------------------------------- planning
def open_export(root: Root, step: int, rank: int) -> Export:
    """Open committed ``step`` of ``root`` (``Root.open_reader``) and find where every tensor
    of rank ``rank``'s state lies.

    DTensors come back whole (global), everything else as rank ``rank`` saved it. Reads only
    the structure file, the shard header and the index (each verified) and holds every file
    the tensors lie in where the medium has descriptors (``StepReader.fileno``), so a
    retirement that starts later cannot remove them under the export; the tensors' bytes are
    read by :meth:`Export.write`. Raises ``CheckpointNotFoundError`` for a missing step,
    ``CheckpointCorruptError`` for any defect found so far and ``CheckpointReadError`` when the
    medium could not serve a file.
    """
    reader = root.open_reader(step)
    try:
        return export_of(reader, rank)
    except BaseException:
        reader.close()
        raise


def export_of(reader: StepReader, rank: int) -> Export:
    """:func:`open_export` of a step already held open (``reader``, which the export then
    owns: closing it closes the reader; on an error the caller still holds it, to judge what
    the error means: ``StepReader.still_there``)."""
    manifest = reader.manifest
    tree = _tree(reader, rank)
    ex = Export(reader, rank, [], [])
    sources: dict[str, Source] = {}
    if indexed(manifest):
        index = index_of(reader)
        tree = resolve_dtensor_aliases(tree, index["aliases"])  # tied DTensors: one source
        entries = index["plain"][rank]
        if entries is None:
            sources.update(_whole(reader, shard_name(rank), ex._wholes))
        else:
            for name, (dtype, shape, file, begin, n, crc) in entries.items():
                sources[name] = Plain(name, file, begin, n, crc, dtype, shape)
        for name, meta in index["tensors"].items():
            sources[name] = Global(name, meta["dtype"], meta["shape"], tuple(meta["chunks"]), tuple(meta["crcs"]))
    else:
        sources.update(_whole(reader, shard_name(rank), ex._wholes))
    tree_path = reader.locate(tree_name(rank))
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
    # every file this rank's tensors lie in, held now (a directory's descriptors): a
    # retirement that starts later (a job writing with keep_last) cannot take them away
    # in the middle of the export. A store's reader holds its attempt's prefix instead.
    for _, src in ex.named:
        for file in {c.file for c in src.chunks} if isinstance(src, Global) else {src.file}:
            listed(reader, file)
            reader.fileno(file)
    return ex


def _tree(reader: StepReader, rank: int) -> Any:
    entry = listed(reader, tree_name(rank))
    where = reader.locate(entry.name)
    check_structure_size(entry.size, where)
    return parse_structure(reader.read(entry.name), where, entry.size, entry.crc32c)


class _Ranges:
    """File ``name`` of ``reader`` as ``_readinto``'s range source (what ``read_header`` reads)."""

    threads, order = 1, 0

    def __init__(self, reader: StepReader, name: str) -> None:
        self.reader, self.name = reader, name

    def read_exact(self, views: list[memoryview], offset: int) -> None:
        self.reader.readv(self.name, offset, views)


def _whole(reader: StepReader, file: str, wholes: dict[str, Whole]) -> dict[str, Source]:
    entry = listed(reader, file)
    where = reader.locate(file)
    head, data_start, slots, _ = read_header(_Ranges(reader, file), where, entry.size)
    wholes[file] = Whole(file, entry.size, entry.crc32c, head, data_start, slots)
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
