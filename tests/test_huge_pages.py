"""``Checkpointer(huge_pages=True)``: staging buffers advised ``MADV_HUGEPAGE``.

Whether the kernel then gives huge pages depends on its free memory, so the tests check what
the library controls and the kernel reports deterministically: the buffer's mapping is
eligible for transparent huge pages (``THPeligible`` in ``/proc/self/smaps``) exactly when
asked for (under THP's ``madvise`` mode), its size is whole huge pages, and saves through it
load back bit-exactly, mutations after ``save()`` returned included.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same

from asyncckpt import Checkpointer, load
from asyncckpt.saving._arena import HUGE_PAGE

_THP = Path("/sys/kernel/mm/transparent_hugepage")


def _bracketed(path: Path) -> str | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _plain_madvise_thp() -> bool:
    """Whether ``THPeligible`` says exactly "advised MADV_HUGEPAGE" for an anonymous
    mapping: THP in ``madvise`` mode for 2 MiB pages (directly, or inherited) and for no
    other size ``always`` (a multi-size THP setting would make every mapping eligible), 4 KiB
    base pages (2 MiB is the huge page), and THP not disabled for this process (prctl)."""
    if _bracketed(_THP / "enabled") != "madvise" or os.sysconf("SC_PAGE_SIZE") != 4096:
        return False
    try:
        if int((_THP / "hpage_pmd_size").read_text()) != HUGE_PAGE:
            return False
    except (OSError, ValueError):
        return False
    for size in _THP.glob("hugepages-*kB"):
        mode = _bracketed(size / "enabled")
        if mode == "always" or (size.name == "hugepages-2048kB" and mode not in ("inherit", "madvise")):
            return False
    status = Path("/proc/self/status").read_text()
    return "THP_enabled:\t0" not in status


def _thp_eligible(address: int) -> bool | None:
    """``THPeligible`` of the mapping holding ``address`` (None when smaps does not say)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return None


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    # 3 MiB + change: not a whole number of huge pages
    return {"model": {"w": torch.randn(786_433, generator=g), "b": torch.arange(7)}, "step": seed}


def test_huge_pages_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="huge_pages must be a bool"):
        Checkpointer(tmp_path, huge_pages=1)  # type: ignore[arg-type]
    assert not (tmp_path / ".asyncckpt").exists() or not any((tmp_path / ".asyncckpt").iterdir())


def _free_buffer(ck: Checkpointer) -> Any:
    """The one free staging buffer, once the settled save gave it back (bounded wait)."""
    deadline = time.monotonic() + 10.0
    while not (free := ck.staging_statistics().free):
        assert time.monotonic() < deadline, "the staging buffer never came back"
        time.sleep(0.01)
    (buffer,) = free
    return buffer


@pytest.mark.parametrize("huge", [True, False])
def test_saves_through_huge_page_buffers_load_back_exactly(tmp_path: Path, huge: bool) -> None:
    state = state_of(1)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": 1}
    with Checkpointer(tmp_path, huge_pages=huge) as ck:
        handle = ck.save(1, state)
        state["model"]["w"].add_(1.0)  # mutated right after save() returned: the save keeps the old values
        handle.result(timeout=60)
        ck.save(2, state).result(timeout=60)  # the same buffer again
        arena = _free_buffer(ck)  # the buffer the saves used, once it is back
        assert arena.huge_pages is huge
        assert arena.capacity % (HUGE_PAGE if huge else 4096) == 0 and arena.capacity >= 4096
        assert ck.staging_statistics().allocations == 1
        if sys.platform == "linux" and _plain_madvise_thp():
            assert _thp_eligible(arena.address) is huge  # advised exactly when asked for
    assert_same(load(tmp_path, 1), expected)
    assert_same(load(tmp_path, 2), state)


def test_reserve_with_huge_pages_sizes_the_buffer_in_whole_huge_pages(tmp_path: Path) -> None:
    state = state_of(2)
    with Checkpointer(tmp_path, huge_pages=True) as ck:
        ck.reserve(state)
        (arena,) = ck.staging_statistics().free
        assert arena.capacity % HUGE_PAGE == 0
        ck.save(1, state).result(timeout=60)
        assert ck.staging_statistics().allocations == 1  # the reserved buffer took the save
    assert_same(load(tmp_path, 1), state)


def test_the_spare_buffer_of_a_sigterm_save_is_never_on_huge_pages() -> None:
    # the final save of a SIGTERM handler runs against a grace period: no multi-second allocation
    from asyncckpt.saving._stagingpool import StagingPool

    pool = StagingPool(1, huge_pages=True)
    try:
        spare = pool.spare(3 * HUGE_PAGE + 5)
        assert spare.spare and not spare.huge_pages and spare.capacity % 4096 == 0
        pooled, _ = pool.acquire(3 * HUGE_PAGE + 5, 1.0)
        assert pooled.huge_pages and pooled.capacity == 4 * HUGE_PAGE
        pool.give_back(pooled)
        pool.give_back(spare)  # released, not pooled
        assert pool._free == [pooled]
    finally:
        pool.close()
