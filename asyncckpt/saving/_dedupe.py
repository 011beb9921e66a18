"""Content dedupe of plain tensors across ranks (``Checkpointer(dedupe=True)``).

On the writer thread, after staging, each rank hashes every plain tensor slot of its staged
file image (xxh3-128, GIL released) and publishes ``{name: [dtype, shape, nbytes, digest]}``
through the coordination channel (:meth:`StoreCoordinator.exchange`). Every rank then
computes the same plan locally (:func:`plan`): a name is *replicated* when every rank holds
it with the same dtype, shape and digest - decided by content, never by key name, so
per-rank values (RNG states) under one key stay per rank - and each replicated tensor gets
one writer, spread over the ranks by longest-processing-time first (loads start at each
rank's bytes that are written anyway). A rank then writes only its own slots and the
replicated ones assigned to it (:func:`kept`, :func:`image`) - unless the copies it would
drop are too few to pay for copying the rest (:func:`worth_an_image`); the global index
records where every rank's tensors lie, so each rank's values load exactly as saved.

The same exchange carries each rank's :func:`mesh_digests`: replicated DTensor boxes are
spread over their replicas by a rule every rank evaluates alone (``_sharding.spread_writers``),
which is only sound when the ranks of a mesh hold the same DTensors (:func:`check_meshes`).
It also carries each rank's :func:`twin_boxes`: the boxes of DTensors whose mesh leaves ranks
out (FSDP over ``mesh["dp"]`` of a dp x tp mesh), which ranks outside that mesh may hold too
(a DTensor's identity is its name, not its mesh); :func:`plan` gives each box held twice or
more one writer, and the others drop it from their file.
"""

from __future__ import annotations

import heapq
import json
import math
import mmap
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from ..format._header import ITEMSIZE, round_up
from ..format._safetensors import ST_TO_DTYPE, ShardLayout, plan_layout
from ._stageprogress import StageProgress

HASH = "xxh3-128"


def digests(buffer: memoryview, data_start: int, slots: Sequence[Any], skip: set[str]) -> dict[str, Any]:
    """``{name: [dtype, shape, nbytes, digest]}`` of every slot not in ``skip``, from the
    staged file image ``buffer`` (``data_start``: where its data section begins)."""
    out: dict[str, Any] = {}
    for s in slots:
        if s.name in skip:
            continue
        n = s.end - s.begin
        h = xxhash.xxh3_128_hexdigest(buffer[data_start + s.begin : data_start + s.end])
        out[s.name] = [s.dtype, list(s.shape), n, h]
    return out


#: the digests of a save are taken in batches of about this many bytes, each once it is staged
BATCH = 16 * 1024 * 1024


