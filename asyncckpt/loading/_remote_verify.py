"""Verify checkpoints on an object store: every object's CRC-32C, streamed in bounded windows.

What ``asyncckpt verify s3://...`` runs. Torch-free. A step passes when its manifest decodes
(its own checksum, its step), one LIST of its attempt prefix shows exactly the manifest's
objects with their sizes (the completeness rule of :mod:`asyncckpt.roots.objstore._remote`), and every
object's CRC-32C, recomputed from ranged GETs, is the manifest's, and a global index passes
the loader's own validator (``_index.parse``). The per-rank structure check that a local
verify adds (tree against shard header and index, every block CRC of the index) needs the
headers, the trees and a second read of the data; it is not run remotely.
A failure is remembered on the store as a bad mark (``_badmarks``: the step is then known
bad), and a pass drops the mark of that very attempt; best effort (read-only credentials
simply keep no mark).
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ObjectIntegrityError,
    ObjectNotFoundError,
    ObjectStoreError,
    without_path,
)
from ..format._index import INDEX
from ..format._layout import data_prefix, manifest_key
from ..format._manifest import Manifest
from ..reading import Problem, parse_index
from ..roots._badmarks import clear_on_store, record_on_store
from ..roots.objstore._client import ObjectStore
from ..roots.objstore._steps import check_objects, read_manifest


async def open_for_verify(store: ObjectStore, step: int, deadline: float) -> tuple[Manifest, int]:
    """The decoded manifest of ``step`` and its size in bytes (a verify counts it, as a local
    one does); ``CheckpointNotFoundError`` if it has none, ``CheckpointCorruptError`` (naming
    its URL) if it does not decode."""
    found = await read_manifest(store, step, deadline)
    if found is None:
        raise CheckpointNotFoundError(f"no checkpoint for step {step} under {store.url}")
    return found[0], len(found[1])


async def verify_remote_step(
    store: ObjectStore, m: Manifest, deadline: float, advance: Callable[[int], None] | None = None,
    *, record: bool = True,
) -> list[Problem]:
    """Every problem of remote step ``m``, each naming the object's URL (empty: it is complete and every byte verified).
    Memory stays at two parts' worth of scratch (``ObjectStore.crc32c_of``); ``advance(n)``
    reports each object's bytes once it is checked."""
    problems: list[Problem] = []
    prefix = data_prefix(m.step, m.attempt)
    try:
        await check_objects(store, m, deadline)
    except CheckpointCorruptError as e:
        problems.append(Problem(e.path or store.object_url(data_prefix(m.step, m.attempt)), without_path(e)))
    if not problems:
        for f in m.files:
            url = store.object_url(prefix + f.name)
            try:
                got = await store.crc32c_of(prefix + f.name, f.size, deadline)
            except (ObjectNotFoundError, ObjectIntegrityError) as e:  # gone mid-read, short: named
                problems.append(Problem(url, str(e) or type(e).__name__))
                continue
            except ObjectStoreError as e:  # 503s, no answer in time: the store, not the data
                problems.append(Problem(url, f"I/O error, not damage ({e.strerror})", io=True))
                continue
            if got != f.crc32c:  # the words of every other reader (a local verify, a load): one bad mark
                problems.append(Problem(url, "checksum mismatch"))
            if advance is not None:
                advance(f.size)
    if not problems and any(f.name == INDEX for f in m.files):
        # the global index, by the loader's own validator: a step whose every byte matches
        # its CRC but whose index a load refuses does not verify
        entry, url = m.file(INDEX), store.object_url(prefix + INDEX)
        try:
            raw = await store.get_bytes(prefix + INDEX, deadline, limit=entry.size)
            parse_index(raw, entry.size, entry.crc32c, m, url)
        except (ObjectNotFoundError, ObjectIntegrityError) as e:
            problems.append(Problem(url, str(e) or type(e).__name__))
        except CheckpointCorruptError as e:
            problems.append(Problem(url, without_path(e)))
    if problems and not await _still_there(store, m, deadline):
        # retired or replaced while we read it: that is not damage
        url = store.object_url(manifest_key(m.step))
        return [Problem(url, f"step {m.step} was retired or replaced while being verified", vanished=True)]
    if record and problems:
        await record_on_store(store, m.step, m.attempt, problems[0].path, problems[0].reason, deadline)
    elif record:
        await clear_on_store(store, m.step, m.attempt, deadline)  # every byte verified
    return problems


async def _still_there(store: ObjectStore, m: Manifest, deadline: float) -> bool:
    try:
        found = await read_manifest(store, m.step, deadline)
    except CheckpointError:
        return False
    return found is not None and found[0].attempt == m.attempt
