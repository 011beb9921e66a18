"""Loading a step that has a global tensor index (it holds DTensors), at any world size.

Each DTensor is rebuilt from the chunks the index lists (``_index``), for a *target box*:
the local shard of the DTensor the caller passed in ``into=`` (any mesh, any placements
``_sharding`` supports), or the whole tensor otherwise (one process, no process group, plain
targets). Only chunks overlapping the box are read (``_reshard.plan_reads``), and of those only
the *blocks* covering the overlap (the index's block CRCs, ``_index.BLOCK`` bytes each; an
index written before them has one block per chunk). All reads of a load go through
``_blocks.read_blocks``: parallel across files and ranges, each block CRC-32C'd as it lands.

Where the bytes land. A DTensor target whose local shard is a contiguous CPU tensor of the
saved dtype (FSDP2 and ``distribute_tensor`` shards) is read into in place and returned
itself; anything else gets a fresh tensor (``restore_into`` copies it into the target). The
contract on damage, as for ``load(into=)`` of one shard (``_load``): by default one pass reads
every needed block, the targets' bytes straight into them, each block checked as it lands;
a step that fails verification leaves the targets partly overwritten (a fallback to an older
step rewrites them all). With ``Reader.verify_first`` a step that fails writes no target: the
first pass reads every needed block into the fresh tensors or, for in-place targets, through
the bounce buffers, only checksummed; only when all of it verified does the second pass read
the targets' bytes, run by run (each contiguous in the file and in the target), from the page
cache the first pass filled. A collective load (``Reader.defer``) then runs that second pass
only once every rank has verified its part (``Reader.finish`` after the ranks agreed), so no
rank writes a target for a step another rank rejects. ``verify=False`` reads only the bytes
needed, in one pass. Extra memory: the I/O threads' bounce buffers, plus the fresh tensors.

A target that does not fit the step (a key the step lacks, a tensor or DTensor of another
shape, a DTensor of another dtype) is refused before the first byte is read into any target
(``_targets.check_fit`` on the state the plan will fill), with the errors of a step without
an index: every target keeps its bytes.

Everything else in a rank's state (plain tensors, values) is *per rank*: it loads from the
reader's own rank when the world size matches, from the rank named by ``rank=``, or, across a
change of world size, only when every saved rank holds the same values (compared by content:
tensors byte for byte) - otherwise ``CheckpointError`` names the keys that differ, unless the
caller chose ``per_rank="rank0"`` (take rank 0's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._errors import CheckpointCorruptError, CheckpointError
from ..format import _index
from ..format._bounds import check_memory, parse_structure
from ..format._manifest import Manifest, shard_name, tree_name
from ..format._reshard import Box, plan_reads
from ..format._safetensors import DTYPE_TO_ST, PLAIN_TENSORS, ST_TO_DTYPE
from ..format._structure_decode import unflatten
from ..format._structure_encode import flatten
from ..format._structure_names import dtensor_names, resolve_dtensor_aliases, tensor_names
from ..roots._readfault import read_error
from . import _blocks
from ._load import check_tree_size
from ._readinto import byte_view
from ._shard import read_shard_fd
from ._stepfiles import NoSuchShard, StepFiles
from ._targets import UnfitValueError, check_fit

PerRank = Literal["error", "rank0"]
PER_RANK = ("error", "rank0")
#: Test-only switch: False lets a ``verify_first`` collective load write before the ranks agreed.
_AGREE_BEFORE_WRITE = True


@dataclass
class Reader:
    """Who reads an indexed step, and how per-rank values are chosen."""

    world: int = 1  # the reading job's world size (1: one process)
    own: int = 0  # the reader's rank in it
    rank: int | None = None  # explicit: take this saved rank's per-rank values
    per_rank: PerRank = "error"
    into: Any = None  # the caller's ``into=``: its DTensors get their local boxes
    strip_prefixes: tuple[str, ...] = ()
    #: collective loads: read into the targets only at :meth:`finish`, after every rank agreed
    defer: bool = False
    #: no target written unless every byte this rank needs verified (a second, in-memory pass)
    verify_first: bool = False
    #: set once bytes may have been read into ``into``'s targets
    touched: bool = False
    #: set when a read that touched the targets failed or was given up (a failed load then
    #: says the targets may be partly overwritten: ``_load.noting_partial_targets``)
    dirty: bool = False
    _targets: dict[str, Any] | None = field(default=None, repr=False)
    _pending: Callable[[bool], None] | None = field(default=None, repr=False)

    @property
    def targets(self) -> dict[str, Any]:
        """Tree name -> (ShardInfo, DTensor) of ``into`` (looked up once, only for indexed steps)."""
        if self._targets is None:
            self._targets = targets_of(self.into, self.strip_prefixes)
        return self._targets

    def finish(self) -> None:
        """Read the verified step's bytes into the targets (``defer``: once every rank agreed).

        A no-op when nothing is pending. An I/O error here, after verification, is
        ``CheckpointReadError`` naming the file (the targets may be partly written then).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            self.touched = True
            try:
                pending(True)
            except BaseException:
                self.dirty = True
                raise

    def discard(self) -> None:
        """Drop a pending read (the ranks agreed on something else): no target is written."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending(False)

    def abandon(self) -> None:
        """:meth:`discard`, for an attempt the ranks did not agree to keep: targets it already
        wrote (one pass) hold a step that is not the one loaded, so they are ``dirty``."""
        self.dirty = self.dirty or self.touched
        self.discard()


def indexed(manifest: Manifest) -> bool:
    """True for a step with a global tensor index."""
    return any(f.name == _index.INDEX for f in manifest.files)


def describe_for_index(
    found: list[tuple[str, Any, Any]], aliases: Mapping[str, str] | None = None, world: int = 1
) -> list[dict[str, Any]]:
    """JSON descriptions of the DTensors ``flatten`` found, for ``_index.rank_part`` and the
    dedupe round; each lists under ``"aliases"`` the names ``flatten`` tied to it
    (``dtensor_aliases``). ``world``: the saving job's size. A box this rank writes is a
    ``"twin"`` candidate when its DTensor's mesh has fewer ranks than the job: ranks outside
    that mesh may hold the same box of the same global tensor (FSDP over ``mesh["dp"]`` of a
    dp x tp mesh: one sub-mesh per tp column), which only the dedupe round can see."""
    from ..format._sharding import mesh_key

    tied_to: dict[str, list[str]] = {}
    for alias, target in (aliases or {}).items():
        tied_to.setdefault(target, []).append(alias)
    out = []
    for name, info, _ in found:
        box = info.box
        out.append(
            {
                "name": name,
                "dtype": DTYPE_TO_ST[info.dtype],
                "shape": list(info.global_shape),
                "placements": list(info.layout.placements),
                "mesh": list(info.layout.mesh_shape),
                "box": None if box is None else [list(box.offsets), list(box.sizes)],
                "writer": info.writer,
                "twin": info.writer and len(set(info.mesh_ranks)) < world,
                "mesh_key": mesh_key(info),  # the dedupe round checks the ranks of a mesh agree
            }
        )
        if name in tied_to:
            out[-1]["aliases"] = tied_to[name]
    return out


def targets_of(into: Any, strip_prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Tree name -> DTensor for every DTensor in ``into`` (named as ``save()`` names them)."""
    if into is None:
        return {}
    found: list[tuple[str, Any, Any]] = []
    try:
        flatten(into, strip_prefixes, dtensors=found)
    except (TypeError, ValueError):
        return {}  # not a state save() could take: restore_into reports the mismatch
    return {name: (info, dt) for name, info, dt in found}


