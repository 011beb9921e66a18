"""``torch.distributed.checkpoint`` through asyncckpt: a storage layer and an importer.

``StorageWriter``/``StorageReader`` implement DCP's storage interfaces, so ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` (any planner that keeps DCP's default metadata, any
world size, resharding included) write and read an ordinary asyncckpt step::

    import torch.distributed.checkpoint as dcp
    from asyncckpt.integrations.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter("ckpt", step=100))      # or "ckpt/step_00000100"
    dcp.load(state, storage_reader=StorageReader("ckpt", step=100))

What it adds to DCP's ``FileSystemWriter``: directories made with the race-tolerant
``ensure_dir`` (every rank; the coordinator first), every file CRC-32C'd as it is written and
fsynced, each item checked against its CRC-32C when read (a flipped byte is an error, not a
wrong weight), an atomic commit (a ``step_N.tmp-<attempt>`` directory renamed into place once
the manifest is written; a kill mid-save leaves nothing a reader takes), DCP's metadata as
JSON (no pickle; ``_dcp_meta``), and a step that ``asyncckpt ls``/``verify``/``load`` and
``Checkpointer.load(into=...)`` read like any other (``_dcp_step``).

``import_dcp`` converts a checkpoint torch's own ``FileSystemWriter`` wrote into such a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _dcp_storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.futures import Future

from .._errors import CheckpointCorruptError, CheckpointNotFoundError
from ..format import _index
from ..format._layout import MAX_STEP, check_step, parse_step_dir, step_dir_name
from ..format._manifest import Manifest
from ..format._safetensors import ST_TO_DTYPE
from ..loading import _blocks
from ..loading._readinto import byte_view
from ..loading._stepfiles import ReaderFiles, StepFiles
from ..roots._scheme import is_url
from ..roots.objstore._lease import DEFAULT_TTL_S, check_ttl
from ..roots.objstore._remote import DEFAULT_DEADLINE_S
from ..roots.posix._ensure_dir import ensure_dir
from ..roots.posix._osops import DEFAULT_OPS, OsOps
from ..roots.posix._root import PosixStepReader
from . import _dcp_meta, _dcp_step
from ._dcp_import import import_dcp

__all__ = ["StorageReader", "StorageWriter", "import_dcp"]

#: The WriteResult a rank returns for its file (DCP hands every rank's to the coordinator).
_FILE_KEY = "asyncckpt.rank_file"
#: Items read in one parallel batch (bytes): bounded memory, parallel I/O within a batch.
_BATCH = 256 << 20


def locate(path: str | os.PathLike[str], step: int | None) -> tuple[str, int]:
    """``(root, step)`` from ``StorageWriter``/``StorageReader``'s arguments: ``path`` is the
    root when ``step`` is given, else ``ROOT/step_NNNNNNNN`` (a step directory's own name);
    ``path`` may be an ``s3://bucket/prefix`` URL (the root is then a URL too)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    p = os.fspath(path)
    if isinstance(p, bytes) or not p:
        raise TypeError("path must be a non-empty str path")
    url = is_url(p)
    if url:
        p = p.rstrip("/")
    if step is not None:
        return p, check_step(step)
    head, name = p.rsplit("/", 1) if url else os.path.split(os.path.normpath(p))
    parsed = parse_step_dir(name)
    if parsed is None or (url and not is_url(head)):
        raise ValueError(
            f"{p!r} is not a step directory (ROOT/step_00000100, 8 digits or more, at most {MAX_STEP}): "
            "pass the root and step=N instead"
        )
    return head or ".", parsed


def step_id(root: str, step: int) -> str:
    """The step's directory (or, under an ``s3://`` root, its URL)."""
    return f"{root}/{step_dir_name(step)}" if is_url(root) else os.path.join(root, step_dir_name(step))


def _store_step(root: str, step: int, options: Mapping[str, str] | None, deadline_s: float,
                lease_ttl: float) -> Any:  # fmt: skip
    """The step on its object store (``_dcp_store.StoreStep``), ``None`` for a local root."""
    if not is_url(root):
        if options:
            raise ValueError("storage_options apply to an s3:// root, not to the local path " + repr(root))
        return None
    from ._dcp_store import StoreStep  # obstore: only for a store

    return StoreStep(root, step, options, deadline_s, lease_ttl)


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")
    return float(value)


class StorageWriter(_dcp_storage.StorageWriter):
    """Writes one DCP save as asyncckpt step ``step`` under ``root`` (see the module docstring).

    ``StorageWriter(root, step=N)`` or ``StorageWriter("root/step_0000000N")``; a
    ``checkpoint_id`` passed to ``dcp.save`` is read the same way (a path ``ROOT/step_N``).
    A step that exists is never overwritten (``FileExistsError``, on every rank, before any
    data is written). ``timeout`` bounds each directory creation (``ensure_dir``, default
    60 s); the rank coordination is DCP's own, on its process group. Picklable
    (``dcp.async_save`` with a process executor sends it to its worker).

    An ``s3://bucket/prefix`` root (``storage_options`` as for ``Checkpointer``) is written
    with asyncckpt's object-store commit (``_dcp_store``): each rank uploads its file under
    ``step_N/a-<attempt>/``, the coordinator creates ``step_N/manifest.json`` once
    (``If-None-Match: *``) under the root's lease (``lease_ttl``), held for the commit only.
    ``timeout`` then bounds each store call (a rank's upload, the commit; default 1 h).

    Call order (DCP's, ``StorageWriter``): ``reset`` (with a ``checkpoint_id``), then on every
    rank ``set_up_storage_writer`` and ``prepare_local_plan``; on the coordinator
    ``prepare_global_plan`` (checks the step is free, makes ``step_N.tmp-<attempt>``, hands
    every rank the attempt and its rank in the plan); on every rank ``write_data`` (joins the
    attempt directory, writes ``rankRRRRR.safetensors``, fsyncs it); on the coordinator, only
    if every rank's write succeeded, ``finish`` (structure, index, metadata, manifest, commit
    rename). All calls run on the thread DCP calls from (a background thread with
    ``dcp.async_save``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        timeout: float | None = None,
        storage_options: Mapping[str, str] | None = None,
        lease_ttl: float = DEFAULT_TTL_S,
        ops: OsOps = DEFAULT_OPS,
    ) -> None:
        super().__init__()
        self.root, self.step = locate(path, step)
        default = DEFAULT_DEADLINE_S if is_url(self.root) else 60.0
        self.timeout = _seconds(default if timeout is None else timeout, "timeout")
        self.lease_ttl = check_ttl(lease_ttl)
        self.storage_options = storage_options
        self.ops = ops
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank = 0
        self._attempt: str | None = None
        self._store = _store_step(self.root, self.step, storage_options, self.timeout, self.lease_ttl)

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"StorageWriter({self.checkpoint_id!r})"

    @property
    def checkpoint_id(self) -> str:
        """The step directory (or URL) this writer commits."""
        return step_id(self.root, self.step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.root, self.step = locate(checkpoint_id, None)
            self._store = _store_step(self.root, self.step, self.storage_options, self.timeout, self.lease_ttl)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if kwargs.get("use_collectives") is False and _world() > 1:
            raise NotImplementedError(
                "asyncckpt commits one step for all ranks: dcp.save(use_collectives=False) is not supported"
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._store is not None:
            self._store.prepare()  # conditional creates enforced, the step free; nothing to make
            attempt = self._attempt = _dcp_step.new_attempt()
        else:
            # the coordinator alone makes the attempt directory (a unique name: no mkdir race)
            # and fsyncs the root so a crash leaves it findable for gc
            ensure_dir(self.root, timeout=self.timeout, ops=self.ops)
            _dcp_step.check_step_free(self.root, self.step)
            attempt = self._attempt = _dcp_step.new_attempt()
            ensure_dir(_dcp_step.attempt_dir(self.root, self.step, attempt), timeout=self.timeout, ops=self.ops)
            self.ops.fsync_dir(self.root)
        return [
            dataclasses.replace(plan, storage_data={"asyncckpt_attempt": attempt, "rank": i})
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[_dcp_storage.WriteResult]]:
        data = plan.storage_data
        if not (isinstance(data, dict) and "asyncckpt_attempt" in data):
            raise RuntimeError("the plan did not come through StorageWriter.prepare_global_plan")
        entries = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raw = planner.resolve_data(item)  # objects first: their sizes fix the layout
                blob = raw.getvalue() if hasattr(raw, "getvalue") else bytes(raw)
                entries.append(_dcp_step.Entry(item.index.fqn, None, (len(blob),), torch.uint8, blob))
                continue
            td = item.tensor_data
            assert td is not None
            _dcp_meta.dtype_name(td.properties.dtype, repr(item.index.fqn))
            entries.append(
                _dcp_step.Entry(
                    item.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.properties.dtype,
                    _resolver(planner, item),
                )
            )  # fmt: skip
        if self._store is not None:
            written = self._store.upload(data["asyncckpt_attempt"], _dcp_step.RankStream(int(data["rank"]), entries))
        else:
            loc = _dcp_step.attempt_dir(self.root, self.step, data["asyncckpt_attempt"])
            ensure_dir(loc, timeout=self.timeout, ops=self.ops)  # made by the coordinator: wait until visible here
            written = _dcp_step.write_rank_file(loc, int(data["rank"]), entries, self.ops)
        result = _dcp_storage.WriteResult(
            index=MetadataIndex(_FILE_KEY),
            size_in_bytes=written.size,
            storage_data={"attempt": data["asyncckpt_attempt"], "file": written.to_json()},
        )
        fut: Future[list[_dcp_storage.WriteResult]] = Future()
        fut.set_result([result])
        return fut

    def finish(self, metadata: Metadata, results: list[list[_dcp_storage.WriteResult]]) -> None:
        files: list[_dcp_step.RankFile] = []
        for rank_results in results:
            mine = [r for r in rank_results if r.index.fqn == _FILE_KEY]
            if len(mine) != 1 or mine[0].storage_data.get("attempt") != self._attempt:
                raise RuntimeError("a rank's write results did not come from this save's StorageWriter.write_data")
            files.append(_dcp_step.RankFile.from_json(mine[0].storage_data["file"]))
        assert self._attempt is not None
        files.sort(key=lambda f: f.rank)
        extra = {"written_by": "torch.distributed.checkpoint"}
        if self._store is not None:
            self._store.commit(self._attempt, files, metadata, extra)
        else:
            _dcp_step.commit(self.root, self.step, self._attempt, files, metadata, extra, self.ops)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            locate(checkpoint_id, None)
        except (TypeError, ValueError):
            return False
        return True


def _resolver(planner: SavePlanner, item: Any) -> Any:
    """A function that resolves ``item``'s tensor when its turn to be written comes."""
    return lambda: planner.resolve_data(item)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class StorageReader(_dcp_storage.StorageReader):
    """Reads an asyncckpt step written through :class:`StorageWriter` (or made by
    :func:`import_dcp`) for ``dcp.load``, at any world size and placement.

    ``StorageReader(root, step=N)`` or ``StorageReader("root/step_0000000N")``; the root may be
    an ``s3://bucket/prefix`` URL (``storage_options`` as for ``Checkpointer``; ``timeout``
    bounds each store call, default 1 h), read by ranged GETs. Only a committed step is read
    (its manifest checked against its own checksum, every file of the size it lists); each
    item's bytes are read once per ``read_data`` and checked against their CRC-32C before DCP
    sees them: a mismatch raises ``CheckpointCorruptError`` naming the file or object URL
    (``dcp.load`` then raises on every rank); a store that fails, ``CheckpointReadError``. A
    step retired or replaced between ``read_metadata`` and ``read_data`` raises
    ``CheckpointNotFoundError``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        step: int | None = None,
        storage_options: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_DEADLINE_S,
    ) -> None:
        super().__init__()
        self.root, self.step = locate(path, step)
        self.timeout = _seconds(timeout, "timeout")
        self.storage_options = storage_options
        self.load_id = uuid.uuid4().hex
        self._attempt: str | None = None
        self._blobs: dict[str, _dcp_meta.BytesLocation] = {}
        self._store = _store_step(self.root, self.step, storage_options, self.timeout, DEFAULT_TTL_S)

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"StorageReader({self.checkpoint_id!r})"

    @property
    def checkpoint_id(self) -> str:
        return step_id(self.root, self.step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.root, self.step = locate(checkpoint_id, None)
            self._store = _store_step(self.root, self.step, self.storage_options, self.timeout, DEFAULT_TTL_S)
        self.load_id = uuid.uuid4().hex
        self._attempt = None

    def _opened(self) -> contextlib.AbstractContextManager[tuple[StepFiles, Manifest]]:
        return self._store.opened() if self._store is not None else _opened(self.root, self.step)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self._opened() as (files, manifest):
            metadata, self._blobs = read_dcp_json(files, manifest)
            self._attempt = manifest.attempt
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with self._opened() as (files, manifest):
            if self._attempt is None:
                _, self._blobs = read_dcp_json(files, manifest)
            elif manifest.attempt != self._attempt:
                raise CheckpointNotFoundError(
                    f"step {self.step} under {self.root} was replaced after its metadata was read"
                )
            entry = manifest.file(_index.INDEX)
            index = _index.parse(files.read(_index.INDEX, entry.crc32c), manifest.world_size,
                                 {f.name: f.size for f in manifest.files})["tensors"]  # fmt: skip
            groups: dict[Any, list[ReadItem]] = {}
            for req in plan.items:
                groups.setdefault(_key(req), []).append(req)
            for batch in _batches(groups, index, self._blobs):
                _read_batch(files, batch, index, self._blobs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return StorageWriter.validate_checkpoint_id(checkpoint_id)


@contextlib.contextmanager
def _opened(root: str, step: int) -> Iterator[tuple[ReaderFiles, Manifest]]:
    """The committed step's files, pinned (a retirement cannot pull them from under a read)."""
    files = ReaderFiles(PosixStepReader(root, step))
    try:
        yield files, files.manifest
    finally:
        files.close()


def read_dcp_json(files: StepFiles, manifest: Manifest) -> tuple[Metadata, dict[str, _dcp_meta.BytesLocation]]:
    """DCP's metadata of a step and where its objects lie (``CheckpointCorruptError`` when the
    step was not written through DCP or ``dcp.json`` is damaged)."""
    try:
        entry = manifest.file(_dcp_meta.FILE)
    except CheckpointCorruptError:
        raise CheckpointCorruptError(
            "this step was not written through DCP (no dcp.json): load it with asyncckpt.load()",
            files.path(_dcp_meta.FILE),
        ) from None
    raw = files.read(_dcp_meta.FILE, entry.crc32c)
    try:
        return _dcp_meta.decode(raw, {f.name: f.size for f in manifest.files})
    except ValueError as e:
        raise CheckpointCorruptError(f"bad DCP metadata ({e})", files.path(_dcp_meta.FILE)) from None


def _key(req: ReadItem) -> tuple[str, tuple[int, ...] | None]:
    idx = req.storage_index
    if req.type == LoadItemType.BYTE_IO:
        return idx.fqn, None
    return idx.fqn, tuple(idx.offset or ())


def _batches(
    groups: dict[Any, list[ReadItem]], index: dict[str, Any], blobs: dict[str, _dcp_meta.BytesLocation]
) -> Iterator[list[tuple[Any, list[ReadItem]]]]:
    """The stored items to read, in batches of about :data:`_BATCH` bytes (in file order)."""
    batch: list[tuple[Any, list[ReadItem]]] = []
    size = 0
    for key, reqs in sorted(groups.items(), key=lambda kv: _where(kv[0], index, blobs)):
        batch.append((key, reqs))
        size += _where(key, index, blobs)[2]
        if size >= _BATCH:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _where(key: tuple[str, tuple[int, ...] | None], index: dict[str, Any],
           blobs: dict[str, _dcp_meta.BytesLocation]) -> tuple[str, int, int, int, Any]:  # fmt: skip
    """``(file, begin, nbytes, crc32c, chunk sizes or None)`` of one stored item."""
    fqn, offsets = key
    if offsets is None:
        loc = blobs.get(fqn)
        if loc is None:
            raise CheckpointCorruptError(f"the checkpoint holds no object {fqn!r}")
        return (*loc, None)
    meta = index.get(fqn)
    if meta is not None:
        for chunk, crc in zip(meta["chunks"], meta["crcs"], strict=True):
            if chunk.box.offsets == offsets:
                item = ST_TO_DTYPE[meta["dtype"]].itemsize
                return chunk.file, chunk.begin, chunk.nbytes(item), crc, chunk.box.sizes
    raise CheckpointCorruptError(f"the checkpoint holds no chunk of {fqn!r} at offsets {list(offsets)}")


def _read_batch(
    files: StepFiles,
    batch: list[tuple[Any, list[ReadItem]]],
    index: dict[str, Any],
    blobs: dict[str, _dcp_meta.BytesLocation],
    planner: LoadPlanner,
) -> None:
    """Read a batch of stored items (in parallel, each CRC-32C checked as it lands), then hand
    each request its part: DCP's ``load_bytes`` / ``resolve_tensor`` + ``commit_tensor``."""
    landed: list[Any] = []
    blocks = []
    for key, _ in batch:
        file, begin, n, crc, sizes = _where(key, index, blobs)
        if sizes is None:
            buf: Any = bytearray(n)
            view = memoryview(buf)
        else:
            buf = torch.empty(sizes, dtype=ST_TO_DTYPE[index[key[0]]["dtype"]])
            view = byte_view(buf)
        landed.append(buf)
        runs = ((0, view),) if n else ()
        blocks.append(_blocks.Block(files.source(file), files.path(file), begin, n, crc, runs, repr(key[0])))
    _blocks.read_blocks(blocks)
    for (_, reqs), buf in zip(batch, landed, strict=True):
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(bytes(buf)))
                continue
            part = buf
            for d, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                part = part.narrow(d, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise CheckpointCorruptError(
                    f"{req.storage_index.fqn!r}: the planner wants {list(target.size())}, "
                    f"the chunk gives {list(part.size())}"
                )
            target.copy_(part)
            planner.commit_tensor(req, target)
