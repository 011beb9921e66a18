"""The runtime of one Checkpointer (its threads, pools and root claim), its totals, and the
exit hook that finishes what a process left pending and makes an unseen failure exit non-zero."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._info import CheckpointerStatistics, CheckpointInfo, SaveStatistics
from ..ranks._coordination import Coordinator
from ..roots._backend import Backend
from ..roots.posix._osops import OsOps
from ..roots.posix._ownership import Ownership
from ..roots.posix._storage import Storage
from ..saving._memtier import MemoryCopies
from ..saving._mirror import Mirror
from ..saving._stagecopy import StagingCopier
from ..saving._stagingpool import StagingPool
from ..threads._cpumeter import current_meter, metered
from ..threads._iopool import IOPool
from ..threads._writer import WriterThread

if TYPE_CHECKING:
    from ..roots.objstore._lease import Lease

#: Extra time past the save deadline before a waiter gives up on the writer itself.
MARGIN_S = 5.0


class Runtime:
    """The threads and resources of one Checkpointer; holds no reference back to it."""

    def __init__(
        self, io_threads: int, ops: OsOps, direct_io: str, max_pending: int, coord: Coordinator, huge_pages: bool
    ) -> None:
        # plain attributes first, threads last, each thread stopped again if anything after
        # it fails: no thread may outlive a construction that failed (even by Ctrl-C)
        self.coord = coord
        self.stopped = False
        self.pid = os.getpid()
        self.ownership: Ownership | None = None
        self.lease: Lease | None = None  # an object-store root's (rank 0): released like ownership
        self.mirror: Mirror | None = None  # tier mode (mirror=): stopped before the writer
        self.memory: MemoryCopies | None = None  # the memory tier's rounds: stopped before the writer
        self.backend: Backend | None = None  # where saves go (POSIX root or object store)
        #: node-local with ``disk_every``: where the saves not due for the disks commit (the memory tier)
        self.memory_backend: Backend | None = None
        # one per writer loop: overlapping saves apply retention one at a time
        self.retention_lock = asyncio.Lock()
        # retired checkpoints whose files are still being removed (tasks on the writer loop)
        self.removals: set[asyncio.Task[None]] = set()
        self.staging = StagingPool(max_pending, huge_pages)
        self.copier = StagingCopier()  # starts its helper thread at the first copy that needs it
        # many ranks: the coordinator's blocking store calls (waits for the other ranks among
        # them) run here, never on an I/O thread the save's writes and checksums need meanwhile
        self.coord_pool: IOPool | None = None
        # each pool is registered in the statement that starts it: an interrupt between two
        # lines leaves none running outside the list the except below stops
        pools: list[IOPool] = []
        try:
            pools.append(IOPool(io_threads, "asyncckpt-io"))
            # checksums of staged bytes (Storage.compute) and the dedupe round's hashes
            # (Storage.digest), each on a thread of its own
            pools.append(IOPool(1, "asyncckpt-crc"))
            pools.append(IOPool(1, "asyncckpt-hash"))
            self.pool, self.compute_pool, self.digest_pool = pools
            self.storage = Storage(self.pool, ops, direct_io, self.compute_pool, self.digest_pool)
            self.writer = WriterThread()
        except BaseException:
            for p in pools:
                p.shutdown(wait=True, timeout=10.0)
            raise

    @property
    def forked(self) -> bool:
        """True in a child forked from the process that built this runtime: its threads are
        not there, so nothing may wait on them and nothing may be written from here."""
        return os.getpid() != self.pid

    def stop(self, timeout: float, *, collective: bool = True) -> None:
        """Say goodbye to the other ranks (``collective``, bounded by ``timeout``), then stop
        the writer (cancelling what still runs) and the I/O threads. Every wait is bounded."""
        if self.stopped:
            return
        self.stopped = True
        if self.forked:
            return  # the threads live in the parent; the child has nothing to stop
        deadline = time.monotonic() + timeout
        try:
            if collective and not self.writer.in_writer():
                fut = self.writer.submit(self.coord.close(deadline))
                fut.result(max(0.0, deadline - time.monotonic()) + MARGIN_S)
        except Exception:  # noqa: BLE001 - peers gone or coordination dead: still stop locally
            pass
        finally:
            try:
                if self.mirror is not None:
                    self.mirror.stop(timeout=10.0)
                if self.memory is not None:
                    self.memory.stop(timeout=10.0)
                shutdown = getattr(self.coord, "shutdown", None)
                if shutdown is not None:
                    shutdown()
                self.writer.stop(timeout=10.0)
                self.pool.shutdown(wait=True, timeout=10.0)
                self.compute_pool.shutdown(wait=True, timeout=10.0)
                self.digest_pool.shutdown(wait=True, timeout=10.0)
                if self.coord_pool is not None:
                    self.coord_pool.shutdown(wait=True, timeout=10.0)
            finally:
                self.staging.close()
                self.copier.close()
                if self.ownership is not None:
                    self.ownership.release()  # the writer is gone: the root is free for the next job
                if self.lease is not None:
                    self.lease.release()

    def removals_future(self) -> concurrent.futures.Future[None] | None:
        """A future that settles once the retired checkpoints' files being removed now are
        removed (``None`` if none is): retention leaves that removal running after the save."""
        if not self.removals or self.stopped or self.forked:
            return None
        try:
            return self.writer.submit(until_removed(self.removals))
        except RuntimeError:  # writer stopped meanwhile
            return None

    async def run_coordination(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the coordination threads (the coordinator's ``run``); its CPU time
        counts to the current save's meter, as the I/O threads' does (``Storage.run``)."""
        assert self.coord_pool is not None
        meter = current_meter.get()
        if meter is not None:
            fn = metered(fn, meter)
        return await asyncio.get_running_loop().run_in_executor(self.coord_pool, fn, *args)

    def stop_when_idle(self, futures: list[concurrent.futures.Future[Any]], timeout: float) -> None:
        """Stop once ``futures`` settled and the removals of the steps their retention retired
        finished, each wait bounded by ``timeout`` (a dropped Checkpointer).

        With nothing pending this happens here, before the call returns, so the root is free
        when the drop is over; with saves pending, or on one of this runtime's own threads
        (which cannot join themselves), from a thread of its own."""

        def wait_then_stop() -> None:
            end = time.monotonic() + timeout
            concurrent.futures.wait(futures, timeout)
            removing = self.removals_future()  # the files of the steps their retention retired
            if removing is not None:
                concurrent.futures.wait([removing], max(0.0, end - time.monotonic()))
            self.stop(timeout=MARGIN_S)

        if not futures and not on_library_thread():
            wait_then_stop()
            return
        try:
            threading.Thread(target=wait_then_stop, name="asyncckpt-reaper", daemon=True).start()
        except RuntimeError:  # no new threads at interpreter shutdown: the exit hook stops it
            pass


    def refuse_if_forked(self) -> None:
        """Raise ``RuntimeError`` in a forked child: the writer thread did not survive the fork."""
        if self.forked:
            raise RuntimeError(
                f"this Checkpointer belongs to process {self.pid}; a forked child cannot save or "
                "wait with it (its writer thread did not survive the fork): build a new one in the child"
            )

    def refuse_in_writer(self) -> None:
        """Raise ``RuntimeError`` on the writer thread, where a blocking call would deadlock."""
        if self.writer.in_writer():
            raise RuntimeError("asyncckpt: blocking call from the writer thread would deadlock")


