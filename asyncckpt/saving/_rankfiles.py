"""Phase 2 of the save protocol, on every rank: write this rank's files of the attempt.

Its shard (``rankRRRRR.safetensors``, streamed from the staging arena as the copy goes) and its
tree (``rankRRRRR.json``), both sealed durable, and its part of the global index (per-chunk
checksums, computed beside the write). With dedupe over many ranks, the dedupe round (every
rank's digests exchanged, one writer chosen per identical tensor: ``_dedupe``) decides which
tensors this rank writes; the write may start before the round ends (``SaveJob.file``) and is
redone if the round gives this rank a tensor that file lacks. The outcome is the
:class:`~asyncckpt.ranks._coordination.Report` this rank sends the leader.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..format import _index, _manifest
from ..format._safetensors import ShardLayout
from ..ranks._coordination import Coordinator, Report
from ..roots._backend import Backend
from ..roots._filewrite import until_staged
from ..roots.posix._storage import Storage
from . import _dedupe
from ._cleanup import consume, drop
from ._savejob import SaveJob
from ._stageprogress import StageProgress

log = logging.getLogger("asyncckpt")


async def _device_copies(storage: Storage, job: SaveJob) -> None:
    """Wait (on the I/O pool) until the device-to-host copies of a CUDA state into the arena
    have run, and note when that was (``SaveStatistics.device_copy_s``)."""
    if not job.cuda_events or "device_copy" in job.times:
        return
    for ev in job.cuda_events:
        await storage.run(ev.synchronize)
    job.times["device_copy"] = time.perf_counter() - job.started


async def run_dedupe_round(storage: Storage, job: SaveJob, coord: Coordinator) -> dict[str, int] | None:
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


async def write_files(
    backend: Backend,
    storage: Storage,
    job: SaveJob,
    rank: int,
    loc: str,
    leader: bool,
    coord: Coordinator | None = None,
    dedupe_round: asyncio.Task[dict[str, int] | None] | None = None,
) -> Report:
    """Write this rank's files into the attempt at ``loc`` (a follower first joins it) and
    return its report: the files with their sizes and checksums, its bytes, its index part.
    An empty report when a peer failed the dedupe round (that peer's report fails the save).
    ``dedupe_round``: the round ``run_save`` started, if it did."""
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
        writers = await (dedupe_round if dedupe_round is not None else run_dedupe_round(storage, job, coord))
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
    # a save due for the memory tier: the same bytes into it, as staged, beside the disk write
    # (a no-op for a save that commits into the memory tier itself: MemoryWrite.in_save)
    mem = job.memory
    try:
        if fill is not None:  # let it reach the pool first: the write's pieces wait for it there
            await asyncio.sleep(0)
        if mem is not None:
            mem.write(shard_name, buffer, layout.file_size, staged, job.deadline)
            mem.write(_manifest.tree_name(rank), memoryview(job.tree), len(job.tree), None, job.deadline)
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
                await drop(part_task)
                part_task = None
                await until_staged(job.progress, job.layout.file_size, job.deadline)
                buffer, layout = await storage.run(_dedupe.image, job.arena.buffer, job.layout, keep, job.arena)
                write_s += shard.write_s
                await backend.discard(job, loc, shard_name)
                if mem is not None:
                    mem.write(shard_name, buffer, layout.file_size, None, job.deadline)
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
        await drop(part_task)
        if fill is not None:  # never cancelled: the image buffer is reused once this save settles
            await asyncio.gather(fill, return_exceptions=True)
        if early is not None and dedupe_round is not None:
            # not cancelled: the other ranks wait in the round for this rank's value
            dedupe_round.add_done_callback(consume)
        if mem is not None:  # before the save settles: its staging slot is reused then
            await mem.settle()
    job.times["write"] = write_s + shard.write_s + tree.write_s
    job.times["fsync"] = shard.fsync_s + tree.fsync_s + seal_s
    job.direct = shard.direct
    files = [
        {"name": shard_name, "size": shard.size, "crc32c": shard.crc32c, "rank": rank},
        {"name": _manifest.tree_name(rank), "size": tree.size, "crc32c": tree.crc32c, "rank": rank},
    ]
    if mem is not None:  # the same bytes: the peer replica sends these sums, never computes them again
        mem.crcs = {shard_name: shard.crc32c, _manifest.tree_name(rank): tree.crc32c}
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
