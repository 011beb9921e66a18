"""One staging buffer: an :class:`Arena`, a page-aligned anonymous mapping laid out exactly
like the shard file it will become (header, then tensor data), so the writer streams it to disk
with no further copy.

Its pages are faulted in at allocation (on transparent huge pages with ``huge_pages``), wiped
in forked children, page-locked for CUDA copies on demand (:meth:`Arena.pin`). Per layout it
caches the :class:`CopyPlan` the copy follows (where each slot goes and the file-order groups
of about :data:`GROUP` bytes the copy hands to the writer) and, for CUDA copies, typed views
of its slots.
"""

from __future__ import annotations

import array
import ctypes
import errno
import mmap

import torch

from ..format._header import ALIGN, round_up
from ..format._safetensors import ST_TO_DTYPE, ShardLayout

#: Bytes per staging group: the unit the copy hands to the writer (and to the helper thread).
GROUP = 8 * 1024 * 1024


class CopyPlan:
    """Per (arena, layout): destination addresses, byte counts and the file-order groups.

    Compact (issue 32: a state of 300,000 tensors): two 8-byte numbers a slot, no tensor
    object a slot; a typed view of a slot (:meth:`view`) is made only for a source the plain
    ``memmove`` cannot read (strided, conjugated), when the copy meets it."""

    def __init__(self, arena: Arena, layout: ShardLayout) -> None:
        base = arena.tensor.data_ptr() + layout.data_start
        slots = layout.slots
        self.tensor, self.layout = arena.tensor, layout  # (not the arena: no cycle through its cache)
        self.dst = array.array("q", [base + s.begin for s in slots])
        self.nbytes = array.array("q", [s.end - s.begin for s in slots])
        self.count = len(slots)
        bounds: list[int] = []  # index after each group
        ends: list[int] = []  # file offset after each group
        acc = 0
        for i, n in enumerate(self.nbytes):
            acc += n
            if acc >= GROUP:
                bounds.append(i + 1)
                ends.append(layout.data_start + slots[i].end)
                acc = 0
        if not bounds or bounds[-1] != len(slots):
            bounds.append(len(slots))
            ends.append(layout.file_size)
        self.starts = [0, *bounds[:-1]]
        self.bounds = bounds
        self.ends = ends

    def view(self, i: int) -> torch.Tensor:
        """A typed view of slot ``i`` of the arena (made on demand, not kept)."""
        s = self.layout.slots[i]
        base = self.layout.data_start
        return self.tensor[base + s.begin : base + s.end].view(ST_TO_DTYPE[s.dtype]).view(s.shape)


#: The size of a transparent huge page on x86-64 and arm64 (4 KiB base pages).
HUGE_PAGE = 2 * 1024 * 1024
# madvise(2) advice values (Linux); Python 3.11's mmap module lacks the last two
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_WIPEONFORK = 18  # Linux 4.14
_MADV_POPULATE_WRITE = 23  # Linux 5.14


def _wipe_on_fork(m: mmap.mmap) -> None:
    """A child forked from this process gets zero pages here instead of sharing ours. Shared
    pages are copy-on-write: with a child alive (a DataLoader worker started by fork), the
    next save's copy faulted on every 4 KiB page, 0.70 s instead of 0.025 s for 256 MiB here,
    and split huge pages for good. No child uses the staging buffers (a forked Checkpointer
    refuses to save)."""
    try:
        m.madvise(_MADV_WIPEONFORK)
    except (OSError, ValueError, AttributeError):
        pass  # before Linux 4.14, or not Linux: shared copy-on-write, as without


def _new_mapping(capacity: int, huge_pages: bool = False) -> mmap.mmap:
    """An anonymous mapping of ``capacity`` bytes with every page faulted in, wiped in forked
    children (:func:`_wipe_on_fork`). With ``huge_pages`` (Linux) it is advised
    ``MADV_HUGEPAGE`` before the faults, so the kernel backs it with transparent huge pages
    where it can (else 4 KiB pages, silently)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not huge_pages or not hasattr(mmap, "MADV_HUGEPAGE"):
        # pre-fault the pages in one go: copying into fresh pages one fault at a time is ~2x slower
        flags |= getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(-1, capacity, flags=flags)
        _wipe_on_fork(m)
        return m
    m = mmap.mmap(-1, capacity, flags=flags)  # not MAP_POPULATE: the advice must come first
    _wipe_on_fork(m)
    try:
        try:
            m.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass  # THP not built in: 4 KiB pages, as without huge_pages
        try:
            m.madvise(_MADV_POPULATE_WRITE)
        except OSError as e:
            if e.errno == errno.EINVAL:  # before Linux 5.14: write the pages to fault them in
                ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 0, capacity)
            # else (ENOMEM, ...) the pages fault in at the copy, as a failed MAP_POPULATE leaves them
    except BaseException:
        m.close()
        raise
    return m


class Arena:
    """One reusable, page-aligned staging buffer of ``capacity`` bytes (with ``huge_pages``,
    rounded up to whole huge pages: the kernel places such mappings on a huge-page boundary)."""

    def __init__(self, capacity: int, huge_pages: bool = False) -> None:
        self.capacity = round_up(max(capacity, 1), HUGE_PAGE if huge_pages else ALIGN)
        self.huge_pages = huge_pages
        self._mapping = _new_mapping(self.capacity, huge_pages)
        self.buffer = memoryview(self._mapping)
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.pinned = False
        self.spare = False  # outside the pool's slots: released, not pooled, when given back
        self.copy_plans = 0  # copy plans built (StagingBuffer.copy_plans)
        self._views_for: ShardLayout | None = None
        self._views: list[torch.Tensor] = []
        self._plan_for: ShardLayout | None = None
        self._plan: CopyPlan | None = None

    def pin(self) -> bool:
        """Page-lock the arena for fast async D2H copies; False if CUDA refuses."""
        if self.pinned:
            return True
        try:
            rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                self.tensor.data_ptr(), self.capacity, 0
            )
            self.pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
        except Exception:  # noqa: BLE001 - an unpinned arena still works, just slower
            self.pinned = False
        return self.pinned

    def views(self, layout: ShardLayout) -> list[torch.Tensor]:
        """Typed views of the arena, one per slot of ``layout`` (cached per layout)."""
        if self._views_for is not layout:
            base = layout.data_start
            self._views = [
                self.tensor[base + s.begin : base + s.end].view(ST_TO_DTYPE[s.dtype]).view(s.shape)
                for s in layout.slots
            ]
            self._views_for = layout
        return self._views

    def copy_plan(self, layout: ShardLayout) -> CopyPlan:
        """Where each slot of ``layout`` goes in this arena, and the copy groups (cached)."""
        if self._plan_for is not layout or self._plan is None:
            self._plan = CopyPlan(self, layout)
            self._plan_for = layout
            self.copy_plans += 1
        return self._plan

    def release(self) -> None:
        """Unpin (if pinned) and drop the views; the mapping is freed with the last reference."""
        if self.pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            self.pinned = False
        self._views = []
        self._views_for = None
        self._plan = None
        self._plan_for = None
