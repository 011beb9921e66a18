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
``guarded`` margin in ``checkpointer._pipeline`` is a backstop for a rank whose own I/O hangs).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._errors import (
    CoordinationLost,
    RankFailure,
    SaveError,
    SaveTimeoutError,
    StateChangedError,
    describe_ranks,
    with_global_ranks,
)
from .._info import CheckpointInfo, SaveStatistics
from ..format import _index, _manifest
from ..format._lifecycle import SaveEvent, SaveState, advance
from ..format._safetensors import ShardLayout
from ..ranks._coordination import Coordinator, LeaderSilent, Report, Start, Verdict
from ..roots._backend import Backend, PhaseTimeout, PosixBackend
from ..roots.posix._storage import CpuMeter, Storage, current_meter, thread_cpu, until_staged
from . import _committable, _dedupe
from ._staging import Arena, StageProgress

log = logging.getLogger("asyncckpt")
T = TypeVar("T")
#: Test-only switch: False commits without first checking the manifest and the global index
#: with the readers' parsers (tests/test_acceptance.py shows what then commits).
_CHECK_BEFORE_COMMIT = True

#: How long past the save's deadline a clean-up after the verdict (a failed attempt's removal,
#: retention) may delay the outcome; then it goes on in the background.
CLEANUP_WAIT_S = 0.5
# clean-ups going on in the background for saves that have no ``removals`` set to track them
_untracked: set[asyncio.Task[None]] = set()


@dataclass
class SaveJob:
    """Everything the writer needs for one save; built by ``save()`` on the caller thread."""

    step: int
    seq: int
    root: str
    arena: Arena | None
    layout: ShardLayout | None
    tree: bytes
    cuda_events: Any
    nbytes: int
    deadline: float  # time.monotonic() by which the outcome must be known
    started: float  # time.perf_counter() at the call to save()
    wait_s: float
    staging_s: float
    keep_last: int | None
    timeout: float = 0.0
    state: SaveState = SaveState.STAGED
    times: dict[str, float] = field(default_factory=dict)
    direct: bool = False
    # set when this rank's state was refused at the call: the rank still takes part, as a failure
    prefailed: BaseException | None = None
    # attempts whose commit rename happened but whose save failed and could not be taken back
    # (shared by the Checkpointer's saves): a retry of that step may replace them
    failed_commits: set[str] = field(default_factory=set)
    # names of directories under the root known dead (shared by the Checkpointer's saves):
    # its own failed attempts and retirements, and the leftovers present when it took the
    # root; only these may be removed before a save of their step
    dead: set[str] = field(default_factory=set)
    # one per writer loop: overlapping saves apply retention one at a time
    retention_lock: asyncio.Lock | None = None
    # one per writer loop: removals of retired checkpoints still running (flush() waits)
    removals: set[asyncio.Task[None]] | None = None
    # retention keeps the latest committed rather than the highest steps
    by_commit_order: bool = False
    # global ranks of the writing group, in group-rank order (recorded in the manifest)
    ranks: tuple[int, ...] | None = None
    # the DTensors this rank holds (``_index.rank_part``'s descriptions); None: none
    dtensors: list[dict[str, Any]] | None = None
    # write plain tensors identical on every rank once (``_dedupe``; many ranks only)
    dedupe: bool = False
    # the state names a tensor twice (tied weights): readers of asyncckpt/1 cannot read it
    tied: bool = False
    # set when save() stages while the writer streams: how far the copy got (its staging_s
    # is the one reported then)
    progress: StageProgress | None = None
    # CPU seconds of the I/O threads' calls for this save
    meter: CpuMeter = field(default_factory=CpuMeter)
    # with dedupe: the file this rank writes before its dedupe round ends, whatever the round
    # decides, a prefix of the arena (``layout`` itself, or the slots the previous round of
    # this structure gave the rank, laid out first); None: the round decides first
    file: ShardLayout | None = None
    # the Checkpointer's record of its last dedupe plan, and the key (the state's layout, one
    # object per structure) this save's plan is recorded under
    plan_hint: _dedupe.PlanHint | None = None
    plan_key: Any = None
    # the run the step belongs to (``_runs``), recorded in the manifest; None: none recorded
    run: str | None = None

    def advance(self, event: SaveEvent) -> None:
        self.state = advance(self.state, event)


async def _within(aw: Awaitable[T], deadline: float, what: str) -> T:
    remaining = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(aw, max(remaining, 0.001))
    except TimeoutError as e:
        if type(e) is not TimeoutError:  # a typed timeout from below (ObjectStoreTimeoutError): keep it
            raise
        raise PhaseTimeout(f"{what} did not finish before the save's deadline") from None


