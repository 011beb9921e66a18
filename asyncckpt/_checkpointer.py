"""The facade: ``Checkpointer`` wires staging, the writer, storage and coordination together.

It validates arguments synchronously on the caller's thread, stages the state, and hands
the rest to the writer thread. It keeps the bookkeeping that makes failures reach the
caller: on the save's handle, once at the next ``save()``, and at every ``flush()`` /
``close()`` until then; an exit hook makes a process whose failure was never seen exit
non-zero.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import logging
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    RankFailure,
    SaveError,
    SaveTimeoutError,
    with_global_ranks,
)
from ._info import CheckpointerStatistics, CheckpointInfo, SaveStatistics
from .format._gcpause import paused_gc
from .format._header import round_up
from .format._layout import check_step, step_dir_name
from .format._lifecycle import SaveState
from .format._safetensors import ST_TO_DTYPE, ShardLayout, plan_layout, plan_split_layout
from .format._structure import TensorRef, check_strip_prefixes, flatten, tree_json
from .loading import _load, _load_global, _nodeload, _resume
from .loading._stepfiles import NoSuchShard
from .ranks import _agree, _distributed, _nodes
from .ranks._coordination import Coordinator, LocalCoordinator, StoreCoordinator
from .roots import _nodeparts, _readfault, _rootstart, _runs
from .roots._backend import Backend, PosixBackend
from .roots._scheme import is_url
from .roots.posix import _discovery
from .roots.posix._ownership import Ownership
from .roots.posix._retention import retire
from .roots.posix._storage import DEFAULT_OPS, OsOps, Storage, current_meter, metered
from .saving import _dedupe, _nodelocal, _nodeupload
from .saving._commit import SaveJob, run_save
from .saving._handle import SaveHandle, SaveRecord
from .saving._mirror import Mirror, UploadRecord, check_options
from .saving._staging import Arena, StageProgress, StagingPool
from .threads._iopool import IOPool
from .threads._sync import run_sync
from .threads._writer import StartGate, WriterThread

if TYPE_CHECKING:
    from .roots.objstore._lease import Lease
    from .roots.objstore._remote import RemoteCheckpointInfo

OnError = Literal["raise", "warn"]
DirectIO = Literal["auto", "on", "off"]

#: Extra time past the save deadline before a waiter gives up on the writer itself.
_MARGIN_S = 5.0
#: Past the save deadline, when a save that is still running is given up (``_guarded``).
_GUARD_S = 2.5
#: Rounds of a collective load(step=None) (each one a retired choice or a corrupt fallback).
_MAX_LOAD_ROUNDS = 64
#: At most this long (and half the timeout, which bounds the other ranks' wait for its answer)
#: for rank 0's look at the store's newest step at construction.
_SURVEY_S = 30.0


class _Runtime:
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
        self.backend: Backend | None = None  # where saves go (POSIX root or object store)
        # one per writer loop: overlapping saves apply retention one at a time
        self.retention_lock = asyncio.Lock()
        # retired checkpoints whose files are still being removed (tasks on the writer loop)
        self.removals: set[asyncio.Task[None]] = set()
        self.staging = StagingPool(max_pending, huge_pages)
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
                fut.result(max(0.0, deadline - time.monotonic()) + _MARGIN_S)
        except Exception:  # noqa: BLE001 - peers gone or coordination dead: still stop locally
            pass
        finally:
            try:
                if self.mirror is not None:
                    self.mirror.stop(timeout=10.0)
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
            return self.writer.submit(_until_removed(self.removals))
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
            self.stop(timeout=_MARGIN_S)

        if not futures and not _on_library_thread():
            wait_then_stop()
            return
        try:
            threading.Thread(target=wait_then_stop, name="asyncckpt-reaper", daemon=True).start()
        except RuntimeError:  # no new threads at interpreter shutdown: the exit hook stops it
            pass


def _on_library_thread() -> bool:
    """Whether this is one of the threads a runtime starts (all named ``asyncckpt-*``): the
    writer, I/O and coordination pools, the mirror's, the lease's, the heartbeat."""
    return threading.current_thread().name.startswith("asyncckpt-")


async def _until_removed(tasks: set[asyncio.Task[None]]) -> None:
    """On the writer loop: wait until the removals of retired checkpoints running now (in
    ``tasks``) are done, never cancelling them. Removals that saves add meanwhile are not
    waited for: with another thread saving on, the set may never be empty."""
    running = list(tasks)
    if running:
        await asyncio.wait(running)


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
log = logging.getLogger("asyncckpt")


class _Totals:
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
            ``asyncckpt/2``). A no-op for one process. ``False`` writes every rank's plain
            tensors in full and each replicated DTensor box from its lowest rank (the layout
            of earlier versions).
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

    # set only while the SIGTERM handler runs: its deadline, and whether it interrupted save()
    _grace_end: float | None = None
    _interrupted_save: bool = False
    # set once the SIGTERM handler ran: the exit hook leaves retired steps' removal to the next
    # start then (a slow deletion must not outlast the grace period)
    _sigterm_seen: bool = False

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
        _ops: OsOps = DEFAULT_OPS,
    ) -> None:
        t_start = time.monotonic()  # construction's waits count from the call
        self.strip_prefixes = check_strip_prefixes(strip_prefixes)
        store = None
        if is_url(root):
            store = _open_store_root(root, mirror, keep_last_remote, storage_options, direct_io, allow_earlier_steps)
            from .roots.objstore._lease import DEFAULT_TTL_S, Lease, check_ttl  # obstore: only for s3:// roots

            ttl = check_ttl(lease_ttl) if lease_ttl is not None else DEFAULT_TTL_S
        else:
            check_options(mirror, keep_last_remote, storage_options)  # tier mode: bad options raise here
            if lease_ttl is not None:
                if mirror is None:
                    raise ValueError(
                        "lease_ttl applies to an object-store root (s3://...) or a mirror=; a local root is locked"
                    )
                from .roots.objstore._lease import check_ttl  # obstore: only for tier mode

                lease_ttl = check_ttl(lease_ttl)  # the mirror's lease (taken at its first upload)
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root must be a path, not {type(root).__name__}")
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, not {keep_last!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        if not _is_int(max_pending) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, not {max_pending!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        if direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io must be 'auto', 'on' or 'off', not {direct_io!r}")
        if not _is_int(io_threads) or io_threads < 1:
            raise ValueError(f"io_threads must be a positive int, not {io_threads!r}")
        if store is not None:
            given = self.root = store.url
        else:
            given = os.path.abspath(os.fspath(root))
            # pinned: a symlinked root (runs/current -> runs/exp7) repointed while the job runs
            # must not make it write to, or retire in, a root it does not own
            self.root = os.path.realpath(given)
        # object-store root (Checkpointer("s3://...")): saves commit by conditional create
        self._store = store
        self._storage_options = dict(storage_options) if store is not None and storage_options else None
        self.keep_last = keep_last
        self.timeout = float(timeout)
        self.max_pending = max_pending
        self.on_error: OnError = on_error
        self.verify = verify
        self._closed = False
        if on_commit is not None and not callable(on_commit):
            raise TypeError("on_commit must be callable")
        self._on_commit = on_commit
        if not isinstance(allow_earlier_steps, bool):
            raise TypeError(f"allow_earlier_steps must be a bool, not {allow_earlier_steps!r}")
        self.allow_earlier_steps = allow_earlier_steps
        if mirror is not None and allow_earlier_steps:
            # both tiers go by step (latest(), keep_last_remote): a rewound run's new, lower
            # steps would be retired on the store at once and lose to the old ones at resume
            raise ValueError("mirror= does not support allow_earlier_steps=True yet")
        if not isinstance(dedupe, bool):
            raise TypeError(f"dedupe must be a bool, not {dedupe!r}")
        if not isinstance(huge_pages, bool):
            raise TypeError(f"huge_pages must be a bool, not {huge_pages!r}")
        self.dedupe = dedupe
        _nodelocal.check_option(node_local, store is not None, allow_earlier_steps)  # the node-local tier
        self._failed_commits: set[str] = set()
        self._dead: set[str] = set()  # directory names under root known dead (see SaveJob.dead)
        # steps reserved by save() (registered atomically with the checks): the record once
        # submitted, None while save() is still staging
        self._reserved: dict[int, SaveRecord | None] = {}
        self._totals = _Totals()
        # reentrant: the SIGTERM handler may flush while the main thread is inside save()
        self._lock = threading.RLock()
        self._records: list[SaveRecord] = []  # not yet settled, or failed and not yet flushed
        self._unraised: list[SaveRecord] = []  # failed, not yet raised/warned by save()
        self._staging_record: SaveRecord | None = None  # the save whose copy is running in save()
        self._committed: set[int] = set()
        self._commits = 0  # commits added to _committed (a generation: see _reserve)
        self._seq = 0
        self._layout_key: list[tuple[str, Any, Any]] | None = None
        self._layout: ShardLayout | None = None
        self._perm: list[int] = []
        # with dedupe: the last round's plan, and the arena laid out for it (see _expected_file)
        self._plan_hint = _dedupe.PlanHint()
        self._split_key: tuple[Any, frozenset[str]] | None = None
        self._split: tuple[ShardLayout, ShardLayout, list[int]] | None = None

        self._dist = _distributed.resolve(process_group, self.timeout)
        self.rank = self._dist.rank if self._dist else 0
        self.world_size = self._dist.world_size if self._dist else 1
        self._ranks = _global_ranks(process_group, self.world_size) if self._dist else (0,)
        self._queries = 0
        # made before anything is locked: whatever interrupts the rest of construction (an
        # error, Ctrl-C, no thread to start), the except below releases what was taken
        key = self._dist.start_key(given) if self._dist is not None else ""
        self._nodes = _nodes.discover(self._dist, key, self.timeout) if node_local and self._dist is not None else None
        self._node_run: str | None = None  # the node-local tier: the run of the agreed newest step
        leads = self.rank == 0 or (self._nodes is not None and self.rank in self._nodes.leaders)
        ownership = Ownership(self.root, None) if leads and store is None else None
        lease = Lease(store, self._ranks, ttl=ttl) if self.rank == 0 and store is not None else None
        rt: _Runtime | None = None
        try:
            committed: list[int] = []
            surveyed: set[int] = set()
            failure: BaseException | None = None
            if lease is not None:
                try:
                    committed, surveyed = _rootstart.remote_start(lease, self.timeout, t_start)
                except (CheckpointError, OSError, ValueError) as e:
                    failure = e
            elif self._nodes is not None:
                assert self._dist is not None
                failure, agreed = _nodelocal.start_on_nodes(self._dist, key, self.root, self._nodes, functools.partial(
                    _rootstart.node_start, self.root, _ops, ownership, self.timeout, self._ranks, self._dead),
                    self.timeout, None if mirror is None else functools.partial(
                        _nodeparts.store_steps, mirror, storage_options, min(self.timeout / 2, _SURVEY_S)))  # fmt: skip
                committed = [int(a[0]) for a in agreed]
                self._node_run = str(agreed[-1][2]) if agreed and agreed[-1][2] else None
            elif store is None:
                failure, committed = _rootstart.start_on_root(
                    self.root, _ops, ownership, self._dist, key, self.timeout, self._ranks, self._dead
                )
            namespace = ""
            if self._dist is not None:
                namespace, committed = self._dist.agree_at_start(key, committed, self.timeout, failure)
            elif failure is not None:
                raise failure
            self._committed = set(committed)
            rt = _Runtime(io_threads, _ops, direct_io, max_pending, LocalCoordinator(), huge_pages)
            rt.ownership = ownership
            rt.lease = lease
            if store is not None:
                from .roots.objstore._backend import ObjectBackend

                rt.backend = ObjectBackend(store, lease, surveyed)
            else:
                rt.backend = PosixBackend(rt.storage, self.root)
            if self._dist is not None:
                rt.coord_pool = IOPool(2, "asyncckpt-coord")
                rt.coord = StoreCoordinator(
                    self._dist.connect, self.rank, self.world_size, namespace, rt.run_coordination
                )
                if self._nodes is not None:  # the node-local tier: one commit per node
                    rt.backend = _nodelocal.NodeLocalBackend(rt.storage, self.root, self._nodes, self.rank, rt.coord,
                                                             committed)  # fmt: skip
            self._rt = rt
            if mirror is not None and self._nodes is not None:  # the node-local tier: every rank uploads its files
                assert self._dist is not None and isinstance(rt.backend, _nodelocal.NodeLocalBackend)
                rt.mirror = _nodeupload.PartUploads(
                    self.root, mirror, storage_options, rank=self.rank, world_size=self.world_size,
                    connect=self._dist.connect, namespace=namespace, keep_last_remote=keep_last_remote,
                    timeout=self.timeout, ranks=self._ranks, lease_ttl=lease_ttl)  # fmt: skip
                rt.backend.uploaded = rt.mirror.uploaded
            elif mirror is not None:  # tier mode: rank 0 uploads (the root is shared), every rank may load
                rt.mirror = Mirror(self.root, mirror, storage_options, keep_last_remote=keep_last_remote,
                                   timeout=self.timeout, retire_local=self._local_retention(rt),
                                   uploads=self.rank == 0, ranks=self._ranks, lease_ttl=lease_ttl)
            self._mirror = rt.mirror
            self._start_run(committed)  # the run this job continues (_runs)
            if self._mirror is not None and self.rank == 0 and committed:
                # a local commit the last job may not have uploaded: push it (a no-op if it is there)
                newest = _discovery.newest_complete(self.root)
                if isinstance(newest, CheckpointInfo):
                    self._track_upload(newest)
            _live.add(self)
        except BaseException:
            _live.discard(self)
            if rt is not None:
                rt.stop(5.0, collective=False)  # releases the ownership too
            if ownership is not None:
                ownership.release()
            if lease is not None:
                lease.release()
            raise

    # ------------------------------------------------------------------ runs
    def _start_run(self, committed: list[int]) -> None:
        """Rank 0 decides the run this job continues and, in tier mode, finds the store's newest
        step (``_runs``; a store that cannot be read is logged, never fatal: the rule is then
        pending, see :meth:`_look_at_store_again`); every rank gets both: the run goes into
        every manifest, the store's newest into ``save()``'s step rule."""

        def look() -> list[Any]:
            if self._nodes is not None:  # the node-local tier: the run of the step every rank holds
                return [self._node_run or _runs.new_run_id(), None, True]
            mirror = None if self._mirror is None else self._mirror.store
            return _runs.at_start(self.root, bool(committed), self._store, mirror, min(self.timeout / 2, _SURVEY_S))

        run, far, known = self._decided_by_leader(look)
        self._run_id: str = run
        self._store_newest = _runs.Newest.from_json(far)
        self._store_known: bool = known
        self._store_look = _runs.StoreLook()
        if self._mirror is not None:
            self._mirror.run = run
            self._mirror.floor_unknown = not known

    def _look_at_store_again(self) -> None:
        """Tier mode, while the store's newest step is unknown (construction could not read it):
        rank 0 looks again (``_runs.StoreLook``: bounded, at most once a minute) and every rank
        takes its answer, so ``save()``'s step rule across tiers is kept, never dropped; until a
        look succeeds the mirror checks before each upload."""
        assert self._mirror is not None
        store, timeout = self._mirror.store, min(self.timeout / 2, _SURVEY_S)
        far, known = self._decided_by_leader(lambda: self._store_look(store, timeout))
        if known:
            with self._lock:
                self._store_newest, self._store_known = _runs.Newest.from_json(far), True
            self._mirror.floor_unknown = False

    @property
    def run_id(self) -> str:
        """The id of the run this job continues (README "Runs"): the newest resumable step's at
        construction, else a new one; recorded in the manifest of every step it commits."""
        return self._run_id

    # ------------------------------------------------------------------ tier mode
    def _local_retention(self, rt: _Runtime) -> Callable[[frozenset[int], int], Any] | None:
        """Local ``keep_last`` for tier mode, run by the mirror (the save itself does none):
        on the writer loop, under its retention lock, with pending uploads protected."""
        keep_last = self.keep_last
        if keep_last is None:
            return None
        root, by_commit_order = self.root, self.allow_earlier_steps

        def start(protect: frozenset[int], latest: int) -> concurrent.futures.Future[list[int]]:
            return rt.writer.submit(retire(rt.storage, root, keep_last, by_commit_order=by_commit_order,
                                           lock=rt.retention_lock, latest=latest, protect=protect))

        return start

    def _track_upload(self, info: CheckpointInfo) -> None:
        """Hand committed ``info`` to the mirror and track its upload like a save."""
        assert self._mirror is not None
        record = self._mirror.committed(info)
        me = weakref.ref(self)
        with self._lock:
            self._records.append(record)

        def settled(f: concurrent.futures.Future[CheckpointInfo]) -> None:
            owner = me()
            if owner is None:
                return
            with owner._lock:
                if f.exception() is None:
                    if record in owner._records:
                        owner._records.remove(record)
                else:
                    owner._unraised.append(record)  # raised at the next save(), flush(), close()

        record.future.add_done_callback(settled)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any) -> SaveHandle:
        """Stage ``state`` for ``step`` and return at once; the write runs in the background.

        When this returns, the state has been copied into staging buffers the library
        owns: the caller may mutate its tensors freely. Raises ``TypeError``/``ValueError``
        for bad arguments (unsupported objects name their key path), ``ValueError`` for a
        step already committed or in flight, ``RuntimeError`` when closed, and (with
        ``on_error="raise"``) the ``SaveError`` of an earlier save that has not been raised
        by ``save()`` yet.
        """
        t_call = time.perf_counter()
        # the collector paused for all of save() (_gcpause): the walk, the plan and the copy
        # allocate a few objects per tensor, and _save's temporaries die before it resumes, so
        # no collection traverses them on the caller's path
        with paused_gc():
            return self._save(step, state, t_call)

    def _save(self, step: int, state: Any, t_call: float) -> SaveHandle:
        """:meth:`save`'s body (a method: its temporaries die before the pause ends)."""
        self._check_usable()
        check_step(step)
        self._surface_earlier_failure()
        self._reserve(step)
        # set by _submit once the save's record owns the slot and the step (its settling
        # frees both); until then an exception anywhere here gives them back
        handed = [False]
        arena: Arena | None = None
        try:
            try:
                found: list[tuple[str, Any, Any]] = []
                n_tied: list[int] = []
                aliases: dict[str, str] = {}
                tree, refs = flatten(
                    state, self.strip_prefixes, dtensors=found, tied_out=n_tied, dtensor_aliases=aliases
                )
                if found and self.dedupe and self.world_size > 1:
                    found, refs = _spread_replica_writes(found, refs)
                tree_bytes = tree_json(tree)
                del tree
                layout, perm, all_cpu = self._plan(refs)
                dtensors = _load_global.describe_for_index(found, aliases, self.world_size) if found else None
                tied = n_tied[0] > 0
                plan_key, file = layout, None
                if self.dedupe and self.world_size > 1:
                    layout, file, perm = self._expected_file(layout, perm, dtensors)
            except (TypeError, ValueError) as e:
                if self._dist is not None:
                    # the other ranks are saving this step too: fail it for them, within the protocol
                    self._submit(step, t_call, None, None, b"", None, 0.0, 0.0, prefailed=e, handed=handed)
                raise
            arena, waited = self._acquire_slot(layout.file_size)
            sources = [refs[i].tensor for i in perm]
            if all_cpu:
                return self._stage_streaming(step, t_call, arena, layout, tree_bytes, sources, waited,
                                             dtensors=dtensors, tied=tied, handed=handed, file=file,
                                             plan_key=plan_key)  # fmt: skip
            events = self._rt.staging.stage(arena, layout, sources, all_cpu=False)
            # everything save() did but wait for a slot: flatten, plan, allocation, copy
            staging_s = time.perf_counter() - t_call - waited
            return self._submit(
                step, t_call, arena, layout, tree_bytes, events, waited, staging_s,
                dtensors=dtensors, tied=tied, handed=handed, file=file, plan_key=plan_key,
            )  # fmt: skip
        finally:
            if not handed[0] and arena is not None:
                self._rt.staging.give_back(arena)
            with self._lock:  # still unregistered (no record took it): free the step
                if self._reserved.get(step, 0) is None:
                    del self._reserved[step]

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
        import torch  # loaded already by staging; imported here to keep this module's imports torch-free

        self._check_usable()
        _, refs = flatten(state, self.strip_prefixes, dtensors=[])
        layout, _, all_cpu = self._plan(refs)
        pin = not all_cpu and torch.cuda.is_available() and any(r.tensor.device.type == "cuda" for r in refs)
        self._rt.staging.reserve(layout.file_size, pin)

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
    ) -> SaveHandle:
        """Hand the save to the writer first, then copy: the writer streams the staged prefix
        of the arena while the rest is copied. Returns once everything is staged.

        If the copy fails (or is interrupted), the writer gives the save up (nothing is
        committed: the manifest is written only after the whole shard), this call waits for
        that to settle (so the slot and the step are free again, as if the save had never
        started) and re-raises the copy's exception; the failed save is nobody's failure to
        report later."""
        progress = StageProgress(layout.file_size)
        got: list[SaveRecord] = []
        try:
            handle = self._submit(
                step, t_call, arena, layout, tree_bytes, None, waited, 0.0,
                dtensors=dtensors, tied=tied, handed=handed, progress=progress, record_out=got,
                file=file, plan_key=plan_key,
            )  # fmt: skip
            self._staging_record = got[0]
            self._rt.staging.stage(arena, layout, sources, progress, all_cpu=True)
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
            self._staging_record = None

    def _forget_unstaged(self, record: SaveRecord) -> None:
        """A save whose copy failed: wait (bounded) until the writer gave it up, then drop it
        from the books, so flush()/close() and the next save() never report it."""
        record.reported = True
        record.silent = True
        try:
            concurrent.futures.wait([record.future], min(self.timeout, 60.0) + _MARGIN_S)
        finally:
            with self._lock:
                self._records = [r for r in self._records if r is not record]
                self._unraised = [r for r in self._unraised if r is not record]

    def _reserve(self, step: int) -> None:
        """Check ``step`` may be saved and reserve it, in one step under the lock, so two
        threads saving the same step cannot both pass: the second raises ``ValueError``.

        A committed step at or above ``step`` that is no longer resumable (known bad: a load
        fell back past it, or a verification failed; or gone) does not count: it is looked up
        (collective: rank 0 decides) only then, so a save of a new, higher step costs nothing."""
        with self._lock:
            self._settle_reserved()
            blockers = sorted(s for s in self._committed if s == step or (s > step and not self.allow_earlier_steps))
            generation = self._commits
        if self._mirror is not None and not self._store_known:
            self._look_at_store_again()
        if blockers:
            gone = self._not_resumable(blockers)
            with self._lock:
                if self._commits == generation:  # else a save committed meanwhile (of that very step?): keep all
                    self._committed.difference_update(gone)
        with self._lock:
            self._settle_reserved()
            if step in self._committed:
                raise ValueError(f"step {step} is already committed under {self.root}")
            if step in self._reserved:
                raise ValueError(f"step {step} is already being saved")
            if not self.allow_earlier_steps:
                newest = max(self._committed, default=None)
                if newest is not None and step < newest:
                    raise ValueError(
                        f"step {step} is lower than step {newest}, the newest committed checkpoint under "
                        f"{self.root}: steps must increase (keep_last and latest() go by step); pass "
                        "allow_earlier_steps=True to save earlier steps anyway"
                    )
                pending = max(self._reserved, default=None)
                if pending is not None and step < pending:
                    raise ValueError(
                        f"step {step} is lower than step {pending}, which is being saved: steps must "
                        "increase; pass allow_earlier_steps=True to save earlier steps anyway"
                    )
            if self._mirror is not None:  # tier mode: the store's steps count too (as found at construction)
                _runs.check_store_step(step, self._store_newest, self._mirror.url, self._run_id,
                                       self.allow_earlier_steps)
            self._reserved[step] = None

    def _settle_reserved(self) -> None:
        """Free the steps of settled saves (under the lock); a committed one joins ``_committed``."""
        for s, rec in list(self._reserved.items()):
            # a done future counts at once, even before its done-callback ran: the caller may
            # have seen the result already
            if rec is not None and rec.future.done():
                del self._reserved[s]
                if not rec.future.cancelled() and rec.future.exception() is None:
                    self._committed.add(s)
                    self._commits += 1

    def _not_resumable(self, steps: list[int]) -> list[int]:
        """Which of ``steps`` (committed by this job or found at start) are not resumable now
        (``_stepstates``: known bad, or gone), as rank 0 sees the root; every rank gets its answer."""

        def look() -> list[int]:
            if self._store is not None:
                from .roots.objstore._steps import step_states

                store, timeout = self._store, self.timeout
                states = run_sync(lambda: step_states(store, time.monotonic() + timeout))
            else:
                states = _discovery.step_states(self.root)
            return [s for s in steps if states.state(s) != "complete"]

        gone: list[int] = self._decided_by_leader(look)
        return gone

    def _submit(
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
    ) -> SaveHandle:
        """Hand a staged save to the writer; the arena goes back to the pool when it settles.

        ``handed[0]`` turns True the moment the save's record owns the arena and the step.
        With ``progress``, the copy is still running and the writer waits on it;
        ``record_out`` receives the save's record as soon as it exists.
        """
        with self._lock:
            self._seq += 1
            seq = self._seq
        job = SaveJob(
            step=step,
            seq=seq,
            root=self.root,
            arena=arena,
            layout=layout,
            tree=tree_bytes,
            cuda_events=events,
            nbytes=(file or layout).data_len if layout is not None else 0,
            deadline=time.monotonic() + self.timeout,
            started=t_call,
            wait_s=waited,
            staging_s=staging_s,
            keep_last=self.keep_last if self._mirror is None else None,  # tier mode: the mirror retires
            timeout=self.timeout,
            prefailed=prefailed,
            failed_commits=self._failed_commits,
            dead=self._dead,
            retention_lock=self._rt.retention_lock,
            removals=self._rt.removals,
            by_commit_order=self.allow_earlier_steps,
            ranks=self._ranks,
            dtensors=dtensors,
            dedupe=self.dedupe,
            tied=tied,
            progress=progress,
            file=file,
            plan_hint=self._plan_hint,
            plan_key=plan_key,
            run=self._run_id,
        )
        holder: list[SaveRecord] = []

        def on_state(state: SaveState) -> None:
            if holder:
                holder[0].state = state

        rt = self._rt
        # the record and its callback exist before the job can start, so an interrupt anywhere
        # in here leaves the save either tracked to its end or never run; the slot goes back
        # exactly once, by whoever gets to it first (this call's caller or the settling)
        fut: concurrent.futures.Future[CheckpointInfo] = concurrent.futures.Future()
        record = SaveRecord(step, fut)
        holder.append(record)
        me = weakref.ref(self)
        gate = StartGate()
        ranks = self._ranks

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
                owner._settle(record, ok)

        def make() -> Any:
            return _guarded(run_save(job, rt.storage, rt.coord, on_state, rt.backend), job, rt.coord.rank, ranks)

        try:
            if handed is not None:
                handed[0] = True  # from here on the settling gives the slot back
            fut.add_done_callback(settled)
            with self._lock:
                self._records.append(record)
                if step in self._reserved:
                    self._reserved[step] = record
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
                with self._lock:  # a save that never ran is nobody's failure to report later
                    self._records = [r for r in self._records if r is not record]
                    self._unraised = [r for r in self._unraised if r is not record]
            raise
        return SaveHandle(record)

    def _plan(self, refs: Sequence[Any]) -> tuple[ShardLayout, list[int], bool]:
        """The shard layout for these tensors, the permutation from ``refs`` to its slots, and
        whether every tensor is on the CPU. The layout (and the arena's copy plan, which
        hangs on the layout object) is reused while names, dtypes and shapes stay exactly
        the same; any difference in one of them, or in their order, plans anew."""
        key = [(r.name, r.tensor.dtype, r.tensor.shape) for r in refs]
        all_cpu = all(r.tensor.is_cpu for r in refs)
        if key != self._layout_key or self._layout is None:
            layout = plan_layout([(n, d, tuple(s)) for n, d, s in key], {"format": "pt", "writer": "asyncckpt"})
            index = {r.name: i for i, r in enumerate(refs)}
            self._perm = [index[s.name] for s in layout.slots]
            self._layout, self._layout_key = layout, key
        return self._layout, self._perm, all_cpu

    def _expected_file(
        self, layout: ShardLayout, perm: list[int], dtensors: list[dict[str, Any]] | None
    ) -> tuple[ShardLayout, ShardLayout | None, list[int]]:
        """With dedupe on many ranks: the arena's layout, the file this rank writes before its
        dedupe round ends (``SaveJob.file``; None: the round decides first) and the permutation
        from the flattened tensors to the arena's slots.

        A rank whose plain tensors are too few to pay for an image without them (FSDP2: step
        counters next to its shard) writes its staged file whole, whatever the round decides.
        Otherwise, once a round planned this structure, the next save expects the same plan:
        the slots it gave this rank are laid out first, and that prefix of the arena is the
        file (no copy to drop the others). The first save of a structure waits for the round.
        """
        if not _dedupe.may_pay_for_an_image(layout.slots, dtensors):
            return layout, layout, perm
        writers = self._plan_hint.writers_for(layout)
        if writers is None:
            return layout, None, perm
        keep = _dedupe.kept(layout.slots, writers, self.rank)
        if len(keep) == len(layout.slots):
            return layout, layout, perm
        key = (layout, frozenset(s.name for s in keep))
        if key != self._split_key:
            names = key[1]
            specs = [(s.name, ST_TO_DTYPE[s.dtype], s.shape) for s in layout.slots]
            staging, file = plan_split_layout(
                [x for x in specs if x[0] in names], [x for x in specs if x[0] not in names],
                {"format": "pt", "writer": "asyncckpt"},
            )  # fmt: skip
            if round_up(staging.file_size) > round_up(layout.file_size):
                # alignment padding would need a larger arena than the structure's (what
                # reserve() allocated): let the round decide first instead
                self._split = None
            else:
                at = {s.name: i for i, s in enumerate(layout.slots)}
                self._split = (staging, file, [perm[at[s.name]] for s in staging.slots])
            self._split_key = key
        if self._split is None:
            return layout, None, perm
        return self._split

    def _settle(self, record: SaveRecord, ok: bool) -> None:
        info = record.future.result() if ok else None
        with self._lock:
            if self._reserved.get(record.step) is record:
                del self._reserved[record.step]
            if record.silent:  # its copy failed in save(), which raised that: not a save failure
                self._records = [r for r in self._records if r is not record]
                return
            if ok:
                self._committed.add(record.step)
                self._commits += 1
                if record in self._records:
                    self._records.remove(record)
            else:
                self._unraised.append(record)
            self._totals.add(info)
        if info is not None and self._mirror is not None and (self.rank == 0 or self._nodes is not None):
            self._track_upload(info)  # tier mode: upload in the background (node-local: on every rank)
        if info is not None and self._on_commit is not None:
            try:
                self._on_commit(info)
            except BaseException:  # on the writer thread: even SystemExit must not kill it
                log.exception("asyncckpt on_commit callback raised")

    def statistics(self) -> CheckpointerStatistics:
        """A frozen snapshot: running totals over this Checkpointer's saves, and the last one."""
        with self._lock:
            return self._totals.snapshot()

    def install_sigterm_handler(
        self, grace_s: float = 30.0, final_save: Callable[[Checkpointer], object] | None = None
    ) -> None:
        """On SIGTERM: optionally take a final save, flush within ``grace_s``, then let the
        previous handler (by default: termination by the signal) proceed.

        ``final_save(ckpt)`` runs inside the signal handler on the main thread and should
        call ``ckpt.save(...)``. Everything the handler waits for (the final save's staging
        slot, the flush) shares one deadline, ``grace_s`` after the signal; if the signal
        lands inside a ``save()`` on the main thread, the final save does not wait for the
        slot that save holds but stages into a spare buffer. If the final save or flush fails
        or runs out of time, the failure is printed and the process exits with status 1.
        Call from the main thread (Python's signal rule).
        """
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("install_sigterm_handler() must be called from the main thread")
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s <= 0:
            raise ValueError(f"grace_s must be a positive number, not {grace_s!r}")
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            # one deadline for all of it (final save's slot wait, staging, flush): the process is
            # gone within grace_s, whatever it was doing when the signal came
            self._grace_end = time.monotonic() + grace_s
            self._sigterm_seen = True
            # the signal may have landed inside save() on this thread, which holds (or waits for)
            # a staging slot it will not give back before this handler returns
            self._interrupted_save = _inside_save(frame, self)
            try:
                if not self._closed:  # closed (or closing): its saves are flushed already
                    # a save whose copy this signal interrupted cannot finish before the handler
                    # returns: the flush waits for every other one
                    interrupted = self._staging_record if self._interrupted_save else None
                    if final_save is not None:
                        final_save(self)
                    # the removal of retired steps is left to run (or to the next start): a
                    # slow deletion must not turn a good final save into a failed exit
                    self._flush(max(0.0, self._grace_end - time.monotonic()), skip=interrupted, removals=False)
            except BaseException as e:  # noqa: BLE001 - reported, then the exit status says it
                print(f"asyncckpt: final flush on SIGTERM failed: {_describe(e)}", file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            finally:
                self._grace_end = None
                self._interrupted_save = False
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signal.SIGTERM)  # the default action: die by the signal

        signal.signal(signal.SIGTERM, on_sigterm)

    def _acquire_slot(self, nbytes: int) -> tuple[Arena, float]:
        """A staging arena for the next save: wait for a slot, bounded by the save timeout, or
        by the grace period inside the SIGTERM handler. A final save that interrupted another
        save() on this thread cannot wait for the slot that save holds: it stages into a spare
        buffer instead (freed when it settles)."""
        grace_end = self._grace_end
        if grace_end is None:
            return self._rt.staging.acquire(nbytes, self.timeout + _MARGIN_S)
        if self._interrupted_save:
            try:
                return self._rt.staging.acquire(nbytes, 0.0)
            except TimeoutError:
                return self._rt.staging.spare(nbytes), 0.0
        return self._rt.staging.acquire(nbytes, min(self.timeout + _MARGIN_S, max(0.0, grace_end - time.monotonic())))

    def _surface_earlier_failure(self) -> None:
        with self._lock:
            pending, self._unraised = self._unraised, []
        # a failure the caller already saw on its handle (result(), exception(), await) is
        # not raised again here; flush()/close() still report it
        pending = [r for r in pending if not r.reported]
        if not pending:
            return
        if self.on_error == "warn":
            for r in pending:
                warnings.warn(f"asyncckpt: {r.failure()}", RuntimeWarning, stacklevel=3)
            return
        first = pending[0]
        first.mark_reported()
        exc = first.failure()
        assert exc is not None
        for other in pending[1:]:
            exc.add_note(f"also failed: step {other.step}: {other.failure()}")
            other.mark_reported()
        raise exc

    # ------------------------------------------------------------------ waiting
    def _pending_futures(self, local_only: bool = False) -> list[concurrent.futures.Future[CheckpointInfo]]:
        with self._lock:
            return [r.future for r in self._records if not (local_only and isinstance(r, UploadRecord))]

    def _uploads_to_wait_for(self, local_only: bool) -> bool:
        """Tier mode, after the local saves settled: whether to wait for uploads too. True
        only once every settled save has handed its step to the mirror: ``_settle`` runs on
        the writer loop right after a save's future resolves, so one round trip through that
        loop orders this after it."""
        if local_only or self._mirror is None or (self.rank != 0 and self._nodes is None) or self._rt.stopped:
            return False
        self._rt.writer.submit(asyncio.sleep(0)).result(_MARGIN_S)
        return True

    def _raise_failures_since_flush(self) -> None:
        with self._lock:
            failed = [r for r in self._records if r.future.done()]
            self._records = [r for r in self._records if not r.future.done()]
            self._unraised = [r for r in self._unraised if r not in failed]
        failed = [r for r in failed if r.failure() is not None]
        if not failed:
            return
        for r in failed:
            r.mark_reported()
        exc = failed[0].failure()
        assert exc is not None
        for other in failed[1:]:
            note = f"also failed: step {other.step}: {other.failure()}"
            if note not in getattr(exc, "__notes__", []):
                exc.add_note(note)
        raise exc

    def flush(self, timeout: float | None = None, *, local_only: bool = False) -> None:
        """Wait for every pending save; raise ``SaveError`` if any failed since the last flush.

        In tier mode (``mirror=``) also wait until the newest committed step is uploaded
        (its upload, or a failed one's ``SaveError``); ``local_only=True`` waits for local
        durability only (upload failures already known are still raised).
        Raises the builtin ``TimeoutError`` if saves are still running after ``timeout``
        seconds (they keep running).
        """
        self._flush(timeout, local_only=local_only)

    def _flush(
        self, timeout: float | None, skip: SaveRecord | None = None, local_only: bool = False, removals: bool = True
    ) -> None:
        self._check_not_in_writer()
        self._check_not_forked()
        end = None if timeout is None else time.monotonic() + timeout
        futures = [f for f in self._pending_futures(local_only=True) if skip is None or f is not skip.future]
        _, not_done = concurrent.futures.wait(futures, timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} save(s) still running after {timeout}s")
        removing = self._removals_future() if removals else None
        if removing is not None:
            done, _ = concurrent.futures.wait([removing], None if end is None else max(0.0, end - time.monotonic()))
            if not done:
                removing.cancel()  # stops the waiting, not the removals
                raise TimeoutError(f"removing retired checkpoints still running after {timeout}s")
        if self._uploads_to_wait_for(local_only):
            left = None if end is None else max(0.0, end - time.monotonic())
            _, not_done = concurrent.futures.wait(self._pending_futures(), left)
            if not_done:
                raise TimeoutError(f"{len(not_done)} upload(s) to {self._mirror_url()} still running after {timeout}s")
        self._raise_failures_since_flush()

    def _removals_future(self) -> concurrent.futures.Future[None] | None:
        return self._rt.removals_future()

    def _mirror_url(self) -> str:
        return "" if self._mirror is None else self._mirror.url

    async def aflush(self, timeout: float | None = None, *, local_only: bool = False) -> None:
        """:meth:`flush` for asyncio code: waits without blocking the running loop."""
        self._check_not_in_writer()
        self._check_not_forked()
        end = None if timeout is None else time.monotonic() + timeout
        futures = [asyncio.shield(asyncio.wrap_future(f)) for f in self._pending_futures(local_only=True)]
        if futures:
            _, not_done = await asyncio.wait(futures, timeout=timeout)
            if not_done:
                raise TimeoutError(f"{len(not_done)} save(s) still running after {timeout}s")
        removing = self._removals_future()
        if removing is not None:
            left = None if end is None else max(0.0, end - time.monotonic())
            waiting: asyncio.Future[None] = asyncio.wrap_future(removing)
            _, still = await asyncio.wait([waiting], timeout=left)
            if still:
                removing.cancel()  # stops the waiting, not the removals
                raise TimeoutError(f"removing retired checkpoints still running after {timeout}s")
        if await asyncio.to_thread(self._uploads_to_wait_for, local_only):
            uploads = [asyncio.shield(asyncio.wrap_future(f)) for f in self._pending_futures()]
            if uploads:
                left = None if end is None else max(0.0, end - time.monotonic())
                _, not_done = await asyncio.wait(uploads, timeout=left)
                if not_done:
                    raise TimeoutError(f"{len(not_done)} upload(s) to {self._mirror_url()} still running after "
                                       f"{timeout}s")
        self._raise_failures_since_flush()

    # ------------------------------------------------------------------ closing
    def close(self, timeout: float | None = None) -> None:
        """Flush, then stop the writer thread; raises what :meth:`flush` raises. Idempotent.

        Interrupted (Ctrl-C) while saves are pending, it stops the writer at once, which
        leaves each pending step either committed or not there at all (the previous
        checkpoint stays the latest), prints which, and re-raises. In a forked child it only
        marks this copy closed: the parent's writer is not there.
        """
        if self._closed:
            return
        if self._rt.forked:
            self._closed = True
            return
        try:
            self.flush(timeout)
        except KeyboardInterrupt:
            self._closed = True
            self._abandon_pending("close() was interrupted")
            raise
        finally:
            self._closed = True
            self._rt.stop(self.timeout)

    def _abandon_pending(self, why: str) -> None:
        """Stop the writer now and print what became of each pending save (stderr)."""
        with self._lock:
            pending = [r for r in self._records if not r.future.done()]
        self._rt.stop(_MARGIN_S, collective=False)
        known = True
        try:  # bounded: the user interrupted to get out (a store that does not answer must not hold them)
            newest = self._find_latest(deadline_s=min(10.0, self.timeout))
            newest_s = f"step {newest.step}" if newest is not None else "none"
        except (OSError, CheckpointError) as e:
            newest, newest_s, known = None, f"unknown ({type(e).__name__}: the store did not answer)", False
        for r in pending:
            r.mark_reported()  # said here: the exit hook must not report it again
            committed = r.future.done() and r.failure() is None
            if not committed:
                committed = newest is not None and newest.step == r.step
            if committed:
                fate = "committed"
            elif known:
                fate = "abandoned before its commit (not on disk; its leftover is removed at the next start)"
            else:
                fate = "abandoned; whether its commit landed could not be checked"
            print(
                f"asyncckpt: {why}: save of step {r.step} under {self.root} {fate}; "
                f"newest complete checkpoint: {newest_s}",
                file=sys.stderr,
            )
        sys.stderr.flush()

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` for asyncio code."""
        if self._closed:
            return
        if self._rt.forked:
            self._closed = True
            return
        try:
            await self.aflush(timeout)
        finally:
            self._closed = True
            await asyncio.to_thread(self._rt.stop, self.timeout)

    @property
    def closed(self) -> bool:
        return self._closed

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
        rt = getattr(self, "_rt", None)
        if rt is None or self._closed or rt.stopped or rt.forked:
            return
        pending = [r.future for r in list(self._records) if not r.future.done()]
        if pending:
            warnings.warn(
                f"asyncckpt Checkpointer({self.root!r}) garbage-collected with {len(pending)} "
                "pending save(s): they finish in the background, then its root is released; "
                "call flush()/close() before dropping it",
                RuntimeWarning,
                stacklevel=2,
            )
        # nothing pending: stopped (and the root released) before the drop returns
        rt.stop_when_idle(pending, self.timeout + _MARGIN_S)

    # ------------------------------------------------------------------ reading
    def _decided_by_leader(self, compute: Any) -> Any:
        """Rank 0 computes a JSON value and every rank gets that same value (collective)."""
        if self._dist is None:
            return compute()
        self._check_not_forked()  # the store connection is the parent's: a child must not speak on it
        self._queries += 1
        return self._dist.share(f"q/{self._queries}", compute if self.rank == 0 else None, self.timeout)

    def latest(self) -> CheckpointInfo | RemoteCheckpointInfo | None:
        """The newest complete checkpoint under ``root``, or ``None``.

        In tier mode (``mirror=``) the newest complete step of this job's run (:attr:`run_id`)
        on either tier: a :class:`RemoteCheckpointInfo` when the store holds a newer step than
        ``root`` (a new node with an empty disk), the local :class:`CheckpointInfo` otherwise;
        the store's steps of another run are never chosen (a WARNING names them); a store that
        cannot be reached raises its ``ObjectStoreError``.
        With many ranks this is collective: rank 0 looks and every rank gets its answer.
        """

        def look() -> Any:
            info = self._find_latest()
            if self._store is not None:  # an object-store root: a RemoteCheckpointInfo or None
                return None if info is None else [info.step, info.url, info.nbytes, info.world_size,
                                                  info.created, info.attempt, info.run]  # type: ignore[union-attr]
            if self._mirror is not None:
                far = self._mirror.latest()  # this run's newest there (another run's: never)
                if far is not None and (info is None or far.step > info.step):
                    return [far.step, far.url, far.nbytes, far.world_size, far.created, far.attempt, far.run]
            return None if info is None else [info.step, info.nbytes, info.world_size, info.created, info.run]

        # every rank takes rank 0's whole answer: re-reading the directory here could race
        # with rank 0's next save (retention, or replacing a commit that was taken back)
        found = self._decided_by_leader(look)
        if found is None:
            return None
        if len(found) == 7:
            from .roots.objstore._remote import RemoteCheckpointInfo

            return RemoteCheckpointInfo(*found)
        step, nbytes, world_size, created, run = found
        return CheckpointInfo(step, Path(self.root) / step_dir_name(step), nbytes, world_size, created, run=run)

    def steps(self) -> list[int]:
        """Every complete step under ``root``, ascending (collective with many ranks)."""
        if self._store is not None:
            return self._decided_by_leader(lambda: sorted(_remote_steps(self._store, self.timeout)))  # type: ignore[no-any-return]
        steps: list[int] = self._decided_by_leader(lambda: [i.step for i in _discovery.complete_checkpoints(self.root)])
        return steps

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
        lacks raises ``CheckpointError`` (also a ``KeyError``), a shape mismatch ``ValueError``.

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
        if step is not None:
            check_step(step)
        if rank is not None and (not _is_int(rank) or rank < 0):
            raise (TypeError if not _is_int(rank) else ValueError)(f"rank must be a non-negative int, not {rank!r}")
        if per_rank not in _load_global.PER_RANK:
            raise ValueError(f"per_rank must be one of {_load_global.PER_RANK}, not {per_rank!r}")
        verify = self.verify if verify is None else verify
        expect = self.world_size if rank is None else None
        shard = self.rank if rank is None else rank
        # collective: an indexed step is read into the targets only after every rank agreed
        defer = self._dist is not None
        if type(verify_first) is not bool:
            raise TypeError(f"verify_first must be a bool, not {type(verify_first).__name__}")
        reader = _load_global.Reader(
            self.world_size, self.rank, rank, per_rank, into, self.strip_prefixes, defer, verify_first
        )
        # one pause of the collector for the whole load and restore (_gcpause: see _load.load_files)
        with _load.noting_partial_targets(reader), paused_gc():
            return self._load(step, shard, verify, mmap, expect, reader)

    def _load(
        self, step: int | None, shard: int, verify: bool, mmap: bool, expect: int | None,
        reader: _load_global.Reader,
    ) -> Any:  # fmt: skip
        """``load``'s body, its arguments checked."""
        into = reader.into
        if self._store is not None:
            state = self._load_store_root(step, shard, verify, mmap, expect, reader)
            if into is not None:
                _load.restore_into(into, state, strip_prefixes=self.strip_prefixes)
            return state
        chosen = None if self._nodes is not None else self._remote_choice(step)
        if self._nodes is not None:  # the node-local tier: each rank reads its part on its node, else the store
            state = self._load_node_part(step, shard, verify, mmap)
        elif chosen is not None:  # tier mode: the step is on the store only, or newer there
            far, attempt = _runs.unpack(chosen)
            if mmap:
                raise ValueError(f"mmap=True needs a local step; step {far} is only on the store "
                                 f"({self._mirror_url()}): load it without mmap")
            state = self._load_remote(far, step is None, shard, verify, expect, reader, attempt)
        elif self._dist is None:
            # into=: tensors read into in place once their shard verified (_load.plan_targets)
            kw = {"into": into, "strip_prefixes": self.strip_prefixes, "mmap": mmap,
                  "deadline": time.monotonic() + self.timeout}  # an I/O fault is retried within it
            if step is None:
                _, state = _resume.load_newest(
                    self.root, rank=shard, verify=verify, world_size=expect, reader=reader, **kw
                )
            else:
                state = _resume.load_step(
                    self.root, step, rank=shard, verify=verify, world_size=expect, reader=reader, **kw
                )
        else:
            state = self._load_agreed(step, shard, verify, expect, reader, mmap)
        if into is not None:
            _load.restore_into(into, state, strip_prefixes=self.strip_prefixes)
        return state

    def _load_node_part(self, step: int | None, shard: int, verify: bool, mmap: bool) -> Any:
        """:meth:`load` on a node-local root (``loading._nodeload``)."""
        assert self._dist is not None
        if shard != self.rank or mmap:
            raise ValueError("node_local=True loads each rank's own part: rank= and mmap=True are not supported")
        store = None
        if self._mirror is not None:
            m = self._mirror
            listed = _nodeparts.store_steps(m.url, m.storage_options, self.timeout) if self.rank == 0 else None
            store = (m.url, m.storage_options, listed)
        self._queries += 1
        return _nodeload.load_part(self._dist, f"q/{self._queries}/node-load", self.root, step, verify, self.timeout,
                                   store)[1]  # fmt: skip

    def _find_latest(
        self, deadline_s: float | None = None, skip: frozenset[int] = frozenset()
    ) -> CheckpointInfo | RemoteCheckpointInfo | None:
        """The newest complete step of this Checkpointer's root (no collective); on a store
        within ``deadline_s`` (default: ``timeout``), passing over the steps in ``skip``."""
        if self._store is not None:
            from .roots.objstore._remote import newest_complete

            store, timeout = self._store, self.timeout if deadline_s is None else deadline_s
            found = run_sync(lambda: newest_complete(store, time.monotonic() + timeout, skip))
            return None if found is None else _remote_info(store, found[0])
        return _discovery.newest_complete(self.root)

    def _load_store_root(
        self, step: int | None, shard: int, verify: bool, mmap: bool, expect: int | None,
        reader: _load_global.Reader,
    ) -> Any:
        """``load()`` under an object-store root: each rank reads its own shard with ranged
        GETs, verified. One process: the newest step that verifies (``_remote_load``). Many
        ranks: the collective protocol of the file system (:meth:`_load_agreed`): rank 0
        picks, every rank tries, and all take one decision (a shard corrupt on any rank makes
        every rank fall back to the same older step; an explicit step raises on every rank)."""
        from .loading import _remote_load

        if mmap:
            raise ValueError(f"mmap=True needs a local root, not {self.root}")
        if self._dist is not None:
            return self._load_agreed(step, shard, verify, expect, reader)
        return _remote_load.load(
            self.root, step, into=reader.into, verify=verify, rank=shard, storage_options=self._storage_options,
            deadline_s=self.timeout, reader=reader, world_size=expect,
        )  # fmt: skip

    def _load_store_step(
        self, step: int, shard: int, verify: bool, expect: int | None, reader: _load_global.Reader,
        attempt: str | None = None,
    ) -> Any:  # fmt: skip
        """One rank's attempt at ``step`` on the store; a step retired meanwhile (its manifest
        or an object gone) is ``CheckpointNotFoundError`` (``_remote_load``), so the ranks
        agree to retry. As on a file system: a step without a global index is read into the
        targets at once unless ``verify_first`` (then restored once every rank verified); an
        indexed one defers inside ``reader``. ``attempt``: the commit rank 0 chose (``_runs``)."""
        from .loading import _remote_load

        return _remote_load.load(
            self.root, step, into=None if reader.verify_first else reader.into, verify=verify, rank=shard,
            storage_options=self._storage_options, deadline_s=self.timeout, reader=reader, world_size=expect,
            expect=attempt,
        )  # fmt: skip

    def _remote_choice(self, step: int | None) -> list[Any] | None:
        """Tier mode: the commit to load from the store (``_runs.choice``; ``None``: load
        locally, as without a mirror). The newest complete step of this run on either tier
        (the store's steps of another run are never chosen), local when both hold it; an
        explicit step comes from the store only when it is not complete locally. Decided by
        rank 0, which names the commit's attempt so that every rank reads that one."""
        if self._mirror is None:
            return None

        def pick() -> list[Any] | None:
            assert self._mirror is not None
            if step is not None:
                if step in [i.step for i in _discovery.complete_checkpoints(self.root)]:
                    return None
                return _runs.store_choice(self._mirror.store, step, self.timeout, self._run_id)
            far = self._mirror.latest(warn=True)
            near = _discovery.newest_complete(self.root)
            if far is not None and (near is None or far.step > near.step):
                return [far.step, far.attempt, far.run]
            return None

        chosen: list[Any] | None = self._decided_by_leader(pick)
        return chosen

    def _load_remote(
        self, step: int, fall_back: bool, shard: int, verify: bool, expect: int | None, reader: _load_global.Reader,
        attempt: str | None = None,
    ) -> Any:  # fmt: skip
        """Load ``shard`` of ``step`` (commit ``attempt``, see ``_runs``) from the mirror (into
        ``reader``'s targets, resharding DTensors, as a local load would); with ``fall_back``
        (``load()`` with no step) a step that does not verify is logged and the newest older
        one of this run on either tier loads instead. Each rank reads its own shard (no
        agreement round: see README), so a read ``reader`` defers is finished at once."""
        from .loading import _remote_load

        assert self._mirror is not None
        mirror = self._mirror

        def from_store(s: int, expected: str | None = None) -> Any:
            state = _remote_load.load(
                mirror.url, s, into=reader.into, verify=verify, rank=shard, storage_options=mirror.storage_options,
                reader=reader, world_size=expect, expect=expected,
            )  # fmt: skip
            reader.finish()
            return state

        try:
            return from_store(step, attempt)
        except CheckpointCorruptError as e:
            if not fall_back:
                raise
            log.warning("asyncckpt: remote step %d under %s does not verify (%s); falling back", step, mirror.url, e)
        near = _discovery.newest_complete(self.root)
        if near is not None:
            state = _resume.load_newest(self.root, rank=shard, verify=verify, world_size=expect, into=reader.into,
                                        strip_prefixes=self.strip_prefixes, reader=reader,
                                        deadline=time.monotonic() + self.timeout)[1]  # fmt: skip
            reader.finish()
            return state
        tried = {step}  # the older steps of this run on the store, newest first (never another run's)
        for _ in range(_MAX_LOAD_ROUNDS):
            older = mirror.latest(skip=frozenset(tried))
            if older is None:
                break
            try:
                return from_store(older.step)
            except (CheckpointCorruptError, CheckpointNotFoundError) as e:
                log.warning("asyncckpt: remote step %d under %s cannot be loaded (%s); falling back", older.step,
                            mirror.url, e)  # fmt: skip
                tried.add(older.step)
        raise CheckpointNotFoundError(f"no complete checkpoint of this run under {self.root} or {mirror.url} "
                                      "verifies")

    def _load_agreed(
        self,
        step: int | None,
        shard: int,
        verify: bool,
        expect: int | None,
        reader: _load_global.Reader,
        mmap: bool = False,
    ) -> Any:
        """The collective part of :meth:`load`: choose, try on every rank, agree, repeat."""
        assert self._dist is not None
        rejected: dict[int, CheckpointCorruptError] = {}
        for _ in range(_MAX_LOAD_ROUNDS):

            # rank 0 names the exact commit (step, attempt, run: _runs.choice); every rank checks
            # that the manifest it reads is that attempt, so none reads another commit's files
            def pick() -> Any:
                if step is not None:
                    if self._store is not None:
                        return _runs.store_choice(self._store, step, self.timeout, None)
                    return _runs.local_choice(self.root, step)
                if self._store is not None:
                    found = self._find_latest(skip=frozenset(rejected))
                    return None if found is None else [found.step, found.attempt, found.run]  # type: ignore[union-attr]
                skipped: dict[int, CheckpointCorruptError] = {}
                info = _discovery.newest_complete(self.root, frozenset(rejected), skipped)
                for s, e in sorted(skipped.items(), reverse=True):
                    if s not in rejected:
                        _resume.warn_corrupt(self.root, s, e)
                        rejected[s] = e
                return None if info is None else _runs.local_choice(self.root, info.step)

            # an I/O fault of rank 0's look is raised on every rank (none waits for a choice)
            retry_until = time.monotonic() + self.timeout / 2
            picked = _resume.picked(self._decided_by_leader(functools.partial(_resume.leader_pick, pick, retry_until)))
            if picked is None:
                raise _resume.no_checkpoint(self.root, rejected)
            chosen, attempt = _runs.unpack(picked)
            state: Any = None
            error: BaseException | None = None
            report: dict[str, Any] = {}
            try:
                if self._store is not None:
                    state = self._load_store_step(chosen, shard, verify, expect, reader, attempt)
                else:
                    # one pass: straight into the targets; verify_first: fresh tensors, restored
                    # once every rank verified (an indexed step defers inside the reader); an
                    # I/O fault is tried again first, leaving the others time to wait for us
                    into = None if reader.verify_first else reader.into
                    state = _readfault.retrying(
                        functools.partial(_resume.attempt, self.root, chosen, shard, verify, expect, into,
                                          reader.strip_prefixes, reader=reader, mmap=mmap, report=report,
                                          expect=attempt),
                        retry_until,
                    )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported to the others, raised below if it decides
                error = e
            self._queries += 1
            try:
                verdict = _agree.agree(
                    self._dist,
                    f"q/{self._queries}/load",
                    _resume.outcome_of(error, report),
                    lambda outcomes: _resume.decide(step is not None, outcomes),
                    self.timeout,
                )
            except BaseException:
                reader.abandon()
                raise
            kind = verdict["kind"]
            if kind == "ok":
                reader.finish()
                if verdict.get("full") and self.rank == 0:  # every file of the step verified
                    _resume.unmark(self.root, chosen, verdict["attempt"])
                return state
            reader.abandon()
            if kind == "error":
                if error is not None:
                    if isinstance(error, _discovery.Vanished | NoSuchShard):
                        raise CheckpointNotFoundError(str(error)) from None
                    raise error
                raise _resume.error_from(chosen, verdict["failures"])
            if kind == "fallback":
                failures = verdict["failures"]
                r, first = min(failures.items(), key=lambda kv: int(kv[0]))
                _resume.warn_corrupt(self.root, chosen, first["msg"], f" on rank {r}")
                rejected[chosen] = CheckpointCorruptError(f"rank {r}: {first['msg']}")
                if self.rank == 0 and error is None and attempt is not None and self._store is None:
                    # rank 0 decides the step rules: it must know even if rank r's mark was not written
                    _resume.mark(self.root, chosen, attempt, CheckpointCorruptError(first["msg"], first["path"]))
            # "retry": the choice was retired meanwhile; rank 0 looks again
            del state
        raise CheckpointNotFoundError(
            f"no checkpoint under {self.root} stayed in place long enough to load ({_MAX_LOAD_ROUNDS} tries)"
        )

    # ------------------------------------------------------------------ internals
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this Checkpointer is closed")
        self._check_not_forked()
        self._check_not_in_writer()

    def _check_not_forked(self) -> None:
        if self._rt.forked:
            raise RuntimeError(
                f"this Checkpointer belongs to process {self._rt.pid}; a forked child cannot save or "
                "wait with it (its writer thread did not survive the fork): build a new one in the child"
            )

    def _check_not_in_writer(self) -> None:
        if self._rt.writer.in_writer():
            raise RuntimeError("asyncckpt: blocking call from the writer thread would deadlock")

    def _unreported_failures(self) -> list[SaveRecord]:
        with self._lock:
            recs = list(self._records) + [r for r in self._unraised if r not in self._records]
        return [r for r in recs if r.future.done() and r.failure() is not None and not r.reported]


async def _guarded(coro: Any, job: SaveJob, rank: int, ranks: Sequence[int] = ()) -> CheckpointInfo:
    """Bound the whole save by its deadline and turn any escape into a ``SaveError``.

    Every phase of a save is bounded by its deadline (``_commit``), so this is a backstop
    for a rank whose own calls overran it. A follower still waiting here past the deadline
    is waiting on rank 0: the coordinator, which usually also hosts the c10d store (a
    stopped rank 0 freezes the store, so no store call of ours can complete). It names rank
    0, within timeout + 2.5 s. Rank 0 past its deadline here names itself: no wait of its
    own is for another rank beyond the deadline.
    """
    follower = rank != 0
    remaining = job.deadline - time.monotonic() + _GUARD_S
    try:
        result: CheckpointInfo = await asyncio.wait_for(coro, remaining)
        return result
    except SaveError:
        raise
    except TimeoutError as e:
        if follower:
            failure = RankFailure(0, "TimeoutError", "rank 0 (the coordinator and store host) did not answer in time")
            failures = with_global_ranks({0: failure}, ranks)
            raise SaveTimeoutError(job.step, failures, missing=(0,), detail="rank 0 did not answer") from e
        failure = RankFailure(rank, "TimeoutError", f"the save did not finish within its {job.timeout:.1f}s deadline")
        raise SaveTimeoutError(job.step, with_global_ranks({rank: failure}, ranks)) from e
    except Exception as e:
        raise SaveError(job.step, with_global_ranks({rank: RankFailure.from_exception(rank, e)}, ranks)) from e


def load(
    root: str | os.PathLike[str],
    step: int | None = None,
    *,
    into: Any = None,
    verify: bool = True,
    rank: int | None = None,
    strip_prefixes: Sequence[str] = (),
    per_rank: _load_global.PerRank = "error",
    storage_options: dict[str, str] | None = None,
    mmap: bool = False,
    verify_first: bool = False,
) -> Any:
    """Load rank ``rank``'s state (default 0) of a complete checkpoint under ``root`` (no Checkpointer needed).

    A checkpoint holding DTensors comes back with full global tensors (or, into DTensors
    of ``into=``, their local shards). Its other values are per rank: ``rank=`` picks the
    saved rank; without it they load only where every saved rank holds the same values,
    else ``CheckpointError`` names the keys, unless ``per_rank="rank0"``.

    ``step=None`` loads the newest checkpoint that verifies: a corrupt newest one is logged
    (WARNING, naming the file) and the next newest is loaded. An explicit ``step`` raises
    ``CheckpointNotFoundError`` if it is missing or was retired while being read and
    ``CheckpointCorruptError`` if it fails verification. A read that fails on I/O is tried
    again a few times (about 2 s of pauses), then raises ``CheckpointReadError`` naming the
    file, whatever ``step``: never a fallback, never a bad mark. With ``into=``, restores in place
    (tensors read straight into and checksummed as they land, see :meth:`Checkpointer.load`:
    a step that fails may leave them partly overwritten; ``verify_first=True`` writes no
    target before the whole state verified). Needs no ownership of the root:
    any number of readers may run while a job writes.

    ``strip_prefixes`` as for :class:`Checkpointer`: wrapper prefixes matched at ``into=``.
    ``root`` may be an ``s3://bucket/prefix`` URL (see :mod:`asyncckpt.remote`), with
    ``storage_options`` for its store.

    ``mmap=True`` returns tensors backed by the shard file (a private, copy-on-write mapping:
    nothing is copied, pages are read when first touched, writes never reach the file), for
    inspection and export of checkpoints larger than memory. With ``verify`` (the default)
    the shard's CRC-32C is checked once, up front, by streaming it through small buffers (no
    copy kept); ``verify=False`` reads nothing until touched. The tensors stay valid after
    retention removes the step (the mapping holds the file). Raises ``ValueError`` with
    ``into=``, for an ``s3://`` root, and for a step with a global index (DTensors, dedupe).
    """
    _load.check_mmap(mmap, into)
    if type(verify_first) is not bool:
        raise TypeError(f"verify_first must be a bool, not {type(verify_first).__name__}")
    if is_url(root):
        if mmap:
            raise ValueError("mmap=True needs a local root, not an s3:// URL")
        from .remote import load as load_remote

        return load_remote(
            root, step, into=into, verify=verify, rank=rank, strip_prefixes=strip_prefixes, per_rank=per_rank,
            verify_first=verify_first, storage_options=storage_options,
        )  # fmt: skip
    prefixes = check_strip_prefixes(strip_prefixes)
    if step is not None:
        check_step(step)
    if rank is not None and (not _is_int(rank) or rank < 0):
        raise (TypeError if not _is_int(rank) else ValueError)(f"rank must be a non-negative int, not {rank!r}")
    if per_rank not in _load_global.PER_RANK:
        raise ValueError(f"per_rank must be one of {_load_global.PER_RANK}, not {per_rank!r}")
    root_s = os.fspath(root)
    reader = _load_global.Reader(1, 0, rank, per_rank, into, prefixes, verify_first=verify_first)
    shard = 0 if rank is None else rank
    kw = {"into": into, "strip_prefixes": prefixes, "reader": reader, "mmap": mmap}
    # one pause of the collector for the whole load and restore (_gcpause: see _load.load_files)
    with _load.noting_partial_targets(reader), paused_gc():
        return _load_and_restore(root_s, step, shard, verify, kw)


def _load_and_restore(root: str, step: int | None, shard: int, verify: bool, kw: dict[str, Any]) -> Any:
    """:func:`load`'s body, its arguments checked (a function: its temporaries die inside the pause)."""
    if step is None:
        _, state = _resume.load_newest(root, rank=shard, verify=verify, **kw)
    else:
        state = _resume.load_step(root, step, rank=shard, verify=verify, **kw)
    if kw["into"] is not None:
        _load.restore_into(kw["into"], state, strip_prefixes=kw["strip_prefixes"])
    return state


def _spread_replica_writes(
    found: list[tuple[str, Any, Any]], refs: list[TensorRef]
) -> tuple[list[tuple[str, Any, Any]], list[TensorRef]]:
    """``flatten``'s DTensors and tensors with each replicated box written by the replica
    ``_sharding.spread_writers`` picks instead of the lowest one (HSDP: spread over the
    replica dim); the tensors to stage follow: this rank's local shards it now writes."""
    from .format import _sharding

    infos = _sharding.spread_writers([info for _, info, _ in found])
    before = {name for name, info, _ in found if info.writer}
    spread = [(name, info, dt) for (name, _, dt), info in zip(found, infos, strict=True)]
    after = {name: info for name, info, _ in spread if info.writer}
    if before == after.keys():
        return spread, refs
    kept = [r for r in refs if r.name not in before or r.name in after]
    added = [TensorRef(name, info.local.detach()) for name, info in after.items() if name not in before]
    return spread, kept + added


def _inside_save(frame: Any, ck: Checkpointer) -> bool:
    """True if ``frame`` (where a signal interrupted this thread) is inside ``ck.save()``."""
    while frame is not None:
        if frame.f_code is Checkpointer.save.__code__ and frame.f_locals.get("self") is ck:
            return True
        frame = frame.f_back
    return False


def _describe(exc: BaseException | None) -> str:
    """``str(exc)``, never empty (a bare ``KeyboardInterrupt()`` or ``CancelledError()``)."""
    if exc is None:
        return "no error"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _global_ranks(process_group: Any, world_size: int) -> tuple[int, ...]:
    """The global ranks of the group's members, in group-rank order."""
    import torch.distributed as dist

    if process_group is None or process_group is dist.group.WORLD:
        return tuple(range(world_size))
    return tuple(dist.get_process_group_ranks(process_group))


def _step_of(info: CheckpointInfo | None) -> int | None:
    return None if info is None else info.step


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _exit_hook() -> None:
    """At exit: finish pending saves (bounded), print unseen failures, exit non-zero if any."""
    unseen: list[str] = []
    settle = False
    for ck in list(_live):
        if ck._rt.forked:
            continue  # a forked child: the saves belong to the parent, which waits for them
        if not ck._closed:
            # wait without marking anything reported: what nobody saw is printed below
            concurrent.futures.wait(ck._pending_futures(), ck.timeout + _MARGIN_S)
            if ck._mirror is not None:  # tier mode: and the uploads of what just committed
                try:
                    if ck._uploads_to_wait_for(False):
                        concurrent.futures.wait(ck._pending_futures(), ck.timeout + _MARGIN_S)
                except Exception:  # noqa: BLE001 - the writer is gone: nothing more will upload
                    pass
            if not ck._sigterm_seen:
                # the files of the steps retention retired (a save settles before they are
                # deleted): stopping the writer now would leave them for the next start
                removing = ck._removals_future()
                if removing is not None:
                    concurrent.futures.wait([removing], ck.timeout + _MARGIN_S)
        failures = ck._unreported_failures()
        if not ck._closed:
            try:
                ck._closed = True
                ck._rt.stop(_MARGIN_S)
            except BaseException:  # noqa: BLE001
                pass
            if ck._store is not None or ck._mirror is not None:
                # its lease was just released through obstore, after obstore's own exit hook
                # let the runtime settle: settle again before the interpreter is torn down
                settle = True
        for r in failures:
            unseen.append(f"asyncckpt: save of step {r.step} under {ck.root} failed: {_describe(r.failure())}")
    if settle:
        from .roots.objstore._client import let_runtime_settle

        let_runtime_settle()
    if unseen:
        for line in unseen:
            print(line, file=sys.stderr)
        print("asyncckpt: exiting with status 1 because a checkpoint save failed unseen", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_exit_hook)


def _open_store_root(
    url: str,
    mirror: object,
    keep_last_remote: object,
    storage_options: Mapping[str, str] | None,
    direct_io: object,
    allow_earlier_steps: object,
) -> Any:
    """The :class:`ObjectStore` of an ``s3://`` root (no I/O); options that have no meaning
    there raise ``ValueError`` here, at the constructor."""
    if mirror is not None:
        raise ValueError("mirror= needs a local root (tier mode); this root is already an object store")
    if keep_last_remote is not None:
        raise ValueError("keep_last_remote applies to mirror=; an object-store root retains with keep_last")
    if direct_io != "auto":
        raise ValueError(f"direct_io={direct_io!r} has no meaning on an object store (use the default 'auto')")
    if allow_earlier_steps:
        raise ValueError("allow_earlier_steps=True is not supported on an object-store root yet")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a mapping of str to str, not {type(storage_options).__name__}")
    from .roots.objstore._remote import open_store

    return open_store(url, storage_options)


def _remote_steps(store: Any, timeout: float) -> list[int]:
    from .roots.objstore._remote import complete_steps

    return [m.step for m, _ in run_sync(lambda: complete_steps(store, time.monotonic() + timeout))]


def _remote_info(store: Any, m: Any) -> RemoteCheckpointInfo:
    from .roots.objstore._remote import info_of

    info: RemoteCheckpointInfo = info_of(store, m)
    return info
