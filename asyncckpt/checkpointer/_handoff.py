"""The hand-off of a staged save to the writer thread: its ``SaveJob`` (and the tiers it goes
to, decided here), its record and handle, and the callback that gives its staging slot back and
settles it, all in place before the job can start: an interrupt anywhere leaves the save either
tracked to its end or never run."""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from typing import Any

from .._info import CheckpointInfo
from ..format._lifecycle import SaveState
from ..format._safetensors import ShardLayout
from ..saving._arena import Arena
from ..saving._commit import run_save
from ..saving._frequency import Routes, TierClock
from ..saving._handle import SaveHandle, SaveRecord
from ..saving._savejob import SaveJob
from ..saving._stageprogress import StageProgress
from ..threads._writer import StartGate
from ._books import Books
from ._guard import guarded
from ._options import Options
from ._plan import Planner
from ._runtime import Runtime
from ._session import RootSession
from ._settle import Settling


class Handoff:
    """Hands the staged saves of one Checkpointer to its writer thread; each save's end goes to
    ``settling``, held weakly by the save's callback."""

    def __init__(
        self, opts: Options, session: RootSession, rt: Runtime, books: Books, planner: Planner, clock: TierClock,
        settling: Settling,
    ) -> None:  # fmt: skip
        self.opts = opts
        self.session = session
        self.rt = rt
        self.books = books
        self.planner = planner
        self.settling = settling
        #: which tiers each save goes to (``saving._frequency``): rank 0 decides, the start word carries it
        self.clock = clock
        self.routes = Routes(rt.backend, rt.memory_backend, opts.root, opts.memory, session.memory,
                             opts.keep_last if session.mirror is None else None)  # fmt: skip

    def submit(
        self,
        step: int,
        t_call: float,
        arena: Arena | None,
        layout: ShardLayout | None,
        tree_bytes: bytes,
        events: Any,
        waited: float,
        staging_s: float,
        prefailed: BaseException | None = None,
        handed: list[bool] | None = None,
        dtensors: list[dict[str, Any]] | None = None,
        tied: bool = False,
        progress: StageProgress | None = None,
        record_out: list[SaveRecord] | None = None,
        file: ShardLayout | None = None,
        plan_key: ShardLayout | None = None,
        prepared: tuple[float, float] = (0.0, 0.0),
        final: bool = False,
    ) -> SaveHandle:
        """Hand a staged save to the writer; the arena goes back to the pool when it settles.

        ``handed[0]`` turns True the moment the save's record owns the arena and the step.
        With ``progress``, the copy is still running and the writer waits on it;
        ``record_out`` receives the save's record as soon as it exists. ``prepared``: the
        walk's, plan's and tree JSON's wall and CPU seconds (``SaveStatistics.prepare_s``).
        ``final``: the SIGTERM handler's final save (its grace period runs).
        """
        with self.books.lock:
            self.books.seq += 1
            seq = self.books.seq
        rt = self.rt
        # the tiers (saving._frequency): rank 0 decides, by its clock at the save() call; the others
        # take its word at the save's start (a provisional route until then); by count, all agree
        leads = self.session.rank == 0
        tiers = self.clock.decide(seq, t_call, provisional=not leads, final=leads and final)
        job = SaveJob(
            step=step,
            seq=seq,
            root=self.opts.root,
            arena=arena,
            layout=layout,
            tree=tree_bytes,
            cuda_events=events,
            nbytes=(file or layout).data_len if layout is not None else 0,
            deadline=time.monotonic() + self.opts.timeout,
            started=t_call,
            wait_s=waited,
            staging_s=staging_s,
            keep_last=None,  # (the route's: tier mode, the mirror retires; the memory tier, its rounds)
            timeout=self.opts.timeout,
            prefailed=prefailed,
            failed_commits=self.books.failed_commits,
            dead=self.books.dead,
            retention_lock=self.rt.retention_lock,
            removals=self.rt.removals,
            by_commit_order=self.opts.allow_earlier_steps,
            ranks=self.session.ranks,
            dtensors=dtensors,
            dedupe=self.opts.dedupe,
            tied=tied,
            progress=progress,
            file=file,
            plan_hint=self.planner.plan_hint,
            plan_key=plan_key,
            run=self.session.run_id,
            prepared=prepared,
            route=self.routes.follow if self.clock.tiered and not leads else None,
        )
        backend = self.routes.apply(job, tiers)
        holder: list[SaveRecord] = []

        def on_state(state: SaveState) -> None:
            if holder:
                holder[0].state = state

        # the record and its callback exist before the job can start, so an interrupt anywhere
        # in here leaves the save either tracked to its end or never run; the slot goes back
        # exactly once, by whoever gets to it first (this call's caller or the settling)
        fut: concurrent.futures.Future[CheckpointInfo] = concurrent.futures.Future()
        record = SaveRecord(step, fut, reported=prefailed is not None)  # save() raised a prefailed one's error
        holder.append(record)
        me = weakref.ref(self.settling)
        gate = StartGate()
        ranks = self.session.ranks

        once = [True]

        def settled(f: concurrent.futures.Future[CheckpointInfo]) -> None:
            try:
                once.pop()  # atomic: runs once even if called from two places
            except IndexError:
                return
            if arena is not None:
                rt.staging.give_back(arena)
            ok = not f.cancelled() and f.exception() is None
            record.state = SaveState.COMMITTED if ok else SaveState.FAILED
            owner = me()
            if owner is not None:
                owner.settle(record, ok, job)

        def make() -> Any:
            return guarded(run_save(job, rt.storage, rt.coord, on_state, backend), job, rt.coord.rank, ranks)

        try:
            if handed is not None:
                handed[0] = True  # from here on the settling gives the slot back
            fut.add_done_callback(settled)
            with self.books.lock:
                self.books.records.append(record)
                if step in self.books.reserved:
                    self.books.reserved[step] = record
            # handed out only here, inside the guard: a caller that sees the record may wait
            # for its future, which from here on either runs or is cancelled below (an
            # interrupt earlier left no record to wait for: waiting would take the timeout)
            if record_out is not None:
                record_out.append(record)
            rt.writer.launch(make, fut, gate)
        except BaseException:
            if gate.abandon():
                # never started and never will: the caller hears the exception; settle the
                # record quietly (slot and step go back through ``settled``, attached or not)
                record.reported = True
                fut.cancel()
                fut.set_running_or_notify_cancel()  # CANCELLED -> notified: wait() sees it done
                if handed is None or handed[0]:
                    settled(fut)
                self.books.forget(record)  # a save that never ran is nobody's failure to report later
            raise
        return SaveHandle(record)