async def _device_copies(storage: Storage, job: SaveJob) -> None:
    """Wait (on the I/O pool) until the device-to-host copies of a CUDA state into the arena
    have run, and note when that was (``SaveStatistics.device_copy_s``)."""
    if not job.cuda_events or "device_copy" in job.times:
        return
    for ev in job.cuda_events:
        await storage.run(ev.synchronize)
    job.times["device_copy"] = time.perf_counter() - job.started


async def _dedupe_round(storage: Storage, job: SaveJob, coord: Coordinator) -> dict[str, int] | None:
    """Hash this rank's plain tensors and agree with every rank on who writes which
    (``_dedupe``); ``None`` when a peer failed before the round (its failure fails the save).
    Independent of the attempt: ``run_save`` starts it before ``begin`` so it overlaps the
    leader's preparation of the attempt directory."""
    assert job.arena is not None and job.layout is not None
    skip = _dedupe_skip(job)
    try:
        await _device_copies(storage, job)
        records: dict[str, Any] = {}
        # hashed as the copy goes: each batch once its bytes are staged (waiting on the loop,
        # not on the I/O pool), so the digests are ready about when the staging is
        data_start = job.layout.data_start
        for batch in _dedupe.batches(job.layout.slots, skip):
            await until_staged(job.progress, data_start + batch[-1].end, job.deadline)
            records.update(await storage.digest(_dedupe.digests, job.arena.buffer, data_start, batch, skip))
        meshes = _dedupe.mesh_digests(job.dtensors or [])
    except BaseException:
        await coord.exchange(job.seq, "dedupe", None, job.deadline, wait=False)
        raise
    fixed = _dedupe.fixed(job.dtensors)
    base = sum(s.end - s.begin for s in job.layout.slots if s.name in fixed)
    value = {"records": records, "base": base, "meshes": meshes, "boxes": _dedupe.twin_boxes(job.dtensors)}
    got = await coord.exchange(job.seq, "dedupe", value, job.deadline)
    if any(v is None for v in got.values()):
        return None
    _dedupe.check_meshes({r: v["meshes"] for r, v in got.items()})
    return _dedupe.plan(
        {r: v["records"] for r, v in got.items()}, {r: v["base"] for r, v in got.items()}, coord.world_size,
        boxes={r: v["boxes"] for r, v in got.items()}, rank=coord.rank,
    )  # fmt: skip


