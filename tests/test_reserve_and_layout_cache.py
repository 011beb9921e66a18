"""``Checkpointer.reserve(state)`` and the layout cache.

reserve() allocates the staging buffers ahead, so the first save allocates nothing; the
layout (and each buffer's copy plan) is reused across saves of exactly the same names,
dtypes and shapes, and planned anew for any change: a stale layout would write tensors
under the wrong names, shapes or offsets.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

from asyncckpt import Checkpointer, load
from asyncckpt.roots.posix._osops import OsOps


def state_of(numel: int, n: int = 3, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}, "step": seed}


def test_first_save_after_reserve_allocates_nothing(tmp_path: Path) -> None:
    state = state_of(100_000)
    with Checkpointer(tmp_path) as ck:
        ck.reserve(state)
        staging = ck.staging_statistics()
        assert staging.allocations == 1 and staging.layouts_planned == 1
        (arena,) = staging.free
        info = ck.save(1, state).result(timeout=60)
        staging = ck.staging_statistics()
        assert staging.allocations == 1  # the save used the reserved buffer
        assert [a.address for a in staging.free] == [arena.address]
        assert staging.layouts_planned == 1  # and the layout reserve() planned
        assert info.statistics is not None
    assert_same(load(tmp_path, 1), state)


def test_reserve_fills_every_free_slot(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, max_pending=3) as ck:
        ck.reserve(state_of(10_000))
        staging = ck.staging_statistics()
        assert staging.allocations == 3
        assert len(staging.free) == staging.slots == 3
        for s in range(1, 4):
            ck.save(s, state_of(10_000, seed=s))
        ck.flush(timeout=60)
        assert ck.staging_statistics().allocations == 3


def test_smaller_state_reuses_a_reserved_buffer_and_a_larger_one_grows_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.reserve(state_of(200_000))
        ck.save(1, state_of(50_000, seed=1)).result(timeout=60)  # smaller: fits
        assert ck.staging_statistics().allocations == 1
        big = state_of(400_000, seed=2)
        ck.save(2, big).result(timeout=60)  # larger: grown at this save, as documented
        assert ck.staging_statistics().allocations == 2
    assert_same(load(tmp_path, 2), big)
    assert_same(load(tmp_path, 1), state_of(50_000, seed=1))


def test_reserving_larger_replaces_and_reserving_smaller_keeps(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.reserve(state_of(10_000))
        (small,) = ck.staging_statistics().free
        ck.reserve(state_of(100_000))
        staging = ck.staging_statistics()
        assert staging.allocations == 2
        (large,) = staging.free
        assert large.capacity > small.capacity
        ck.reserve(state_of(10_000))
        staging = ck.staging_statistics()
        assert staging.allocations == 2 and staging.free == (large,)


class _Gate(OsOps):
    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def pwrite(self, fd: int, data: object, offset: int) -> int:
        self.entered.set()
        if not self.gate.wait(30):
            raise TimeoutError("test gate never opened")
        return super().pwrite(fd, data, offset)


def test_reserve_leaves_buffers_of_saves_in_flight_alone(tmp_path: Path) -> None:
    ops = _Gate()
    with Checkpointer(tmp_path, max_pending=2, os_ops=ops) as ck:
        h = ck.save(1, state_of(10_000))
        assert ops.entered.wait(10)
        ck.reserve(state_of(10_000))  # one slot is held by the save: only the other is filled
        assert ck.staging_statistics().allocations == 2
        ops.gate.set()
        h.result(timeout=60)


def test_reserve_refuses_what_save_refuses_at_the_call(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match=r"opt\.bad"):
        ck.reserve({"opt": {"bad": object()}})
    with pytest.raises(TypeError):
        ck.reserve({"t": torch.zeros(2, dtype=torch.complex128)})
    assert ck.staging_statistics().allocations == 0
    ck.close()
    with pytest.raises(RuntimeError, match="closed"):
        ck.reserve(state_of(10))


# ------------------------------------------------------------------ the layout cache
def _changed_states() -> list[tuple[str, dict[str, Any]]]:
    base = state_of(1000)
    shape = state_of(1000)
    shape["model"]["w1"] = torch.randn(10, 100)  # same name and element count, new shape
    dtype = state_of(1000)
    dtype["model"]["w1"] = dtype["model"]["w1"].double()
    renamed = state_of(1000)
    renamed["model"]["w9"] = renamed["model"].pop("w1")
    added = state_of(1000)
    added["model"]["extra"] = torch.arange(7)
    removed = state_of(1000)
    del removed["model"]["w2"]
    reordered = {"model": dict(reversed(list(state_of(1000)["model"].items()))), "step": 0}
    grown = state_of(1000)
    grown["model"]["w0"] = torch.randn(1001)
    return [
        ("base", base),
        ("shape", shape),
        ("dtype", dtype),
        ("renamed", renamed),
        ("added", added),
        ("removed", removed),
        ("reordered", reordered),
        ("grown", grown),
        ("base-again", state_of(1000, seed=5)),
    ]


def test_any_change_of_names_dtypes_shapes_or_order_plans_a_new_layout(tmp_path: Path) -> None:
    seen: list[Any] = []
    with Checkpointer(tmp_path) as ck:
        for step, (what, st) in enumerate(_changed_states(), start=1):
            ck.save(step, st).result(timeout=60)
            seen.append(ck.staging_statistics().layouts_planned)
            assert_same(load(tmp_path, step), st, what)
    # every change planned anew; the final state has the base's structure again, so its
    # layout is planned again too (only the last one is kept)
    assert seen == list(range(1, len(seen) + 1))


def test_same_structure_new_values_reuses_the_layout_and_writes_the_new_values(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, state_of(5000, seed=1)).result(timeout=60)
        (arena,) = ck.staging_statistics().free
        assert arena.copy_plans == 1
        for s in range(2, 5):
            st = state_of(5000, seed=s)
            ck.save(s, st).result(timeout=60)
            staging = ck.staging_statistics()
            # the layout and the arena's copy plan of the first save, reused
            assert staging.layouts_planned == 1 and staging.free == (arena,)
            assert_same(load(tmp_path, s), st)


def test_non_contiguous_and_conjugated_sources_are_copied_by_value(tmp_path: Path) -> None:
    # the fast copy reads raw memory: views it cannot read that way must go through torch
    base = torch.randn(64, 32)
    z = torch.randn(100, dtype=torch.complex64)
    st = {"t": base.t(), "slice": base[:, ::2], "conj": z.conj(), "neg": z.conj().imag, "c": base.clone()}
    with Checkpointer(tmp_path) as ck:
        ck.save(1, st).result(timeout=60)
    back = load(tmp_path, 1)
    for k, v in st.items():
        assert torch.equal(back[k], v.resolve_conj().resolve_neg()), k
