"""The one adapter between asyncckpt and torch's DTensor layout calls.

Everything asyncckpt needs to know about a DTensor comes from here: its local shard (no copy),
its global shape, the box (global offsets and sizes) of its local shard, the boxes of every
other mesh coordinate (computed locally, no communication), which ranks hold the same box
(replicas) and which one of them writes it. The layout calls used are semi-private or private
in torch (``compute_local_shape_and_global_offset``, ``_compute_local_shape_and_global_offset``,
``_StridedShard``), so they live in this module alone, and every box is cross-checked against
the public helper and the local tensor's shape: a torch upgrade that changes them fails loudly
here instead of writing wrong offsets.

**Why a box per tensor dim.** Each placement shards one tensor dim, so a coordinate's offset
and size on dim ``d`` depend only on its coordinates on the mesh dims that shard ``d``
(``_compute_local_shape_and_global_offset`` walks the dims independently). A layout is
therefore checked one dim at a time: the intervals of the distinct sub-coordinates must tile
``[0, n_d)``. Since the true index sets of a placement partition the dim, tiling intervals
prove the sets *are* those intervals (order them by start: everything before the next start
can only belong to the current set, which has exactly that many elements). That refuses the
placements whose shards are not one box (a 1-D ``_StridedShard``, or ``(Shard(0),
_StridedShard(0))``), for which torch reports overlapping boxes, while FSDP2, TP, FSDP x TP
and HSDP layouts pass. The product of tiling dims tiles the tensor, so this is the same as
checking the boxes of all coordinates at once, at a cost of ``sum_d prod(mesh dims sharding
d)`` helper calls instead of the mesh size; the result is cached per (global shape, mesh
shape, placements).

Importing this module never fails where ``torch.distributed`` is unavailable: nothing is then
a DTensor.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._reshard import Box, check_tiling

try:
    if not torch.distributed.is_available():
        raise ImportError("torch.distributed is not available")
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import (
        _compute_local_shape_and_global_offset,
        compute_local_shape_and_global_offset,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the torch build
    AVAILABLE = False


def is_dtensor(obj: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (always False without torch.distributed)."""
    return AVAILABLE and isinstance(obj, DTensor)


def local_tensor(dt: Any) -> torch.Tensor:
    """This rank's shard of ``dt``: the DTensor's own local tensor, not a copy.

    Under ``no_grad`` ``to_local()`` returns the stored local tensor itself (with grad enabled
    it would be an autograd view); that stored tensor is read directly when torch keeps it
    where this torch version does (``_local_tensor``), else through ``to_local()``. FSDP2's
    is a narrow view of padded storage: write its ``numel * element_size`` bytes, never its
    storage.
    """
    # the attribute to_local() returns under no_grad; entering no_grad per DTensor cost ~40 %
    # of describe() on the training thread (FSDP2, 90 DTensors)
    out = getattr(dt, "_local_tensor", None)
    if isinstance(out, torch.Tensor):
        return out
    with torch.no_grad():
        stored: torch.Tensor = dt.to_local()
    return stored


def placement_name(p: Any) -> str:
    """A stable, short spelling of one placement for the manifest: ``S(0)``, ``R``, ``SS(0,2)``."""
    if AVAILABLE and isinstance(p, _StridedShard):
        return f"SS({p.dim},{p.split_factor})"
    if AVAILABLE and isinstance(p, Shard):
        return f"S({p.dim})"
    if AVAILABLE and isinstance(p, Replicate):
        return "R"
    return repr(p)


def _sharded_dim(key: str, p: Any, ndim: int) -> int | None:
    """The tensor dim ``p`` shards, ``None`` for ``Replicate``; ``TypeError`` for the rest."""
    if isinstance(p, (Shard, _StridedShard)):
        if not 0 <= p.dim < ndim:
            raise TypeError(f"DTensor at {key!r}: placement {p} shards dim {p.dim} of a {ndim}-d tensor")
        return int(p.dim)
    if isinstance(p, Replicate):
        return None
    if isinstance(p, Partial):
        raise TypeError(
            f"DTensor at {key!r} has a Partial placement (pending reduction, {p}): its shards are not "
            "the tensor's values; save dt.redistribute(dt.device_mesh, [Replicate() or Shard(d), ...]) "
            "or dt.full_tensor() instead"
        )
    raise TypeError(f"DTensor at {key!r} has an unsupported placement {p!r} (supported: Shard, Replicate)")


