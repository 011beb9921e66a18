"""Staging: copy the caller's tensors into CPU buffers the library owns and reuses.

An :class:`Arena` is one page-aligned anonymous mapping laid out exactly like the shard
file it will become (header, then tensor data), so the writer streams it to disk with no
further copy. The :class:`StagingPool` owns at most ``slots`` arenas (one per save in
flight) and reuses them across saves, growing one only when the state grows.

CUDA tensors are copied with ``non_blocking=True`` on a side stream into the arena,
which is page-locked with ``cudaHostRegister``; the caller's current stream then waits on
the copy's event (so the training loop may mutate its tensors right away) and the writer
synchronizes on the event before it reads the buffer. Without CUDA all of this is skipped.

CPU tensors are copied in file order, in groups of about :data:`GROUP` bytes, and each
finished group moves a :class:`StageProgress` watermark forward: the writer streams the
staged prefix of the arena to disk while the rest is still being copied. Contiguous
tensors are copied with a plain ``memmove`` (GIL released, no OpenMP region per tensor,
so it holds up when torch's intra-op threads are contended), by the caller's thread and
one helper thread pulling groups from a shared counter; the caller never waits for the
helper longer than the one group it is copying.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import SaveError
from .._info import StagingBuffer, StagingStatistics
from ..format._header import ALIGN, round_up
from ..format._safetensors import PLAIN_TENSORS, ST_TO_DTYPE, ShardLayout

#: Bytes per staging group: the unit the copy hands to the writer (and to the helper thread).
GROUP = 8 * 1024 * 1024
_memmove = ctypes.memmove
_STOP = object()


class StagingAborted(Exception):
    """The copy in ``save()`` did not finish (it raised, or the caller was interrupted): the
    writer streaming that arena gives the save up. Never raised to the caller of ``save()``,
    who gets the original exception."""


class StageProgress:
    """How much of an arena is staged: a watermark (file offset) the copy moves forward and
    the writer waits on. Thread-safe; every wait has a deadline."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.staging_s = 0.0
        self._cond = threading.Condition()
        self._staged = 0
        self._error: BaseException | None = None
        self._gone = False  # the writer stopped waiting: nothing more to tell it
        self._ends: list[int] = []
        self._done: set[int] = set()
        self._next = 0
        self._wakers: list[tuple[int, Callable[[], None]]] = []

    @property
    def finished(self) -> bool:
        return self._staged >= self.total

    def advance(self, pos: int) -> None:
        """The arena is staged up to file offset ``pos``."""
        with self._cond:
            if pos > self._staged:
                self._staged = pos
                self._cond.notify_all()
            due = self._due()
        _wake(due)

    def when_reached(self, pos: int, wake: Callable[[], None]) -> None:
        """Call ``wake()`` once offset ``pos`` is staged, or the copy failed, or the writer gave
        the save up: now, or from the thread that gets there (the copying thread; ``wake``
        must be quick and must not raise). The writer loop waits on this (``until_staged``)."""
        with self._cond:
            if self._staged < pos and self._error is None and not self._gone:
                self._wakers.append((pos, wake))
                return
        wake()

    def _due(self) -> list[Callable[[], None]]:
        """Under the lock: take the wakers whose offset is staged (all of them once the copy
        failed or was abandoned)."""
        if not self._wakers:
            return []
        if self._error is not None or self._gone:
            due, self._wakers = [w for _, w in self._wakers], []
            return due
        due = [w for p, w in self._wakers if p <= self._staged]
        if due:
            self._wakers = [(p, w) for p, w in self._wakers if p > self._staged]
        return due

    def expect_groups(self, ends: Sequence[int]) -> None:
        """The copy will finish groups whose (file-order) end offsets are ``ends``."""
        with self._cond:
            # only finish() completes the staging: a copy that raises after its last group
            # must leave the writer one byte short, so that save never commits
            self._ends, self._done, self._next = [min(e, self.total - 1) for e in ends], set(), 0

    def group_done(self, g: int) -> None:
        """Group ``g`` is copied; the watermark moves over every group done in order."""
        with self._cond:
            self._done.add(g)
            moved = False
            while self._next in self._done:
                self._done.discard(self._next)
                self._staged = max(self._staged, self._ends[self._next])
                self._next += 1
                moved = True
            if moved:
                self._cond.notify_all()
            due = self._due()
        _wake(due)

    def finish(self, staging_s: float) -> None:
        """Everything is staged (called by ``save()`` once the copy returned). A no-op once
        :meth:`fail` was called: a failed copy never completes."""
        with self._cond:
            if self._error is not None:
                return
            self.staging_s = staging_s
            self._staged = self.total
            self._cond.notify_all()
            due = self._due()
        _wake(due)

    def fail(self, exc: BaseException) -> None:
        """The copy failed: every wait (now or later) raises :class:`StagingAborted`."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()
            due = self._due()
        _wake(due)

    def abandon(self) -> None:
        """The writer gave the save up (failure, deadline): release its waiting threads."""
        with self._cond:
            self._gone = True
            self._cond.notify_all()
            due = self._due()
        _wake(due)

    def reached(self, pos: int) -> bool:
        """Whether offset ``pos`` is staged, without waiting; ``StagingAborted`` as :meth:`wait_for`."""
        with self._cond:
            if self._staged >= pos:
                return True
            if self._error is not None:
                raise self._aborted()
            if self._gone:
                raise StagingAborted("the save was given up before its state was staged")
            return False

    def _aborted(self) -> Exception:
        """What a wait raises once the copy failed: the failure itself when it is already the
        save's verdict (a ``SaveError``: deferred staging's ``StateChangedError``), else
        :class:`StagingAborted` describing it."""
        err = self._error
        if isinstance(err, SaveError):
            return err
        return StagingAborted(f"save() did not finish copying the state: {type(err).__name__}: {err}")

    def wait_for(self, pos: int, deadline: float) -> None:
        """Block until offset ``pos`` is staged; ``StagingAborted`` if the copy failed or the
        writer abandoned the save, ``TimeoutError`` at ``deadline`` (``time.monotonic()``)."""
        with self._cond:
            while self._staged < pos:
                if self._error is not None:
                    raise self._aborted()
                if self._gone:
                    raise StagingAborted("the save was given up before its state was staged")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the state was not staged before the save's deadline")
                self._cond.wait(left)


def _wake(due: list[Callable[[], None]]) -> None:
    for wake in due:
        wake()


class _CopyPlan:
    """Per (arena, layout): destination addresses, byte counts and the file-order groups."""

    def __init__(self, arena: Arena, layout: ShardLayout, views: list[torch.Tensor]) -> None:
        base = arena.tensor.data_ptr() + layout.data_start
        self.dst = [base + s.begin for s in layout.slots]
        self.nbytes = [s.end - s.begin for s in layout.slots]
        self.views = views
        bounds: list[int] = []  # index after each group
        ends: list[int] = []  # file offset after each group
        acc = 0
        for i, s in enumerate(layout.slots):
            acc += s.end - s.begin
            if acc >= GROUP:
                bounds.append(i + 1)
                ends.append(layout.data_start + s.end)
                acc = 0
        if not bounds or bounds[-1] != len(layout.slots):
            bounds.append(len(layout.slots))
            ends.append(layout.file_size)
        self.starts = [0, *bounds[:-1]]
        self.bounds = bounds
        self.ends = ends


class _CopyRun:
    """One stage() call's CPU copy, shared by the caller and the helper thread."""

    def __init__(self, plan: _CopyPlan, sources: Sequence[torch.Tensor], progress: StageProgress | None) -> None:
        self.plan, self.sources, self.progress = plan, sources, progress
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._helper = "queued"  # -> "running" -> "done", or "closed" when it never started
        self.helper_done = threading.Event()
        self.error: BaseException | None = None
        self.abort = False

    def work(self) -> None:
        """Copy groups until none is left (or the run is aborted)."""
        plan, sources = self.plan, self.sources
        n = len(plan.bounds)
        while not self.abort:
            g = next(self._next)  # atomic under the GIL: each group is copied exactly once
            if g >= n:
                return
            for i in range(plan.starts[g], plan.bounds[g]):
                s = sources[i]
                if type(s) in PLAIN_TENSORS and s.is_contiguous() and not s.is_conj() and not s.is_neg():
                    _memmove(plan.dst[i], s.data_ptr(), plan.nbytes[i])
                else:  # strided, conjugated or wrapped tensors: torch knows how to read them
                    plan.views[i].copy_(s)
            if self.progress is not None:
                self.progress.group_done(g)

    def run_helper(self) -> None:
        with self._lock:
            if self._helper != "queued":
                return
            self._helper = "running"
        try:
            self.work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
            self.error = e
            self.abort = True
        finally:
            self._helper = "done"
            self.helper_done.set()

    def close(self, timeout: float) -> None:
        """Caller side, after its own work: wait for the helper's last group (if it started)."""
        with self._lock:
            if self._helper == "queued":
                self._helper = "closed"
                return
        if not self.helper_done.wait(timeout):
            raise TimeoutError(f"the staging helper thread did not finish its copy within {timeout:.0f}s")


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
        self._plan: _CopyPlan | None = None

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

    def copy_plan(self, layout: ShardLayout) -> _CopyPlan:
        """Where each slot of ``layout`` goes in this arena, and the copy groups (cached)."""
        if self._plan_for is not layout or self._plan is None:
            self._plan = _CopyPlan(self, layout, self.views(layout))
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


