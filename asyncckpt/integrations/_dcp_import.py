"""Import a checkpoint torch's own ``FileSystemWriter`` wrote (``__R_I.distcp`` + ``.metadata``)
as an asyncckpt step, keeping its chunks, so that it reshards on load like any DTensor step.

The bytes are read by torch's own ``FileSystemReader`` (so every format it writes is read
as it reads it: ``torch.save`` items, safetensors, its stream transforms), one ``.distcp``
file at a time (memory: the largest file), into a :class:`_Capture` planner that keeps each
item as it lands. Every DCP file becomes one asyncckpt rank file (``__0_0.distcp`` ->
``rank00000.safetensors``, in file-name order), written and committed by ``_dcp_step``.

DCP's ``.metadata`` is a pickle: reading it runs whatever code the file names, so importing
needs ``allow_pickle=True`` (the command line's ``--allow-pickle``), for checkpoints you
trust. The items themselves are read with ``torch.load(weights_only=True)`` by DCP, and the
objects among them are decoded the same way (``_dcp_step.value_node``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pathlib
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ..format._layout import check_step
from ..roots.posix import _ownership
from ..roots.posix._ensure_dir import ensure_dir
from ..roots.posix._osops import DEFAULT_OPS, OsOps
from ..roots.posix._remove_tree import remove_tree
from . import _dcp_meta, _dcp_step

log = logging.getLogger("asyncckpt")

PICKLE_WARNING = (
    "DCP's .metadata file is a Python pickle: reading it runs whatever code the file names. "
    "Import only checkpoints you trust, with allow_pickle=True (asyncckpt import --allow-pickle)."
)


def import_dcp(
    dcp_dir: str | os.PathLike[str],
    root: str | os.PathLike[str],
    step: int,
    *,
    allow_pickle: bool = False,
    timeout: float = 60.0,
    ops: OsOps = DEFAULT_OPS,
) -> pathlib.Path:
    """Convert the DCP checkpoint in ``dcp_dir`` into step ``step`` under ``root``; returns the
    committed step directory.

    The step holds every tensor chunk as DCP saved it (``index.json``), so
    ``Checkpointer(root).load(into=...)``/``asyncckpt.load`` reshard it onto any world size or
    mesh, and ``dcp.load`` with :class:`~asyncckpt.integrations.dcp.StorageReader` reads it as
    well. ``allow_pickle`` must be ``True`` (see the module docstring: ``.metadata`` is a
    pickle). An existing step is never overwritten (``FileExistsError``); on any failure
    nothing is committed and the attempt directory is removed. ``timeout`` bounds each
    directory creation. Adding a step is writing: it takes the root's ownership for the call,
    as ``gc`` and ``pull`` do (``RootInUseError`` naming the owner while a Checkpointer owns
    the root: its retention would retire the imported step, or the import its newest).
    """
    if allow_pickle is not True:
        raise ValueError(f"refusing to read {os.fspath(dcp_dir)!r} without allow_pickle=True: {PICKLE_WARNING}")
    check_step(step)
    src, dst = os.fspath(dcp_dir), os.fspath(root)
    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise FileNotFoundError(2, "not a DCP checkpoint directory (no .metadata)", os.path.join(src, ".metadata"))
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    reader = FileSystemReader(src)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    dtypes = {
        fqn: md.properties.dtype for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }  # fmt: skip
    for fqn, dt in dtypes.items():
        _dcp_meta.dtype_name(dt, repr(fqn))  # refused before anything is written
    metadata = _storable(metadata)
    by_file = _items_by_file(metadata)
    ensure_dir(dst, timeout=timeout, ops=ops)
    own = _ownership.acquire(dst, [], role="asyncckpt import")
    try:
        return _write_step(reader, by_file, dtypes, metadata, src, dst, step, timeout, ops)
    finally:
        own.release()


def _write_step(
    reader: Any, by_file: dict[str, list[ReadItem]], dtypes: dict[str, torch.dtype], metadata: Metadata, src: str,
    dst: str, step: int, timeout: float, ops: OsOps,
) -> pathlib.Path:  # fmt: skip
    """:func:`import_dcp`'s writing part, under the root's ownership."""
    _dcp_step.check_step_free(dst, step)
    attempt = _dcp_step.new_attempt()
    loc = _dcp_step.attempt_dir(dst, step, attempt)
    ensure_dir(loc, timeout=timeout, ops=ops)
    ops.fsync_dir(dst)
    try:
        files = []
        for rank, (name, items) in enumerate(sorted(by_file.items())):
            entries = _read_file(reader, items, dtypes)
            files.append(_dcp_step.write_rank_file(loc, rank, entries, ops))
            log.debug("asyncckpt import: %s -> %s", name, files[-1].name)
        if not files:  # an empty state: still one rank, with an empty file
            files.append(_dcp_step.write_rank_file(loc, 0, [], ops))
        committed = _dcp_step.commit(dst, step, attempt, files, metadata,
                                     {"imported_from": os.path.abspath(src)}, ops)  # fmt: skip
    except BaseException:
        try:
            remove_tree(loc, ops)
        except OSError as e:
            log.warning("asyncckpt import: could not remove %s: %s", loc, e)
        raise
    return pathlib.Path(committed)


def _storable(metadata: Metadata) -> Metadata:
    """``metadata`` without a ``planner_data`` JSON cannot carry (a custom planner's): the
    step's structure is then flat (one key per DCP item), which DCP loads the same way."""
    try:
        _dcp_meta.encode_mappings(metadata.planner_data)
    except TypeError:
        log.warning("asyncckpt import: dropping planner_data of type %s (not key mappings)",
                    type(metadata.planner_data).__name__)  # fmt: skip
        return dataclasses.replace(metadata, planner_data=None)
    return metadata


def _items_by_file(metadata: Metadata) -> dict[str, list[ReadItem]]:
    """One ``ReadItem`` per stored item (a whole chunk, or an object), by the file holding it."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise ValueError("the DCP metadata has no storage_data (not written by FileSystemWriter)")
    out: dict[str, list[ReadItem]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            idx = MetadataIndex(fqn)
            req = ReadItem(LoadItemType.BYTE_IO, idx, torch.Size(()), idx, torch.Size(()), torch.Size(()))
            out.setdefault(storage[idx].relative_path, []).append(req)
            continue
        assert isinstance(md, TensorStorageMetadata)
        for i, chunk in enumerate(md.chunks):
            idx = MetadataIndex(fqn, chunk.offsets, i)
            zeros = torch.Size([0] * len(chunk.sizes))
            req = ReadItem(LoadItemType.TENSOR, idx, zeros, idx, zeros, chunk.sizes)
            out.setdefault(storage[idx].relative_path, []).append(req)
    return out


def _read_file(reader: Any, items: list[ReadItem], dtypes: dict[str, torch.dtype]) -> list[_dcp_step.Entry]:
    """Every item of one DCP file, read by DCP's own reader."""
    capture = _Capture(dtypes)
    reader.read_data(LoadPlan(items), capture).wait()
    entries = []
    for req in items:
        idx = req.storage_index
        if req.type == LoadItemType.BYTE_IO:
            blob = capture.blobs[idx.fqn]
            entries.append(_dcp_step.Entry(idx.fqn, None, (len(blob),), torch.uint8, blob))
        else:
            t = capture.tensors[(idx.fqn, tuple(idx.offset or ()))]
            entries.append(_dcp_step.Entry(idx.fqn, tuple(idx.offset or ()), tuple(t.shape), t.dtype, t))
    return entries


class _Capture(LoadPlanner):
    """A load planner that keeps every item DCP's reader hands it, as it is stored."""

    def __init__(self, dtypes: dict[str, torch.dtype]) -> None:
        self.tensors: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.blobs: dict[str, bytes] = {}
        self._dtypes = dtypes

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[read_item.storage_index.fqn] = value.getvalue()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # the whole stored chunk, in its stored dtype: DCP copies it in as it is
        idx = read_item.storage_index
        t = torch.empty(read_item.lengths, dtype=self._dtypes[idx.fqn])
        self.tensors[(idx.fqn, tuple(idx.offset or ()))] = t
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass
