"""An asyncckpt step made of DCP items: the files each rank writes, and the commit.

Used by the DCP storage layer (``dcp.StorageWriter``: every rank writes its file, the
coordinator commits) and by the importer (``dcp.import_dcp``: one process writes them all).
The result is an ordinary indexed asyncckpt step (``asyncckpt verify``, ``ls``, ``load``
and ``Checkpointer.load(into=...)`` read it)::

    ROOT/step_N.tmp-<attempt>/           until the commit rename
      rankRRRRR.safetensors              rank R's DCP items: tensor chunks under their flat key
                                         (``fqn``, then ``fqn@o1,o2`` for more chunks of it),
                                         bytes items (DCP's serialized objects) as U8 tensors
      rankRRRRR.json                     the state's structure (the same for every rank: DCP's
                                         state is global): ``$dtensor`` nodes for the tensors,
                                         decoded values for the objects
      index.json                         every tensor's chunks (``_index``): resharded reads
      dcp.json                           DCP's Metadata without pickle (``_dcp_meta``)
      manifest.json                      written last: files, sizes, CRC-32C; then the rename

Every file is created exclusively, CRC-32C'd as written, fsynced and closed before it is
reported; the coordinator fsyncs the attempt directory before the manifest and after it,
renames the directory into place (the commit point) and fsyncs the root. A crash before the
rename leaves a ``*.tmp-*`` directory that no reader takes and ``asyncckpt gc`` removes.
"""

from __future__ import annotations

import io
import logging
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from .._errors import CheckpointCorruptError, CheckpointError
from ..format import _index, _manifest
from ..format._checksum import crc32c
from ..format._layout import deleting_dir_name, step_dir_name, tmp_dir_name
from ..format._safetensors import DTYPE_TO_ST, plan_layout
from ..format._structure_encode import flatten
from ..format._structure_json import tree_json
from ..loading._readinto import byte_view
from ..roots.posix._discovery import open_step
from ..roots.posix._osops import DEFAULT_OPS, OsOps
from ..roots.posix._remove_tree import remove_tree
from . import _dcp_meta

log = logging.getLogger("asyncckpt")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: the safetensors ``__metadata__`` of a rank file written from DCP items
_SHARD_META = {"format": "pt", "written_by": "torch.distributed.checkpoint via asyncckpt"}