def batches(slots: Sequence[Any], skip: set[str]) -> list[list[Any]]:
    """The slots not in ``skip``, in file order, in consecutive batches of about :data:`BATCH` bytes."""
    out: list[list[Any]] = []
    cur: list[Any] = []
    size = 0
    for s in sorted((s for s in slots if s.name not in skip), key=lambda s: s.begin):
        cur.append(s)
        size += s.end - s.begin
        if size >= BATCH:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def plan(
    records: Mapping[int, dict[str, Any]],
    base: Mapping[int, int],
    world: int,
    boxes: Mapping[int, Sequence[Any]] | None = None,
    rank: int | None = None,
) -> dict[str, int]:
    """Name -> the rank that writes it, as ``rank`` sees it (equal inputs: equal plans).

    ``records``: each rank's :func:`digests`; ``base``: each rank's bytes written anyway
    (DTensor chunks nobody else holds). A plain name is replicated when all ``world`` ranks
    hold it with equal ``[dtype, shape, nbytes, digest]``. ``boxes``: each rank's
    :func:`twin_boxes`; the ranks reporting one box of one DTensor name hold the same bytes
    of the same global tensor, and one of them writes it. The result holds every replicated
    plain name (the same on every rank) and, for each of ``rank``'s twin boxes, its writer
    under the DTensor's name (each rank sees the writer of its own box).

    Every item (a replicated name, a box held twice or more) goes, largest first (ties by
    kind, name and offsets), to the rank holding it that has the fewest bytes so far (ties:
    the lowest rank): longest-processing-time first, within 4/3 of the best balance.
    """
    first = records[0]
    replicated = [
        name
        for name, rec in first.items()
        if all(records[r].get(name) == rec for r in range(1, world))
    ]
    chosen = set(replicated)
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[int, list[int]]] = {}
    for r, got in sorted((boxes or {}).items()):
        for name, offsets, sizes, n in got:
            holders.setdefault((name, tuple(offsets), tuple(sizes)), (n, []))[1].append(r)
    load = [base.get(r, 0) + sum(rec[2] for k, rec in records[r].items() if k not in chosen) for r in range(world)]
    items: list[tuple[int, str, str, tuple[int, ...], tuple[int, ...], list[int] | None]] = [
        (-first[name][2], "p", name, (), (), None) for name in replicated
    ]
    for (name, offsets, sizes), (n, held) in holders.items():
        if len(held) == 1:
            load[held[0]] += n  # no twin anywhere: its only holder writes it
        else:
            items.append((-n, "d", name, offsets, sizes, held))
    items.sort(key=lambda i: i[:5])
    # a lazy heap over every rank (a plain replicated item may go anywhere): entries whose load
    # is stale (a twin box went to that rank meanwhile) are dropped when they surface
    heap = [(load[r], r) for r in range(world)]
    heapq.heapify(heap)
    out: dict[str, int] = {}
    mine = {(b[0], tuple(b[1])) for b in (boxes or {}).get(rank, ())} if rank is not None else set()
    for neg, kind, name, offsets, _, who in items:
        if who is None:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            w = heap[0][1]
        else:
            w = min(who, key=lambda r: (load[r], r))
        load[w] -= neg
        heapq.heappush(heap, (load[w], w))
        if kind == "p" or (name, offsets) in mine:
            out[name] = w
    return out


def fixed(dtensors: Sequence[Mapping[str, Any]] | None) -> set[str]:
    """The DTensor boxes this rank writes whatever the dedupe round decides: no rank outside
    their mesh can hold them (``dtensors``: ``_load_global.describe_for_index``'s)."""
    return {d["name"] for d in dtensors or () if d["writer"] and not d.get("twin")}


def twin_boxes(dtensors: Sequence[Mapping[str, Any]] | None) -> list[list[Any]]:
    """``[name, offsets, sizes, nbytes]`` of every box this rank would write whose DTensor's
    mesh leaves ranks out, which may hold the same box (the round gives each one writer)."""
    return [
        [d["name"], d["box"][0], d["box"][1], math.prod(d["box"][1]) * ITEMSIZE[d["dtype"]]]
        for d in dtensors or ()
        if d["writer"] and d.get("twin")
    ]


def kept(slots: Sequence[Any], writers: Mapping[str, int], rank: int) -> list[Any]:
    """The slots this rank writes: all but the replicated ones another rank writes."""
    return [s for s in slots if writers.get(s.name, rank) == rank]


#: drop replicated copies only when they are at least this share of the bytes kept: the
#: image that drops them copies every kept byte once, while leaving a few small copies in
#: (FSDP's optimizer step counters next to a large shard) costs a little disk and no copy
MIN_DROP_SHARE = 1 / 8


