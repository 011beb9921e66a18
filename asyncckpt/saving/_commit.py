"""The save protocol one rank runs on the writer thread, ending in an atomic commit.

Written once for every storage; what differs (directories and renames on a POSIX root, key
prefixes and a conditional create on an object store) is the ``_backend.Backend``'s. Order
of operations (``L`` = leader only; POSIX wording, the object store's in ``roots.objstore._backend``):

1. L: retire leftovers of earlier attempts of this step; create ``step_N.tmp-<attempt>/``
   (race-tolerant ``ensure_dir``), fsync the root so the attempt is findable after a crash;
   publish the attempt.
2. every rank: wait for the staging copy, write ``rankRRRRR.safetensors`` and
   ``rankRRRRR.json`` (exclusive create, checksummed while writing, fsynced), fsync the
   attempt directory, report the files (or the failure) to the leader.
3. L, only if every rank reported success in time: check the global index and the manifest
   with the very parsers ``load()`` uses (what a reader would refuse is never committed: the
   save fails, nothing is retired); write ``manifest.json`` to a temp name, fsync, rename into
   place, fsync the attempt directory, rename the attempt directory to ``step_N`` (the commit
   point), fsync the root. Publish the verdict.
4. every rank: resolve its handle with the verdict. On failure L removes its own files,
   the manifest, the index and the files of every rank whose I/O ended (``Report.settled``),
   then the directory once it is empty; a rank L could not count on (missing from the
   verdict) removes its own, on its own view of the root. Nobody touches the files of a rank
   whose write overran the deadline: it may be stuck in the kernel, and an unlink would wait
   with it (unkillable, holding the directory's lock); the next start removes them. L, on
   success: retention. Neither clean-up delays the outcome past the save's deadline: what
   is left then goes on in the background (``flush()`` and ``close()`` wait for it).

Every wait is bounded by the save's deadline, so each rank knows the outcome by then (the
``guarded`` margin in ``checkpointer._guard`` is a backstop for a rank whose own I/O hangs).

This module is the protocol's order; each phase's work has its own module: ``_rankfiles``
(step 2), ``_leadercommit`` (step 3's commit), ``_verdict`` (what a rank knows of the outcome,
and the outcome as the caller's error), ``_cleanup`` (step 4's removals and retention),
``_savestats`` (the committed save's statistics and log line).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .._errors import CoordinationLost, RankFailure
from .._info import CheckpointInfo
from ..format._lifecycle import SaveEvent, SaveState
from ..ranks._coordination import Coordinator, LeaderSilent, Report, Start, Verdict
from ..roots._backend import Backend, PhaseTimeout, PosixBackend
from ..roots.posix._storage import Storage
from ..threads._cpumeter import current_meter, thread_cpu
from ._cleanup import clean_up, drop, remove_failed_attempt
from ._leadercommit import commit_attempt
from ._rankfiles import run_dedupe_round, write_files
from ._savejob import SaveJob
from ._savestats import log_committed, save_statistics
from ._verdict import RankBook, leader_lost, verdict_error

T = TypeVar("T")


async def run_save(
    job: SaveJob,
    storage: Storage,
    coord: Coordinator,
    on_state: Callable[[SaveState], None] | None = None,
    backend: Backend | None = None,
) -> CheckpointInfo:
    """Run one save to its verdict on this rank; return the info or raise ``SaveError``.

    ``backend``: where the files go and how the step commits (default: the POSIX root
    ``job.root`` through ``storage``); ``storage``'s I/O pool runs the CPU work either way."""
    if backend is None:
        backend = PosixBackend(storage, job.root)
    # this task's context: the I/O calls of this save count to its meter (Storage.run)
    current_meter.set(job.meter)
    loop_cpu0 = thread_cpu()
    book = RankBook(job, coord.rank, on_state)
    dedupe = await _start_dedupe_round(storage, job, coord)

    # 1. the leader opens the attempt; every rank learns it, or the leader's failure
    start = await _open_attempt(backend, job, coord, book, dedupe)
    if job.route is not None and not book.leader and start.tiers is not None:
        backend = job.route(job, start.tiers) or backend  # rank 0's decision of the tiers, before a byte is written
    loc = backend.location(job.step, start.attempt)
    try:
        # 2. every rank writes its own files and reports them (or its failure) to the leader
        mine = await _write_own_files(backend, storage, job, coord, book, start, loc, dedupe)
        book.reports = await coord.report(job.step, job.seq, start.attempt, mine, job.deadline)
        if not book.leader:  # the node-local tier: a node's leader commits its node's part here
            await backend.follow(job, loc, start.attempt)

        # 3. the leader decides, and commits only if everyone succeeded in time
        verdict = await _decide(backend, job, coord, book, start, loc) if book.leader else None
        verdict = await coord.decide(job.step, job.seq, start.attempt, verdict, job.deadline)
    except (TimeoutError, CoordinationLost) as e:
        book.end_failed()
        if not book.committable or (isinstance(e, LeaderSilent) and e.aborted):
            await remove_failed_attempt(backend, job, loc, book.to_remove(counted=False), book.leader)
        raise leader_lost(job.step, e) from e

    # 4. every rank resolves its handle with the verdict
    if not verdict.committed:
        book.end_failed()
        counted = book.rank not in verdict.missing
        await remove_failed_attempt(backend, job, loc, book.to_remove(counted), book.leader)
        raise verdict_error(job.step, verdict, job.ranks, book.error) from book.error
    book.step_to(SaveEvent.COMMITTED)
    if book.leader:  # retention never fails a committed save (logged), nor makes its outcome late
        await clean_up(job, backend.retire(job), f"retention after step {job.step} failed")
    stats = save_statistics(job, verdict.nbytes, loop_cpu0)
    log_committed(job, stats, coord.rank, coord.world_size)
    return backend.info(
        job.step,
        nbytes=verdict.nbytes,
        world_size=coord.world_size,
        created=verdict.created,
        statistics=stats,
        run=job.run,
    )


