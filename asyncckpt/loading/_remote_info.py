"""The key tree one rank saved in a remote step, read without torch (``asyncckpt info s3://``).

The same bounded parsers and checks as a local ``info`` (:mod:`asyncckpt.reading`), on bytes
fetched from the store: the structure object (size bound, CRC-32C), the shard's 8-byte length
and header (two ranged GETs, never the tensor data), and the global index when the step has
one. Every defect is ``CheckpointCorruptError`` naming the object's URL.
"""

from __future__ import annotations

from .._errors import CheckpointCorruptError, CheckpointNotFoundError, ObjectIntegrityError
from ..format._bounds import check_structure_size, parse_structure
from ..format._header import TensorSlot
from ..format._index import INDEX, MAX_INDEX_BYTES
from ..format._layout import data_prefix, step_dir_name
from ..format._manifest import MANIFEST, FileEntry, Manifest, shard_name, tree_name
from ..reading import Entry, check_rank, header_length, indexed_slots, rank_outline, slots_of_header
from ..roots.objstore._client import ObjectStore
from ..roots.objstore._steps import newest_resumable, open_step


async def resolve_remote_step(
    store: ObjectStore, step: int | None, deadline: float,
    passed: list[tuple[int, CheckpointCorruptError]] | None = None,
) -> Manifest:
    """The manifest of complete remote ``step`` (the newest resumable when ``None``: pull's
    choice); steps newer than that one passed over as corrupt or known bad are put in ``passed``."""
    if step is not None:
        return (await open_step(store, step, deadline))[0]
    found = await newest_resumable(store, deadline, passed=passed)
    if found is None:
        raise CheckpointNotFoundError(f"no complete checkpoint under {store.url}")
    return found[0]


async def remote_rank_outline(
    store: ObjectStore, m: Manifest, rank: int, deadline: float
) -> tuple[list[Entry], dict[str, TensorSlot]]:
    """Rank ``rank``'s key tree and its shard's slots, as :func:`asyncckpt.reading.read_rank_outline`."""
    check_rank(m, rank)
    tree_f, shard_f = _listed(store, m, tree_name(rank)), _listed(store, m, shard_name(rank))
    prefix = data_prefix(m.step, m.attempt)
    tree_url, shard_url = store.object_url(prefix + tree_f.name), store.object_url(prefix + shard_f.name)
    check_structure_size(tree_f.size, tree_url)
    tree = parse_structure(await _whole(store, prefix + tree_f.name, tree_f.size, deadline), tree_url,
                           tree_f.size, tree_f.crc32c)  # fmt: skip
    head = bytearray(8) if shard_f.size >= 8 else bytearray()
    if head:
        await store.get_range_into(prefix + shard_f.name, 0, memoryview(head), deadline)
    n = header_length(bytes(head), shard_f.size, shard_url)
    rest = bytearray(n)
    if n:
        await store.get_range_into(prefix + shard_f.name, 8, memoryview(rest), deadline)
    shard_slots = slots_of_header(bytes(head) + bytes(rest), shard_f.size, shard_url)
    more: dict[str, TensorSlot] = {}
    if any(f.name == INDEX for f in m.files):
        index_f = _listed(store, m, INDEX)
        if index_f.size > MAX_INDEX_BYTES:
            raise CheckpointCorruptError(f"index of {index_f.size} bytes is too large",
                                         store.object_url(prefix + INDEX))  # fmt: skip
        raw = await _whole(store, prefix + INDEX, index_f.size, deadline)
        more = indexed_slots(raw, index_f.size, index_f.crc32c, m, rank, store.object_url(prefix + INDEX))
    return rank_outline(tree, shard_slots, more, tree_url, shard_url)


def _listed(store: ObjectStore, m: Manifest, name: str) -> FileEntry:
    try:
        return m.file(name)
    except CheckpointCorruptError:
        url = store.object_url(f"{step_dir_name(m.step)}/{MANIFEST}")
        raise CheckpointCorruptError(f"manifest does not list {name}", url) from None


async def _whole(store: ObjectStore, key: str, size: int, deadline: float) -> bytes:
    try:
        return await store.get_bytes(key, deadline, limit=size)
    except ObjectIntegrityError:  # larger than the manifest says
        raise CheckpointCorruptError(f"object is not the {size} bytes the manifest records",
                                     store.object_url(key)) from None