@dataclass(frozen=True)
class Layout:
    """Where every mesh coordinate's shard of one tensor lies (checked to tile the tensor)."""

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    #: per tensor dim, the mesh dims that shard it, in placement order
    shard_mesh_dims: tuple[tuple[int, ...], ...]
    #: per tensor dim, (offset, size) for each sub-coordinate over its shard_mesh_dims
    intervals: tuple[dict[tuple[int, ...], tuple[int, int]], ...]

    @property
    def replicate_mesh_dims(self) -> tuple[int, ...]:
        used = {m for dims in self.shard_mesh_dims for m in dims}
        return tuple(m for m in range(len(self.mesh_shape)) if m not in used)

    def box(self, coord: Sequence[int]) -> Box:
        """The box held by mesh coordinate ``coord`` (possibly empty)."""
        offs, sizes = [], []
        for d, dims in enumerate(self.shard_mesh_dims):
            o, s = self.intervals[d][tuple(coord[m] for m in dims)]
            offs.append(o)
            sizes.append(s)
        return Box(tuple(offs), tuple(sizes))

    def coordinates(self) -> Iterator[tuple[int, ...]]:
        """Every mesh coordinate, row-major (the order of ``DeviceMesh.mesh.flatten()``)."""
        return itertools.product(*(range(n) for n in self.mesh_shape))

    def replica_coordinates(self, coord: Sequence[int]) -> list[tuple[int, ...]]:
        """The coordinates holding the same box as ``coord``: those that differ only on
        ``Replicate`` mesh dims (other coordinates hold disjoint boxes, by the tiling check)."""
        rep = self.replicate_mesh_dims
        out = []
        for sub in itertools.product(*(range(self.mesh_shape[m]) for m in rep)):
            c = list(coord)
            for m, i in zip(rep, sub, strict=True):
                c[m] = i
            out.append(tuple(c))
        return out


@functools.lru_cache(maxsize=4096)
def _layout(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]) -> Layout:
    ndim = len(global_shape)
    shard_dims: list[list[int]] = [[] for _ in range(ndim)]
    for m, p in enumerate(placements):
        d = _sharded_dim("<layout>", p, ndim)
        if d is not None:
            shard_dims[d].append(m)
    intervals: list[dict[tuple[int, ...], tuple[int, int]]] = []
    for d in range(ndim):
        dims = shard_dims[d]
        found: dict[tuple[int, ...], tuple[int, int]] = {}
        for sub in itertools.product(*(range(mesh_shape[m]) for m in dims)):
            coord = [0] * len(mesh_shape)
            for m, i in zip(dims, sub, strict=True):
                coord[m] = i
            shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, coord, placements)
            found[sub] = (int(offset[d]), int(shape[d]))
        # one dim at a time is the whole-tensor check (see the module docstring)
        check_tiling(
            (global_shape[d],), [Box((o,), (s,)) for o, s in found.values()], f"dim {d} of shape {list(global_shape)}"
        )
        intervals.append(found)
    return Layout(
        global_shape,
        mesh_shape,
        tuple(placement_name(p) for p in placements),
        tuple(tuple(x) for x in shard_dims),
        tuple(intervals),
    )


def layout_of(key: str, global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]) -> Layout:
    """The checked layout of a tensor of ``global_shape`` placed by ``placements`` on a mesh of
    ``mesh_shape``, computed locally. ``TypeError`` naming ``key`` when a placement is not
    supported (``Partial``) or its shards are not boxes that tile the tensor."""
    if not AVAILABLE:
        raise TypeError(f"{key!r}: torch.distributed is not available")
    if len(placements) != len(mesh_shape):
        raise TypeError(f"DTensor at {key!r}: {len(placements)} placements on a {len(mesh_shape)}-d mesh")
    for p in placements:
        _sharded_dim(key, p, len(global_shape))  # the error names the key
    try:
        return _layout(tuple(int(n) for n in global_shape), tuple(int(n) for n in mesh_shape), tuple(placements))
    except ValueError as e:
        names = ", ".join(placement_name(p) for p in placements)
        raise TypeError(
            f"DTensor at {key!r} has placements ({names}) whose shards are not contiguous blocks of the "
            f"global tensor ({e}); redistribute it to Shard/Replicate placements before saving"
        ) from None