async def _write_files(
    backend: Backend,
    storage: Storage,
    job: SaveJob,
    rank: int,
    loc: str,
    leader: bool,
    coord: Coordinator | None = None,
    dedupe_round: asyncio.Task[dict[str, int] | None] | None = None,
) -> Report:
    assert job.arena is not None and job.layout is not None
    dedupe = job.dedupe and coord is not None and coord.world_size > 1
    buffer, layout = job.arena.buffer, job.layout
    # with dedupe, the file this rank writes before the round ends, whatever it decides: save()
    # chose it (SaveJob.file); it streams while the staging and the round run
    early = job.file if dedupe and dedupe_round is not None else None
    if early is not None:
        layout = early
    if not leader and (early is not None or not dedupe):
        await backend.join(job, loc)
    if job.cuda_events and (early is not None or not dedupe):  # else the dedupe round waits for them itself
        await _device_copies(storage, job)
    writers: dict[str, int] | None = None
    image_progress: StageProgress | None = None
    fill: asyncio.Future[None] | None = None
    if dedupe and early is None:
        assert coord is not None
        writers = await (dedupe_round if dedupe_round is not None else _dedupe_round(storage, job, coord))
        if writers is None:
            return Report(rank=rank)  # a peer failed: nothing to write, its report fails the save
        _remember_plan(job, writers)
        if not leader:  # after the round: a failure here cannot leave the others waiting in it
            await backend.join(job, loc)
        keep = _dedupe.kept(layout.slots, writers, rank)
        if len(keep) < len(layout.slots):
            if _dedupe.worth_an_image(layout.slots, keep, job.dtensors):
                # the image is copied from the staged arena (the round waited only for what it
                # hashed, not for the DTensor boxes), on the I/O pool while the write streams it
                await until_staged(job.progress, job.layout.file_size, job.deadline)
                out, new = await storage.run(_dedupe.image_buffer, layout, keep, job.arena)
                image_progress = StageProgress(new.file_size)
                fill = asyncio.ensure_future(
                    storage.run(_dedupe.fill_image, out, new, buffer, layout, image_progress)
                )
                buffer, layout = out, new
            else:  # a few small copies: writing them beats copying the whole shard to drop them
                writers = _dedupe.own_copies(writers, layout.slots, rank)
    # the arena, or the deduplicated image, may still be being copied into
    staged = job.progress if buffer is job.arena.buffer else image_progress
    # the index part's checksums run beside the write (they read what it writes, once staged);
    # an early file's part gets the round's writers once it ends
    part_task = (
        asyncio.ensure_future(_index_part(storage, job, buffer, layout, rank, staged, writers))
        if job.dtensors is not None or writers or early is not None
        else None
    )
    shard_name = _manifest.shard_name(rank)
    write_s = 0.0
    try:
        if fill is not None:  # let it reach the pool first: the write's pieces wait for it there
            await asyncio.sleep(0)
        shard = await backend.write_shard(job, loc, shard_name, buffer, layout.file_size, staged)
        tree = await backend.write_small(job, loc, _manifest.tree_name(rank), job.tree)
        t0 = time.perf_counter()
        await backend.seal(job, loc)
        seal_s = time.perf_counter() - t0
        if early is not None:
            assert dedupe_round is not None
            writers = await dedupe_round
            if writers is None:
                return Report(rank=rank)  # a peer failed: its report fails the save
            _remember_plan(job, writers)
            keep = _dedupe.kept(job.layout.slots, writers, rank)
            lacking = _dedupe.missing(keep, layout.slots)
            if lacking:
                # the round gave this rank a tensor its early file lacks (one the plan it expected
                # has another rank write is no longer identical on every rank): write the file
                # again, holding what the round gives it
                log.debug(
                    "rank %d: step %d: the dedupe round gave this rank %d tensor(s) its file lacks (%s): "
                    "writing it again", rank, job.step, len(lacking), ", ".join(lacking[:3]),
                )  # fmt: skip
                await _drop(part_task)
                part_task = None
                await until_staged(job.progress, job.layout.file_size, job.deadline)
                buffer, layout = await storage.run(_dedupe.image, job.arena.buffer, job.layout, keep, job.arena)
                write_s += shard.write_s
                await backend.discard(job, loc, shard_name)
                shard = await backend.write_shard(job, loc, shard_name, buffer, layout.file_size, None)
                t0 = time.perf_counter()
                await backend.seal(job, loc)
                seal_s += time.perf_counter() - t0
            else:
                writers = _dedupe.own_copies(writers, layout.slots, rank)
        part = await part_task if part_task is not None else None
        if part is None and writers:  # no DTensors: only the round named plain tensors to index
            part = await _index_part(storage, job, buffer, layout, rank, None, writers)
        elif part is not None:
            if job.dtensors is None and not writers:
                part = None  # nothing was deduplicated: no index (the step keeps the plain format)
            else:
                part["writers"] = dict(writers or {})
    finally:
        await _drop(part_task)
        if fill is not None:  # never cancelled: the image buffer is reused once this save settles
            await asyncio.gather(fill, return_exceptions=True)
        if early is not None and dedupe_round is not None:
            # not cancelled: the other ranks wait in the round for this rank's value
            dedupe_round.add_done_callback(_consume)
    job.times["write"] = write_s + shard.write_s + tree.write_s
    job.times["fsync"] = shard.fsync_s + tree.fsync_s + seal_s
    job.direct = shard.direct
    files = [
        {"name": shard_name, "size": shard.size, "crc32c": shard.crc32c, "rank": rank},
        {"name": _manifest.tree_name(rank), "size": tree.size, "crc32c": tree.crc32c, "rank": rank},
    ]
    return Report(rank=rank, files=files, nbytes=layout.data_len, index=part, needs_v2=job.tied)


def _remember_plan(job: SaveJob, writers: dict[str, int]) -> None:
    """Record the round's plan for the next save of this structure (``_dedupe.PlanHint``)."""
    if job.plan_hint is not None:
        job.plan_hint.record(job.plan_key, writers)


def _dedupe_skip(job: SaveJob) -> set[str]:
    """The slots the dedupe round does not hash: DTensor boxes this rank writes (never replicated
    plain tensors; a replicated box's writer is already chosen by the mesh)."""
    return {d["name"] for d in job.dtensors or () if d["writer"]}


