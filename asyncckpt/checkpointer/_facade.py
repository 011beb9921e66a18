"""The facade: ``Checkpointer`` wires the root session, the save pipeline, the waits and the
loader together, and does no I/O itself.

It validates arguments synchronously on the caller's thread (:class:`~._options.Options`),
stages the state and hands the rest to the writer thread (:class:`~._pipeline.SavePipeline`).
Failures reach the caller (:class:`~._books.Books`) on the save's handle, once at the next
``save()``, and at every ``flush()`` / ``close()`` until then (:class:`~._waits.Waits`); an
exit hook (:mod:`._runtime`) makes a process whose failure was never seen exit non-zero.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

from .._info import CheckpointerStatistics, CheckpointInfo, RemoteCheckpointInfo, StagingStatistics
from ..format._gcpause import paused_gc
from ..loading import _load, _load_global
from ..roots.posix._osops import DEFAULT_OPS, OsOps
from ..saving import _deferred
from ..saving._handle import SaveHandle
from . import _runtime, _sigterm
from ._books import Books
from ._loader import Loader, LoadRequest, check_load_args, load
from ._options import DirectIO, OnError, Options
from ._pipeline import SavePipeline
from ._session import RootSession
from ._waits import Waits

__all__ = ["Checkpointer", "load"]


class Checkpointer:
    """Save training state in the background; resume from the newest complete checkpoint.

    Args:
        root: directory holding one ``step_NNNNNNNN/`` directory per checkpoint (created).
            Resolved once, at construction (``os.path.realpath``): repointing a symlinked
            root later does not move a running Checkpointer.
        keep_last: keep only the newest N complete checkpoints (``None`` keeps all).
        timeout: seconds one save may take end to end before it fails with
            ``SaveTimeoutError`` (also bounds how long any rank waits for the others).
        max_pending: saves in flight at once (each holds one staging buffer the size of
            the state); a further ``save()`` waits for a slot.
        on_error: ``"raise"`` (default) raises a background failure once at the next
            ``save()``; ``"warn"`` only warns there and keeps training. Either way
            ``flush()``/``close()`` raise it.
        direct_io: ``"auto"`` writes shards with O_DIRECT where the file system allows it
            and falls back to buffered writes; ``"on"`` requires it; ``"off"`` never uses it.
        verify: default of ``load(verify=)``: check every CRC-32C while reading.
        on_commit: called with the :class:`CheckpointInfo` of every committed save (its
            ``statistics`` included), **on the writer thread**, right after the commit; keep it
            quick (push numbers to a metrics client). Its exceptions are logged, not raised.
        io_threads: threads of the bounded pool that runs blocking file-system calls.
        process_group: the ``torch.distributed`` group whose ranks save together (default:
            the default world when ``torch.distributed`` is initialized, else none). Every
            rank then builds its Checkpointer, calls ``save()`` with the same steps and
            ``close()`` in the same order; each writes only its own ``rankRRRRR.*`` files and
            rank 0 commits once every rank reported success. Coordination goes through the
            group's c10d store with deadlines, never through collectives.
        strip_prefixes: key prefixes of module wrappers to drop from module state dicts at
            save and to match again at ``load(into=)``, e.g. ``("module.",)`` for DDP. The
            ``torch.compile`` prefix ``_orig_mod.`` is always handled this way.
        dedupe: on by default; with many ranks, write each plain tensor that is
            byte-identical on every rank (DDP's model and optimizer) once, by one rank, the
            writers spread so each writes about ``1/world`` of it: decided on the writer
            thread by an xxh3-128 hash of the staged bytes exchanged through the c10d store,
            never by key name (values that differ per rank, such as RNG states, stay per
            rank); replicated DTensor boxes (``Replicate``, HSDP's replica dim) are likewise
            spread over their replicas. Such checkpoints carry the global index (format
            ``asyncckpt/2``). A no-op for one process and with ``node_local``. ``False`` writes
            every rank's plain tensors in full and each replicated DTensor box from its lowest
            rank (the layout of earlier versions).
        mirror: tier mode: an ``s3://bucket/prefix`` URL every committed step is uploaded to
            in the background (the local save is unchanged; see README "Tier mode"). At most
            one upload runs, a newer commit supersedes a waiting older one; ``flush()`` and
            ``close()`` wait for uploads (``flush(local_only=True)`` does not); a failed upload
            is a ``SaveError`` naming the step and the URL, raised like a failed save's, and the
            next commit's upload retries. ``latest()``/``load()`` consider both tiers. With many
            ranks the root must be a file system every rank shares: rank 0 uploads the step.
        keep_last_remote: with ``mirror``, keep only the newest N complete steps on the store.
        storage_options: with ``mirror``, obstore S3 options (``endpoint``, ``region``, keys);
            missing ones come from the ``AWS_*`` environment. Never logged.
        lease_ttl: for an ``s3://`` root: seconds the root's lease lives without renewal
            (default 60; renewed every ``lease_ttl / 6``). A job killed without ``close()``
            keeps the next one waiting (at construction) for at most about this long. With
            ``mirror``: the same for the mirror prefix's lease, which rank 0 takes at its first
            upload (a second job mirroring to that prefix fails its uploads with
            ``RootInUseError``; a job killed without ``close()`` delays the next job's first
            upload, not its construction).
        allow_earlier_steps: by default ``save()`` refuses a step lower than the newest
            committed (or in-flight) one with ``ValueError``; ``True`` allows it, and
            ``keep_last`` then keeps the most recently *committed* checkpoints.
        huge_pages: back the staging buffers with transparent huge pages (Linux,
            ``madvise(MADV_HUGEPAGE)``; where the kernel has none to give, 4 KiB pages as
            without). The writer's O_DIRECT writes then pin 512x fewer pages: on our 2-core VM
            its CPU per GiB fell from ~0.14 to ~0.10 s and saves blocked and became durable a
            few percent sooner. The price is paid once, when a buffer is allocated (the first
            save, or ``reserve()``): the kernel may have to compact memory for the huge
            pages, which took 3-16 s per GiB on that VM (0.3 s without). Off by default.
        node_local: the root is the same path on every node with a different disk behind it
            (a local NVMe): each node commits its own ranks' files on its own disk, and a save
            commits once every node acknowledged; ``load()`` agrees on the newest step every rank
            holds with one attempt (docs/node-local.md). Nodes are grouped by host name, or by
            the ``ASYNCCKPT_NODE`` environment variable where it is set. With ``mirror``, every
            rank uploads its own files of each committed step and rank 0 commits on the store.
        memory: with ``node_local``, a directory on tmpfs (``/dev/shm/run1``, the same path on
            every node): the memory tier. Each save also writes its files there from the bytes
            it holds, committed after the disks (same commit discipline); the tier survives
            a restart of the training processes on the node (not a reboot), and ``load()``
            reads each rank's part from it first (then its disk, then the store: always the
            agreed step). A directory not on tmpfs fails construction (docs/node-local.md).
        memory_keep_last: steps each node keeps in its memory tier (default 1).
        memory_budget: bytes each node's memory tier keeps, replicas it holds included (a due save's
            files come on top until its round); the oldest go first, a part alone over it is not
            kept. Never fails a save.
        replicate: with ``memory``, also keep each step in the next node's memory (docs/node-local.md).
        memory_every: every n-th save() of the job (the first always) goes to the memory tier;
            a ``datetime.timedelta``: a save at least that long after the last one there (each
            ``*_every`` alike; rank 0's clock decides for every rank: docs/design/tiers.md).
        mirror_every: every m-th commit to the disks (the first always), or one a timedelta
            after the last upload's save, goes to the store (any local root with ``mirror``).
        disk_every: with ``memory``, every n-th save() of the job (the first always), or one a
            timedelta after the last disk save, goes to the node disks, the others commit to the
            memory tier only (``CheckpointInfo.tier``).
        os_ops: the fault-injection seam, for tests: an :class:`asyncckpt.testing.OsOps`
            whose methods are the blocking OS calls of the save path (``mkdir``, ``open``,
            ``pwrite``, ``fsync``, ``rename``, ...); a subclass that raises or stalls in one
            of them stands in for a file system failing there (docs/development.md "Fault
            injection"). The default makes the real calls.

    One root has one writing job: the Checkpointer (rank 0 of its group) takes ownership of
    ``root`` at construction and holds it until ``close()``; a second writer on the same
    root - another process, job, process group, or Checkpointer - raises
    ``RootInUseError`` naming the owner. A root that cannot be written raises
    ``RootNotWritableError`` (a ``PermissionError``). Reading needs no Checkpointer:
    ``asyncckpt.load()`` / ``find_latest()``. On an ``s3://`` root ownership is a lease
    object renewed in the background (README "An object-store root"): construction waits
    while a lease is there that is neither renewed (a live owner: ``RootInUseError``) nor
    past its TTL (a dead one: taken over), and a job whose lease was taken over fails every
    later save with ``RootInUseError`` on every rank, committing nothing.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        timeout: float = 600.0,
        max_pending: int = 1,
        on_error: OnError = "raise",
        direct_io: DirectIO = "auto",
        verify: bool = True,
        io_threads: int = 2,
        process_group: Any = None,
        on_commit: Callable[[CheckpointInfo], object] | None = None,
        strip_prefixes: Sequence[str] = (),
        allow_earlier_steps: bool = False,
        dedupe: bool = True,
        mirror: str | None = None,
        keep_last_remote: int | None = None,
        storage_options: Mapping[str, str] | None = None,
        lease_ttl: float | None = None,
        huge_pages: bool = False,
        node_local: bool = False,
        memory: str | os.PathLike[str] | None = None,
        memory_keep_last: int | None = None,
        memory_budget: int | None = None,
        memory_every: int | timedelta | None = None,
        mirror_every: int | timedelta | None = None,
        replicate: bool = False,
        disk_every: int | timedelta | None = None,
        os_ops: OsOps = DEFAULT_OPS,
    ) -> None:
        t_start = time.monotonic()  # construction's waits count from the call
        opts = Options.check(
            root, keep_last=keep_last, timeout=timeout, max_pending=max_pending, on_error=on_error,
            direct_io=direct_io, verify=verify, io_threads=io_threads, process_group=process_group,
            on_commit=on_commit, strip_prefixes=strip_prefixes, allow_earlier_steps=allow_earlier_steps,
            dedupe=dedupe, mirror=mirror, keep_last_remote=keep_last_remote, storage_options=storage_options,
            lease_ttl=lease_ttl, huge_pages=huge_pages, os_ops=os_ops, node_local=node_local,
            memory=memory, memory_keep_last=memory_keep_last, memory_budget=memory_budget, memory_every=memory_every,
            mirror_every=mirror_every, replicate=replicate, disk_every=disk_every)  # fmt: skip
        self.root = opts.root
        self.strip_prefixes = opts.strip_prefixes
        self.keep_last = opts.keep_last
        self.timeout = opts.timeout
        self.max_pending = opts.max_pending
        self.on_error: OnError = opts.on_error
        self.verify = opts.verify
        self.allow_earlier_steps = opts.allow_earlier_steps
        self.dedupe = opts.dedupe
        self._books = books = Books()
        self._session = session = RootSession(opts, books.dead, books.lock)
        self.rank = session.rank
        self.world_size = session.world_size
        waits: Waits | None = None
        try:
            self._rt = rt = session.claim(t_start)
            books.committed.update(session.committed)
            self._pipeline = SavePipeline(opts, session, rt, books)
            self._waits = waits = Waits(session, rt, books)
            self._loader = Loader(session)
            newest = session.newest_to_upload()
            if newest is not None:
                self._pipeline.settling.track_upload(newest)
            _runtime.keep_until_exit(waits)
        except BaseException:
            if waits is not None:
                _runtime.forget_at_exit(waits)
            session.abandon()
            raise

    @property
    def run_id(self) -> str:
        """The id of the run this job continues (README "Runs"): the newest resumable step's at
        construction, else a new one; recorded in the manifest of every step it commits."""
        return self._session.run_id

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, *, until: Any = None, copy_now: Sequence[str] = ()) -> SaveHandle:
        """Stage ``state`` for ``step`` and return at once; the write runs in the background.

        When this returns, the state has been copied into staging buffers the library
        owns: the caller may mutate its tensors freely. With ``until`` (an optimizer, or a
        sequence of them: *deferred staging*), the tensors those optimizers own are copied in
        the background instead, and the next optimizer step (any optimizer's), ``wait_staged()``,
        the next ``save()`` or ``flush()`` waits for that copy; the rest (buffers, one-element
        tensors, tensors no optimizer in ``until`` owns, the keys named in ``copy_now``) is
        copied before this returns. Such a save commits only after that guard ran, and fails
        with ``StateChangedError`` naming the keys if a deferred tensor was written in place
        before it (docs/deferred.md). Raises ``TypeError``/``ValueError``
        for bad arguments (unsupported objects name their key path), ``ValueError`` for a
        step already committed or in flight, ``RuntimeError`` when closed, and (with
        ``on_error="raise"``) the ``SaveError`` of an earlier save that has not been raised
        by ``save()`` yet.
        """
        t_call = time.perf_counter()
        self._check_usable()
        # the collector paused for all of save() (_gcpause): the walk, the plan and the copy
        # allocate a few objects per tensor, and the pipeline's temporaries die before it
        # resumes, so no collection traverses them on the caller's path
        lazy = None if until is None else (_deferred.check_until(until), _deferred.check_copy_now(copy_now))
        with paused_gc():
            return self._pipeline.save(step, state, t_call, lazy)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Deferred staging: wait until every tensor of this Checkpointer's deferred saves is
        copied (with CUDA: make the current stream wait for the copies), so the caller may
        write them. Call it before writing a saved tensor other than through an optimizer
        step (whose pre-hook does this). A save whose tensors were written in place since
        ``save()`` fails here with ``StateChangedError`` on its handle (not raised by this
        call). A no-op without deferred saves. Raises ``TimeoutError`` after ``timeout`` s."""
        self._books.release_deferred(None if timeout is None else time.monotonic() + timeout)

    def reserve(self, state: Any) -> None:
        """Allocate the staging buffers a save of ``state`` needs, now, so that the first
        save's blocking time excludes the allocation (about 0.5 s per GiB: the pages are
        faulted in up front). Pins them (``cudaHostRegister``) when ``state`` holds CUDA
        tensors and CUDA is available.

        Promises: every free staging slot (``max_pending`` of them when no save is in
        flight) holds a buffer big enough for ``state`` afterwards; a later save of a state
        of the same structure, or of a smaller one, allocates nothing; a larger state grows
        the buffer at that save, as without ``reserve()``. Reserving a larger state replaces
        smaller free buffers; reserving a smaller one keeps the larger ones. Buffers held by
        saves in flight are left alone. The layout of ``state`` is planned and kept too, so
        the first save of that structure does not plan it again. Nothing is copied or
        written, and ``state`` is not kept.

        Raises ``TypeError`` (naming the key path) for anything ``save()`` would refuse,
        ``ValueError`` for a reference cycle or too deep a nesting, ``RuntimeError`` when
        closed.
        """
        self._check_usable()
        self._pipeline.reserve_buffers(state)

    def statistics(self) -> CheckpointerStatistics:
        """A frozen snapshot: running totals over this Checkpointer's saves, and the last one."""
        with self._books.lock:
            return self._books.totals.snapshot()

    def staging_statistics(self) -> StagingStatistics:
        """A frozen snapshot of the staging buffers (read-only; for tests and for checking that
        saves reuse their buffers): how many were allocated and planned, and the free ones."""
        return self._rt.staging.snapshot(self._pipeline.planner.layouts_planned)

    def upload_states(self) -> dict[int, str]:
        """Tier mode (``mirror=``): the steps whose upload has not settled, or failed and has
        not been raised by ``flush()``/``close()`` yet, each ``"pending"`` (waiting or in
        flight) or ``"failed"``; an upload that succeeded or was superseded is not listed
        (``{}`` without ``mirror``). A read-only snapshot, for tests and monitoring: it marks
        no failure as seen."""
        return self._books.upload_states()

    def install_sigterm_handler(
        self, grace_s: float = 30.0, final_save: Callable[[Checkpointer], object] | None = None
    ) -> None:
        """On SIGTERM: optionally take a final save, flush within ``grace_s`` (as ``close()``,
        uploading the newest commit ``mirror_every`` skipped), then let the previous handler
        (by default: termination by the signal) proceed.

        ``final_save(ckpt)`` runs inside the signal handler on the main thread and should
        call ``ckpt.save(...)``. Everything the handler waits for (the final save's staging
        slot, the flush) shares one deadline, ``grace_s`` after the signal; if the signal
        lands inside a ``save()`` on the main thread, the final save does not wait for the
        slot that save holds but stages into a spare buffer. If the final save or flush fails
        or runs out of time, the failure is printed and the process exits with status 1.
        Call from the main thread (Python's signal rule).
        """
        save = Checkpointer.save.__code__
        _sigterm.install(self, save, self._pipeline, self._waits, self._books, grace_s, final_save)

    # ------------------------------------------------------------------ waiting
    def flush(self, timeout: float | None = None, *, local_only: bool = False) -> None:
        """Wait for every pending save; raise ``SaveError`` if any failed since the last flush.

        In tier mode (``mirror=``) also wait until the newest committed step is uploaded
        (its upload, or a failed one's ``SaveError``); ``local_only=True`` waits for local
        durability only (upload failures already known are still raised).
        Raises the builtin ``TimeoutError`` if saves are still running after ``timeout``
        seconds (they keep running).
        """
        self._waits.flush(timeout, local_only=local_only)

    async def aflush(self, timeout: float | None = None, *, local_only: bool = False) -> None:
        """:meth:`flush` for asyncio code: waits without blocking the running loop."""
        await self._waits.aflush(timeout, local_only=local_only)

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the writer thread; raises what :meth:`flush` raises. Idempotent.
        With ``mirror_every``, the newest disk commit it did not upload is uploaded first.

        Interrupted (Ctrl-C) while saves are pending, it stops the writer at once, which
        leaves each pending step either committed or not there at all (the previous
        checkpoint stays the latest), prints which, and re-raises. In a forked child it only
        marks this copy closed: the parent's writer is not there.
        """
        if self._waits.closed:
            return
        if self._rt.forked:
            self._waits.closed = True
            return
        try:  # with mirror_every: the last disk commit it skipped is uploaded too
            self._waits.flush(timeout, final=self._pipeline.settling.upload_skipped)
        except KeyboardInterrupt:
            self._waits.closed = True
            self._waits.abandon_pending("close() was interrupted")
            raise
        finally:
            self._waits.closed = True
            self._rt.stop(self.timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` for asyncio code."""
        if self._waits.closed:
            return
        if self._rt.forked:
            self._waits.closed = True
            return
        try:
            await self._waits.aflush(timeout, final=self._pipeline.settling.upload_skipped)
        finally:
            self._waits.closed = True
            await asyncio.to_thread(self._rt.stop, self.timeout)

    @property
    def closed(self) -> bool:
        """True once ``close()``/``aclose()`` ran, or the exit hook finished this Checkpointer's
        waits (it is set then, before its threads are stopped)."""
        return self._waits.closed

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if ev is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - do not mask the exception already in flight
            ev.add_note(f"asyncckpt close() also failed: {e}")

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if ev is None:
            await self.aclose()
            return
        try:
            await self.aclose()
        except Exception as e:  # noqa: BLE001
            ev.add_note(f"asyncckpt aclose() also failed: {e}")

    def __del__(self) -> None:
        _runtime.dropped(self)

    # ------------------------------------------------------------------ reading
    def latest(self) -> CheckpointInfo | RemoteCheckpointInfo | None:
        """The newest complete checkpoint under ``root``, or ``None``.

        In tier mode (``mirror=``) the newest complete step of this job's run (:attr:`run_id`)
        on either tier: a :class:`RemoteCheckpointInfo` when the store holds a newer step than
        ``root`` (a new node with an empty disk), the local :class:`CheckpointInfo` otherwise;
        the store's steps of another run are never chosen (a WARNING names them); a store that
        cannot be reached raises its ``ObjectStoreError``.
        With many ranks this is collective: rank 0 looks and every rank gets its answer.
        """
        return self._session.latest()

    def steps(self) -> list[int]:
        """Every complete step under ``root``, ascending (collective with many ranks)."""
        return self._session.steps()

    def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        verify: bool | None = None,
        rank: int | None = None,
        per_rank: _load_global.PerRank = "error",
        mmap: bool = False,
        verify_first: bool = False,
    ) -> Any:
        """Load a complete checkpoint (``None``: the newest that verifies) and return its state.

        With ``into=``, restores in place. Tensors of the saved dtype and shape (module
        parameters and buffers, optimizer state, tensors in dicts and lists) are read straight
        into their memory and checksummed as their bytes land, so the extra memory is the I/O
        buffers', not the state's; the returned state holds those tensors. The rest: objects
        get ``load_state_dict``, tensors get ``copy_``. For an explicit ``step``, raises
        ``CheckpointNotFoundError`` if it is missing, uncommitted or retired while being read,
        and ``CheckpointCorruptError`` (naming the file) when anything fails verification; the
        targets may then be partly overwritten. With ``step=None`` a corrupt newest checkpoint
        is logged (WARNING, naming the file) and the next newest that verifies is loaded over
        the same targets (restoring is strict, so a fallback that succeeds rewrote them all).
        ``verify_first=True`` writes no target before the whole state verified (a checkpoint
        that fails leaves every target untouched), at the price of a second, in-memory pass
        over the targets' bytes; with many ranks no rank writes before every rank verified.

        A read that fails on I/O (EIO, ETIMEDOUT, a store's 503 or silence) is not damage: it
        is tried again within ``timeout``, then ``CheckpointReadError`` (an ``OSError`` naming
        the file) is raised, for an explicit step and for ``step=None`` alike: the step is
        not marked bad and no older step is loaded instead. A key of ``into`` the checkpoint
        lacks raises ``CheckpointError`` (also a ``KeyError``), a shape mismatch ``ValueError``;
        found before any target is written (in the step's structure; a step with a global
        index: its index and values), they leave every target as it was.

        With many ranks this is collective: rank 0 picks the step, each rank loads its own
        shard and reports, and every rank takes the same decision, so if any rank's shard
        is corrupt every rank falls back to the same older step (or, for an explicit step,
        every rank raises); an I/O error on any rank makes every rank raise it. Every wait
        is bounded by ``timeout``. A checkpoint saved by a
        different number of ranks raises ``CheckpointError`` unless ``rank=`` names the
        shard to read.

        A checkpoint holding DTensors loads at any world size: each DTensor of ``into``
        (any mesh and placements) gets exactly its local shard, read from the chunks that
        overlap it; without a DTensor target a DTensor comes back as the full tensor. The
        rest of the state is per rank: across a change of world size it loads only where
        every saved rank holds the same values, else ``CheckpointError`` names the keys,
        unless ``per_rank="rank0"`` (take rank 0's) or ``rank=`` picks the saved rank.

        ``mmap=True`` returns tensors backed by the shard's file (no copy; see
        :func:`asyncckpt.load`); not with ``into=`` (``ValueError``).
        """
        _load.check_mmap(mmap, into)
        check_load_args(step, rank, per_rank, verify_first)
        # collective: an indexed step is read into the targets only after every rank agreed
        reader = _load_global.Reader(self.world_size, self.rank, rank, per_rank, into, self.strip_prefixes,
                                     self._session.dist is not None, verify_first)  # fmt: skip
        req = LoadRequest(step, self.rank if rank is None else rank, self.verify if verify is None else verify, mmap,
                          self.world_size if rank is None else None, reader)  # fmt: skip
        # one pause of the collector for the whole load and restore (_gcpause: see _load.load_files)
        with _load.noting_partial_targets(reader), paused_gc():
            return self._loader.load(req)

    # ------------------------------------------------------------------ internals
    def _check_usable(self) -> None:
        if self._waits.closed:
            raise RuntimeError("this Checkpointer is closed")
        self._rt.refuse_if_forked()
        self._rt.refuse_in_writer()
