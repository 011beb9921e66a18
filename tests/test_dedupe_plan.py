"""Who writes what, in memory: the plain-tensor dedupe plan, the spread of replicated DTensor
boxes over their replicas, the mesh agreement check and the kept-slot file image."""

from __future__ import annotations

import itertools
import json
import struct
from typing import Any

import pytest
import torch

from asyncckpt.format import _sharding
from asyncckpt.format._safetensors import plan_layout
from asyncckpt.saving import _dedupe

pytestmark = pytest.mark.skipif(not _sharding.AVAILABLE, reason="needs torch.distributed")

if _sharding.AVAILABLE:
    from torch.distributed.tensor import Replicate, Shard


def infos_on(rank: int, mesh_shape: tuple[int, ...], ranks: tuple[int, ...], tensors: Any) -> list[Any]:
    """The ShardInfos ``describe`` would give ``rank`` for ``tensors`` = [(key, shape, placements)]."""
    out = []
    coord = next(c for c in itertools.product(*map(range, mesh_shape)) if ranks[_flat(c, mesh_shape)] == rank)
    for key, shape, placements in tensors:
        layout = _sharding.layout_of(key, shape, mesh_shape, placements)
        box = layout.box(coord)
        holders = sorted(ranks[_flat(c, mesh_shape)] for c in layout.replica_coordinates(coord))
        replicas = () if box.empty else tuple(holders)
        out.append(
            _sharding.ShardInfo(
                key, tuple(shape), torch.float32, layout, torch.empty(box.sizes), rank, box, replicas,
                ranks, replicas[0] if replicas else None,
            )
        )  # fmt: skip
    return out


def _flat(c: tuple[int, ...], shape: tuple[int, ...]) -> int:
    n = 0
    for i, s in zip(c, shape, strict=True):
        n = n * s + i
    return n


HSDP = [
    ("w1", (64, 16), [Replicate(), Shard(0)]) if _sharding.AVAILABLE else None,
    ("b1", (64,), [Replicate(), Shard(0)]) if _sharding.AVAILABLE else None,
    ("w2", (48, 64), [Replicate(), Shard(0)]) if _sharding.AVAILABLE else None,
    ("w3", (8, 48), [Replicate(), Shard(0)]) if _sharding.AVAILABLE else None,
    ("w4", (96, 8), [Replicate(), Shard(0)]) if _sharding.AVAILABLE else None,
    ("b4", (96,), [Replicate(), Shard(0)]) if _sharding.AVAILABLE else None,
]


def written(per_rank: dict[int, list[Any]]) -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """(key, box offsets) -> the ranks that would write it."""
    out: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for r, infos in per_rank.items():
        for i in infos:
            if i.box is not None and not i.box.empty:
                out.setdefault((i.key, i.box.offsets), [])
                if i.writer:
                    out[(i.key, i.box.offsets)].append(r)
    return out


def test_hsdp_boxes_get_exactly_one_writer_and_balanced_bytes() -> None:
    ranks = (0, 1, 2, 3)
    before = {r: infos_on(r, (2, 2), ranks, HSDP) for r in ranks}
    after = {r: _sharding.spread_writers(v) for r, v in before.items()}
    assert all(len(w) == 1 for w in written(after).values())  # every rank computed the same writers
    # the default (no spread): the lowest replica, replicate coordinate 0, writes everything
    assert {w[0] for w in written(before).values()} == {0, 1}
    load = dict.fromkeys(ranks, 0)
    for (key, _), (w,) in written(after).items():
        load[w] += next(i for i in after[w] if i.key == key).local.numel() * 4
    largest = max(i.local.numel() * 4 for v in after.values() for i in v)
    assert max(load.values()) - min(load.values()) <= largest, load
    assert min(load.values()) > 0
    # deterministic: the same inputs give the same writers (and the cached answer is the same)
    again = {r: _sharding.spread_writers(infos_on(r, (2, 2), ranks, HSDP)) for r in ranks}
    assert written(again) == written(after)


def test_spread_is_per_mesh_and_leaves_unreplicated_and_foreign_meshes_alone() -> None:
    # a 1-D mesh of ranks 4..7 (say another pipeline stage) and a fully sharded tensor
    ranks = (4, 5, 6, 7)
    tensors = [("rep", (10,), [Replicate()]), ("shard", (8, 3), [Shard(0)])]
    per = {r: _sharding.spread_writers(infos_on(r, (4,), ranks, tensors)) for r in ranks}
    w = written(per)
    assert all(len(v) == 1 for v in w.values())
    assert [w[("shard", (2 * k, 0))] for k in range(4)] == [[4], [5], [6], [7]]  # one holder: itself
    # the replicated vector goes to the least-loaded holder (all equal: the lowest rank)
    assert w[("rep", (0,))] == [4]
    outside = _sharding.ShardInfo(
        "x", (4,), torch.float32, per[4][0].layout, torch.empty(0), None, None, (), ranks, None
    )
    assert _sharding.spread_writers([outside]) == [outside] and not outside.writer