async def _index_part(
    storage: Storage,
    job: SaveJob,
    buffer: memoryview,
    layout: ShardLayout,
    rank: int,
    staged: StageProgress | None,
    writers: dict[str, int] | None,
) -> dict[str, Any]:
    """This rank's index part (per-chunk CRCs of ``buffer``) once the file ``layout`` describes
    is staged in it (the arena may hold more after it), on the compute thread."""
    await until_staged(staged, layout.file_size, job.deadline)
    name, dtensors = _manifest.shard_name(rank), job.dtensors or []
    return await storage.compute(_index.rank_part, buffer, layout.data_start, layout.slots, dtensors, name, writers)


async def _commit(
    backend: Backend, job: SaveJob, loc: str, attempt: str, world: int, reports: dict[int, Report]
) -> Verdict:
    t0 = time.perf_counter()
    created = time.time()
    nbytes = sum(r.nbytes for r in reports.values())
    files = [_manifest.FileEntry(**f) for r in reports.values() for f in r.files]
    ranks = list(job.ranks) if job.ranks is not None else list(range(world))
    fmt = _manifest.FORMAT
    if any(r.index is not None for r in reports.values()):
        # DTensors: the global index, durable before the manifest that lists it
        index = _index.merge(world, {r: rep.index for r, rep in reports.items()})
        if _CHECK_BEFORE_COMMIT:
            _committable.check_index(loc, world, {**{f.name: f.size for f in files}, _index.INDEX: len(index)}, index)
        written = await backend.write_small(job, loc, _index.INDEX, index)
        files.append(_manifest.FileEntry(_index.INDEX, written.size, written.crc32c, 0))
        fmt = _manifest.FORMAT_INDEXED
    if any(r.needs_v2 for r in reports.values()):
        fmt = _manifest.FORMAT_INDEXED
    body = _manifest.encode(job.step, attempt, world, nbytes, created, files, extra={}, ranks=ranks, format=fmt,
                             run=job.run)
    if _CHECK_BEFORE_COMMIT:
        _committable.check_manifest(loc, body)
    await backend.commit(job, loc, attempt, body)
    job.times["commit"] = time.perf_counter() - t0
    return Verdict(committed=True, nbytes=nbytes, created=created)


async def _drop(task: asyncio.Future[Any] | None) -> None:
    """Cancel a task nobody will use (a dedupe round, an index part, a file write) and collect
    its outcome (it is not this save's failure: the reason it is dropped is)."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # a cancellation of ours still propagates


def _consume(task: asyncio.Task[Any]) -> None:
    """Retrieve the outcome of a task nobody awaits any more (its failure is not this save's:
    the failure that made nobody await it is)."""
    if not task.cancelled():
        task.exception()


async def _logged(aw: Awaitable[Any], what: str) -> None:
    try:
        await aw
    except Exception as e:  # noqa: BLE001 - a clean-up: the next start (or sweep) collects what is left
        log.warning("%s: %s", what, e)


def in_background(job: SaveJob, aw: Awaitable[Any], what: str) -> asyncio.Task[None]:
    """Start a clean-up as a task tracked in ``job.removals`` (what ``flush()`` and ``close()``
    wait for); its failure is logged."""
    task = asyncio.ensure_future(_logged(aw, what))
    tracked = job.removals if job.removals is not None else _untracked
    tracked.add(task)
    task.add_done_callback(tracked.discard)
    return task


async def _clean_up(job: SaveJob, aw: Awaitable[Any], what: str) -> None:
    """Run a clean-up after the verdict until the save's deadline (at least
    :data:`CLEANUP_WAIT_S`), then leave it running in the background: a store that stopped
    answering, or a file a stuck write holds, never delays the save's outcome."""
    task = in_background(job, aw, what)
    await asyncio.wait({task}, timeout=max(0.0, job.deadline - time.monotonic()) + CLEANUP_WAIT_S)


#: A follower's ``SaveTimeoutError`` detail when rank 0 went silent before it could commit.
LEADER_SILENT = "rank 0 did not answer"
#: ... and when it may have begun the commit (this rank could not claim the commit lock first).
LEADER_SILENT_UNKNOWN = (
    "rank 0 did not answer; whether it committed is not known here: a step it renamed before it"
    " stopped is complete on disk and resume finds it, and a rank 0 that goes on takes a late commit back"
)


