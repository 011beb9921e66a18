"""Loading a checkpoint straight from an object store into fresh tensors, verified.

The same checks as the local loader, on bytes fetched with ranged GETs: the structure file
(bounded, CRC-32C), the shard's 8-byte length and header (``_header.parse_header`` /
``validate_header``), tensors allocated by ``_load._allocate`` and filled by ranged GETs
(large tensors directly into their memory, runs of small ones through one scratch range),
then the whole shard's CRC-32C in file order against the manifest, and the state rebuilt
by ``_load._rebuild``. Every defect is ``CheckpointCorruptError`` naming the object's URL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from . import _load
from ._bounds import MAX_TREE_BYTES, human, parse_structure
from ._checksum import crc32c
from ._errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ._format import ST_TO_DTYPE
from ._header import MAX_HEADER, TensorSlot, parse_header, validate_header
from ._index import INDEX, MAX_INDEX_BYTES
from ._index import parse as parse_index
from ._layout import check_step
from ._manifest import Manifest, shard_name, tree_name
from ._objstore import ObjectNotFoundError, ObjectStore, gather_or_cancel
from ._remote import DEFAULT_DEADLINE_S, candidate_steps, data_prefix, open_step, open_store, run_sync

log = logging.getLogger("asyncckpt")

#: Tensors at least this large are fetched straight into their memory; smaller ones in runs.
_DIRECT = 1024 * 1024
_RUN = 8 * 1024 * 1024
_RANGES_IN_FLIGHT = 4
#: Listings of a load(step=None) whose choice was retired while being read, before giving up.
_LIST_ROUNDS = 16


def _entry(store: ObjectStore, m: Manifest, name: str) -> tuple[str, int, int]:
    try:
        f = m.file(name)
    except CheckpointCorruptError:
        raise CheckpointCorruptError(f"manifest does not list {name}", store.object_url(f"step_{m.step:08d}")) from None
    return data_prefix(m.step, m.attempt) + f.name, f.size, f.crc32c


async def _read_header(store: ObjectStore, key: str, size: int, deadline: float) -> tuple[bytes, int, list[TensorSlot]]:
    url = store.object_url(key)
    if size < 8:
        raise CheckpointCorruptError(f"shard of {size} bytes has no header", url)
    prefix = bytearray(8)
    await store.get_range_into(key, 0, memoryview(prefix), deadline)
    n = int.from_bytes(prefix, "little")
    try:
        if n > MAX_HEADER or n > size - 8:
            raise ValueError(f"declared header length {n} does not fit the object ({size} bytes)")
        rest = bytearray(n)
        await store.get_range_into(key, 8, memoryview(rest), deadline)
        head = bytes(prefix) + bytes(rest)
        _, header = parse_header(head, size)
        data_start = 8 + n
        if data_start % 8:
            raise ValueError("data section is not 8-byte aligned")
        slots = validate_header(header, size - data_start)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"bad safetensors header ({e})", url) from None
    return head, data_start, slots


async def _fill(store: ObjectStore, key: str, data_start: int, ordered: list[TensorSlot],
                views: list[memoryview], deadline: float) -> None:
    """Ranged GETs of every tensor's bytes into ``views`` (in ``ordered``'s order)."""
    groups: list[list[int]] = []
    run: list[int] = []
    run_bytes = 0
    for i, v in enumerate(views):
        if v.nbytes >= _DIRECT:
            groups.append([i])
        elif v.nbytes:
            run.append(i)
            run_bytes += v.nbytes
            if run_bytes >= _RUN:
                groups.append(run)
                run, run_bytes = [], 0
    if run:
        groups.append(run)
    sem = asyncio.Semaphore(_RANGES_IN_FLIGHT)

    async def one(group: list[int]) -> None:
        async with sem:
            first = ordered[group[0]]
            if len(group) == 1:
                await store.get_range_into(key, data_start + first.begin, views[group[0]], deadline)
                return
            # small tensors are adjacent in the data section (it is tiled without gaps)
            span = ordered[group[-1]].end - first.begin
            scratch = bytearray(span)
            await store.get_range_into(key, data_start + first.begin, memoryview(scratch), deadline)
            for i in group:
                s = ordered[i]
                views[i][:] = memoryview(scratch)[s.begin - first.begin : s.end - first.begin]

    await gather_or_cancel([one(g) for g in groups])


def _crc(head: bytes, views: list[memoryview]) -> int:
    crc = crc32c(head)
    for v in views:
        crc = crc32c(v, crc)
    return crc


async def load_rank(store: ObjectStore, m: Manifest, rank: int, verify: bool, deadline: float) -> Any:
    """Rebuild rank ``rank``'s state of complete step ``m`` from the store.

    Values written once for several ranks (dedupe) are read from the rank's file that holds
    them, each checked against its index CRC. A step holding DTensors is refused with
    ``CheckpointError``: its shards hold local pieces of global tensors, assembled only by the
    file-system loader (``pull`` it first)."""
    borrowed = await _borrowed(store, m, rank, deadline) if any(f.name == INDEX for f in m.files) else {}
    tree_key, tree_size, tree_crc = _entry(store, m, tree_name(rank))
    shard_key, shard_size, shard_crc = _entry(store, m, shard_name(rank))
    tree_url, shard_url = store.object_url(tree_key), store.object_url(shard_key)
    if tree_size > MAX_TREE_BYTES:
        raise CheckpointCorruptError(f"structure object of {tree_size} bytes exceeds the {human(MAX_TREE_BYTES)} limit",
                                     tree_url)
    raw = await store.get_bytes(tree_key, deadline, limit=MAX_TREE_BYTES)
    tree = parse_structure(raw, tree_url, tree_size, tree_crc if verify else None)
    del raw
    head, data_start, slots = await _read_header(store, shard_key, shard_size, deadline)
    ordered = sorted(slots, key=lambda s: s.begin)
    tensors = _load._allocate(ordered, shard_size - data_start, shard_url)
    views = [_load.byte_view(tensors[s.name]) for s in ordered]
    await _fill(store, shard_key, data_start, ordered, views, deadline)
    if verify and await asyncio.to_thread(_crc, head, views) != shard_crc:
        raise CheckpointCorruptError("checksum mismatch", shard_url)
    for name, (dtype, shape, file, begin, n, crc) in borrowed.items():
        t = torch.empty(shape, dtype=ST_TO_DTYPE[dtype])
        key = data_prefix(m.step, m.attempt) + file
        view = _load.byte_view(t)
        if n:
            await store.get_range_into(key, begin, view, deadline)
        if verify and await asyncio.to_thread(crc32c, view) != crc:
            raise CheckpointCorruptError(f"checksum mismatch in {name!r}", store.object_url(key))
        tensors[name] = t
    return _load._rebuild(tree, tensors, tree_url, shard_url)


async def _borrowed(store: ObjectStore, m: Manifest, rank: int, deadline: float) -> dict[str, Any]:
    """The plain tensors of ``rank`` stored in another rank's file (dedupe), from the step's
    verified index: ``name -> (dtype, shape, file, begin, nbytes, crc32c)``."""
    key, size, crc = _entry(store, m, INDEX)
    url = store.object_url(key)
    raw = await store.get_bytes(key, deadline, limit=MAX_INDEX_BYTES)
    if len(raw) != size or crc32c(raw) != crc:
        raise CheckpointCorruptError("checksum mismatch", url)
    try:
        dtensors = bool(json.loads(raw).get("tensors"))
        index = parse_index(raw, m.world_size, {f.name: f.size for f in m.files}, plain_only=True)
    except (ValueError, AttributeError, RecursionError) as e:
        raise CheckpointCorruptError(f"bad global index ({e})", url) from None
    if dtensors:
        raise CheckpointError(
            f"step {m.step} under {store.url} holds DTensors (sharded state): loading it straight from the store "
            "is not supported yet; pull it to a local root (asyncckpt.remote.pull) and load from there"
        )
    entries = index["plain"].get(rank) or {}
    return {name: e for name, e in entries.items() if e[2] != shard_name(rank)}


def _check_rank(rank: object) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise (TypeError if not isinstance(rank, int) else ValueError)(f"rank must be a non-negative int, not {rank!r}")
    return rank


def load(
    url: str,
    step: int | None = None,
    *,
    into: Any = None,
    verify: bool = True,
    rank: int = 0,
    strip_prefixes: Sequence[str] = (),
    storage_options: Mapping[str, str] | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> Any:
    """:func:`asyncckpt.load` for ``s3://bucket/prefix``: the same rules (``step=None`` loads the
    newest complete checkpoint that verifies, logging and skipping a corrupt newer one; an
    explicit step raises ``CheckpointNotFoundError`` / ``CheckpointCorruptError``)."""
    from ._checkpointer import _prefixes

    prefixes = _prefixes(strip_prefixes)
    if step is not None:
        check_step(step)
    _check_rank(rank)
    store = open_store(url, storage_options)

    async def go() -> Any:
        deadline = time.monotonic() + deadline_s
        if step is not None:
            try:
                m, _ = await open_step(store, step, deadline)
                return await load_rank(store, m, rank, verify, deadline)
            except ObjectNotFoundError as e:  # retired while being read (manifest first, then objects)
                msg = f"step {step} under {store.url} vanished while being read ({e})"
                raise CheckpointNotFoundError(msg) from None
        for _ in range(_LIST_ROUNDS):
            vanished = False
            for s in await candidate_steps(store, deadline):
                try:
                    m, _ = await open_step(store, s, deadline)
                    return await load_rank(store, m, rank, verify, deadline)
                except CheckpointNotFoundError:
                    continue
                except ObjectNotFoundError:
                    vanished = True  # retired while being read: a newer step exists now, list again
                    break
                except CheckpointCorruptError as e:
                    log.warning("remote step %d does not verify, trying an older one: %s", s, e)
            if not vanished:
                break
        raise CheckpointNotFoundError(f"no complete checkpoint under {store.url}")

    state = run_sync(go)
    if into is not None:
        with torch.no_grad():
            _load.restore_into(into, state, strip_prefixes=prefixes)
    return state