def worth_an_image(
    slots: Sequence[Any], keep: Sequence[Any], dtensors: Sequence[Mapping[str, Any]] | None = None
) -> bool:
    """Whether this rank should build an image without the copies others write (``keep``
    of its ``slots``), rather than write its staged file whole (its copies then go unused:
    the index points its tensors at its own copies, correct either way).

    Always when it drops a DTensor box another rank writes (a twin, see :func:`twin_boxes`):
    a global tensor's bytes are on disk once, as DCP writes them; the copy is paid by the
    first save of a structure only (later ones lay the arena out for the plan).
    """
    twins = {d["name"] for d in dtensors or () if d["writer"] and d.get("twin")}
    if twins and len(keep) < len(slots) and twins - {s.name for s in keep}:
        return True
    kept = nbytes(keep)
    return nbytes(slots) - kept >= MIN_DROP_SHARE * kept


def may_pay_for_an_image(slots: Sequence[Any], dtensors: Sequence[Mapping[str, Any]] | None) -> bool:
    """Whether some plan of the round could make :func:`worth_an_image` true for this rank:
    only the slots the round may drop (all but :func:`fixed`) count. When False, the rank
    writes its staged file whole whatever the round decides, so it may write before the round
    ends (FSDP2: a few step counters next to the rank's shard)."""
    if any(d["writer"] and d.get("twin") for d in dtensors or ()):
        return True
    skip = fixed(dtensors)
    candidates: int = sum(s.end - s.begin for s in slots if s.name not in skip)
    return candidates >= MIN_DROP_SHARE * (nbytes(slots) - candidates)


class PlanHint:
    """The writers the last dedupe round of a Checkpointer's saves chose, and the layout (the
    structure of the state) they were chosen for. A later save of the same structure expects
    the same plan: ``save()`` lays out its arena with the slots the rank expects to write
    first, so it writes that file while the state is staged and the round runs (the round still
    decides; a rank whose file lacks a slot the round gives it writes its file again).

    Recorded on the writer thread, read by ``save()``: one attribute, replaced whole."""

    def __init__(self) -> None:
        self._last: tuple[Any, dict[str, int]] | None = None

    def record(self, layout: Any, writers: Mapping[str, int]) -> None:
        """The round of a save of ``layout`` chose ``writers``."""
        self._last = (layout, dict(writers))

    def writers_for(self, layout: Any) -> dict[str, int] | None:
        """The last writers chosen for ``layout`` (the same object), or None."""
        last = self._last
        return last[1] if last is not None and last[0] is layout else None


def missing(keep: Sequence[Any], written: Sequence[Any]) -> list[str]:
    """The names of ``keep`` (the slots the round gives this rank) that the file it wrote
    before the round ended (``written``: that file's slots) lacks."""
    have = {s.name for s in written}
    return [s.name for s in keep if s.name not in have]


def own_copies(writers: Mapping[str, int], slots: Sequence[Any], rank: int) -> dict[str, int]:
    """``writers`` as this rank reports them when it writes its staged file whole: its own
    copy of every tensor it holds (``_index.merge`` then points its entries at its file)."""
    mine = {s.name for s in slots}
    return {name: rank if name in mine else w for name, w in writers.items()}


def nbytes(slots: Sequence[Any]) -> int:
    """The data bytes of ``slots``."""
    return sum(s.end - s.begin for s in slots)


#: per staging arena, the buffer its kept image was last built in (reused: a fresh mapping
#: costs a page fault per 4 KiB, measured at 3-4x the copy itself on 4 ranks sharing 2 cores)
_IMAGES: weakref.WeakKeyDictionary[Any, mmap.mmap] = weakref.WeakKeyDictionary()


def image(
    buffer: memoryview,
    layout: ShardLayout,
    keep: Sequence[Any],
    owner: Any = None,
    progress: StageProgress | None = None,
) -> tuple[memoryview, ShardLayout]:
    """A page-aligned file image holding only the ``keep`` slots of the staged image
    ``buffer`` (laid out by ``layout``): one copy of the kept bytes, on the writer's I/O pool.

    With ``owner`` (the staging arena that holds ``buffer``) the image's buffer is kept and
    reused by that arena's next save; the caller must be done with the image before the
    arena is staged into again (true of a save: the arena is its own until it settles).
    """
    out, new = image_buffer(layout, keep, owner)
    fill_image(out, new, buffer, layout, progress)
    return out, new