def load_indexed_files(files: StepFiles, reader: Reader, verify: bool) -> Any:
    """The state of an indexed step as ``reader`` gets it (see the module docstring); ``files``
    are closed when the load is done.

    With ``reader.verify_first`` (and verifying), no target is written unless every byte this
    rank needs verified, and with ``reader.defer`` too the targets are not written here at
    all: the returned state holds them still unchanged, the step's files stay open, and
    ``reader.finish()`` (or ``discard()``) completes the load.
    """
    manifest = files.manifest
    reader.discard()  # a previous attempt's leftover, if any
    plan = _Plan(reader.verify_first)
    try:
        state = _load(files, manifest, reader, verify, plan)
        plan.run_first()
    except OSError as e:
        files.close()
        raise _io_error(e) from None
    except BaseException:
        files.close()
        raise

    def complete(write: bool) -> None:
        try:
            if write:
                plan.run_second()
        except OSError as e:
            raise _io_error(e) from None
        finally:
            files.close()

    if reader.defer and reader.verify_first and _AGREE_BEFORE_WRITE:
        reader._pending = complete
    else:
        complete(True)
    return state


def _io_error(e: OSError) -> CheckpointError:
    # an object store's own error (gone, timed out) as it is; EIO and the like: not damage
    return read_error(e, "cannot read", getattr(e, "filename", None))