async def _start_dedupe_round(
    storage: Storage, job: SaveJob, coord: Coordinator
) -> asyncio.Task[dict[str, int] | None] | None:
    """With dedupe over many ranks, the dedupe round, started now: hashing and the exchange
    need no attempt, so they overlap the leader's preparation. A rank whose state was refused
    at the call starts none and tells the others at once (they wait for every rank in it)."""
    if not job.dedupe or coord.world_size <= 1:
        return None
    if job.prefailed is None:
        return asyncio.ensure_future(run_dedupe_round(storage, job, coord))
    try:
        await coord.exchange(job.seq, "dedupe", None, job.deadline, wait=False)
    except (TimeoutError, CoordinationLost):
        pass
    return None


async def _open_attempt(
    backend: Backend,
    job: SaveJob,
    coord: Coordinator,
    book: RankBook,
    dedupe: asyncio.Task[dict[str, int] | None] | None,
) -> Start:
    """Step 1: the leader prepares a new attempt (its failure becomes a value every rank sees);
    every rank learns the attempt. A leader that never answers fails the save here, on every
    other rank, with ``leader_lost``'s ``SaveTimeoutError``; the dedupe round is dropped when
    the attempt will not be written."""
    start: Start | None = None
    if book.leader:
        attempt = uuid.uuid4().hex[:16]
        tiers = None if job.tiers is None else job.tiers.to_json()  # the other ranks take its route
        try:
            if job.prefailed is not None:
                raise job.prefailed
            await _within(backend.prepare(job, attempt), job.deadline, "creating the step directory")
            start = Start(attempt, tiers=tiers)
        except Exception as e:  # noqa: BLE001 - a failure becomes a value every rank sees
            start = Start(attempt, book.failed(e), tiers)
    try:
        start = await coord.begin(job.step, job.seq, start, job.deadline)
    except (TimeoutError, CoordinationLost) as e:
        await drop(dedupe)
        raise leader_lost(job.step, e) from e
    if start.failure is not None:
        await drop(dedupe)
    return start


async def _write_own_files(
    backend: Backend,
    storage: Storage,
    job: SaveJob,
    coord: Coordinator,
    book: RankBook,
    start: Start,
    loc: str,
    dedupe: asyncio.Task[dict[str, int] | None] | None,
) -> Report:
    """Step 2 on this rank: its files written and durable, within the deadline, as the report
    it sends the leader (its failure becomes a value every rank sees). Nothing is written when
    the attempt failed to open; a rank whose state was refused at the call reports that."""
    mine = Report(rank=book.rank)
    if start.failure is not None and start.failure.rank == book.rank and not book.leader:
        # its own start failed (it saves another step than rank 0): a report without files would
        # leave rank 0 to commit the others' files, so it reports why
        mine = Report(rank=book.rank, failure=start.failure)
    elif start.failure is None and job.prefailed is not None:
        mine = Report(rank=book.rank, failure=book.failed(job.prefailed))
    elif start.failure is None:
        if job.memory is not None:
            job.memory.begin(start.attempt)
        try:
            book.step_to(SaveEvent.START_WRITE)
            mine = await _within(
                write_files(backend, storage, job, book.rank, loc, book.leader, coord, dedupe),
                job.deadline,
                "writing the shard",
            )
            book.step_to(SaveEvent.FILES_DURABLE)
        except Exception as e:  # noqa: BLE001 - a failure becomes a value every rank sees
            mine = Report(rank=book.rank, failure=book.failed(e))
    book.committable = not book.leader and mine.failure is None and start.failure is None
    mine.settled = book.settled
    return mine


async def _decide(
    backend: Backend, job: SaveJob, coord: Coordinator, book: RankBook, start: Start, loc: str
) -> Verdict:
    """Step 3 on the leader: commit only if every rank reported success in time and no
    follower gave up waiting; else the failed verdict (missing ranks, each rank's failure),
    with the backend's hold on the attempt released."""
    rank, world = book.rank, coord.world_size
    failures = {r: rep.failure for r, rep in book.reports.items() if rep.failure is not None}
    if start.failure is not None:
        failures[rank] = start.failure
    missing = tuple(r for r in range(world) if r not in book.reports)
    if not failures and not missing and not await coord.may_commit(job.seq):
        failures[rank] = RankFailure(rank, "TimeoutError", "a follower gave up waiting before the commit began")
    if not failures and not missing:
        try:
            book.step_to(SaveEvent.START_COMMIT)
            book.committable = True
            return await _within(
                commit_attempt(backend, job, loc, start.attempt, world, book.reports), job.deadline, "committing"
            )
        except Exception as e:  # noqa: BLE001 - a failure becomes a value every rank sees
            failures[rank] = book.failed(e)
    verdict = Verdict(committed=False, failures=failures, missing=missing)
    await backend.release(job)
    return verdict


async def _within(aw: Awaitable[T], deadline: float, what: str) -> T:
    """``aw``'s result, or ``PhaseTimeout`` naming ``what`` once ``deadline`` passed."""
    remaining = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(aw, max(remaining, 0.001))
    except TimeoutError as e:
        if type(e) is not TimeoutError:  # a typed timeout from below (ObjectStoreTimeoutError): keep it
            raise
        raise PhaseTimeout(f"{what} did not finish before the save's deadline") from None
