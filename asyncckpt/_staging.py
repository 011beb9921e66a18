"""Staging: copy the caller's tensors into CPU buffers the library owns and reuses.

An :class:`Arena` is one page-aligned anonymous mapping laid out exactly like the shard
file it will become (header, then tensor data), so the writer streams it to disk with no
further copy. The :class:`StagingPool` owns at most ``slots`` arenas (one per save in
flight) and reuses them across saves, growing one only when the state grows.

CUDA tensors are copied with ``non_blocking=True`` on a side stream into the arena,
which is page-locked with ``cudaHostRegister``; the caller's current stream then waits on
the copy's event (so the training loop may mutate its tensors right away) and the writer
synchronizes on the event before it reads the buffer. Without CUDA all of this is skipped.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ._format import ST_TO_DTYPE, ShardLayout
from ._header import round_up


def _new_mapping(capacity: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    # pre-fault the pages in one go: copying into fresh pages one fault at a time is ~2x slower
    flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, capacity, flags=flags)


class Arena:
    """One reusable, page-aligned staging buffer of ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = round_up(max(capacity, 1))
        self._mapping = _new_mapping(self.capacity)
        self.buffer = memoryview(self._mapping)
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.pinned = False
        self.spare = False  # outside the pool's slots: released, not pooled, when given back
        self._views_for: ShardLayout | None = None
        self._views: list[torch.Tensor] = []

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


class StagingPool:
    """At most ``slots`` arenas, handed out one per save in flight and reused."""

    def __init__(self, slots: int) -> None:
        self._cond = threading.Condition()
        self._free: list[Arena | None] = [None] * slots
        self._streams: dict[torch.device, Any] = {}

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
            arena = Arena(nbytes)
        return arena, waited

    def spare(self, nbytes: int) -> Arena:
        """A fresh arena outside the slots, for a save that must not wait for one (the final
        save of a SIGTERM handler that interrupted a save holding the slot)."""
        arena = Arena(nbytes)
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

    def close(self) -> None:
        with self._cond:
            for a in self._free:
                if a is not None:
                    a.release()
            self._free = [None] * len(self._free)

    def stage(self, arena: Arena, layout: ShardLayout, sources: Sequence[torch.Tensor]) -> Any:
        """Copy ``sources`` (in ``layout.slots`` order) into ``arena``.

        Returns ``None`` when the copy is complete on return, or CUDA events the writer must
        synchronize before reading the arena.
        """
        arena.buffer[: len(layout.header)] = layout.header
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
        return self._stage_cuda(arena, gpu)

    def _stage_cuda(
        self, arena: Arena, groups: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]]
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
            with torch.cuda.stream(stream):
                for d, s in pairs:
                    d.copy_(s, non_blocking=arena.pinned)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            # later training kernels that overwrite the sources run after the copy
            current.wait_event(event)
            events.append(event)
        return events