@dataclass
class RankFile:
    """What one rank wrote: its file and where each of its DCP items lies in it.

    ``tensors``: ``[fqn, offsets, sizes, dtype, begin, nbytes, crc32c, block_crcs]``;
    ``blobs``: ``[fqn, begin, nbytes, crc32c]``; offsets are absolute file bytes.
    """

    rank: int
    name: str
    size: int
    crc32c: int
    nbytes: int
    tensors: list[list[Any]] = field(default_factory=list)
    blobs: list[list[Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankFile:
        return cls(**{k: d[k] for k in ("rank", "name", "size", "crc32c", "nbytes", "tensors", "blobs")})


def attempt_dir(root: str, step: int, attempt: str) -> str:
    return os.path.join(root, tmp_dir_name(step, attempt))


def new_attempt() -> str:
    return uuid.uuid4().hex[:16]


def check_step_free(root: str, step: int) -> None:
    """``FileExistsError`` if ``ROOT/step_N`` exists: a step is never overwritten."""
    final = os.path.join(root, step_dir_name(step))
    if os.path.lexists(final):
        raise FileExistsError(
            17, f"step {step} exists under {root}; asyncckpt never overwrites a step (save another step, or "
            "remove it first)", final,
        )  # fmt: skip


# ----------------------------------------------------------------------------- one rank's file
@dataclass
class Entry:
    """One DCP item to write: a tensor chunk (``offsets`` set) or serialized bytes."""

    fqn: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...]
    dtype: torch.dtype
    #: the tensor (or bytes) itself, or a function that makes it (called once, in file order)
    data: Any


def _slot_names(entries: list[Entry]) -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    for e in entries:
        name = e.fqn
        if name in seen or name == "__metadata__":
            name = f"{e.fqn}@{','.join(map(str, e.offsets or ()))}"
            while name in seen:
                name += "'"
        seen.add(name)
        names.append(name)
    return names


class RankStream:
    """Rank ``rank``'s file of DCP ``entries`` (``rankRRRRR.safetensors``), its bytes made in
    file order on demand: the local writer takes :meth:`pieces`, an upload reads any range
    with :meth:`read` (a retried upload starts over). Each entry's data is resolved when its
    bytes are first needed and only one is held at a time (a GPU tensor: one CPU copy). Every
    entry's CRC-32C and block CRCs are taken the first time its bytes are made; the data must
    be the same each time it is resolved (DCP's planners give the staged or paused state).
    One call at a time."""

    def __init__(self, rank: int, entries: list[Entry]) -> None:
        self.rank = rank
        self.name = _manifest.shard_name(rank)
        names = _slot_names(entries)
        layout = plan_layout([(n, e.dtype, e.sizes) for n, e in zip(names, entries, strict=True)], _SHARD_META)
        by_name = dict(zip(names, entries, strict=True))
        self.header = layout.header
        self.size = layout.file_size
        self.nbytes = layout.data_len
        #: (begin, end, entry) of every entry, in file order (absolute file offsets)
        self._slots = [(layout.data_start + s.begin, layout.data_start + s.end, by_name[s.name]) for s in layout.slots]
        self._rows: dict[int, tuple[bool, list[Any]]] = {}  # slot -> (is a tensor, its RankFile row)
        self._held: tuple[int, memoryview] | None = None

    def _view(self, i: int) -> memoryview:
        """Slot ``i``'s bytes (resolved now unless it is the one held); its row recorded."""
        if self._held is not None and self._held[0] == i:
            return self._held[1]
        self._held = None  # the previous entry's bytes go before the next is resolved
        begin, end, e = self._slots[i]
        data = e.data() if callable(e.data) else e.data
        view = _bytes_of(data, e, end - begin)
        if i not in self._rows:
            whole, blocks = _index.block_crcs(view, _index.BLOCK)
            if e.offsets is None:
                self._rows[i] = (False, [e.fqn, begin, len(view), whole])
            else:
                self._rows[i] = (True, [e.fqn, list(e.offsets), list(e.sizes), DTYPE_TO_ST[e.dtype], begin,
                                        len(view), whole, blocks])  # fmt: skip
        self._held = (i, view)
        return view

    def pieces(self) -> Iterator[tuple[int, memoryview]]:
        """``(offset, bytes)`` of the header, then of each entry, in file order."""
        yield 0, memoryview(self.header)
        for i, (begin, _, _) in enumerate(self._slots):
            yield begin, self._view(i)
        self._held = None

    def read(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes ``[offset, offset + len(out))``."""
        end = offset + len(out)
        if offset < 0 or end > self.size:
            raise ValueError(f"range [{offset}, {end}) outside {self.name}'s {self.size} bytes")
        if offset < len(self.header):
            n = min(end, len(self.header)) - offset
            out[:n] = self.header[offset : offset + n]
        for i, (begin, stop, _) in enumerate(self._slots):
            if stop <= offset or begin >= end or begin == stop:
                continue
            lo, hi = max(begin, offset), min(stop, end)
            out[lo - offset : hi - offset] = self._view(i)[lo - begin : hi - begin]
        if end == self.size:
            self._held = None

    def described(self, crc: int) -> RankFile:
        """The :class:`RankFile` of the whole file, whose CRC-32C is ``crc`` (every entry's
        bytes made once by now; empty ones, which no range covers, are resolved here)."""
        for i in range(len(self._slots)):
            if i not in self._rows:
                self._view(i)
        self._held = None
        out = RankFile(self.rank, self.name, self.size, crc, self.nbytes)
        for i in range(len(self._slots)):
            tensor, row = self._rows[i]
            (out.tensors if tensor else out.blobs).append(row)
        return out


def write_rank_file(directory: str, rank: int, entries: list[Entry], ops: OsOps = DEFAULT_OPS) -> RankFile:
    """Write ``entries`` as ``rankRRRRR.safetensors`` in ``directory`` (exclusive create,
    CRC-32C and block CRCs as written, fsync, close) and describe where each one lies."""
    stream = RankStream(rank, entries)
    path = os.path.join(directory, stream.name)
    fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    try:
        crc = 0
        for begin, view in stream.pieces():
            _pwrite_all(ops, fd, view, begin, path)
            crc = crc32c(view, crc)
        ops.fsync(fd)
    except OSError as err:
        _close_quietly(ops, fd)
        raise err if err.filename is not None else OSError(err.errno, err.strerror, path) from err
    except BaseException:
        _close_quietly(ops, fd)
        raise
    ops.close(fd)
    return stream.described(crc)


def _bytes_of(data: Any, e: Entry, expect: int) -> memoryview:
    if e.offsets is None:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        view = memoryview(raw)
    else:
        t = data.detach()
        if t.dtype != e.dtype or tuple(t.shape) != tuple(e.sizes):
            raise ValueError(
                f"{e.fqn!r}: the planner resolved a {t.dtype}{list(t.shape)} tensor for a "
                f"{e.dtype}{list(e.sizes)} chunk"
            )
        view = byte_view(t.to("cpu").contiguous())
    if len(view) != expect:
        raise ValueError(f"{e.fqn!r}: {len(view)} bytes resolved, {expect} planned")
    return view


def _pwrite_all(ops: OsOps, fd: int, view: memoryview, offset: int, path: str) -> None:
    pos = 0
    while pos < len(view):
        n = ops.pwrite(fd, view[pos:], offset + pos)
        if n <= 0:
            raise OSError(5, "write returned 0 bytes", path)
        pos += n


def _close_quietly(ops: OsOps, fd: int) -> None:
    try:
        ops.close(fd)
    except OSError:
        pass


def write_small(directory: str, name: str, data: bytes, rank: int, ops: OsOps = DEFAULT_OPS) -> _manifest.FileEntry:
    """Create ``directory/name`` exclusively with ``data``, fsync, close; its manifest entry."""
    path = os.path.join(directory, name)
    fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o644)
    try:
        _pwrite_all(ops, fd, memoryview(data), 0, path)
        ops.fsync(fd)
    except BaseException:
        _close_quietly(ops, fd)
        raise
    ops.close(fd)
    return _manifest.FileEntry(name, len(data), crc32c(data), rank)


# ------------------------------------------------------------------------------- the structure
def value_node(raw: bytes) -> Any:
    """The structure node of one DCP bytes item: the object it holds, decoded by
    ``torch.load(weights_only=True)`` (no code runs) when it is plain data; otherwise, or when
    it holds tensors, its bytes (``$bytes``)."""
    import base64

    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        node, tensors = flatten(value)
        if not tensors:
            return node
    except Exception:  # noqa: BLE001 - not plain data: kept as the bytes DCP wrote
        pass
    return {"$bytes": base64.b64encode(raw).decode("ascii")}


def build_tree(fqns: Iterable[str], tensors: set[str], values: Mapping[str, Any], mappings: Any) -> Any:
    """The state's structure: nested as the saved state dict was (``mappings``: DCP's flat key
    -> key path), or flat when the planner kept no mappings. Tensors are ``$dtensor`` nodes
    named by their flat key (the index's name, and asyncckpt's dotted key path)."""
    root: dict[Any, Any] = {}
    for fqn in fqns:
        leaf = _Leaf({"$dtensor": fqn} if fqn in tensors else values[fqn])
        path = mappings.get(fqn) if isinstance(mappings, Mapping) else None
        if not path:
            path = (fqn,)
        node = root
        for key in path[:-1]:
            nxt = node.setdefault(key, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"{fqn!r}: key path {list(path)} runs through a value")
            node = nxt
        if path[-1] in node:
            raise ValueError(f"{fqn!r}: key path {list(path)} is taken twice")
        node[path[-1]] = leaf
    return _encode(root)


@dataclass(frozen=True)
class _Leaf:
    """A finished structure node (kept apart from the dicts :func:`build_tree` nests)."""

    node: Any


def _encode(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.node
    if isinstance(node, dict):
        keys = list(node)
        if keys and all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
            return [_encode(node[i]) for i in range(len(keys))]
        return {"$dict": [[k, _encode(v)] for k, v in node.items()]}
    raise AssertionError(f"unexpected node {node!r}")


# ------------------------------------------------------------------------------------ the commit
def blob_locations(files: list[RankFile], where: str) -> dict[str, _dcp_meta.BytesLocation]:
    """Where each DCP object (bytes item) lies: fqn -> ``(file, begin, nbytes, crc32c)``;
    ``CheckpointCorruptError`` (naming ``where``) for one written by two ranks."""
    locations: dict[str, _dcp_meta.BytesLocation] = {}
    for f in files:
        for fqn, begin, n, crc in f.blobs:
            if locations.setdefault(fqn, (f.name, begin, n, crc))[0] != f.name:
                raise CheckpointCorruptError(f"{fqn!r} was written by two ranks", where)
    return locations


def shared_files(
    files: list[RankFile], metadata: Metadata, blobs: Mapping[str, bytes], where: str
) -> list[tuple[str, bytes, int]]:
    """The files the coordinator adds to every rank's: ``(name, bytes, rank)`` of
    ``index.json``, ``dcp.json`` and each rank's structure.

    ``files``: every rank's :class:`RankFile` (rank ``r`` at index ``r``); ``blobs``: the
    bytes of each DCP object (:func:`blob_locations`, read back and checked). Raises
    ``CheckpointCorruptError`` (naming ``where``) if the items do not make a loadable step
    (chunks that do not tile a tensor, an item written twice or by nobody), ``TypeError`` for
    metadata JSON cannot carry.
    """
    world = len(files)
    if [f.rank for f in files] != list(range(world)):
        raise ValueError(f"rank files {[f.rank for f in files]} are not ranks 0..{world - 1}")
    meta_raw = _dcp_meta.encode(metadata, blob_locations(files, where))
    values = {fqn: value_node(raw) for fqn, raw in blobs.items()}
    tensors = {fqn for fqn, md in metadata.state_dict_metadata.items() if not isinstance(md, BytesStorageMetadata)}
    tree = build_tree(metadata.state_dict_metadata, tensors, values, metadata.planner_data)
    index_raw = _index_doc(files, meta_raw)
    try:
        _index.parse(index_raw, world, {f.name: f.size for f in files})
    except ValueError as e:
        raise CheckpointCorruptError(f"the DCP items do not make a loadable step ({e})", where) from None
    tree_raw = tree_json(tree)
    return [(_index.INDEX, index_raw, 0), (_dcp_meta.FILE, meta_raw, 0),
            *((_manifest.tree_name(r), tree_raw, r) for r in range(world))]  # fmt: skip


def manifest_body(
    step: int, attempt: str, files: list[RankFile], shared: list[_manifest.FileEntry], extra: dict[str, Any]
) -> bytes:
    """The manifest of the step: every rank's file and the ``shared`` ones."""
    entries = [_manifest.FileEntry(f.name, f.size, f.crc32c, f.rank) for f in files] + shared
    return _manifest.encode(step, attempt, len(files), sum(f.nbytes for f in files), time.time(), entries, extra,
                            format=_manifest.FORMAT_INDEXED)  # fmt: skip


def commit(
    root: str,
    step: int,
    attempt: str,
    files: list[RankFile],
    metadata: Metadata,
    extra: dict[str, Any],
    ops: OsOps = DEFAULT_OPS,
) -> str:
    """Write the step's shared files and commit it; returns the committed directory.

    ``files``: every rank's :class:`RankFile` (rank ``r`` at index ``r``), all written and
    fsynced in the attempt directory; ``metadata``: DCP's global metadata of the save.
    Raises what :func:`shared_files` raises, ``FileExistsError`` if the step appeared
    meanwhile, ``OSError`` on I/O. Nothing is committed on failure.
    """
    loc = attempt_dir(root, step, attempt)
    blobs = {fqn: _read_back(loc, *at) for fqn, at in blob_locations(files, loc).items()}
    shared = [write_small(loc, name, raw, rank, ops) for name, raw, rank in shared_files(files, metadata, blobs, loc)]
    body = manifest_body(step, attempt, files, shared, extra)
    ops.fsync_dir(loc)  # every rank's file and ours are durable names before the marker
    tmp_marker = os.path.join(loc, _manifest.MANIFEST + ".tmp")
    write_small(loc, _manifest.MANIFEST + ".tmp", body, 0, ops)
    ops.rename(tmp_marker, os.path.join(loc, _manifest.MANIFEST))
    ops.fsync_dir(loc)
    check_step_free(root, step)
    final = os.path.join(root, step_dir_name(step))
    ops.rename(loc, final)  # the commit point
    try:
        ops.fsync_dir(root)
        _, committed = open_step(root, step)  # exactly the manifest's files, our attempt
        if committed.attempt != attempt:
            raise CheckpointCorruptError(f"holds attempt {committed.attempt}, not {attempt}", final)
    except (OSError, CheckpointError):
        # not durable, or not what we wrote: take it back so that no reader trusts it
        aside = os.path.join(root, deleting_dir_name(step, new_attempt()))
        try:
            ops.rename(final, aside)
            remove_tree(aside, ops)
        except OSError as e2:
            log.warning("asyncckpt: could not take back the commit of step %d: %s", step, e2)
        raise
    return final


def _read_back(directory: str, name: str, begin: int, n: int, crc: int) -> bytes:
    """Bytes ``[begin, begin + n)`` of ``directory/name`` as written (CRC-32C checked)."""
    path = os.path.join(directory, name)
    with open(path, "rb") as f:
        f.seek(begin)
        raw = f.read(n)
    if len(raw) != n or crc32c(raw) != crc:
        raise CheckpointCorruptError("checksum mismatch reading back a DCP object", path)
    return raw


def _index_doc(files: list[RankFile], meta_raw: bytes) -> bytes:
    """``index.json``: every tensor's chunks, sorted by offset (shape from ``dcp.json``)."""
    import json

    shapes = {fqn: t["size"] for fqn, t in json.loads(meta_raw)["tensors"].items()}
    tensors: dict[str, Any] = {}
    for f in files:
        for fqn, offs, sizes, dtype, begin, n, crc, blocks in f.tensors:
            have = tensors.get(fqn)
            if have is None:
                shape = shapes.get(fqn)
                if shape is None:
                    raise CheckpointCorruptError(f"rank {f.rank} wrote {fqn!r}, which the metadata does not list")
                have = tensors[fqn] = {"dtype": dtype, "shape": shape, "placements": [], "mesh": [],
                                       "chunks": [], "blocks": []}  # fmt: skip
            elif have["dtype"] != dtype:
                raise CheckpointCorruptError(f"ranks wrote {fqn!r} as {have['dtype']} and as {dtype}")
            have["chunks"].append([offs, sizes, f.name, begin, n, crc])
            have["blocks"].append(blocks)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointCorruptError(f"no rank wrote tensor(s) {missing[:5]}")
    for e in tensors.values():
        order = sorted(range(len(e["chunks"])), key=lambda i: e["chunks"][i][0])
        e["chunks"] = [e["chunks"][i] for i in order]
        e["blocks"] = [e["blocks"][i] for i in order]
    doc = {
        "format": _index.FORMAT,
        "world_size": len(files),
        "block": _index.BLOCK,
        "tensors": tensors,
        "plain": {str(f.rank): {} for f in files},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
