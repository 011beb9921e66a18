"""The resharding math of asyncckpt.format._reshard against real tensors and torch slicing."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt.format._reshard import (
    MAX_CHUNKS,
    Box,
    ChunkRead,
    SavedChunk,
    check_chunk_index,
    check_tiling,
    intersect,
    plan_reads,
)

DTYPES = [torch.uint8, torch.int16, torch.float32, torch.float64]


def slices(b: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))


def grid_chunks(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """The boxes of a grid chunking: per dim, sorted interior cut points."""
    per_dim = []
    for n, c in zip(shape, cuts, strict=True):
        pts = [0, *sorted(set(x for x in c if 0 < x < n)), n]
        per_dim.append([(a, b - a) for a, b in itertools.pairwise(pts)] or [(0, 0)])
    boxes = [[]]  # type: list[list[tuple[int, int]]]
    for iv in per_dim:
        boxes = [[*b, x] for b in boxes for x in iv]
    return [Box(tuple(o for o, _ in b), tuple(s for _, s in b)) for b in boxes]


def save(full: torch.Tensor, boxes: list[Box], rng: random.Random) -> tuple[bytearray, list[SavedChunk]]:
    """Lay the chunks out in one 'file' in random order with random gaps, row-major each."""
    order = list(range(len(boxes)))
    rng.shuffle(order)
    data = bytearray(rng.randrange(0, 16))
    placed: dict[int, SavedChunk] = {}
    for i in order:
        raw = full[slices(boxes[i])].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        placed[i] = SavedChunk(boxes[i], "f", len(data))
        data += raw + bytes(rng.randrange(0, 8))
    return data, [placed[i] for i in range(len(boxes))]


def assemble(data: bytes, reads: list[ChunkRead], target: Box, dtype: torch.dtype) -> torch.Tensor:
    out = bytearray(target.numel * dtype.itemsize)
    seen = bytearray(len(out))
    for r in reads:
        for c in r.copies():
            assert not any(seen[c.dst : c.dst + c.length])  # no target byte is written twice
            seen[c.dst : c.dst + c.length] = b"\x01" * c.length
            out[c.dst : c.dst + c.length] = data[c.src : c.src + c.length]
    assert all(seen)  # ... and none is left out
    return torch.frombuffer(out, dtype=torch.uint8).view(dtype).reshape(target.sizes) if out else torch.empty(
        target.sizes, dtype=dtype
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[tuple[int, ...], list[list[int]], Box, torch.dtype, int]:
    nd = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=nd, max_size=nd)))
    cuts = [draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3)) for n in shape]
    offs, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        offs.append(o)
        sizes.append(draw(st.integers(0, n - o)))
    return shape, cuts, Box(tuple(offs), tuple(sizes)), draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**16))


Case = tuple[tuple[int, ...], list[list[int]], Box, torch.dtype, int]


@settings(max_examples=300, deadline=None)
@given(cases())
def test_copies_reconstruct_the_target_slice(case: Case) -> None:
    shape, cuts, target, dtype, seed = case
    rng = random.Random(seed)
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape).to(dtype)
    if dtype.is_floating_point:
        full = full * 1.5 - 3
    boxes = grid_chunks(shape, cuts)
    check_tiling(shape, boxes)
    data, chunks = save(full, boxes, rng)
    check_chunk_index(shape, chunks, dtype.itemsize, {"f": len(data)})
    reads = plan_reads(chunks, target, dtype.itemsize)
    if target.empty:
        assert reads == []
    got = assemble(bytes(data), reads, target, dtype)
    assert torch.equal(got, full[slices(target)])
    for r in reads:
        copies = list(r.copies())
        assert len(copies) == r.ncopies()
        # minimal: no two consecutive copies are contiguous on both sides
        for a, b in itertools.pairwise(copies):
            assert not (a.src + a.length == b.src and a.dst + a.length == b.dst)
        # reads: fewer or equal, cover exactly the bytes the copies take from the file
        reads_ = list(r.reads())
        assert len(reads_) <= len(copies)
        for a, b in itertools.pairwise(reads_):
            assert a[0] + a[1] < b[0]
        wanted = {x for c in copies for x in range(c.src, c.src + c.length)}
        assert wanted == {x for s, n in reads_ for x in range(s, s + n)}
        first, length = r.span()
        assert (first, first + length) == (min(wanted), max(wanted) + 1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.data())
def test_dim0_resharding_is_one_copy_per_overlapping_chunk(dims: list[int], data: st.DataObject) -> None:
    rows = data.draw(st.integers(1, 40))
    shape = (rows, *dims)
    saved = grid_chunks(shape, [data.draw(st.lists(st.integers(1, rows), max_size=6))] + [[] for _ in dims])
    full = torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)
    raw, chunks = save(full, saved, random.Random(0))
    lo = data.draw(st.integers(0, rows))
    target = Box((lo, *(0 for _ in dims)), (data.draw(st.integers(0, rows - lo)), *dims))
    reads = plan_reads(chunks, target, 4)
    assert all(r.ncopies() == 1 and len(list(r.copies())) == 1 for r in reads)
    assert len(reads) == sum(intersect(c.box, target) is not None for c in chunks)
    assert torch.equal(assemble(bytes(raw), reads, target, torch.int32), full[slices(target)])


def test_column_target_from_row_chunks_is_one_copy_per_row() -> None:
    full = torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10)
    raw, chunks = save(full, [Box((0, 0), (2, 10)), Box((2, 0), (2, 10))], random.Random(1))
    target = Box((0, 5), (4, 5))
    reads = plan_reads(chunks, target, 4)
    assert [r.ncopies() for r in reads] == [2, 2]
    assert [list(r.reads()) == [(c.src, c.length) for c in r.copies()] for r in reads] == [True, True]
    assert [r.span()[1] for r in reads] == [(10 + 5) * 4] * 2  # row 0 col 5 .. row 1 col 9
    assert torch.equal(assemble(bytes(raw), reads, target, torch.float32), full[:, 5:])


def test_narrow_chunks_into_a_wide_target_read_whole_but_copy_by_row() -> None:
    full = torch.arange(3 * 4, dtype=torch.int16).reshape(3, 4)
    raw, chunks = save(full, [Box((0, 0), (3, 2)), Box((0, 2), (3, 2))], random.Random(2))
    reads = plan_reads(chunks, Box.whole((3, 4)), 2)
    assert [r.ncopies() for r in reads] == [3, 3]
    assert [len(list(r.reads())) for r in reads] == [1, 1]  # each saved chunk is read in one go
    assert torch.equal(assemble(bytes(raw), reads, Box.whole((3, 4)), torch.int16), full)


def test_scalar_and_empty() -> None:
    full = torch.tensor(2.5)
    raw, chunks = save(full, [Box((), ())], random.Random(3))
    reads = plan_reads(chunks, Box((), ()), 4)
    assert len(reads) == 1 and reads[0].ncopies() == 1
    assert torch.equal(assemble(bytes(raw), reads, Box((), ()), torch.float32), full)
    assert plan_reads(chunks, Box((), ()), 4)[0].span() == (chunks[0].begin, 4)
    assert plan_reads([SavedChunk(Box((0,), (5,)), "f", 0)], Box((5,), (0,)), 4) == []
    check_tiling((0, 3), [Box((0, 0), (0, 3))])
    check_tiling((4,), [Box((0,), (4,)), Box((4,), (0,))])  # an empty shard at offset = dim size


@pytest.mark.parametrize(
    ("shape", "boxes", "match"),
    [
        ((4,), [Box((0,), (2,)), Box((1,), (3,))], "elements"),  # overlap with too much volume
        ((4,), [Box((0,), (2,)), Box((1,), (2,)), Box((3,), (0,))], "overlaps"),  # gap + overlap, equal volume
        ((4, 2), [Box((0, 0), (2, 2)), Box((1, 0), (2, 1)), Box((3, 0), (1, 2))], "overlaps"),
        ((4,), [Box((0,), (4,)), Box((0,), (4,))], "elements"),  # a replica left in
        ((4,), [Box((0,), (2,)), Box((2,), (3,))], "exceeds"),
        ((4,), [Box((5,), (0,))], "exceeds"),
        ((4,), [Box((-1,), (2,)), Box((1,), (3,))], "negative"),
        ((4,), [Box((0, 0), (4, 1))], "dims"),
        ((2, 2), [Box((0, 0), (1, 2)), Box((1, 0), (True, 2))], "non-integer"),
        ((-1,), [], "global shape"),
        ((), [Box((), ()), Box((), ())], "elements"),
    ],
)
def test_bad_tilings_are_value_errors(shape: tuple[int, ...], boxes: list[Box], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_tiling(shape, boxes, "model.w")


def test_overlap_with_equal_volume_is_found() -> None:
    # the right total volume, but two chunks overlap and a corner is missing
    boxes = [Box((0, 0), (2, 2)), Box((0, 1), (2, 2)), Box((2, 0), (1, 1))]
    with pytest.raises(ValueError, match="overlaps"):
        check_tiling((3, 3), boxes, "w")


def test_hostile_chunk_index_is_cheap_and_refused() -> None:
    # a huge tensor claimed by a few chunks: the check never touches its size
    n = 2**40
    check_tiling((n, n), [Box((0, 0), (n // 2, n)), Box((n // 2, 0), (n // 2, n))])
    h = n // 2
    with pytest.raises(ValueError, match="overlaps"):
        check_tiling((n, 2), [Box((0, 0), (h + 1, 1)), Box((h, 0), (h, 1)), Box((0, 1), (n - 1, 1))], "w")
    # an irregular brick pattern with many cut points is refused before any grid is allocated
    k = 3000
    bricks = [Box((i, i), (1, k - i)) for i in range(k)] + [Box((i, 0), (1, i)) for i in range(1, k)]
    with pytest.raises(ValueError, match="irregular"):
        check_tiling((k, k), bricks, "w")
    with pytest.raises(ValueError, match="chunks"):
        check_tiling((MAX_CHUNKS + 1,), [Box((0,), (1,))] * (MAX_CHUNKS + 1))
    chunks = [SavedChunk(Box((0,), (4,)), "a", 8)]
    with pytest.raises(ValueError, match="past the end"):
        check_chunk_index((4,), chunks, 4, {"a": 23})
    with pytest.raises(ValueError, match="unknown file"):
        check_chunk_index((4,), chunks, 4, {"b": 100})
    with pytest.raises(ValueError, match="file position"):
        check_chunk_index((4,), [SavedChunk(Box((0,), (4,)), "a", -1)], 4)
    with pytest.raises(ValueError, match="element size"):
        check_chunk_index((4,), chunks, 0)
    check_chunk_index((4,), chunks, 4, {"a": 24})


def test_box_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="offsets"):
        Box((0, 0), (1,))
    with pytest.raises(ValueError, match="dims"):
        intersect(Box((0,), (1,)), Box((0, 0), (1, 1)))
