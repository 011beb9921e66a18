"""The save pipeline: check and reserve the step, flatten and plan, take a staging slot,
copy (streaming to the writer while the copy runs), hand the job to the writer (``_handoff``),
whose end is booked by ``_settle``."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from ..format._layout import check_step
from ..format._safetensors import ShardLayout
from ..format._structure_encode import TensorRef, flatten, flatten_parts
from ..format._structure_json import tree_json
from ..format._structure_names import TensorFacts
from ..loading import _load_global
from ..roots import _runs
from ..saving import _deferred
from ..saving._arena import Arena
from ..saving._frequency import TierClock
from ..saving._handle import SaveHandle, SaveRecord
from ..saving._nodelocal import refuse_dtensors
from ..saving._stageprogress import StageProgress
from ._books import Books
from ._handoff import Handoff
from ._options import Options
from ._plan import Planner, spread_replica_writes
from ._runtime import MARGIN_S, Runtime
from ._session import RootSession
from ._settle import Settling


class SavePipeline:
    """The saves of one Checkpointer, from ``save()``'s call to their settling.

    Referenced only by its Checkpointer, and its parts (:class:`Handoff`, :class:`Settling`)
    only by it (the writer's callbacks hold the settling weakly): a dropped Checkpointer's saves
    finish, but nothing is booked or reported for them any more."""

    def __init__(self, opts: Options, session: RootSession, rt: Runtime, books: Books) -> None:
        self.opts = opts
        self.session = session
        self.rt = rt
        self.books = books
        self.planner = Planner(session.rank)
        # set only while the SIGTERM handler runs: its deadline, and whether it interrupted save()
        self.grace_end: float | None = None
        self.interrupted_save = False
        # which tiers each save goes to (``saving._frequency``): decided at the hand-off, told of failures
        clock = TierClock(opts.memory_every, opts.disk_every, opts.mirror_every,
                          split=rt.memory_backend is not None, memory=session.memory is not None)  # fmt: skip
        #: the end of each save (books, memory tier, mirror, ``on_commit``) and the uploads
        self.settling = Settling(opts, session, books, clock)
        self.handoff = Handoff(opts, session, rt, books, self.planner, clock, self.settling)

    def save(self, step: int, state: Any, t_call: float, lazy: Any = None) -> SaveHandle:
        """``Checkpointer.save``'s body, called with the collector paused (a method of its
        own: its temporaries die before the pause ends). ``lazy``: deferred staging's checked
        ``(until, copy_now)``, or None."""
        check_step(step)
        self.books.release_deferred()  # a save is a guard too: the last deferred copy completes first
        self.books.surface_earlier_failure(self.opts.on_error == "warn")
        self.reserve_step(step)
        # set by the hand-off once the save's record owns the slot and the step (its settling
        # frees both); until then an exception anywhere here gives them back
        handed = [False]
        arena: Arena | None = None
        try:
            try:
                c0, t0 = time.thread_time(), time.perf_counter()  # (SaveStatistics.prepare_s)
                found: list[tuple[str, Any, Any]] = []
                n_tied: list[int] = []
                aliases: dict[str, str] = {}
                facts: TensorFacts | None = TensorFacts(self.planner.shapes)  # (read by the walk: no pass of its own)
                tree, names, tensors = flatten_parts(
                    state, self.opts.strip_prefixes, dtensors=found, tied_out=n_tied, dtensor_aliases=aliases,
                    compact=True, facts=facts,
                )  # fmt: skip
                refuse_dtensors(bool(found), self.session.nodes is not None)  # a part that could not load
                if found and self.opts.dedupe and self.session.world_size > 1:
                    found, refs = spread_replica_writes(found, list(map(TensorRef, names, tensors)))
                    names, tensors, facts = [r.name for r in refs], [r.tensor for r in refs], None
                    del refs
                tree_bytes = tree_json(tree)
                del tree
                layout, perm, all_cpu = self.planner.plan_parts(names, tensors, facts)
                del facts
                dtensors = _load_global.describe_for_index(found, aliases, self.session.world_size) if found else None
                tied = n_tied[0] > 0
                plan_key, file = layout, None
                if self.opts.dedupe and self.session.world_size > 1:
                    layout, file, perm = self.planner.expected_file(layout, perm, dtensors)
                prepared = (time.perf_counter() - t0, time.thread_time() - c0)
            except (TypeError, ValueError) as e:
                if self.session.dist is not None:
                    # the other ranks are saving this step too: fail it for them, within the protocol
                    self.handoff.submit(step, t_call, None, None, b"", None, 0.0, 0.0, prefailed=e, handed=handed,
                                        final=self.grace_end is not None)  # fmt: skip
                raise
            arena, waited = self.acquire_slot(layout.file_size)
            sources = [tensors[i] for i in perm]
            del tensors
            deferred = _deferred.split([names[i] for i in perm], sources, *lazy) if lazy else None
            if deferred:
                return self._stage_deferred(step, t_call, arena, layout, tree_bytes, sources, waited, deferred,
                                            [names[i] for i in perm], dtensors=dtensors, tied=tied,
                                            handed=handed, file=file, plan_key=plan_key, prepared=prepared)  # fmt: skip
            del names  # (the layout keeps its own: these died with the tree, but for this list)
            if all_cpu:
                return self._stage_streaming(step, t_call, arena, layout, tree_bytes, sources, waited,
                                             dtensors=dtensors, tied=tied, handed=handed, file=file,
                                             plan_key=plan_key, prepared=prepared)  # fmt: skip
            events = self.rt.copier.stage(arena, layout, sources, all_cpu=False)
            # everything save() did but wait for a slot: flatten, plan, allocation, copy
            staging_s = time.perf_counter() - t_call - waited
            return self.handoff.submit(
                step, t_call, arena, layout, tree_bytes, events, waited, staging_s,
                dtensors=dtensors, tied=tied, handed=handed, file=file, plan_key=plan_key, prepared=prepared,
                final=self.grace_end is not None,
            )  # fmt: skip
        finally:
            if not handed[0] and arena is not None:
                self.rt.staging.give_back(arena)
            with self.books.lock:  # still unregistered (no record took it): free the step
                if self.books.reserved.get(step, 0) is None:
                    del self.books.reserved[step]

    def reserve_buffers(self, state: Any) -> None:
        """``Checkpointer.reserve``: plan ``state``'s layout and fill the free slots with
        buffers big enough for it (pinned for CUDA tensors)."""
        import torch  # loaded already by staging; imported here to keep this module's imports torch-free

        _, refs = flatten(state, self.opts.strip_prefixes, dtensors=[])
        layout, _, all_cpu = self.planner.plan(refs)
        pin = not all_cpu and torch.cuda.is_available() and any(r.tensor.device.type == "cuda" for r in refs)
        self.rt.staging.reserve(layout.file_size, pin)

    def _stage_streaming(
        self,
        step: int,
        t_call: float,
        arena: Arena,
        layout: ShardLayout,
        tree_bytes: bytes,
        sources: list[Any],
        waited: float,
        *,
        dtensors: list[dict[str, Any]] | None,
        tied: bool,
        handed: list[bool],
        file: ShardLayout | None,
        plan_key: ShardLayout,
        prepared: tuple[float, float],
    ) -> SaveHandle:
        """Hand the save to the writer first, then copy: the writer streams the staged prefix
        of the arena while the rest is copied. Returns once everything is staged. A failed (or
        interrupted) copy: the writer gives the save up (nothing committed), this call waits for
        that (slot and step free again) and re-raises; nobody reports that save later."""
        progress = StageProgress(layout.file_size)
        got: list[SaveRecord] = []
        try:
            handle = self.handoff.submit(
                step, t_call, arena, layout, tree_bytes, None, waited, 0.0,
                dtensors=dtensors, tied=tied, handed=handed, progress=progress, record_out=got,
                file=file, plan_key=plan_key, prepared=prepared, final=self.grace_end is not None,
            )  # fmt: skip
            self.books.staging_record = got[0]
            self.rt.copier.stage(arena, layout, sources, progress, all_cpu=True)
            # everything save() did but wait for a slot: flatten, plan, allocation, copy
            progress.finish(time.perf_counter() - t_call - waited)
            return handle
        except BaseException as e:
            if progress.finished:
                raise  # interrupted after the copy completed: the save goes on, as any staged one
            progress.fail(e)
            if got:
                self._forget_unstaged(got[0])
            raise
        finally:
            self.books.staging_record = None

    def _stage_deferred(
        self, step: int, t_call: float, arena: Arena, layout: ShardLayout, tree_bytes: bytes, sources: list[Any],
        waited: float, deferred: list[int], names: list[str], **submit: Any,
    ) -> SaveHandle:
        """Deferred staging (``save(until=)``, ``saving/_deferred.py``): copy what may change
        before the optimizer step now, hand the save to the writer, start the copy of the rest
        in the background and return. A failure before the copy started gives the slot and
        the step back and raises, as :meth:`_stage_streaming`."""
        progress = StageProgress(layout.file_size)
        got: list[SaveRecord] = []
        try:
            sources = _deferred.snapshot(sources, deferred)
            copy = _deferred.DeferredCopy(
                step, self.session.rank, self.session.ranks, progress, {names[i]: sources[i] for i in deferred},
                time.perf_counter() - t_call - waited, time.monotonic() + self.opts.timeout,
            )  # fmt: skip
            handle = self.handoff.submit(step, t_call, arena, layout, tree_bytes, None, waited, 0.0, progress=progress,
                                         record_out=got, final=self.grace_end is not None, **submit)  # fmt: skip
            got[0].before_wait = copy.release_if_owner
            self.books.hold_deferred(copy)
            copy.start(self.rt.copier, arena, layout, sources)
            return handle
        except BaseException as e:
            progress.fail(e)
            if got:
                self._forget_unstaged(got[0])
            raise

    def _forget_unstaged(self, record: SaveRecord) -> None:
        """A save whose copy failed: wait (bounded) until the writer gave it up, then drop it
        from the books, so flush()/close() and the next save() never report it."""
        record.reported = True
        record.silent = True
        try:
            concurrent.futures.wait([record.future], min(self.opts.timeout, 60.0) + MARGIN_S)
        finally:
            self.books.forget(record)

    def reserve_step(self, step: int) -> None:
        """Check ``step`` may be saved and reserve it, in one step under the lock, so two
        threads saving the same step cannot both pass: the second raises ``ValueError``.

        A committed step at or above ``step`` that is no longer resumable (known bad: a load
        fell back past it, or a verification failed; or gone) does not count: it is looked up
        (collective: rank 0 decides) only then, so a save of a new, higher step costs nothing."""
        with self.books.lock:
            self.books.settle_reserved()
            later = not self.opts.allow_earlier_steps
            blockers = sorted(s for s in self.books.committed if s == step or (s > step and later))
            generation = self.books.commits
        if self.session.mirror is not None and not self.session.store_known:
            self.session.look_at_store_again()
        # a step in the memory tier only (disk_every) is not on the disk rank 0 looks at: it blocks
        looked = [s for s in blockers if s not in self.settling.memory_only]
        if looked:  # (collective: every rank has the same books, so every rank asks, or none)
            gone = self.session.not_resumable(looked)
            with self.books.lock:
                if self.books.commits == generation:  # else a save committed meanwhile (of that very step?): keep all
                    self.books.committed.difference_update(gone)
        with self.books.lock:
            self.books.settle_reserved()
            if step in self.books.committed:
                raise ValueError(f"step {step} is already committed under {self.opts.root}")
            if step in self.books.reserved:
                raise ValueError(f"step {step} is already being saved")
            if not self.opts.allow_earlier_steps:
                newest = max(self.books.committed, default=None)
                if newest is not None and step < newest:
                    raise ValueError(
                        f"step {step} is lower than step {newest}, the newest committed checkpoint under "
                        f"{self.opts.root}: steps must increase (keep_last and latest() go by step); pass "
                        "allow_earlier_steps=True to save earlier steps anyway"
                    )
                pending = max(self.books.reserved, default=None)
                if pending is not None and step < pending:
                    raise ValueError(
                        f"step {step} is lower than step {pending}, which is being saved: steps must "
                        "increase; pass allow_earlier_steps=True to save earlier steps anyway"
                    )
            if self.session.mirror is not None:  # tier mode: the store's steps count too (as found at construction)
                _runs.check_store_step(step, self.session.store_newest, self.session.mirror.url, self.session.run_id,
                                       self.opts.allow_earlier_steps)
            self.books.reserved[step] = None

    def acquire_slot(self, nbytes: int) -> tuple[Arena, float]:
        """A staging arena for the next save: wait for a slot, bounded by the save timeout, or
        by the grace period inside the SIGTERM handler. A final save that interrupted another
        save() on this thread cannot wait for the slot that save holds: it stages into a spare
        buffer instead (freed when it settles)."""
        grace_end = self.grace_end
        if grace_end is None:
            return self.rt.staging.acquire(nbytes, self.opts.timeout + MARGIN_S)
        if self.interrupted_save:
            try:
                return self.rt.staging.acquire(nbytes, 0.0)
            except TimeoutError:
                return self.rt.staging.spare(nbytes), 0.0
        left = max(0.0, grace_end - time.monotonic())
        return self.rt.staging.acquire(nbytes, min(self.opts.timeout + MARGIN_S, left))
