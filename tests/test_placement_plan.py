"""In memory: how replicas outside a DTensor's own mesh ("twins": FSDP over ``mesh["dp"]`` of a
dp x tp mesh) get one writer in the dedupe round, and how the index describes each global
tensor once whatever was written."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch

from asyncckpt.format import _index
from asyncckpt.format._safetensors import plan_layout
from asyncckpt.saving import _dedupe


def part(file: str, tensors: dict[str, Any], writers: dict[str, int] | None = None) -> dict[str, Any]:
    return {"file": file, "tensors": tensors, "plain": [], "writers": writers or {}, "block": _index.BLOCK}


def entry(shape: list[int], box: tuple[list[int], list[int]] | None, crc: int = 7, mesh: list[int] | None = None,
          placements: list[str] | None = None, begin: int = 4096) -> dict[str, Any]:  # fmt: skip
    chunk = None
    if box is not None:
        n = 4
        for s in box[1]:
            n *= s
        chunk = [box[0], box[1], begin, n, crc, [crc]]
    return {"dtype": "F32", "shape": shape, "placements": placements or ["S(0)"], "mesh": mesh or [2], "chunk": chunk}


def test_twins_are_indexed_once_and_drift_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    # a (4, 3) norm-like weight FSDP'd over dp, one dp sub-mesh per tp column: ranks 0 and 1 hold
    # rows 0-1, ranks 2 and 3 rows 2-3 (dedupe=False: all four wrote); rank 3's copy drifted
    parts = {
        0: part("rank00000.safetensors", {"w": entry([4, 3], ([0, 0], [2, 3]))}),
        1: part("rank00001.safetensors", {"w": entry([4, 3], ([0, 0], [2, 3]))}),
        2: part("rank00002.safetensors", {"w": entry([4, 3], ([2, 0], [2, 3]))}),
        3: part("rank00003.safetensors", {"w": entry([4, 3], ([2, 0], [2, 3]), crc=8)}),
    }
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        doc = json.loads(_index.merge(4, parts))
    chunks = doc["tensors"]["w"]["chunks"]
    assert [(c[0], c[2]) for c in chunks] == [([0, 0], "rank00000.safetensors"), ([2, 0], "rank00002.safetensors")]
    assert len(doc["tensors"]["w"]["blocks"]) == 2
    assert "'w': ranks 2 and 3 hold the same box with different bytes" in caplog.text
    sizes = {f"rank0000{r}.safetensors": 1 << 20 for r in range(4)}
    assert set(_index.parse(json.dumps(doc).encode(), 4, sizes)["tensors"]) == {"w"}


def test_a_twin_dropped_by_the_plan_is_not_a_plain_entry() -> None:
    # rank 1 holds w's box but the round gave it to rank 0: no chunk, and w in its writers is skipped
    parts = {
        0: part("rank00000.safetensors", {"w": entry([2, 3], ([0, 0], [2, 3]))}, {"w": 0}),
        1: part("rank00001.safetensors", {"w": entry([2, 3], None)}, {"w": 0}),
    }
    doc = json.loads(_index.merge(2, parts))
    assert len(doc["tensors"]["w"]["chunks"]) == 1 and doc["plain"] == {"0": {}, "1": {}}


def test_one_tensor_in_two_layouts_that_do_not_tile_is_refused_by_name() -> None:
    parts = {
        0: part("rank00000.safetensors", {"w": entry([4], ([0], [2]))}),
        1: part("rank00001.safetensors", {"w": entry([4], ([2], [2]))}),
        2: part("rank00002.safetensors", {"w": entry([4], ([0], [4]), mesh=[2], placements=["R"])}),
        3: part("rank00003.safetensors", {"w": entry([4], None, mesh=[2], placements=["R"])}),
    }
    with pytest.raises(ValueError, match=r"ranks hold DTensor 'w' in different layouts .*\['R'\] on a mesh \[2\]"):
        _index.merge(4, parts)


def dt(name: str, offs: list[int], sizes: list[int], twin: bool, writer: bool = True) -> dict[str, Any]:
    return {"name": name, "dtype": "F32", "box": [offs, sizes], "writer": writer, "twin": twin}


def test_the_round_gives_every_twin_box_one_writer_every_rank_agrees_on() -> None:
    # 2 x 2 (dp, tp): "emb" (8 x 4, 64 B per box) and "norm" (4,) are FSDP'd over dp only (twins
    # across tp); "q" is TP x FSDP over the whole mesh (each rank's box its own)
    def held(r: int) -> list[dict[str, Any]]:
        dp = r // 2
        return [dt("emb", [4 * dp, 0], [4, 4], True), dt("norm", [2 * dp], [2], True), dt("q", [r, 0], [1, 4], False)]

    boxes = {r: _dedupe.twin_boxes(held(r)) for r in range(4)}
    base = {r: 16 for r in range(4)}  # q's box, written by its holder whatever the round decides
    assert _dedupe.fixed(held(0)) == {"q"}
    views = {r: _dedupe.plan({q: {} for q in range(4)}, base, 4, boxes=boxes, rank=r) for r in range(4)}
    for dp in (0, 1):
        a, b = 2 * dp, 2 * dp + 1  # the two tp columns holding the same boxes
        assert views[a]["emb"] == views[b]["emb"] in (a, b)
        assert views[a]["norm"] == views[b]["norm"] in (a, b)
        # the largest twin goes to one holder, the next to the other (longest first, least loaded)
        assert views[a]["emb"] != views[a]["norm"]
    # each rank sees only the writers of its own boxes
    assert set(views[0]) == {"emb", "norm"}


def test_twins_always_pay_for_an_image() -> None:
    layout = plan_layout([("big", torch.float32, (4096,)), ("norm", torch.float32, (2,))], {})
    dts = [dt("big", [0], [4096], False), dt("norm", [0], [2], True)]
    keep = [s for s in layout.slots if s.name == "big"]
    assert _dedupe.may_pay_for_an_image(layout.slots, dts)
    assert _dedupe.worth_an_image(layout.slots, keep, dts)  # 8 B dropped, 16 KiB copied: still
    assert not _dedupe.worth_an_image(layout.slots, keep)  # a plain copy that small is kept


def test_range_check_streams_any_split_of_the_file() -> None:
    """verify's per-block CRCs, fed the file in pieces of any size: matching, damaged, empty,
    overlapping and past-the-end ranges."""
    from asyncckpt.format._checksum import RangeCheck, crc32c

    data = bytes(range(256)) * 40
    ranges = [(0, 100, crc32c(data[:100]), "a"), (50, 200, crc32c(data[50:250]), "overlaps a"),
              (300, 0, crc32c(b""), "empty"), (400, 1000, crc32c(data[400:1400]) ^ 1, "damaged"),
              (10_000, 500, 0, "past the end"), (20_000, 0, 0, "empty, past the end"),
              (len(data), 0, 0, "empty, at the end")]  # fmt: skip
    for piece in (1, 7, 100, 4096, len(data)):
        check = RangeCheck(sorted(ranges))
        for at in range(0, len(data), piece):
            check.feed(at, memoryview(data[at : at + piece]))
        check.finish()
        assert check.bad == ["damaged", "past the end", "empty, past the end"], (piece, check.bad)