def image_buffer(layout: ShardLayout, keep: Sequence[Any], owner: Any = None) -> tuple[memoryview, ShardLayout]:
    """The (not yet filled) buffer and layout of :func:`image`: the header is written, the
    data is :func:`fill_image`'s to copy."""
    specs = [(s.name, ST_TO_DTYPE[s.dtype], tuple(s.shape)) for s in keep]
    new = plan_layout(specs, {"format": "pt", "writer": "asyncckpt"})
    size = round_up(max(new.file_size, 1))
    out = _IMAGES.get(owner) if owner is not None else None
    if out is None or len(out) < size:
        out = mmap.mmap(-1, size)
        if owner is not None:
            _IMAGES[owner] = out
    out[: len(new.header)] = new.header
    return memoryview(out)[:size], new


#: the image is copied, and its progress told, in pieces of about this many bytes
_FILL_PIECE = 8 * 1024 * 1024


def fill_image(
    out: memoryview, new: ShardLayout, buffer: memoryview, layout: ShardLayout, progress: StageProgress | None = None
) -> None:
    """Copy the slots of ``new`` from the staged image ``buffer`` (laid out by ``layout``) into
    ``out``, in file order. With ``progress``, each piece copied moves its watermark, so a
    writer streaming ``out`` trails the copy; a failure fails ``progress`` before it is raised."""
    try:
        dst, src = np.frombuffer(out, dtype=np.uint8), np.frombuffer(buffer, dtype=np.uint8)
        old = {s.name: s for s in layout.slots}
        done = len(new.header)
        for s in new.slots:
            a, b = layout.data_start + old[s.name].begin, new.data_start + s.begin
            n = s.end - s.begin
            for i in range(0, n, _FILL_PIECE):
                k = min(_FILL_PIECE, n - i)
                # numpy releases the GIL for the copy (a memoryview slice assignment holds it)
                dst[b + i : b + i + k] = src[a + i : a + i + k]
                if progress is not None and b + i + k - done >= _FILL_PIECE:
                    done = b + i + k
                    progress.advance(done)
    except BaseException as e:
        if progress is not None:
            progress.fail(e)
        raise
    if progress is not None:
        progress.finish(0.0)


def mesh_digests(dtensors: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Per mesh (``mesh_key``), a digest of the DTensors this rank holds on it: names,
    global shapes, dtypes and placements. Ranks of one mesh must agree on it, or they
    would disagree on which replica writes a box (``_sharding.spread_writers``)."""
    by_mesh: dict[str, list[Any]] = {}
    for d in dtensors:
        if d.get("box") is not None:
            by_mesh.setdefault(d["mesh_key"], []).append([d["name"], d["dtype"], d["shape"], d["placements"]])
    return {
        k: xxhash.xxh3_128_hexdigest(json.dumps(sorted(v), separators=(",", ":")).encode())
        for k, v in by_mesh.items()
    }


def check_meshes(got: Mapping[int, Mapping[str, str]]) -> None:
    """``ValueError`` naming the mesh and the ranks when ranks of one mesh hold different
    DTensors on it (``got``: each rank's :func:`mesh_digests`); every rank raises the same."""
    seen: dict[str, dict[str, list[int]]] = {}
    for r in sorted(got):
        for k, digest in got[r].items():
            seen.setdefault(k, {}).setdefault(digest, []).append(r)
    for k, variants in sorted(seen.items()):
        if len(variants) > 1:
            groups = "; ".join(f"ranks {v}" for v in sorted(variants.values()))
            raise ValueError(
                f"ranks hold different DTensors on the mesh {k} ({groups}): every rank of a mesh must "
                "save the same DTensors under the same names, or no rank may write a replicated box"
            )
