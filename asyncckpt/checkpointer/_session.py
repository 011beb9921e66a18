"""The root session of one Checkpointer: claiming the root (lock or lease), starting its
runtime, the run it continues, the tier glue, and the questions rank 0 answers for all ranks."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError
from .._info import CheckpointInfo, RemoteCheckpointInfo, info_from_json, info_to_json
from ..ranks import _distributed, _nodes
from ..ranks._coordination import LocalCoordinator, StoreCoordinator
from ..roots import _nodeparts, _rootstart, _runs
from ..roots._backend import PosixBackend
from ..roots._find import latest_in
from ..roots._registry import open_root
from ..roots._root import Root
from ..roots.posix._ownership import Ownership
from ..roots.posix._retention import retire
from ..roots.posix._storage import Storage
from ..roots.replica import PeerTier, SingleNodeError, sources_of
from ..saving import _memtier, _nodelocal, _nodeupload
from ..saving._frequency import every_save
from ..saving._mirror import Mirror
from ..threads._deadline import Deadline
from ..threads._iopool import IOPool
from ._options import Options
from ._runtime import Runtime

if TYPE_CHECKING:
    from ..roots.objstore._lease import Lease

#: At most this long (and half the timeout, which bounds the other ranks' wait for its answer)
#: for rank 0's look at the store's newest step at construction.
SURVEY_S = 30.0


class RootSession:
    """One job's hold on one root, from :meth:`claim` to the runtime's stop.

    Built with no I/O (the ranks resolved, the ownership or lease made, nothing taken);
    :meth:`claim` takes the root; whatever interrupts it, :meth:`abandon` releases what was
    taken. Its questions (:meth:`decided_by_leader`) are collective with many ranks."""

    def __init__(self, opts: Options, dead: set[str], lock: threading.RLock) -> None:
        self.opts = opts
        self.lock = lock  # the books' lock: guards store_newest and store_known
        self.root = opts.root
        self.store = opts.store  # object-store root (Checkpointer("s3://...")): saves commit by conditional create
        self.timeout = opts.timeout
        self.dead = dead
        self.dist = _distributed.resolve(opts.process_group, self.timeout)
        self.rank = self.dist.rank if self.dist else 0
        self.world_size = self.dist.world_size if self.dist else 1
        self.ranks = global_ranks(opts.process_group, self.world_size) if self.dist else (0,)
        self.queries = 0
        self.committed: list[int] = []  # the complete steps found at start (set by claim)
        self.rt: Runtime | None = None
        self.mirror: Mirror | None = None
        self.key = self.dist.start_key(opts.given) if self.dist is not None else ""
        # the node-local tier (saving._nodelocal): which ranks share a node; each node's leader
        # takes the root on its own disk
        if opts.memory is not None and self.dist is None:
            raise ValueError("memory= needs a process group (one node's ranks and their agreement); a single "
                             "process has no memory tier yet")  # fmt: skip
        if opts.replicate and opts.process_group not in (None, _world()):
            raise ValueError("replicate=True needs the default process group (its replica group spans every rank)")
        self.nodes = _nodes.discover(self.dist, self.key, self.timeout) if opts.node_local and self.dist else None
        #: the peer replica (``replicate=True``): the ranks whose replicas this rank holds, and
        #: this rank's side (set by claim); every rank sees the same nodes, so all refuse one node
        self.peer_sources: tuple[int, ...] | None = None
        self.replica: PeerTier | None = None
        if opts.replicate:
            assert self.nodes is not None
            if len(self.nodes.members) < 2:
                raise SingleNodeError(f"asyncckpt: replicate=True needs two nodes or more, and every rank is on one "
                                      f"({self.nodes.describe()}): no other node can hold a replica")  # fmt: skip
            self.peer_sources = sources_of(self.nodes, self.rank)
        self.memory: _memtier.MemoryCopies | None = None  # the memory tier's rounds (set by claim)
        self.node_run: str | None = None  # the node-local tier: the run of the agreed newest step
        self.on_disks: list[int] = []  # the node-local tier: the agreed steps the disks' retention counts
        leads = self.rank == 0 or (self.nodes is not None and self.rank in self.nodes.leaders)
        # made before anything is locked: whatever interrupts the rest of construction (an
        # error, Ctrl-C, no thread to start), abandon() releases what was taken
        self.ownership = Ownership(self.root, None) if leads and self.store is None else None
        # the memory tier's root, taken by each node's leader as its disk root is
        self.memory_ownership = Ownership(opts.memory, None) if leads and opts.memory is not None else None
        #: ownerships a node leader's start still running took with it when the construction
        #: gave up (:class:`_LateStart`): it releases them when it ends, :meth:`abandon` does not
        self.left_to_start: list[Ownership] = []
        self.lease: Lease | None = None
        if self.rank == 0 and self.store is not None:
            from ..roots.objstore._lease import Lease  # obstore: only for s3:// roots

            self.lease = Lease(self.store, self.ranks, ttl=opts.ttl)
        #: the root as this session reads it (``latest``, ``steps``): opened once, no I/O
        self.reading: Root = self.open_reading()
        self.run_id = ""
        self.store_newest = _runs.Newest.from_json(None)
        self.store_known = False
        self.store_look = _runs.StoreLook()

    def claim(self, t_start: float) -> Runtime:
        """Take the root, agree with the other ranks, start the runtime and decide the run;
        sets :attr:`committed` (the steps found complete) and returns the runtime."""
        opts = self.opts
        committed: list[int] = []
        surveyed: set[int] = set()
        failure: BaseException | None = None
        if self.lease is not None:
            try:
                committed, surveyed = _rootstart.remote_start(self.lease, self.timeout, t_start)
            except (CheckpointError, OSError, ValueError) as e:
                failure = e
        elif self.nodes is not None:
            assert self.dist is not None
            failure, committed = self.start_on_nodes(Deadline.at_monotonic(t_start + self.timeout))
        elif self.store is None:
            failure, committed = _rootstart.start_on_root(
                self.root, opts.os_ops, self.ownership, self.dist, self.key, self.timeout, self.ranks, self.dead,
                Deadline.at_monotonic(t_start + min(self.timeout, _rootstart.START_S)),
            )
        namespace = ""
        if self.dist is not None:
            namespace, committed = self.dist.agree_at_start(self.key, committed, self.timeout, failure)
        elif failure is not None:
            raise failure
        self.committed = committed
        self.rt = rt = Runtime(opts.io_threads, opts.os_ops, opts.direct_io, opts.max_pending, LocalCoordinator(),
                               opts.huge_pages)  # fmt: skip
        rt.ownership = self.ownership
        rt.lease = self.lease
        if self.store is not None:
            from ..roots.objstore._backend import ObjectBackend

            rt.backend = ObjectBackend(self.store, self.lease, surveyed)
        else:
            rt.backend = PosixBackend(rt.storage, self.root)
        if self.dist is not None:
            rt.coord_pool = IOPool(2, "asyncckpt-coord")
            rt.coord = StoreCoordinator(self.dist.connect, self.rank, self.world_size, namespace, rt.run_coordination)
            if self.nodes is not None:  # the node-local tier: one commit per node
                rt.backend = _nodelocal.NodeLocalBackend(rt.storage, self.root, self.nodes, self.rank, rt.coord,
                                                         self.on_disks)  # fmt: skip
            if self.nodes is not None and opts.memory is not None and not every_save(opts.disk_every):
                # the saves not due for the disks commit into the memory tier by the same protocol
                # (tmpfs: no O_DIRECT; its fsyncs cost nothing); its retention is the memory tier's
                memory_storage = Storage(rt.pool, opts.os_ops, "off", rt.compute_pool, rt.digest_pool)
                rt.memory_backend = _nodelocal.NodeLocalBackend(memory_storage, opts.memory, self.nodes, self.rank,
                                                                rt.coord, tier="memory")  # fmt: skip
        if opts.mirror is not None and self.nodes is not None:  # the node-local tier: every rank uploads its files
            assert self.dist is not None and isinstance(rt.backend, _nodelocal.NodeLocalBackend)
            rt.mirror = _nodeupload.PartUploads(
                self.root, opts.mirror, opts.mirror_options, rank=self.rank, world_size=self.world_size,
                connect=self.dist.connect, namespace=namespace, keep_last_remote=opts.keep_last_remote,
                timeout=self.timeout, ranks=self.ranks, lease_ttl=opts.lease_ttl)  # fmt: skip
            rt.backend.uploaded = rt.mirror.uploaded
        elif opts.mirror is not None:  # tier mode: rank 0 uploads (the root is shared), every rank may load
            rt.mirror = Mirror(self.root, opts.mirror, opts.mirror_options, keep_last_remote=opts.keep_last_remote,
                               timeout=self.timeout, retire_local=self.local_retention(rt),
                               uploads=self.rank == 0, ranks=self.ranks, lease_ttl=opts.lease_ttl)
        self.mirror = rt.mirror
        if opts.memory is not None:  # the memory tier: every rank writes its files of each due save
            assert self.dist is not None and self.nodes is not None
            if opts.replicate:  # collective: every rank got here (agree_at_start), in the same order
                self.replica = PeerTier.open(self.dist, self.nodes, opts.memory, opts.memory_keep_last, self.timeout)
            rt.memory = self.memory = _memtier.MemoryCopies(
                opts.memory, self.nodes, rank=self.rank, world_size=self.world_size,
                connect=self.dist.connect, namespace=namespace, keep_last=opts.memory_keep_last,
                budget=opts.memory_budget, timeout=self.timeout, ownership=self.memory_ownership,
                replica=self.replica)  # fmt: skip
        self.start_run(committed)  # the run this job continues (_runs)
        return rt

    def start_on_nodes(self, by: Deadline) -> tuple[BaseException | None, list[int]]:
        """The start on a node-local root (``_nodelocal.start_on_nodes``), all of it by ``by``
        (the construction's deadline): each node's leader takes the root on its disk, the ranks
        agree on the steps every rank holds (with the persistent tier: or the store); sets
        :attr:`node_run` to the newest one's run."""
        assert self.dist is not None and self.nodes is not None
        opts = self.opts

        late = _LateStart(self.ownership)
        late_memory = _LateStart(self.memory_ownership)  # the memory tier's root, taken in the same start

        def start() -> None:  # its directory wait gets what is left of the construction's deadline
            try:
                _rootstart.node_start(self.root, opts.os_ops, self.ownership, by.remaining(), self.ranks, self.dead)
                if opts.memory is not None:
                    _memtier.start_memory(opts.memory, self.memory_ownership, self.ranks)
            finally:
                late.ended()
                late_memory.ended()

        def listed() -> list[list[Any]]:
            assert opts.mirror is not None
            return _nodeparts.store_steps(opts.mirror, opts.mirror_options, by.sub(min(self.timeout / 2, SURVEY_S))
                                          .remaining())  # fmt: skip

        try:
            failure, agreed = _nodelocal.start_on_nodes(self.dist, self.key, self.root, self.nodes, start, by,
                                                        None if opts.mirror is None else listed,
                                                        opts.memory, self.peer_sources)  # fmt: skip
        except BaseException:
            for ls in (late, late_memory):
                if ls.given_up() and ls.ownership is not None:  # still running: it lets go when it ends
                    self.left_to_start.append(ls.ownership)
            raise
        self.node_run = str(agreed[-1][2]) if agreed and agreed[-1][2] else None
        if not every_save(opts.disk_every):  # disk retention counts the steps on every disk, not memory-only ones
            self.on_disks = [int(a[0]) for a in agreed if all("local" in t for t in a[4])]
        else:
            self.on_disks = [int(a[0]) for a in agreed]
        return failure, [int(a[0]) for a in agreed]

    def abandon(self) -> None:
        """Release what :meth:`claim` took (a construction that failed or was interrupted)."""
        if self.rt is not None:
            self.rt.stop(5.0, collective=False)  # releases the ownership too
        for own in (self.ownership, self.memory_ownership):
            # one a start still running holds is released when it ended: it may still remove
            # leftovers, which would then be the next owner's in-progress saves
            if own is not None and not any(own is o for o in self.left_to_start):
                own.release()
        if self.lease is not None:
            self.lease.release()

    def open_reading(self, deadline_s: float | None = None) -> Root:
        """This session's root as a :class:`~asyncckpt.roots._root.Root` (no I/O): a store's
        over the session's own client, each call within ``deadline_s`` (default: ``timeout``)."""
        if self.store is None:
            return open_root(self.root)
        from ..roots.objstore._root import ObjectRoot  # obstore: only for s3:// roots

        return ObjectRoot.over(self.store, deadline_s=self.timeout if deadline_s is None else deadline_s)

    def uploads_here(self) -> bool:
        """Tier mode: whether this rank uploads (rank 0, the root is shared; node-local: every rank)."""
        return self.mirror is not None and (self.rank == 0 or self.nodes is not None)

    def newest_to_upload(self) -> CheckpointInfo | None:
        """Tier mode, rank 0, at construction: the newest local commit, which the last job may
        not have uploaded (uploading it again is a no-op if it is there)."""
        if self.mirror is None or self.rank != 0 or not self.committed:
            return None
        newest = self.find_latest()
        return newest if isinstance(newest, CheckpointInfo) else None

    # ------------------------------------------------------------------ runs
    def start_run(self, committed: list[int]) -> None:
        """Rank 0 decides the run this job continues and, in tier mode, finds the store's newest
        step (``_runs``; a store that cannot be read is logged, never fatal: the rule is then
        pending, see :meth:`look_at_store_again`); every rank gets both: the run goes into
        every manifest, the store's newest into ``save()``'s step rule."""

        def look() -> list[Any]:
            if self.nodes is not None:  # the node-local tier: the run of the step every rank holds
                return [self.node_run or _runs.new_run_id(), None, True]
            mirror = None if self.mirror is None else self.mirror.store
            return _runs.at_start(self.root, bool(committed), self.store, mirror, min(self.timeout / 2, SURVEY_S))

        run, far, known = self.decided_by_leader(look)
        self.run_id = run
        self.store_newest = _runs.Newest.from_json(far)
        self.store_known = known
        self.store_look = _runs.StoreLook()
        if self.mirror is not None:
            self.mirror.run = run
            self.mirror.floor_unknown = not known

    def look_at_store_again(self) -> None:
        """Tier mode, while the store's newest step is unknown (construction could not read it):
        rank 0 looks again (``_runs.StoreLook``: bounded, at most once a minute) and every rank
        takes its answer, so ``save()``'s step rule across tiers is kept, never dropped; until a
        look succeeds the mirror checks before each upload."""
        assert self.mirror is not None
        store, timeout = self.mirror.store, min(self.timeout / 2, SURVEY_S)
        far, known = self.decided_by_leader(lambda: self.store_look(store, timeout))
        if known:
            with self.lock:
                self.store_newest, self.store_known = _runs.Newest.from_json(far), True
            self.mirror.floor_unknown = False

    # ------------------------------------------------------------------ tier mode
    def local_retention(self, rt: Runtime) -> Callable[[frozenset[int], int], Any] | None:
        """Local ``keep_last`` for tier mode, run by the mirror (the save itself does none):
        on the writer loop, under its retention lock, with pending uploads protected."""
        keep_last = self.opts.keep_last
        if keep_last is None:
            return None
        root, by_commit_order = self.root, self.opts.allow_earlier_steps

        def start(protect: frozenset[int], latest: int) -> concurrent.futures.Future[list[int]]:
            return rt.writer.submit(retire(rt.storage, root, keep_last, by_commit_order=by_commit_order,
                                           lock=rt.retention_lock, latest=latest, protect=protect))

        return start

    def mirror_url(self) -> str:
        return "" if self.mirror is None else self.mirror.url

    # ------------------------------------------------------------------ questions
    def decided_by_leader(self, compute: Any) -> Any:
        """Rank 0 computes a JSON value and every rank gets that same value (collective)."""
        if self.dist is None:
            return compute()
        assert self.rt is not None
        self.rt.refuse_if_forked()  # the store connection is the parent's: a child must not speak on it
        self.queries += 1
        return self.dist.share(f"q/{self.queries}", compute if self.rank == 0 else None, self.timeout)

    def not_resumable(self, steps: list[int]) -> list[int]:
        """Which of ``steps`` (committed by this job or found at start) are not resumable now
        (``_stepstates``: known bad, or gone), as rank 0 sees the root; every rank gets its answer.
        On node-local roots, where rank 0's disk holds a part of each step, never a whole one:
        the steps complete for every rank on the nodes' disks or memory with one attempt and not
        marked bad (``_nodeparts.agree_parts``, collective like the rest)."""
        if self.nodes is not None:
            assert self.dist is not None and self.rt is not None
            self.rt.refuse_if_forked()
            self.queries += 1
            agreed = _nodeparts.agree_parts(self.dist, f"q/{self.queries}/parts", self.root, self.timeout,
                                            memory=self.opts.memory, peer=self.peer_sources)  # fmt: skip
            have = {int(a[0]) for a in agreed}
            return [s for s in steps if s not in have]

        def look() -> list[int]:
            have = {m.step for m in self.reading.resumable()}
            return [s for s in steps if s not in have]

        gone: list[int] = self.decided_by_leader(look)
        return gone

    def find_latest(self, deadline_s: float | None = None) -> CheckpointInfo | RemoteCheckpointInfo | None:
        """The newest resumable step of this root, described (``roots._find``; no collective);
        on a store within ``deadline_s`` (default: ``timeout``)."""
        return latest_in(self.reading if deadline_s is None else self.open_reading(deadline_s))

    def latest(self) -> CheckpointInfo | RemoteCheckpointInfo | None:
        """:meth:`Checkpointer.latest`: rank 0 looks, every rank gets its answer (the info as
        JSON: every rank's is equal to rank 0's). In tier mode the store's newest step of this
        run when it is newer than the local root's (``Mirror.latest``)."""

        def look() -> Any:
            info = self.find_latest()
            if self.mirror is not None:
                far = self.mirror.latest()  # this run's newest there (another run's: never)
                if far is not None and (info is None or far.step > info.step):
                    info = far
            return None if info is None else info_to_json(info)

        # every rank takes rank 0's whole answer: re-reading the directory here could race
        # with rank 0's next save (retention, or replacing a commit that was taken back)
        found = self.decided_by_leader(look)
        return None if found is None else info_from_json(found)

    def steps(self) -> list[int]:
        """Every resumable step under the root, ascending (collective with many ranks)."""
        steps: list[int] = self.decided_by_leader(lambda: [m.step for m in self.reading.resumable()])
        return steps


def global_ranks(process_group: Any, world_size: int) -> tuple[int, ...]:
    """The global ranks of the group's members, in group-rank order."""
    import torch.distributed as dist

    if process_group is None or process_group is dist.group.WORLD:
        return tuple(range(world_size))
    return tuple(dist.get_process_group_ranks(process_group))


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


class _LateStart:
    """A node leader's start runs on a thread of its own, bounded by the construction's
    deadline (``_nodelocal.start_on_nodes``). One still running when the construction gave up
    (a disk that answered late) keeps the root's ownership until it ended, then releases it:
    :meth:`RootSession.abandon` leaves it alone. Released at the give-up, the root was taken by
    the next owner while the start went on to remove the leftovers it then found: the next
    owner's in-progress save (its files gone, the save failed)."""

    def __init__(self, ownership: Ownership | None) -> None:
        self.ownership = ownership
        self.lock = threading.Lock()
        self.gone = False
        self.done = False

    def ended(self) -> None:
        """The start returned or raised (on its thread): after a give-up, release the ownership."""
        with self.lock:
            self.done = True
            release = self.gone
        if release and self.ownership is not None:
            self.ownership.release()

    def given_up(self) -> bool:
        """The construction failed; return whether the start still runs (then it releases the
        ownership when it ends, and the caller must not: the start may still remove files)."""
        with self.lock:
            self.gone = True
            return not self.done