@dataclass(frozen=True)
class ShardInfo:
    """One DTensor as this rank saves it."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    local: torch.Tensor  # the DTensor's own local tensor (no copy)
    rank: int | None  # this process's global rank, None when it is outside the DTensor's mesh
    box: Box | None  # the box of ``local``; None outside the mesh
    #: global ranks holding the same non-empty box, ascending; () for an empty box or outside
    replicas: tuple[int, ...]
    #: the mesh's global ranks in row-major coordinate order
    mesh_ranks: tuple[int, ...] = ()
    #: the global rank that writes this rank's box: the lowest replica unless
    #: :func:`spread_writers` chose another; None for an empty box or outside the mesh
    writer_rank: int | None = None

    @property
    def writer(self) -> bool:
        """True on exactly one rank per non-empty box: the one that writes it."""
        return self.rank is not None and bool(self.replicas) and self.writer_rank == self.rank


#: mesh -> its global ranks; DeviceMesh.mesh is rebuilt on every access (~0.15 ms)
_RANKS: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _mesh_ranks(mesh: Any) -> list[int]:
    try:
        return list(_RANKS[mesh])
    except (KeyError, TypeError):
        pass
    ranks: list[int] = mesh.mesh.flatten().tolist()
    try:
        _RANKS[mesh] = ranks  # equal meshes have equal ranks, so equality-keyed is right
    except TypeError:
        pass  # not weak-referenceable or unhashable: just do not cache
    return list(ranks)


#: per mesh, (global shape, placements) -> what :func:`describe` derived for this rank, checked:
#: a state saved every few steps holds the same DTensors each time, and deriving their boxes
#: again cost ~17 us each (FSDP2 and Adam: hundreds per rank, on the training thread)
_DESCRIBED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def describe(key: str, dt: Any) -> ShardInfo:
    """Describe the DTensor ``dt`` saved under ``key`` on this rank; no communication.

    Raises ``TypeError`` naming ``key`` for a value that is not a DTensor, an unsupported
    placement, a layout whose shards are not boxes, or a local tensor whose shape disagrees
    with the layout (a torch version whose layout rules this module does not know).
    """
    if not is_dtensor(dt):
        raise TypeError(f"{key!r} is a {type(dt).__name__}, not a DTensor")
    mesh = dt.device_mesh
    global_shape = tuple(dt.shape)
    placements = tuple(dt.placements)
    memo = _memo_of(mesh)
    found = memo.get((global_shape, placements)) if memo is not None else None
    if found is None:
        found = _derive(key, mesh, global_shape, placements)
        if memo is not None:
            memo[(global_shape, placements)] = found
    layout, rank, box, replicas, ranks = found
    local = local_tensor(dt)
    if box is not None and tuple(local.shape) != box.sizes:
        raise TypeError(
            f"DTensor at {key!r}: this rank's local tensor has shape {tuple(local.shape)}, the layout says "
            f"{box}; this torch version's layout rules are not supported"
        )
    writer = replicas[0] if replicas else None
    return ShardInfo(key, global_shape, dt.dtype, layout, local, rank, box, replicas, ranks, writer)


#: the mesh _memo_of was last asked for (weakly) and its memo: a state's DTensors mostly share
#: one mesh, and this skips the weak dictionary's lookup for all but the first
_LAST_MEMO: tuple[Any, dict[tuple[Any, ...], tuple[Any, ...]]] | None = None


def _memo_of(mesh: Any) -> dict[tuple[Any, ...], tuple[Any, ...]] | None:
    global _LAST_MEMO
    last = _LAST_MEMO
    if last is not None and last[0]() is mesh:
        return last[1]
    try:
        memo = _DESCRIBED.setdefault(mesh, {})
    except TypeError:
        return None  # not weak-referenceable or unhashable: derive every time
    _LAST_MEMO = (weakref.ref(mesh), memo)
    return memo


def _derive(key: str, mesh: Any, global_shape: tuple[int, ...], placements: tuple[Any, ...]) -> tuple[Any, ...]:
    """(layout, rank, box, replicas, mesh ranks) of a DTensor of ``global_shape`` placed by
    ``placements`` on ``mesh``, for this rank; the box checked against torch's public helper."""
    mesh_shape = tuple(int(n) for n in mesh.shape)
    layout = layout_of(key, global_shape, mesh_shape, placements)
    coord = mesh.get_coordinate()
    if coord is None:
        return layout, None, None, (), tuple(_mesh_ranks(mesh))
    coord = tuple(int(c) for c in coord)
    box = layout.box(coord)
    # the public helper costs ~1 ms with _StridedShard: once per layout and coordinate
    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    if (tuple(shape), tuple(offset)) != (box.sizes, box.offsets):
        raise TypeError(
            f"DTensor at {key!r}: torch places this rank's shard at {tuple(offset)} (size {tuple(shape)}), "
            f"the layout says {box}; this torch version's layout rules are not supported"
        )
    ranks = _mesh_ranks(mesh)
    flat = _flat_index(mesh_shape)
    rank = ranks[flat(coord)]
    replicas = () if box.empty else tuple(sorted(ranks[flat(c)] for c in layout.replica_coordinates(coord)))
    return layout, rank, box, replicas, tuple(ranks)


