"""Deferred staging: ``save(step, state, until=optimizer)`` returns after the structure walk;
the copy of the optimizer's tensors overlaps the next forward and backward.

Theory of operation. Between ``save()`` and the next ``optimizer.step()``, parameters and
optimizer state are only read (forward and backward write activations and gradients), so
their copy may run in the background, and only the step - their first write - waits for it.
Everything else can change before that step and is snapshotted in ``save()`` as today:
module buffers (BatchNorm statistics change in forward), one-element tensors (step counters,
scaler scales), every tensor no optimizer in ``until`` owns, and every key named in
``copy_now``. Non-tensor values are encoded in ``save()`` anyway.

The guard (:meth:`DeferredCopy.release`) runs on the training thread before the first write:
a process-wide optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``,
so that an optimizer not named in ``until`` waits too), ``Checkpointer.wait_staged()``, the
next ``save()``, and ``flush()``/``close()``. It waits for the copy (CPU) or makes the
current CUDA stream wait for it (CUDA), then compares each deferred tensor's ``_version``
with the one read in ``save()``: any in-place write since (in forward, through another
optimizer, by hand) fails the save with :class:`StateChangedError` naming the keys. The
shard's last byte is released to the writer only after that check (``StageProgress``
holds it back), so a save whose tensors changed never commits, and a save commits only
after its guard ran.

What the version counter cannot see: writes through ``tensor.data``, numpy or DLPack
aliases, or raw pointers bypass it; such code must call ``wait_staged()`` first.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._errors import RankFailure, StateChangedError, with_global_ranks
from ..format._safetensors import ShardLayout
from ._arena import Arena
from ._stagecopy import StagingCopier
from ._stageprogress import StageProgress

#: Tensors of at most this many elements are copied in ``save()`` even when an optimizer
#: owns them: step counters and scales, which code outside the step may bump.
SCALAR_NUMEL = 1

#: Test-only switch: False skips the version check (tests/test_deferred.py shows what then commits).
_CHECK_VERSIONS = True

_hook_lock = threading.Lock()
_hook: Any = None
# every deferred copy not yet released, in any Checkpointer of this process
_pending: weakref.WeakSet[DeferredCopy] = weakref.WeakSet()
# every optimizer that stepped since the hook was installed (see stepped_optimizers)
_stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def check_until(until: Any) -> tuple[torch.optim.Optimizer, ...]:
    """``until`` as a tuple of optimizers; ``TypeError`` for anything else."""
    opts = (until,) if isinstance(until, torch.optim.Optimizer) else tuple(until) if _iterable(until) else None
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError(
            f"until must be a torch.optim.Optimizer or a non-empty sequence of them, not {type(until).__name__}"
        )
    return opts


def check_copy_now(copy_now: Any) -> frozenset[str]:
    """``copy_now`` as a set of tensor names; ``TypeError`` for anything else."""
    if isinstance(copy_now, str) or not _iterable(copy_now) or not all(isinstance(k, str) for k in copy_now):
        raise TypeError("copy_now must be a sequence of key names (str), e.g. ('model.bn.running_mean',)")
    return frozenset(copy_now)


def _iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


#: a tensor's storage view: address, dtype, shape, strides
ViewKey = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def _key(t: torch.Tensor) -> ViewKey:
    return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2's parameters and their optimizer state), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t) is not torch.Tensor else t


def owned(optimizers: Sequence[torch.optim.Optimizer]) -> set[ViewKey]:
    """The storage views (address, dtype, shape, strides) of every tensor the optimizers
    step or keep as state: the tensors whose first write is an optimizer step."""
    keys = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                keys.add(_key(_local(p)))
        for st in opt.state.values():
            for v in st.values() if isinstance(st, dict) else ():
                if isinstance(v, torch.Tensor):
                    keys.add(_key(_local(v)))
    return keys


def split(
    names: Sequence[str],
    sources: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
    copy_now: frozenset[str],
) -> list[int]:
    """Indices of ``sources`` whose copy may be deferred: owned by ``optimizers`` (same storage
    view), more than :data:`SCALAR_NUMEL` elements, not named in ``copy_now``."""
    mine = owned(optimizers)
    return [
        i
        for i, (n, s) in enumerate(zip(names, sources, strict=True))
        if s.numel() > SCALAR_NUMEL and n not in copy_now and _key(s) in mine
    ]


class DeferredCopy:
    """One deferred save's copy: started by :meth:`start` in ``save()``, released once by
    :meth:`release` on the training thread. Thread-safe; every wait has a deadline."""

    def __init__(
        self,
        step: int,
        rank: int,
        ranks: Sequence[int],
        progress: StageProgress,
        deferred: dict[str, torch.Tensor],
        blocked_s: float,
        deadline: float,
    ) -> None:
        self.step, self.rank, self.ranks = step, rank, tuple(ranks)
        self.progress = progress
        self.blocked_s = blocked_s
        self.deadline = deadline
        #: name -> (tensor, its version in save()); dropped once released
        self._watch: dict[str, tuple[torch.Tensor, int]] | None = {n: (t, t._version) for n, t in deferred.items()}
        self._copied = threading.Event()
        self._events: list[tuple[torch.device, Any]] = []  # CUDA: (device, the copy's event)
        self._lock = threading.Lock()
        self._released = False
        self._owner = threading.get_ident()  # the thread that saved: the training thread
        self._ok = False  # released and no deferred tensor changed: the shard may complete
        self._failed = False  # the copy raised
        self.copy_s = 0.0

    def start(self, copier: StagingCopier, arena: Arena, layout: ShardLayout, sources: Sequence[torch.Tensor]) -> None:
        """Start the copy of ``sources`` into ``arena``: CPU tensors on a new background thread
        (the copier's helper thread shares the copy); CUDA tensors are queued here on the copier's
        side stream after what the caller's stream computed so far, without making that stream
        wait, and the background thread waits for their events. The shard stays one byte short
        of staged until :meth:`release`."""
        try:
            _install_hook()
            with _hook_lock:
                _pending.add(self)
            cpu = StagingCopier.can_stream(sources)
            if not cpu:
                events = copier.stage(arena, layout, sources, None, all_cpu=False, compute_waits=False) or []
                devices = [d for d in dict.fromkeys(s.device for s in sources) if d.type == "cuda"]
                with self._lock:
                    self._events = list(zip(devices, events, strict=False))
            t = threading.Thread(
                target=self._copy, args=(copier, arena, layout, list(sources) if cpu else [], cpu),
                name="asyncckpt-deferred", daemon=True,
            )  # fmt: skip
            t.start()
        except BaseException as e:
            self.progress.fail(e)
            self._copied.set()
            raise

    def _copy(
        self, copier: StagingCopier, arena: Arena, layout: ShardLayout, sources: list[torch.Tensor], cpu: bool
    ) -> None:
        t0 = time.perf_counter()
        try:
            if cpu:
                copier.stage(arena, layout, sources, self.progress, all_cpu=True)
            else:
                for _, ev in self._events:
                    ev.synchronize()  # this thread waits for the D2H copy, never the training thread
                self.progress.advance(layout.file_size - 1)  # the last byte waits for release()
        except BaseException as e:  # noqa: BLE001 - the save fails with it; the writer reports it
            with self._lock:
                self._failed = True  # never finished, whatever release() finds
            self.progress.fail(e)
        finally:
            del sources
            self.copy_s = time.perf_counter() - t0
            self._copied.set()
            self._finish_if_ready()

    @property
    def released(self) -> bool:
        return self._released

    def release(self, deadline: float | None = None) -> None:
        """The guard: from here on the caller may write the saved tensors. On the CPU waits
        for the copy (until ``deadline``, default the save's; ``TimeoutError`` past it, the save
        then fails by its own deadline); with CUDA makes the current stream wait for the copy
        instead. Fails the save with :class:`StateChangedError` if a deferred tensor was written
        in place since ``save()``. Idempotent; never raises the save's failure (the handle,
        ``flush()`` and the next ``save()`` do)."""
        with self._lock:
            if self._released:
                return
        until = self.deadline if deadline is None else deadline
        if not self._copied.is_set():
            with self._lock:
                events = list(self._events)
            if events and _wait_on_stream(events):
                pass  # CUDA: the stream waits; the copy thread finishes the progress
            elif not self._copied.wait(max(0.0, until - time.monotonic())):
                raise TimeoutError(f"the deferred copy of step {self.step} did not finish in time")
        with self._lock:
            if self._released:
                return
            self._released = True
            watch, self._watch = self._watch, None
        with _hook_lock:
            _pending.discard(self)
        changed = tuple(n for n, (t, v) in (watch or {}).items() if t._version != v) if _CHECK_VERSIONS else ()
        del watch
        with self._lock:
            self._ok = not changed
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            msg = (
                f"tensor(s) {shown} were written in place after save() and before the copy finished "
                "(deferred staging: name them in copy_now=, or call wait_staged() before writing)"
            )
            failure = RankFailure(self.rank, "StateChangedError", msg)
            self.progress.fail(StateChangedError(self.step, with_global_ranks({self.rank: failure}, self.ranks),
                                                 keys=changed))  # fmt: skip
            return
        self._finish_if_ready()

    def release_if_owner(self) -> None:
        """:meth:`release`, when called on the thread that saved (a wait for the save's
        outcome there is its guard); else nothing."""
        if threading.get_ident() == self._owner:
            self.release()

    def _finish_if_ready(self) -> None:
        """Once copied and released unchanged: the whole shard is staged (its last byte goes out)."""
        with self._lock:
            ok = self._ok and not self._failed
        if ok and self._copied.is_set():
            self.progress.finish(self.blocked_s)


def snapshot(sources: Sequence[torch.Tensor], deferred: Sequence[int]) -> list[torch.Tensor]:
    """``sources`` with every tensor not in ``deferred`` replaced by a copy made now (on the
    tensor's device; with CUDA on the current stream, so it reads what was computed before
    ``save()``): the background copy then reads these snapshots, not the live tensors."""
    lazy = set(deferred)
    return [s if i in lazy else s.clone() for i, s in enumerate(sources)]


def _wait_on_stream(events: list[tuple[torch.device, Any]]) -> bool:
    """Make the current CUDA stream of each event's device wait for it (no host wait)."""
    try:
        for device, ev in events:
            torch.cuda.current_stream(device).wait_event(ev)
    except (RuntimeError, AttributeError):
        return False
    return True