def _leader_lost(step: int, e: BaseException) -> SaveTimeoutError:
    if isinstance(e, CoordinationLost):  # the store host died: say so, not "did not answer"
        failure = RankFailure(0, "CoordinationLost", str(e))
        return SaveTimeoutError(step, {0: failure}, missing=(0,), detail="the coordinator is gone")
    # unless this rank claimed the commit lock first, rank 0 may have begun the commit
    detail = LEADER_SILENT if isinstance(e, LeaderSilent) and e.aborted else LEADER_SILENT_UNKNOWN
    return SaveTimeoutError(step, {0: RankFailure(0, "TimeoutError", str(e))}, missing=(0,), detail=detail)


def _failure(rank: int, exc: BaseException) -> RankFailure:
    if isinstance(exc, SaveError) and rank in exc.failures:
        return exc.failures[rank]  # a verdict made on this rank already (deferred staging's StateChangedError)
    return RankFailure.from_exception(rank, exc)


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
    rank, world = coord.rank, coord.world_size
    leader = rank == 0
    local_exc: BaseException | None = None
    # this task's context: the I/O calls of this save count to its meter (Storage.run)
    current_meter.set(job.meter)
    loop_cpu0 = thread_cpu()

    def step_to(event: SaveEvent) -> None:
        job.advance(event)
        if on_state is not None:
            on_state(job.state)

    dedupe_round: asyncio.Task[dict[str, int] | None] | None = None
    if job.dedupe and world > 1:
        if job.prefailed is None:
            # hashing and the exchange need no attempt: overlap them with the leader's preparation
            dedupe_round = asyncio.ensure_future(_dedupe_round(storage, job, coord))
        else:
            try:  # the others wait for every rank in the dedupe round: tell them at once
                await coord.exchange(job.seq, "dedupe", None, job.deadline, wait=False)
            except (TimeoutError, CoordinationLost):
                pass
    # 1. the leader opens the attempt
    start: Start | None = None
    if leader:
        attempt = uuid.uuid4().hex[:16]
        try:
            if job.prefailed is not None:
                raise job.prefailed
            await _within(backend.prepare(job, attempt), job.deadline, "creating the step directory")
            start = Start(attempt)
        except Exception as e:  # noqa: BLE001 - a failure becomes a value every rank sees
            local_exc = e
            start = Start(attempt, _failure(rank, e))
    try:
        start = await coord.begin(job.step, job.seq, start, job.deadline)
    except (TimeoutError, CoordinationLost) as e:
        await _drop(dedupe_round)
        raise _leader_lost(job.step, e) from e
    if start.failure is not None:
        await _drop(dedupe_round)
    attempt = start.attempt
    loc = backend.location(job.step, attempt)

    # whether this rank's files of the attempt may still be committed: a follower's once it
    # reported success, the leader's once it began the commit; until then they are dead if
    # the save ends
    committable = False
    reports: dict[int, Report] = {}

    async def clean_up(counted: bool) -> None:
        """The failed attempt's files, on this rank's view: the leader takes its own and those
        of every rank whose I/O ended (``Report.settled``), a follower its own only when the
        leader did not count it (``counted``). Nobody touches a part whose I/O overran: a
        thread may still be inside a file (stuck in the kernel), and an unlink would wait with
        it, holding the directory's lock; the next start removes it."""
        mine_settled = not isinstance(local_exc, TimeoutError)
        if leader:
            ranks = [r for r, rep in reports.items() if rep.settled and r != rank]
            ranks += [rank] if mine_settled else []
        else:
            ranks = [rank] if mine_settled and not counted else []
        if ranks or leader:
            await _clean_up(job, backend.abandon(job, loc, ranks, leader), f"could not remove the failed attempt {loc}")

    try:
        # 2. every rank writes its own files
        mine = Report(rank=rank)
        if start.failure is None and job.prefailed is not None:
            local_exc = job.prefailed
            mine = Report(rank=rank, failure=_failure(rank, job.prefailed))
        elif start.failure is None:
            try:
                step_to(SaveEvent.START_WRITE)
                mine = await _within(
                    _write_files(backend, storage, job, rank, loc, leader, coord, dedupe_round),
                    job.deadline,
                    "writing the shard",
                )
                step_to(SaveEvent.FILES_DURABLE)
            except Exception as e:  # noqa: BLE001 - a failure becomes a value every rank sees
                local_exc = e
                mine = Report(rank=rank, failure=_failure(rank, e))
        committable = not leader and mine.failure is None and start.failure is None
        mine.settled = not isinstance(local_exc, TimeoutError)
        reports = await coord.report(job.step, job.seq, attempt, mine, job.deadline)
        if not leader:  # the node-local tier: a node's leader commits its node's part here
            await backend.follow(job, loc, attempt)

        # 3. the leader decides, and commits only if everyone succeeded in time
        verdict: Verdict | None = None
        if leader:
            failures = {r: rep.failure for r, rep in reports.items() if rep.failure is not None}
            if start.failure is not None:
                failures[rank] = start.failure
            missing = tuple(r for r in range(world) if r not in reports)
            if not failures and not missing and not await coord.may_commit(job.seq):
                failures[rank] = RankFailure(rank, "TimeoutError", "a follower gave up waiting before the commit began")
            if not failures and not missing:
                try:
                    step_to(SaveEvent.START_COMMIT)
                    committable = True
                    verdict = await _within(
                        _commit(backend, job, loc, attempt, world, reports), job.deadline, "committing"
                    )
                except Exception as e:  # noqa: BLE001 - a failure becomes a value every rank sees
                    local_exc = e
                    failures[rank] = _failure(rank, e)
            if verdict is None:
                verdict = Verdict(committed=False, failures=failures, missing=missing)
                await backend.release(job)
        verdict = await coord.decide(job.step, job.seq, attempt, verdict, job.deadline)
    except (TimeoutError, CoordinationLost) as e:
        if not job.state.final:
            step_to(SaveEvent.FAIL)
        if not committable or (isinstance(e, LeaderSilent) and e.aborted):
            await clean_up(counted=False)
        raise _leader_lost(job.step, e) from e

    # 4. resolve
    if not verdict.committed:
        if not job.state.final:
            step_to(SaveEvent.FAIL)
        await clean_up(counted=rank not in verdict.missing)
        timed_out = bool(verdict.missing) or any(
            f.exc_type in ("TimeoutError", "PhaseTimeout", "SaveTimeoutError", "ObjectStoreTimeoutError")
            for f in verdict.failures.values()
        )
        err: SaveError
        failures = with_global_ranks(verdict.failures, job.ranks)
        if timed_out:
            err = SaveTimeoutError(
                job.step,
                failures,
                missing=verdict.missing,
                detail=f"ranks {describe_ranks(verdict.missing, job.ranks)} did not answer" if verdict.missing else "",
            )
        elif any(f.exc_type == "StateChangedError" for f in failures.values()):
            err = StateChangedError(job.step, failures, keys=getattr(local_exc, "keys", ()))
        else:
            err = SaveError(job.step, failures)
        raise err from local_exc
    step_to(SaveEvent.COMMITTED)
    if leader:  # retention never fails a committed save (logged), nor makes its outcome late
        await _clean_up(job, backend.retire(job), f"retention after step {job.step} failed")
    total = time.perf_counter() - job.started
    stats = SaveStatistics(
        wait_s=job.wait_s,
        staging_s=job.progress.staging_s if job.progress is not None else job.staging_s,
        write_s=job.times.get("write", 0.0),
        fsync_s=job.times.get("fsync", 0.0),
        commit_s=job.times.get("commit", 0.0),
        total_s=total,
        nbytes=verdict.nbytes,
        direct_io=job.direct,
        writer_cpu_s=job.meter.seconds + (thread_cpu() - loop_cpu0),
        device_copy_s=job.times.get("device_copy", 0.0),
    )
    if leader:
        # once per save, by the rank that committed it, with the bytes of every rank
        log.info(
            "%scommitted step %d: %s%s in %.3fs (%s; staging %.3fs, write %.3fs, fsync %.3fs, commit %.3fs)",
            f"rank {rank}: " if world > 1 else "",
            job.step,
            format_bytes(stats.nbytes),
            f" from {world} ranks" if world > 1 else "",
            total,
            format_rate(stats.nbytes, total),
            stats.staging_s,
            stats.write_s,
            stats.fsync_s,
            stats.commit_s,
        )
    else:
        log.debug("rank %d: step %d committed by rank 0 (%s written here)", rank, job.step, format_bytes(job.nbytes))
    return backend.info(
        job.step,
        nbytes=verdict.nbytes,
        world_size=world,
        created=verdict.created,
        statistics=stats,
        run=job.run,
    )


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units a person reads at a glance: ``512 B``, ``3.4 MB``, ``1.25 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.{2 if v < 10 else 1 if v < 100 else 0}f} {unit}"
    return f"{int(n)} B"


def format_rate(nbytes: float, seconds: float) -> str:
    """A transfer rate with its unit picked by size (``812 MB/s``, never ``0.00 GB/s``)."""
    if seconds <= 0:
        return "n/a"
    return format_bytes(nbytes / seconds) + "/s"