def on_library_thread() -> bool:
    """Whether this is one of the threads a runtime starts (all named ``asyncckpt-*``): the
    writer, I/O and coordination pools, the mirror's, the lease's, the heartbeat."""
    return threading.current_thread().name.startswith("asyncckpt-")


async def until_removed(tasks: set[asyncio.Task[None]]) -> None:
    """On the writer loop: wait until the removals of retired checkpoints running now (in
    ``tasks``) are done, never cancelling them. Removals that saves add meanwhile are not
    waited for: with another thread saving on, the set may never be empty."""
    running = list(tasks)
    if running:
        await asyncio.wait(running)


class Totals:
    """Running totals behind :meth:`Checkpointer.statistics` (guarded by the owner's lock)."""

    def __init__(self) -> None:
        self.committed = 0
        self.failed = 0
        self.nbytes = 0
        self.sums = dict.fromkeys(
            ("blocking_s", "wait_s", "staging_s", "write_s", "fsync_s", "commit_s", "total_s", "writer_cpu_s"), 0.0
        )
        self.last: SaveStatistics | None = None

    def add(self, info: CheckpointInfo | None) -> None:
        if info is None or info.statistics is None:
            self.failed += info is None
            return
        st = info.statistics
        self.committed += 1
        self.nbytes += st.nbytes
        for k in self.sums:
            self.sums[k] += getattr(st, k)
        self.last = st

    def snapshot(self) -> CheckpointerStatistics:
        return CheckpointerStatistics(self.committed, self.failed, self.nbytes, **self.sums, last=self.last)


