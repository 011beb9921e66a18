"""The copy of the caller's tensors into a staging arena: :class:`StagingCopier`.

CUDA tensors are copied with ``non_blocking=True`` on a side stream into the arena,
which is page-locked with ``cudaHostRegister``; the caller's current stream then waits on
the copy's event (so the training loop may mutate its tensors right away) and the writer
synchronizes on the event before it reads the buffer. Without CUDA all of this is skipped.

CPU tensors are copied in file order, in groups of about ``_arena.GROUP`` bytes, and each
finished group moves a :class:`~asyncckpt.saving._stageprogress.StageProgress` watermark
forward: the writer streams the staged prefix of the arena to disk while the rest is still
being copied. Contiguous tensors are copied with a plain ``memmove`` (GIL released, no OpenMP
region per tensor, so it holds up when torch's intra-op threads are contended), by the
caller's thread and one helper thread pulling groups from a shared counter; the caller never
waits for the helper longer than the one group it is copying.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..format._safetensors import PLAIN_TENSORS, ShardLayout
from ._arena import Arena, CopyPlan
from ._stageprogress import StageProgress

_memmove = ctypes.memmove  # (measured: ~10% less a call than libc memcpy with declared argtypes)
_STOP = object()


class _CopyRun:
    """One stage() call's CPU copy, shared by the caller and the helper thread."""

    def __init__(self, plan: CopyPlan, sources: Sequence[torch.Tensor], progress: StageProgress | None) -> None:
        self.plan, self.sources, self.progress = plan, sources, progress
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._helper = "queued"  # -> "running" -> "done", or "closed" when it never started
        self.helper_done = threading.Event()
        self.error: BaseException | None = None
        self.abort = False

    def work(self) -> None:
        """Copy groups until none is left (or the run is aborted)."""
        plan, sources, memmove, plain = self.plan, self.sources, _memmove, PLAIN_TENSORS
        n = len(plan.bounds)
        while not self.abort:
            g = next(self._next)  # atomic under the GIL: each group is copied exactly once
            if g >= n:
                return
            a, b = plan.starts[g], plan.bounds[g]
            for i, s, dst, nbytes in zip(range(a, b), sources[a:b], plan.dst[a:b], plan.nbytes[a:b], strict=True):
                if type(s) in plain and s.is_contiguous() and not s.is_conj() and not s.is_neg():
                    memmove(dst, s.data_ptr(), nbytes)
                else:  # strided, conjugated or wrapped tensors: torch knows how to read them
                    plan.view(i).copy_(s)
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


class StagingCopier:
    """Copies sources into arenas for ``save()``: owns the helper thread that shares a CPU
    copy (started at the first copy that has more than one group) and one CUDA side stream
    per device."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._helper: threading.Thread | None = None
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False

    def close(self) -> None:
        """Stop the helper thread (joined, bounded); later copies run on the caller's thread alone."""
        with self._lock:
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
        with self._lock:
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
        if plan.count != len(sources):
            raise ValueError(f"{len(sources)} tensors for a layout of {plan.count}")
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
