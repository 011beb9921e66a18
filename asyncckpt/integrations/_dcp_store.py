"""The DCP storage layer on an object store (``s3://bucket/prefix``): asyncckpt's store commit.

A step saved through ``dcp.StorageWriter("s3://...")`` has the names and the commit of any
step on a store (``roots.objstore._backend``, ``_remote``), so ``asyncckpt ls``/``verify``/``load`` and
``Checkpointer("s3://...").load(into=...)`` read it::

    P/step_N/a-<attempt>/rankRRRRR.safetensors   rank R's DCP items (``_dcp_step.RankStream``)
    P/step_N/a-<attempt>/index.json, dcp.json, rankRRRRR.json
    P/step_N/manifest.json                       the commit object, created once

1. The coordinator (``prepare_global_plan``): the store must enforce ``If-None-Match: *``
   (probed once per process and location: a store that ignores it would let two commits of
   a step both "win"); ``step_N/manifest.json`` must not exist (``FileExistsError``: a
   step is never overwritten); a fresh attempt id for every rank.
2. Every rank (``write_data``): its file uploaded under the attempt-unique key by
   ``ObjectStore.put_from``, its bytes made from DCP's items part by part as the upload takes
   them (memory: the parts in flight and one item), the CRC-32C of the bytes sent kept for
   the manifest, the stored size checked by a HEAD. A 200 is the durability point.
3. The coordinator (``finish``, only when every rank's write succeeded): DCP's objects read
   back by ranged GETs and checked against their CRC-32C, the shared files uploaded, then,
   under the root's lease (``_lease``): one LIST of the attempt prefix must show exactly the
   manifest's names and sizes, and the manifest is created with ``create_once`` (one PUT with
   ``If-None-Match: *``, read back after every outcome; sent only while the lease is ours). Lost
   → ``FileExistsError`` naming the winning attempt. The lease is released at the end.

**The lease is held for the commit only** (step 3), not for the whole save: DCP calls the
storage layer no more after a save failed on any rank (``finish`` runs only when every write
succeeded), so a lease taken in step 1 would stay held and renewed after a failed save, and
refuse the job's own next save. Held for the commit it still gives what a lease is for: no
commit while another job writes the prefix (a store-root ``Checkpointer``, ``push``, ``gc``:
``RootInUseError``), and the objects are checked under it, so a ``gc`` that removed a save's
objects while they were uploaded makes that save fail, never commit a step that does not load.
The price: uploads into a prefix another job holds are refused only at their commit.

A save that fails, or is killed, before its manifest is created leaves objects under
``step_N/a-<attempt>/`` that no reader takes (there is no manifest); ``asyncckpt gc URL``
removes them, as does a store-root ``Checkpointer`` taking the prefix. A kill during the
commit leaves the lease record unreleased: the next commit on the prefix takes it over after
its TTL (``lease_ttl``).
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from .._errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointReadError,
    ObjectNotFoundError,
    ObjectStoreError,
)
from ..format._checksum import crc32c
from ..format._manifest import FileEntry, Manifest, decode
from ..loading._stepfiles import ReaderFiles
from ..roots._readfault import store_fault
from ..roots.objstore._client import ObjectStore
from ..roots.objstore._connection import gather_or_cancel
from ..roots.objstore._lease import held
from ..roots.objstore._remote import check_objects, data_prefix, manifest_key, open_store, read_manifest
from ..roots.objstore._root import ObjectStepReader
from ..threads._sync import run_sync
from . import _dcp_step

#: The lease holder's role, as its record names it (``RootInUseError`` messages show it).
ROLE = "DCP StorageWriter"
#: Locations probed for conditional creates in this process: (URL, storage options).
_probed: set[tuple[str, frozenset[tuple[str, str]]]] = set()


class StoreStep:
    """Step ``step`` under ``url`` (``s3://bucket/prefix``) for the DCP writer and reader.

    ``deadline_s`` bounds each of its calls (a rank's upload, the commit, one read); the
    ``ObjectStore`` is made in each process on first use and never pickled
    (``dcp.async_save`` may send the writer to a process of its own).
    """

    def __init__(self, url: str, step: int, storage_options: Mapping[str, str] | None, deadline_s: float,
                 lease_ttl: float) -> None:  # fmt: skip
        self.url, self.step, self.deadline_s, self.lease_ttl = url, step, deadline_s, lease_ttl
        self.options = dict(storage_options or {})
        self._store: ObjectStore | None = None
        self.store  # bad options (not str -> str, a malformed URL) raise here, at construction  # noqa: B018

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}

    def __repr__(self) -> str:  # never the options: they may hold credentials
        return f"StoreStep({self.url!r}, step={self.step})"

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store(self.url, self.options)
        return self._store

    def _deadline(self) -> float:
        return time.monotonic() + self.deadline_s

    # -- the writer ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Step 1 (the coordinator): the store enforces conditional creates, the step is free."""
        store, deadline = self.store, self._deadline()
        where = (store.url, frozenset(self.options.items()))

        async def go() -> None:
            if where not in _probed:
                await store.probe(deadline)  # ConditionalWriteUnsupportedError: never a silent race
                _probed.add(where)
            try:
                there = await read_manifest(store, self.step, deadline) is not None
            except CheckpointCorruptError:
                there = True  # a manifest that does not decode is there all the same
            if there:
                key = store.object_url(manifest_key(self.step))
                raise FileExistsError(
                    errno.EEXIST, f"step {self.step} exists under {store.url}; asyncckpt never overwrites a step "
                    "(save another step, or remove it first)", key,
                )  # fmt: skip

        run_sync(go)

    def upload(self, attempt: str, stream: _dcp_step.RankStream) -> _dcp_step.RankFile:
        """Step 2 (every rank): upload ``stream``, its file of DCP items; what it wrote."""
        store, deadline = self.store, self._deadline()
        key = data_prefix(self.step, attempt) + stream.name
        put = run_sync(lambda: store.put_from(key, stream.size, stream.read, deadline))
        return stream.described(put.crc32c)

    def commit(self, attempt: str, files: list[_dcp_step.RankFile], metadata: Metadata,
               extra: dict[str, Any]) -> None:  # fmt: skip
        """Step 3 (the coordinator): the shared files, then the manifest's conditional create
        under the root's lease (module docstring)."""
        store, deadline = self.store, self._deadline()
        prefix = data_prefix(self.step, attempt)
        where = store.object_url(prefix)

        async def go() -> None:
            locations = _dcp_step.blob_locations(files, where)
            blobs: dict[str, bytes] = {}

            async def blob(fqn: str, name: str, begin: int, n: int, crc: int) -> None:
                buf = bytearray(n)
                await store.get_range_into(prefix + name, begin, memoryview(buf), deadline)
                if crc32c(buf) != crc:
                    raise CheckpointCorruptError("checksum mismatch reading back a DCP object",
                                                 store.object_url(prefix + name))  # fmt: skip
                blobs[fqn] = bytes(buf)

            await gather_or_cancel([blob(fqn, *at) for fqn, at in locations.items()])
            docs = _dcp_step.shared_files(files, metadata, blobs, where)

            async def put(name: str, raw: bytes) -> None:
                await store.put_file(prefix + name, memoryview(raw), deadline)

            await gather_or_cancel([put(name, raw) for name, raw, _ in docs])
            shared = [FileEntry(name, len(raw), crc32c(raw), rank) for name, raw, rank in docs]
            body = _dcp_step.manifest_body(self.step, attempt, files, shared, extra)
            key = manifest_key(self.step)
            async with held(store, ROLE, deadline, self.lease_ttl) as lease:
                # under the lease no other writer removes objects: what this LIST shows stays
                await check_objects(store, decode(body, store.object_url(key)), deadline)
                until = min(deadline, await lease.confirm(lease.ttl / 3))
                result = await store.create_once(key, body, until)
            if not result.won:
                try:
                    other = decode(result.stored, store.object_url(key)).attempt
                except CheckpointCorruptError:
                    other = "unreadable"
                raise FileExistsError(
                    errno.EEXIST, f"step {self.step} was committed by another attempt ({other}) while this one "
                    "wrote; asyncckpt never overwrites a step", store.object_url(key),
                )  # fmt: skip

        run_sync(go)

    # -- the reader ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def opened(self) -> Iterator[tuple[ReaderFiles, Manifest]]:
        """The complete step's objects (its manifest decoded, one LIST showing exactly its
        names and sizes), read by ranged GETs. A store's failure is ``CheckpointReadError``
        (damage: ``CheckpointCorruptError``), an object gone mid-read (the step retired)
        ``CheckpointNotFoundError``."""
        deadline = self._deadline()
        reader: ObjectStepReader | None = None
        try:
            reader = ObjectStepReader(self.store, self.step, deadline)
            files = ReaderFiles(reader)
            try:
                yield files, reader.manifest
            finally:
                files.close()
        except (CheckpointCorruptError, CheckpointReadError) as e:
            if reader is not None and not reader.still_there():
                raise CheckpointNotFoundError(f"step {self.step} under {self.url} vanished while being read ({e})"
                                              ) from None  # fmt: skip
            raise
        except ObjectNotFoundError as e:
            msg = f"step {self.step} under {self.url} vanished while being read ({e})"
            raise CheckpointNotFoundError(msg) from None
        except ObjectStoreError as e:
            raise store_fault(e) from e