def describe(exc: BaseException | None) -> str:
    """``str(exc)``, never empty (a bare ``KeyboardInterrupt()`` or ``CancelledError()``)."""
    if exc is None:
        return "no error"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class AtExit(Protocol):
    """What the exit hook asks of each live Checkpointer (its :class:`~._waits.Waits`)."""

    def finish_at_exit(self) -> tuple[list[str], bool]:
        """Finish pending work (bounded), stop; return the lines of failures nobody saw and
        whether an object store's runtime must settle before the interpreter goes."""
        ...


_live: weakref.WeakSet[AtExit] = weakref.WeakSet()


def keep_until_exit(job: AtExit) -> None:
    """Have the exit hook finish ``job`` (held weakly: a dropped Checkpointer leaves)."""
    _live.add(job)


def forget_at_exit(job: AtExit) -> None:
    """Take ``job`` back from the exit hook (a construction that failed)."""
    _live.discard(job)


def exit_hook() -> None:
    """At exit: finish pending saves (bounded), print unseen failures, exit non-zero if any."""
    unseen: list[str] = []
    settle = False
    for job in list(_live):
        lines, needs_settle = job.finish_at_exit()
        unseen.extend(lines)
        settle = settle or needs_settle
    if settle:
        from ..roots.objstore._forkguard import let_runtime_settle

        let_runtime_settle()
    if unseen:
        for line in unseen:
            print(line, file=sys.stderr)
        print("asyncckpt: exiting with status 1 because a checkpoint save failed unseen", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(exit_hook)


def dropped(ck: Any) -> None:
    """A Checkpointer ``ck`` garbage-collected (``__del__``) before ``close()``, or whose
    construction failed part way: warn when saves are pending (they finish in the background,
    then its root is released); nothing pending: its runtime is stopped (and the root
    released) before the drop returns."""
    rt: Runtime | None = getattr(ck, "_rt", None)
    waits = getattr(ck, "_waits", None)
    if rt is None or waits is None or waits.closed or rt.stopped or rt.forked:
        return
    root, timeout = ck.root, ck.timeout
    # no lock: a collection may run this on a thread that holds it (or while another does)
    pending = [r.future for r in list(ck._books.records) if not r.future.done()]
    if pending:
        warnings.warn(
            f"asyncckpt Checkpointer({root!r}) garbage-collected with {len(pending)} "
            "pending save(s): they finish in the background, then its root is released; "
            "call flush()/close() before dropping it",
            RuntimeWarning,
            stacklevel=3,
        )
    rt.stop_when_idle(pending, timeout + MARGIN_S)
