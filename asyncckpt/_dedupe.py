"""Content dedupe of plain tensors across ranks (``Checkpointer(dedupe=True)``).

On the writer thread, after staging, each rank hashes every plain tensor slot of its staged
file image (xxh3-128, GIL released) and publishes ``{name: [dtype, shape, nbytes, digest]}``
through the coordination channel (:meth:`StoreCoordinator.exchange`). Every rank then
computes the same plan locally (:func:`plan`): a name is *replicated* when every rank holds
it with the same dtype, shape and digest - decided by content, never by key name, so
per-rank values (RNG states) under one key stay per rank - and each replicated tensor gets
one writer, spread over the ranks by longest-processing-time first (loads start at each
rank's bytes that are written anyway). A rank then writes only its own slots and the
replicated ones assigned to it (:func:`keep_layout`); the global index records where every
rank's tensors lie, so each rank's values load exactly as saved.
"""

from __future__ import annotations

import heapq
import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from ._format import ST_TO_DTYPE, ShardLayout, plan_layout
from ._header import round_up

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


def plan(records: Mapping[int, dict[str, Any]], base: Mapping[int, int], world: int) -> dict[str, int]:
    """Replicated name -> the rank that writes it (identical on every rank for equal inputs).

    ``records``: each rank's :func:`digests`; ``base``: each rank's bytes written anyway
    (DTensor chunks). A name is replicated when all ``world`` ranks hold it with equal
    ``[dtype, shape, nbytes, digest]``.
    """
    first = records[0]
    replicated = [
        name
        for name, rec in first.items()
        if all(records[r].get(name) == rec for r in range(1, world))
    ]
    chosen = set(replicated)
    loads = []
    for r in range(world):
        own = base.get(r, 0) + sum(rec[2] for name, rec in records[r].items() if name not in chosen)
        loads.append((own, r))
    heapq.heapify(loads)
    out: dict[str, int] = {}
    for name in sorted(replicated, key=lambda n: (-first[n][2], n)):
        load, r = heapq.heappop(loads)
        out[name] = r
        heapq.heappush(loads, (load + first[name][2], r))
    return out


def kept(slots: Sequence[Any], writers: Mapping[str, int], rank: int) -> list[Any]:
    """The slots this rank writes: all but the replicated ones another rank writes."""
    return [s for s in slots if writers.get(s.name, rank) == rank]


def nbytes(slots: Sequence[Any]) -> int:
    return sum(s.end - s.begin for s in slots)



def image(buffer: memoryview, layout: ShardLayout, keep: Sequence[Any]) -> tuple[mmap.mmap, ShardLayout]:
    """A new page-aligned file image holding only the ``keep`` slots of the staged image
    ``buffer`` (laid out by ``layout``): one copy of the kept bytes, on the writer's I/O pool."""
    specs = [(s.name, ST_TO_DTYPE[s.dtype], tuple(s.shape)) for s in keep]
    new = plan_layout(specs, {"format": "pt", "writer": "asyncckpt"})
    out = mmap.mmap(-1, round_up(max(new.file_size, 1)))
    out[: len(new.header)] = new.header
    old = {s.name: s for s in layout.slots}
    for s in new.slots:
        src = layout.data_start + old[s.name].begin
        out[new.data_start + s.begin : new.data_start + s.end] = buffer[src : src + s.end - s.begin]
    return out, new