def _load(files: StepFiles, manifest: Manifest, reader: Reader, verify: bool, plan: _Plan) -> Any:
    saved = manifest.world_size
    entry = manifest.file(_index.INDEX)
    raw = files.read(_index.INDEX, entry.crc32c if verify else None)
    try:
        index = _index.parse(raw, saved, {f.name: f.size for f in manifest.files})
    except ValueError as e:
        raise CheckpointCorruptError(f"bad global index ({e})", files.path(_index.INDEX)) from None
    del raw
    if reader.rank is not None:
        if reader.rank >= saved:
            raise NoSuchShard(f"step {manifest.step} was saved by {saved} rank(s); no rank {reader.rank}")
        ranks = [reader.rank]
    elif reader.world == saved:
        ranks = [reader.own]
    elif reader.per_rank == "rank0":
        ranks = [0]
    else:
        ranks = list(range(saved))  # compared below: they must agree
    # every rank's tree names a tied DTensor as the index stores it
    trees = {r: resolve_dtensor_aliases(_tree(files, r, verify), index["aliases"]) for r in ranks}
    plains = {r: _plain(files, index, r, trees[r], verify) for r in ranks}
    first = ranks[0]
    if len(ranks) > 1:
        differ: list[str] = []
        for r in ranks[1:]:
            for key in _diff(trees[first], plains[first], trees[r], plains[r], ()):
                if key not in differ:
                    differ.append(key)
        if differ:
            shown = ", ".join(repr(k) for k in differ[:10]) + (
                f" and {len(differ) - 10} more" if len(differ) > 10 else ""
            )
            raise CheckpointError(
                f"step {manifest.step} was saved by {saved} rank(s) and this job has {reader.world}: "
                f"the DTensors reshard, but these values differ between the saved ranks (per-rank state): "
                f"{shown}; pass per_rank='rank0' to take rank 0's values, or rank= to pick one rank's"
            )
    tree = trees[first]
    tensors: dict[str, Any] = dict(plains[first])
    names = dtensor_names(tree)
    missing = _index.lacking(index, names)  # (the rule asyncckpt verify applies too)
    if missing:
        raise CheckpointCorruptError(f"the index lacks DTensor {missing[0]!r}", files.path(_index.INDEX))
    for name in dict.fromkeys(names):  # a tied DTensor is named twice: read once
        tensors[name] = _dtensor(files, name, index["tensors"][name], reader.targets.get(name), verify, plan)
    try:
        state = unflatten(tree, tensors)
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise CheckpointCorruptError(f"malformed structure ({e})", files.path(tree_name(first))) from None
    if reader.into is not None:  # what restore_into would refuse, before any target is written
        check_fit(reader.into, state)
    return state


def _tree(files: StepFiles, rank: int, verify: bool) -> Any:
    name = tree_name(rank)
    size = files.size(name)
    check_tree_size(files.path(name), size)
    raw = files.read(name, None)
    return parse_structure(raw, files.path(name), size, files.manifest.file(name).crc32c if verify else None)