def pending() -> int:
    """How many deferred copies of this process wait for a guard (an inspection seam)."""
    with _hook_lock:
        return len(_pending)


def release_all(copies: Iterable[DeferredCopy] | None = None, deadline: float | None = None) -> None:
    """Release ``copies`` (default: every deferred copy of this process not yet released)."""
    if copies is None:
        with _hook_lock:
            copies = list(_pending)
    for c in list(copies):
        c.release(deadline)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The process-wide optimizer step pre-hook: any optimizer's step is a first write."""
    if _pending:
        release_all()
    _stepped.add(optimizer)


def watch_optimizers() -> None:
    """Start noting which optimizers step (for :func:`stepped_optimizers`); installs the hook."""
    _install_hook()


def stepped_optimizers() -> tuple[torch.optim.Optimizer, ...]:
    """The live optimizers that stepped since :func:`watch_optimizers`: for an integration that
    sees the state dicts but not the optimizers (Lightning's ``CheckpointIO``). Every optimizer's
    step is guarded by the same hook, so deferring the tensors of all of them is as safe as
    deferring those of the ones named."""
    return tuple(_stepped)


def _install_hook() -> None:
    """Register :func:`_before_step` once per process (it costs a set lookup per step)."""
    global _hook
    with _hook_lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_before_step)