def test_mesh_digests_and_the_agreement_check() -> None:
    d = {"name": "a", "dtype": "F32", "shape": [4], "placements": ["R"], "mesh_key": "[2]:[0, 1]", "box": [[0], [4]]}
    same = _dedupe.mesh_digests([d])
    _dedupe.check_meshes({0: same, 1: same, 2: {}})  # a rank outside the mesh reports nothing
    other = _dedupe.mesh_digests([{**d, "name": "b"}])
    with pytest.raises(ValueError, match=r"mesh \[2\]:\[0, 1\] \(ranks \[0\]; ranks \[1\]\)"):
        _dedupe.check_meshes({0: same, 1: other})
    assert _dedupe.mesh_digests([{**d, "box": None}]) == {}  # outside the mesh: nothing to agree on


def records(*items: tuple[str, int, str]) -> dict[str, Any]:
    return {name: ["F32", [n // 4], n, digest] for name, n, digest in items}


def test_plan_writes_identical_tensors_once_spread_by_bytes_and_keeps_per_rank_values() -> None:
    common = [("w0", 400, "a"), ("w1", 400, "b"), ("w2", 200, "c"), ("w3", 200, "d"), ("w4", 100, "e")]
    recs = {r: records(*common, ("rng", 40, f"r{r}")) for r in range(3)}
    writers = _dedupe.plan(recs, {0: 0, 1: 0, 2: 0}, 3)
    assert "rng" not in writers  # differs per rank: every rank writes its own
    assert sorted(writers) == ["w0", "w1", "w2", "w3", "w4"]
    loads = [sum(n for name, n, _ in common if writers[name] == r) for r in range(3)]
    assert max(loads) - min(loads) <= 400 and sorted(loads) == [400, 400, 500]
    # the bytes a rank writes anyway count: a rank with its own 1000 B gets nothing more
    assert 0 not in _dedupe.plan(recs, {0: 1000, 1: 0, 2: 0}, 3).values()
    # a name one rank lacks, or holds with another dtype/shape, is not replicated
    recs[2].pop("w4")
    recs[1]["w3"] = ["F16", [100], 200, "d"]
    assert set(_dedupe.plan(recs, {}, 3)) == {"w0", "w1", "w2"}
    assert _dedupe.kept(_slots(["w0", "rng"]), {"w0": 1}, 0) == _slots(["rng"])


def _slots(names: list[str]) -> list[Any]:
    return list(plan_layout([(n, torch.float32, (2,)) for n in names], {}).slots)


def test_image_holds_only_the_kept_slots_and_reuses_its_buffer() -> None:
    import mmap

    specs = [("a", torch.float32, (1000,)), ("b", torch.float32, (3000,)), ("c", torch.int64, (7,))]
    layout = plan_layout(specs, {"format": "pt"})
    buf = mmap.mmap(-1, layout.file_size)
    buf[: len(layout.header)] = layout.header
    values = {"a": torch.arange(1000.0), "b": -torch.arange(3000.0), "c": torch.arange(7)}
    for s in layout.slots:
        raw = values[s.name].numpy().tobytes()
        buf[layout.data_start + s.begin : layout.data_start + s.end] = raw

    class Owner:  # stands in for the staging arena (weakly referenced)
        pass

    owner = Owner()
    keep = [s for s in layout.slots if s.name != "b"]
    img, new = _dedupe.image(memoryview(buf), layout, keep, owner)
    assert len(img) % 4096 == 0 and [s.name for s in new.slots] == ["c", "a"]
    (n,) = struct.unpack("<Q", bytes(img[:8]))
    header = json.loads(bytes(img[8 : 8 + n]))
    for s in new.slots:
        assert header[s.name]["data_offsets"] == [s.begin, s.end]
        got = bytes(img[new.data_start + s.begin : new.data_start + s.end])
        assert got == values[s.name].numpy().tobytes()
    again, _ = _dedupe.image(memoryview(buf), layout, keep, owner)
    assert again.obj is img.obj  # the same buffer, reused by the arena's next save
    bigger, _ = _dedupe.image(memoryview(buf), layout, list(layout.slots), owner)
    assert bigger.obj is not img.obj and len(bigger) >= layout.file_size


def test_a_few_small_copies_are_kept_rather_than_copying_the_shard_to_drop_them() -> None:
    slots = list(plan_layout([("shard", torch.float32, (8000,)), ("step", torch.float32, ())], {}).slots)
    keep = [s for s in slots if s.name == "shard"]  # another rank writes "step"
    assert not _dedupe.worth_an_image(slots, keep)  # 4 B dropped for 32 kB copied: keep them
    assert _dedupe.own_copies({"step": 1, "other": 1}, slots, 0) == {"step": 0, "other": 1}
    ddp = list(plan_layout([(f"w{i}", torch.float32, (1000,)) for i in range(4)], {}).slots)
    assert _dedupe.worth_an_image(ddp, ddp[:1])  # DDP on 4 ranks: 3/4 dropped, 1/4 copied