class StagingPool:
    """At most ``slots`` arenas, handed out one per save in flight and reused."""

    def __init__(self, slots: int, huge_pages: bool = False) -> None:
        self.huge_pages = huge_pages
        self._cond = threading.Condition()
        self._free: list[Arena | None] = [None] * slots
        self._streams: dict[torch.device, Any] = {}
        self._helper: threading.Thread | None = None
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        #: arenas allocated so far (tests and ``reserve()`` check that saves reuse them)
        self.allocations = 0

    def _new_arena(self, nbytes: int, huge_pages: bool | None = None) -> Arena:
        arena = Arena(nbytes, self.huge_pages if huge_pages is None else huge_pages)
        self.allocations += 1
        return arena

    def acquire(self, nbytes: int, timeout: float) -> tuple[Arena, float]:
        """Wait (up to ``timeout`` s) for a free slot; return an arena of >= ``nbytes``.

        Returns the arena and the seconds spent waiting. Raises ``TimeoutError``.
        """
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), max(0.0, timeout)):
                raise TimeoutError(f"no staging slot became free within {timeout:.1f}s")
            # prefer an arena that is already big enough
            idx = next(
                (i for i, a in enumerate(self._free) if a is not None and a.capacity >= nbytes),
                len(self._free) - 1,
            )
            arena = self._free.pop(idx)
        waited = time.perf_counter() - t0
        if arena is None or arena.capacity < round_up(nbytes):
            if arena is not None:
                arena.release()
                del arena
            arena = self._new_arena(nbytes)
        return arena, waited

    def reserve(self, nbytes: int, pin: bool) -> int:
        """Make every free slot hold an arena of >= ``nbytes`` (pinned if ``pin``), allocating
        only what is missing or too small; returns how many arenas were allocated. Slots held
        by saves in flight are left alone (they grow when they come back, at their next use)."""
        made = 0
        with self._cond:
            for i, a in enumerate(self._free):
                if a is None or a.capacity < round_up(nbytes):
                    if a is not None:
                        a.release()
                    a = self._free[i] = self._new_arena(nbytes)
                    made += 1
                if pin:
                    a.pin()
        return made

    def spare(self, nbytes: int) -> Arena:
        """A fresh arena outside the slots, for a save that must not wait for one (the final
        save of a SIGTERM handler that interrupted a save holding the slot). Never on huge
        pages: their allocation can take seconds, and this save runs against a grace period."""
        arena = self._new_arena(nbytes, huge_pages=False)
        arena.spare = True
        return arena

    def give_back(self, arena: Arena) -> None:
        """Return an arena to the pool (called when its save committed or failed)."""
        if arena.spare:
            arena.release()
            return
        with self._cond:
            self._free.append(arena)
            self._cond.notify()

    def snapshot(self, layouts_planned: int) -> StagingStatistics:
        """A read-only snapshot of the pool (``Checkpointer.staging_statistics``)."""
        with self._cond:
            free = [a for a in self._free if a is not None]
            buffers = tuple(StagingBuffer(a.tensor.data_ptr(), a.capacity, a.huge_pages, a.pinned, a.copy_plans)
                            for a in free)  # fmt: skip
            return StagingStatistics(self.allocations, len(self._free), buffers, layouts_planned)

    def close(self) -> None:
        """Release the free arenas and stop the helper thread (joined, bounded)."""
        with self._cond:
            for a in self._free:
                if a is not None:
                    a.release()
            self._free = [None] * len(self._free)
            self._closed = True
            helper, self._helper = self._helper, None
        if helper is not None and helper.is_alive():
            self._work.put(_STOP)
            helper.join(10.0)

    @staticmethod
    def can_stream(sources: Sequence[torch.Tensor]) -> bool:
        """True when every source is a CPU tensor: the copy is then complete group by group,
        as it happens, and the writer may stream the staged prefix (CUDA copies complete
        only at their event)."""
        return all(s.is_cpu for s in sources)

    def _helper_loop(self) -> None:
        while True:
            run = self._work.get()
            if run is _STOP:
                return
            run.run_helper()
            del run

    def _start_helper(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            if self._helper is None or not self._helper.is_alive():
                t = threading.Thread(target=self._helper_loop, name="asyncckpt-stage", daemon=True)
                t.start()
                self._helper = t
        return True

    def stage(
        self,
        arena: Arena,
        layout: ShardLayout,
        sources: Sequence[torch.Tensor],
        progress: StageProgress | None = None,
        *,
        all_cpu: bool | None = None,
        compute_waits: bool = True,
    ) -> Any:
        """Copy ``sources`` (in ``layout.slots`` order) into ``arena``. ``all_cpu``: what
        :meth:`can_stream` says of ``sources``, when the caller knows it already.
        ``compute_waits=False`` (deferred staging): the caller's CUDA streams do not wait for
        the device-to-host copies; the caller makes them wait before the first write.

        Returns ``None`` when the copy is complete on return, or CUDA events the writer must
        synchronize before reading the arena. With ``progress`` (CPU sources only, see
        :meth:`can_stream`), each copied group moves its watermark; the caller calls
        :meth:`StageProgress.finish` after this returns. Raises whatever the copy raised,
        after the helper thread stopped touching the arena.
        """
        arena.buffer[: len(layout.header)] = layout.header
        if progress is not None:
            progress.advance(len(layout.header))
        if all_cpu if all_cpu is not None else self.can_stream(sources):
            self._stage_cpu(arena, layout, sources, progress)
            return None
        dsts = arena.views(layout)
        cpu_dst: list[torch.Tensor] = []
        cpu_src: list[torch.Tensor] = []
        gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for d, s in zip(dsts, sources, strict=True):
            if s.device.type == "cpu":
                cpu_dst.append(d)
                cpu_src.append(s)
            else:
                gpu.setdefault(s.device, []).append((d, s))
        if cpu_dst:
            torch._foreach_copy_(cpu_dst, cpu_src)
        if not gpu:
            return None
        return self._stage_cuda(arena, gpu, compute_waits)

    def _stage_cpu(
        self, arena: Arena, layout: ShardLayout, sources: Sequence[torch.Tensor], progress: StageProgress | None
    ) -> None:
        plan = arena.copy_plan(layout)
        if len(plan.views) != len(sources):
            raise ValueError(f"{len(sources)} tensors for a layout of {len(plan.views)}")
        if progress is not None:
            progress.expect_groups(plan.ends)
        run = _CopyRun(plan, sources, progress)
        helped = len(plan.bounds) > 1 and self._start_helper()
        if helped:
            self._work.put(run)
        try:
            run.work()
        except BaseException:
            run.abort = True
            if helped:
                run.close(10.0)  # the helper must be off the arena before it is reused
            raise
        if helped:
            run.close(60.0)
        if run.error is not None:
            raise run.error

    def _stage_cuda(
        self,
        arena: Arena,
        groups: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]],
        compute_waits: bool = True,
    ) -> list[Any]:
        arena.pin()
        events = []
        for device, pairs in groups.items():
            if device.type != "cuda":
                for d, s in pairs:
                    d.copy_(s)
                continue
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            current = torch.cuda.current_stream(device)
            stream.wait_stream(current)  # copy what the training stream has computed so far
            dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
            with torch.cuda.stream(stream):
                try:  # one call queues every copy (a Python loop of copy_ cost ~15 us a tensor)
                    torch._foreach_copy_(dsts, srcs, non_blocking=arena.pinned)
                except (RuntimeError, TypeError):  # a torch whose foreach copy refuses the mix
                    for d, s in pairs:
                        d.copy_(s, non_blocking=arena.pinned)
                for s in srcs:
                    # a source freed by the caller right after save() returns is not reused
                    # by the caching allocator before the copy out of it has run
                    s.record_stream(stream)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            if compute_waits:  # later training kernels that overwrite the sources run after the copy
                current.wait_event(event)
            events.append(event)
        return events