def _plain(files: StepFiles, index: dict[str, Any], rank: int, tree: Any, verify: bool) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s plain tensors (everything but its DTensor chunks)."""
    name = shard_name(rank)
    wanted = set(tensor_names(tree))
    entries = index["plain"][rank]
    if entries is None:  # a rank that held no DTensor: its whole file, checked by the manifest
        fd = files.source(name)
        got, _ = read_shard_fd(
            fd, files.path(name), files.size(name), files.manifest.file(name).crc32c if verify else None
        )
        out = {k: v for k, v in got.items() if k in wanted}
    else:
        out = {}
        need = sum(e[4] for k, e in entries.items() if k in wanted)
        if need:  # (the check reads /proc and the cgroup files: not for nothing)
            check_memory(need, f"loading the values of rank {rank}", files.path(name))
        blocks = []
        for k in sorted(wanted):
            if k not in entries:
                break
            dtype, shape, file, begin, n, crc = entries[k]  # file: another rank's when deduplicated
            t = torch.empty(shape, dtype=ST_TO_DTYPE[dtype])
            src, where = files.source(file), files.path(file)
            blocks.append(_blocks.Block(src, where, begin, n, crc if verify else None, ((0, byte_view(t)),), repr(k)))
            out[k] = t
        _blocks.read_blocks(blocks)
    if set(out) != wanted:
        raise CheckpointCorruptError("structure and shard disagree on tensor names", files.path(name))
    return out


def _dtensor(files: StepFiles, name: str, meta: dict[str, Any], target: Any, verify: bool, plan: _Plan) -> Any:
    """The saved DTensor ``name``: the target's local shard as a DTensor, or the whole tensor.

    Only planned here (``plan``): a target whose local shard can take the bytes as they are
    (a contiguous CPU tensor of the saved dtype and the box's shape) is read into in place
    and returned itself; otherwise a fresh tensor is read (restored by ``restore_into``).
    """
    dtype = ST_TO_DTYPE[meta["dtype"]]
    shape = meta["shape"]
    box = Box.whole(shape)
    if target is not None:
        info, dt = target
        if tuple(info.global_shape) != tuple(shape) or info.dtype != dtype:
            raise UnfitValueError(  # (planned only: no target written yet)
                f"{name}: {dtype}{list(shape)} in checkpoint, {info.dtype}{list(info.global_shape)} in target"
            )
        box = info.box if info.box is not None else Box((0,) * len(shape), (0,) * len(shape))
        local = info.local
        if _in_place(local, dtype, box):
            if not box.empty:
                plan.add(files, name, meta, local, box, verify, target=True)
            return dt
    check_memory(box.numel * dtype.itemsize, f"loading {name!r}", files.path(_index.INDEX))
    out = torch.empty(box.sizes, dtype=dtype)
    if not box.empty:
        plan.add(files, name, meta, out, box, verify, target=False)
    if target is None:
        return out
    from torch.distributed.tensor import DTensor

    info, dt = target
    local = out
    if info.local.device != out.device:  # e.g. CUDA: copied once the fill is done
        local = torch.empty(box.sizes, dtype=dtype, device=info.local.device)
        plan.after.append(lambda: local.copy_(out))
    return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())


def _in_place(t: torch.Tensor, dtype: torch.dtype, box: Box) -> bool:
    """Whether the local shard ``t`` takes the saved bytes as they are (read straight into)."""
    return (
        type(t) in PLAIN_TENSORS
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.dtype == dtype
        and tuple(t.shape) == tuple(box.sizes)
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_inference()
    )


class _Plan:
    """Every read of one load, in one or two passes (see the module docstring).

    ``first``: the checked reads: the blocks of fresh tensors and of in-place targets read
    into them, checked as they land; with ``verify_first`` the targets' blocks are only
    checksummed here, and ``second`` holds the targets' bytes, read straight into them once
    everything verified (from the page cache the first pass filled), each copy contiguous in
    the file and in the target, unchecked.
    """

    def __init__(self, verify_first: bool = False) -> None:
        self.verify_first = verify_first
        self.first: list[_blocks.Block] = []
        self.second: list[_blocks.Block] = []
        self.after: list[Callable[[], object]] = []
        self.bytes_needed = 0

    def add(
        self, files: StepFiles, name: str, meta: dict[str, Any], out: torch.Tensor, box: Box, verify: bool, target: bool
    ) -> None:
        item = out.element_size()
        dst = byte_view(out)
        for cr in plan_reads(meta["chunks"], box, item):
            chunk, fd, path = cr.chunk, files.source(cr.chunk.file), files.path(cr.chunk.file)
            copies = [(r.src, dst[r.dst : r.dst + r.length]) for r in cr.copies()]
            self.bytes_needed += cr.nbytes
            what = f"a chunk of {name!r}"
            if not verify:
                bucket = self.second if target else self.first
                bucket.extend(_blocks.Block(fd, path, src, len(v), None, ((0, v),), what) for src, v in copies)
                continue
            # the chunk's checked blocks: its block CRCs, or (an index without them) the chunk whole
            n = chunk.nbytes(item)
            size = meta["block"] or max(n, 1)
            crcs = meta["blocks"][cr.index] if meta["block"] else [meta["crcs"][cr.index]]
            runs: dict[int, list[tuple[int, memoryview]]] = {}
            for src, v in copies:
                rel, at = src - chunk.begin, 0
                while at < len(v):  # split the copy at block boundaries
                    k = (rel + at) // size
                    take = min(len(v) - at, (k + 1) * size - rel - at)
                    runs.setdefault(k, []).append((rel + at - k * size, v[at : at + take]))
                    at += take
            for k in sorted(runs):
                begin = chunk.begin + k * size
                length = min(size, n - k * size)
                label = f"block {k} of {what}" if meta["block"] else what
                parts = () if target and self.verify_first else tuple(runs[k])
                self.first.append(_blocks.Block(fd, path, begin, length, crcs[k], parts, label))
            if target and self.verify_first:
                self.second.extend(_blocks.Block(fd, path, src, len(v), None, ((0, v),), what) for src, v in copies)

    def run_first(self) -> None:
        _blocks.read_blocks(self.first)
        self.first.clear()

    def run_second(self) -> None:
        _blocks.read_blocks(self.second)
        self.second.clear()
        with torch.no_grad():
            for fn in self.after:
                fn()
        self.after.clear()


# ---------------------------------------------------------------------------- per-rank values
_MAPPINGS = ("$dict", "$defaultdict", "$odict")


def _diff(
    a: Any, ta: dict[str, torch.Tensor], b: Any, tb: dict[str, torch.Tensor], path: tuple[str, ...]
) -> Iterator[str]:
    """Dotted key paths where two ranks' trees (with their tensors) hold different values."""
    where = ".".join(path) or "<root>"
    if isinstance(a, dict) and isinstance(b, dict) and len(a) == len(b) == 1 and a.keys() == b.keys():
        ((tag, va),) = a.items()
        vb = b[tag]
        if tag == "$tensor":
            x, y = ta.get(va), tb.get(vb)
            if x is None or y is None or x.dtype != y.dtype or x.shape != y.shape or not _same_bytes(x, y):
                yield where
            return
        if tag == "$dtensor":
            if va != vb:
                yield where
            return
        if tag == "$ndarray" and isinstance(va, list) and isinstance(vb, list) and va and vb:
            yield from _diff({"$tensor": va[0]}, ta, {"$tensor": vb[0]}, tb, path)
            if va[1:] != vb[1:]:
                yield where
            return
        if tag in _MAPPINGS and isinstance(va, list) and isinstance(vb, list):
            # $dict: items; $defaultdict: [factory, items]; $odict: [items, metadata]
            if tag == "$dict":
                yield from _diff_items(va, ta, vb, tb, path)
                return
            if len(va) != 2 or len(vb) != 2:
                yield where
                return
            items = 1 if tag == "$defaultdict" else 0
            if va[1 - items] != vb[1 - items]:
                yield where
            yield from _diff_items(va[items], ta, vb[items], tb, path)
            return
        yield from _diff(va, ta, vb, tb, path)
        return
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for x, y in zip(a, b, strict=True):
            yield from _diff(x, ta, y, tb, path)
        return
    if a != b:
        yield where


def _diff_items(
    ia: Any, ta: dict[str, torch.Tensor], ib: Any, tb: dict[str, torch.Tensor], path: tuple[str, ...]
) -> Iterator[str]:
    if not (isinstance(ia, list) and isinstance(ib, list)):
        yield ".".join(path) or "<root>"
        return
    da = {str(i[0]): i[1] for i in ia if isinstance(i, list) and len(i) == 2}
    db = {str(i[0]): i[1] for i in ib if isinstance(i, list) and len(i) == 2}
    for k in da.keys() | db.keys():
        sub = (*path, k)
        if k not in da or k not in db:
            yield ".".join(sub)
        else:
            yield from _diff(da[k], ta, db[k], tb, sub)


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))) if x.numel() else True