#: (layout key, mesh ranks, itemsize) -> every distinct box's (offsets, holders, nbytes)
_GROUPS: dict[tuple[Any, ...], list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {}
#: the spread of the last states seen: their key -> (name, box offsets) -> writer rank
_SPREADS: dict[tuple[Any, ...], dict[tuple[str, tuple[int, ...]], int]] = {}


def _groups_of(info: ShardInfo) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    lay = info.layout
    key = (lay.global_shape, lay.mesh_shape, lay.placements, info.mesh_ranks, info.dtype.itemsize)
    got = _GROUPS.get(key)
    if got is None:
        got = [
            (g.box.offsets, g.ranks, math.prod(g.box.sizes) * info.dtype.itemsize)
            for g in box_groups(lay, info.mesh_ranks)
        ]
        if len(_GROUPS) > 4096:
            _GROUPS.clear()
        _GROUPS[key] = got
    return got


def mesh_key(info: ShardInfo) -> str:
    """A name for the mesh ``info``'s DTensor lies on (its shape and global ranks)."""
    return f"{list(info.layout.mesh_shape)}:{list(info.mesh_ranks)}"


def spread_writers(infos: Sequence[ShardInfo]) -> list[ShardInfo]:
    """``infos`` with each replicated box's writer spread over the ranks holding it.

    Per mesh, every distinct non-empty box of every DTensor on it is an item; boxes with one
    holder count toward that rank's bytes, and the replicated ones go, largest first (ties by
    name, then offsets), to the holder with the fewest bytes so far (ties: the lowest rank).
    Greedy assignment keeps every rank's bytes within one box of the others' on the same
    replica set. The result depends only on names, layouts and mesh ranks, so every rank of
    a mesh computes the same writers without communication, provided every rank of the mesh
    holds the same DTensors on it under the same names (SPMD; ``_dedupe`` checks this in its
    exchange). Cost: the mesh size per distinct layout once, then the number of DTensors.
    """
    key = tuple(
        (i.key, i.global_shape, i.layout.mesh_shape, i.layout.placements, i.mesh_ranks, i.dtype) for i in infos
    )
    chosen = _SPREADS.get(key)
    if chosen is None:
        chosen = {}
        by_mesh: dict[tuple[Any, ...], list[ShardInfo]] = {}
        for i in infos:
            if i.rank is not None:
                by_mesh.setdefault((i.layout.mesh_shape, i.mesh_ranks), []).append(i)
        for members in by_mesh.values():
            loads: dict[int, int] = {}
            items: list[tuple[int, str, tuple[int, ...], tuple[int, ...]]] = []
            for i in members:
                for offsets, holders, n in _groups_of(i):
                    if len(holders) == 1:
                        loads[holders[0]] = loads.get(holders[0], 0) + n
                    else:
                        items.append((-n, i.key, offsets, holders))
            items.sort()
            for neg, name, offsets, holders in items:
                w = min(holders, key=lambda r: (loads.get(r, 0), r))
                loads[w] = loads.get(w, 0) - neg
                chosen[(name, offsets)] = w
        if len(_SPREADS) > 64:
            _SPREADS.clear()
        _SPREADS[key] = chosen
    out = []
    for i in infos:
        spread = chosen.get((i.key, i.box.offsets)) if i.box is not None and i.replicas else None
        out.append(i if spread is None else dataclasses.replace(i, writer_rank=spread))
    return out


def _flat_index(mesh_shape: Sequence[int]) -> Any:
    strides = [math.prod(mesh_shape[m + 1 :]) for m in range(len(mesh_shape))]

    def flat(coord: Sequence[int]) -> int:
        return sum(c * s for c, s in zip(coord, strides, strict=True))

    return flat


@dataclass(frozen=True)
class BoxGroup:
    """One distinct non-empty box of a tensor and the global ranks holding it (ascending)."""

    box: Box
    ranks: tuple[int, ...]

    @property
    def writer(self) -> int:
        return self.ranks[0]


def box_groups(layout: Layout, mesh_ranks: Sequence[int]) -> list[BoxGroup]:
    """Every distinct non-empty box of ``layout`` with its holders, ordered by offsets.

    ``mesh_ranks`` is the mesh's global ranks in row-major coordinate order
    (``DeviceMesh.mesh.flatten().tolist()``). This is the chunk list the global index records
    for the tensor; it costs the mesh size, so the save path uses :func:`describe` instead.
    """
    flat = _flat_index(layout.mesh_shape)
    groups: dict[Box, list[int]] = {}
    for c in layout.coordinates():
        b = layout.box(c)
        if not b.empty:
            groups.setdefault(b, []).append(mesh_ranks[flat(c)])
    return [BoxGroup(b, tuple(sorted(r))) for b, r in sorted(groups.items(), key=lambda kv: kv[0].offsets)]


def mesh_ranks(dt: Any) -> list[int]:
    """The global ranks of ``dt``'s mesh in row-major coordinate order."""
    return _mesh_ranks(dt.device_mesh)


__all__ = [
    "AVAILABLE",
    "BoxGroup",
    "Layout",
    "ShardInfo",
    "box_groups",
    "describe",
    "is_dtensor",
    "layout_of",
    "local_tensor",
    "mesh_key",
    "mesh_ranks",
    "placement_name",
    "spread_writers",
]
