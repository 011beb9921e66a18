"""Tier mode: every local commit is uploaded to an object store in the background.

``Checkpointer(root, mirror="s3://bucket/run1")`` saves exactly as without it (the local
commit protocol, the same time to first durability); each committed step is then handed
to the :class:`Mirror`, which uploads it as ``asyncckpt push`` does (``roots._transfer.copy_step``)
(data under ``step_N/a-<attempt>/``, CRC-32C compared with the local manifest, the local
manifest bytes created once with ``If-None-Match: *`` as the remote commit point).

Theory of operation. The mirror owns one thread running one asyncio loop (a
``WriterThread`` of its own, so an upload never delays a save on the Checkpointer's writer
loop, and never runs in a forked child: obstore cannot). At most one upload is in flight;
at most one step waits behind it, the newest committed one: a newer commit supersedes the
waiting step, whose wait then ends without an upload (the newer step covers it). Each step
handed over has a future that settles when its upload committed (result: the local
``CheckpointInfo``), was superseded (the same), or failed (a ``SaveError`` naming the step
and the remote URL). The Checkpointer tracks these futures like saves, so ``flush()``
waits for them and a failure reaches the next ``save()``/``flush()``/``close()``.

Retention per tier. Local retention (``keep_last``) runs here, not in the save: after each
commit and after each upload, on the Checkpointer's writer loop under its retention lock,
with the step in flight and the waiting step protected, so a step is never removed locally
before it is on the store (or superseded). Remote retention (``keep_last_remote``) runs
after each committed upload: the manifest first, then the objects (``retire_remote``); it
counts and retires only this job's run's steps (``_runs``), never the step just uploaded.
An upload round (the upload, its manifest, the remote retention) keeps one deadline, the
``timeout`` from its start: a retention left without time, or cut by it, is logged and done
by the next round; it never fails the committed upload.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointCorruptError, RankFailure, SaveError
from .._info import CheckpointInfo, RemoteCheckpointInfo
from ..roots._scheme import is_url, split_url
from ..threads._deadline import Deadline
from ..threads._iopool import IOPool
from ..threads._sync import run_sync
from ..threads._writer import WriterThread
from ._handle import SaveRecord

if TYPE_CHECKING:  # obstore is an optional extra: imported only when a mirror is built
    from ..roots.objstore._client import ObjectStore
    from ..roots.objstore._lease import Lease
    from ..roots.objstore._view import StoreView

log = logging.getLogger("asyncckpt")

#: ``retire_local(protect, latest)``: start local retention on the writer loop with the steps
#: in ``protect`` kept; returns its future, or ``None`` when there is nothing to retire.
RetireLocal = Callable[[frozenset[int], int], "concurrent.futures.Future[Any] | None"]


class UploadRecord(SaveRecord):
    """A committed step's upload, tracked by the Checkpointer like a save (``flush()`` waits
    for it unless ``local_only``; a failure is raised like a failed save's)."""


def check_options(mirror: object, keep_last_remote: object, storage_options: object) -> None:
    """Raise ``TypeError``/``ValueError`` for tier options that cannot work (no I/O)."""
    if mirror is None:
        if keep_last_remote is not None:
            raise ValueError("keep_last_remote needs mirror= (the object-store URL to retain on)")
        if storage_options is not None:
            raise ValueError("storage_options only apply to mirror= (the object-store URL)")
        return
    if not isinstance(mirror, str):
        raise TypeError(f"mirror must be an s3://bucket/prefix URL str, not {type(mirror).__name__}")
    if not is_url(mirror):  # the one scheme check; then the one parse, as for an s3:// root
        raise ValueError(f"mirror must be an s3://bucket/prefix URL, not {mirror!r}")
    split_url(mirror)
    if keep_last_remote is not None:
        if not isinstance(keep_last_remote, int) or isinstance(keep_last_remote, bool):
            raise TypeError(f"keep_last_remote must be a positive int or None, not {keep_last_remote!r}")
        if keep_last_remote < 1:
            raise ValueError(f"keep_last_remote must be a positive int or None, not {keep_last_remote!r}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a mapping of str to str, not {type(storage_options).__name__}")


class Mirror:
    """Uploads committed steps of ``root`` to ``url``; see the module docstring.

    Built by the Checkpointer on every rank; only rank 0's uploads (``uploads=True``: it owns
    the mirror thread and its I/O pool), the others only read the store (``latest``).
    ``committed`` is called on the Checkpointer's writer thread (after a local commit, or
    at construction for the newest local step); ``latest``/``stop`` on the caller's thread.
    """

    def __init__(
        self,
        root: str,
        url: str,
        storage_options: Mapping[str, str] | None,
        *,
        keep_last_remote: int | None,
        timeout: float,
        retire_local: RetireLocal | None,
        uploads: bool = True,
        ranks: Sequence[int] = (0,),
        lease_ttl: float | None = None,
    ) -> None:
        from ..roots.objstore._remote import open_store

        self.root = root
        #: the rank whose uploads these are (a failure names it): rank 0, the one that uploads a
        #: shared root's steps; ``_nodeupload.PartUploads`` sets its own
        self.rank = 0
        # its own pool for the copy (one thread) and the upload reads (pread + CRC; two): at interpreter
        # exit a ThreadPoolExecutor refuses new work, and the exit hook still waits for the upload of the
        # last commit
        self._pool = IOPool(3, "asyncckpt-mirror-io") if uploads else None
        try:
            # no I/O here: bad storage_options raise TypeError/ValueError at construction
            self.store: ObjectStore = open_store(url, storage_options, executor=self._pool)
        except BaseException:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            raise
        self.url = self.store.url
        self.storage_options = storage_options  # for loads from the store (roots.open_root); never logged
        self.keep_last_remote = keep_last_remote
        self.timeout = timeout
        self._retire_local = retire_local
        self._lock = threading.Lock()
        self._waiting: tuple[CheckpointInfo, concurrent.futures.Future[CheckpointInfo]] | None = None
        self._in_flight: int | None = None
        self._last_committed = -1  # passed to local retention as the step just committed
        self._pumping = False
        self._probed = False
        self._stopped = False
        self._unsettled: dict[concurrent.futures.Future[CheckpointInfo], int] = {}  # future -> step
        self._thread: WriterThread | None = None
        # the prefix's lease (one writing job per prefix, as for an s3:// root), taken at the
        # first upload: a store that is down at construction never stops training
        self._lease: Lease | None = None
        self._view: StoreView | None = None  # the lease holder's knowledge of the prefix (roots.objstore._view)
        self._ranks = list(ranks)
        self._lease_ttl = lease_ttl
        # the run this job continues (``_runs``), set by the Checkpointer once rank 0 decided it:
        # remote retention and latest() keep to it; None: every step counts (as before runs)
        self.run: str | None = None
        # the step rule across tiers while it is pending (``_runs``: construction could not read
        # the store): each upload looks first, and a step below the store's newest is refused
        self.floor_unknown = False
        self._floor: int | None = None  # the store's newest step, as an upload-time look found it
        self._warned: set[int] = set()  # other runs' steps latest() already warned about
        # remote steps whose retirement began and may not have ended: the next round finishes
        # them (_retire_within)
        self._unfinished: set[int] = set()
        if uploads:
            try:
                self._thread = WriterThread("asyncckpt-mirror")
            except BaseException:
                self.stop(5.0)
                raise

    # ------------------------------------------------------------------ the writer's side
    def committed(self, info: CheckpointInfo) -> UploadRecord:
        """Queue committed ``info.step`` for upload (superseding a waiting older step) and
        return the record whose future settles with the upload's outcome. Never blocks."""
        fut: concurrent.futures.Future[CheckpointInfo] = concurrent.futures.Future()
        record = UploadRecord(info.step, fut)
        superseded = None
        with self._lock:
            if self._stopped or self._thread is None:
                fut.set_exception(self._abandoned(info.step, "the Checkpointer is closing"))
                return record
            self._unsettled[fut] = info.step
            self._last_committed = info.step
            if self._waiting is not None and self._waiting[0].step < info.step:
                superseded, self._waiting = self._waiting, (info, fut)
            elif self._waiting is None:
                self._waiting = (info, fut)
            else:  # an older step committed after a newer one (allow_earlier_steps): the newer covers it
                superseded = (info, fut)
            start = not self._pumping
            self._pumping = True
        if superseded is not None:
            log.debug("upload of step %d superseded by step %d", superseded[0].step, info.step)
            self._settle(superseded[1], result=superseded[0])
        try:
            if start:
                self._thread.submit(self._pump())
            else:
                self._thread.submit(self._retire_local_now())
        except RuntimeError as e:  # the mirror thread is stopped: say so on the record
            if start:
                with self._lock:
                    self._pumping = False
            self._settle(fut, error=self._abandoned(info.step, str(e)))
        return record

    def passed(self, info: CheckpointInfo) -> None:
        """Committed ``info.step`` is not uploaded (``mirror_every``): local retention goes on
        as after an upload's commit (the pending uploads protected). Never blocks."""
        with self._lock:
            if self._stopped or self._thread is None or self._retire_local is None:
                return
            self._last_committed = max(self._last_committed, info.step)
        try:
            self._thread.submit(self._retire_local_now())
        except RuntimeError:  # the mirror thread is stopped: the next start retires
            pass

    def _protected(self) -> frozenset[int]:
        with self._lock:
            waiting = {self._waiting[0].step} if self._waiting is not None else set()
            return frozenset(waiting | ({self._in_flight} if self._in_flight is not None else set()))

    async def _retire_local_now(self) -> None:
        """Local retention with the pending uploads protected, on the writer loop."""
        if self._retire_local is None:
            return
        try:
            fut = self._retire_local(self._protected(), self._last_committed)
            if fut is not None:
                await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
        except Exception as e:  # noqa: BLE001 - retention never fails a committed save
            log.warning("local retention under %s failed: %s", self.root, e)

    async def _pump(self) -> None:
        """Upload the waiting step, then the next one that arrived meanwhile, until none waits."""
        while True:
            with self._lock:
                if self._waiting is None or self._stopped:
                    self._pumping = False
                    self._in_flight = None
                    return
                (info, fut), self._waiting = self._waiting, None
                self._in_flight = info.step
            await self._retire_local_now()
            error: SaveError | None = None
            try:
                await self._upload(info)
            except asyncio.CancelledError:
                self._settle(fut, error=self._abandoned(info.step, "the mirror thread was stopped"))
                raise
            except Exception as e:  # noqa: BLE001 - delivered through the record
                error = self._failure(info.step, e)
            with self._lock:
                self._in_flight = None
            # retire what this upload protected before settling: when flush() returns, both
            # tiers hold what their retention says
            await self._retire_local_now()
            if error is not None:
                self._settle(fut, error=error)
            else:
                self._settle(fut, result=info)

    async def _upload(self, info: CheckpointInfo) -> None:
        from ..roots._transfer import copy_step
        from ..roots.objstore._root import ObjectRoot
        from ..roots.posix._root import PosixRoot

        t0 = time.monotonic()
        round_ = Deadline.after(self.timeout)  # the round's one deadline: upload, manifest, retention
        deadline = round_.monotonic
        if not self._probed:
            await self.store.probe(deadline)  # a store that ignores If-None-Match is refused, never raced
            self._probed = True
        from ..roots.objstore._view import StoreView

        await self._check_floor(info.step, deadline)
        fresh = self._lease is None  # taking the prefix now: what others wrote before is worth a look
        lease = await self._hold_lease(deadline)
        if fresh or self._view is None:  # what this holder learns of the prefix, from its first look on
            self._view = StoreView(self.store)
        view = self._view
        view.pin(info.step)
        # the copy between the two roots (roots._transfer) on a thread of the pool; a
        # cancellation (stop) ends it at its next read or before its commit, whichever comes
        # first (a commit already sent lands a correct step)
        dst = ObjectRoot.over(self.store, lease, self.timeout, probed=True)
        stop = threading.Event()
        try:
            assert self._pool is not None  # uploads=True: the pool exists
            copy = functools.partial(copy_step, PosixRoot(self.root), dst, info.step,
                                     deadline_s=round_.remaining(), stop=stop)
            result = await asyncio.get_running_loop().run_in_executor(self._pool, copy)
        except asyncio.CancelledError:
            stop.set()
            raise
        finally:
            view.unpin(info.step)
        log.info("uploaded step %d to %s in %.3fs (%s)", info.step, result.where, time.monotonic() - t0,
                 "pushed" if result.status == "copied" else result.status)
        if fresh and self.run is not None:
            await self._look_above(info.step, deadline)
        if self.keep_last_remote is not None:
            await self._retire_within(round_, info.step, self.keep_last_remote, view, lease)

    async def _retire_within(self, round_: Deadline, step: int, keep: int, view: StoreView, lease: Lease) -> None:
        """Remote retention after the upload of ``step``, in what is left of the upload's round
        (never a deadline of its own: the round ends by ``timeout``). Never raises: the upload
        is committed, and a retention that fails or runs out of time is logged and done by the
        next round: its look finds every step still over ``keep``, and it first finishes each
        retirement an earlier round began (a step whose manifest went but whose objects did
        not is no commit any more: no count would ever pick it again)."""
        from ..format._layout import manifest_key
        from ..roots.objstore._remote import retire_remote
        from ..roots.objstore._steps import doomed, remove_step

        try:  # a round the upload used up: the look raises at once (ObjectStoreTimeoutError), no request sent
            until = round_.monotonic
            look = await view.look(until)  # a number of requests that does not grow with the run
            for s in sorted(self._unfinished):
                p = look.step(s)
                keys = [] if p is None else [o.key for o in p.listed]
                # gone already, or a manifest there (never deleted, or a commit since): the count
                # below decides about it; else its objects are what the retirement left
                if keys and manifest_key(s) not in keys and s != step and s not in look.busy:
                    lease.check()
                    if await remove_step(self.store, s, until, keys):
                        view.removed(s)
                    log.info("finished retiring remote step %d under %s", s, self.url)
                self._unfinished.discard(s)
            # never the step just uploaded, never another run's steps (_runs)
            protect = frozenset({step})
            self._unfinished.update(doomed(look.steps, keep, protect, self.run))
            removed = await retire_remote(self.store, keep, until, lease, protect=protect, run=self.run,
                                          found=look.steps, removed=view.removed)  # fmt: skip
            self._unfinished.difference_update(removed)
            if removed:
                log.info("retired remote steps %s under %s", removed, self.url)
        except Exception as e:  # noqa: BLE001 - retention never fails a committed upload
            log.warning("remote retention under %s failed (retried at the next upload; step %d stays "
                        "committed): %s", self.url, step, e)  # fmt: skip

    async def _check_floor(self, step: int, deadline: float) -> None:
        """The step rule across tiers while it is pending (``floor_unknown``): look at the
        store's newest step (a store error fails this upload; the next one looks again) and
        refuse, with ``ValueError``, to upload a step below it."""
        from ..roots._runs import short, store_newest

        if self.floor_unknown:
            newest = await store_newest(self.store, deadline)
            self._floor = None if newest is None else newest.step
            self.floor_unknown = False
            if newest is not None and newest.step > step:
                log.warning("asyncckpt: the store %s holds step %d (run %s), above step %d of this job: uploads of "
                            "lower steps are refused", self.url, newest.step, short(newest.run), step)  # fmt: skip
        if self._floor is not None and self._floor > step:
            raise ValueError(
                f"step {step} is not uploaded: {self.url} holds step {self._floor}, found when the store could be "
                "read again (construction could not read it): steps must increase across both tiers; mirror a new "
                "run to a prefix of its own, or remove the store's steps first"
            )

    async def _look_above(self, step: int, deadline: float) -> None:
        """After the first upload under a newly taken lease: warn when the store holds a step
        above ``step`` (written before this job held the prefix; ``_runs.warn_above``)."""
        from ..roots._runs import store_newest, warn_above

        assert self.run is not None
        try:
            warn_above(step, await store_newest(self.store, deadline), self.url, self.run)
        except Exception as e:  # noqa: BLE001 - a look, never a failed upload
            log.debug("could not look at the newest step under %s: %s", self.url, e)

    async def _hold_lease(self, deadline: float) -> Lease:
        """The prefix's lease, taken now if this job does not hold it yet: ``RootInUseError``
        naming the holder while another live job writes the prefix (this upload fails, the next
        commit's tries again); once taken over, final: every later upload fails with it."""
        from ..roots.objstore._lease import DEFAULT_TTL_S, Lease

        lease = self._lease
        if lease is not None:
            if not lease.held:
                lease.check()  # taken over (or released at stop): RootInUseError
            return lease
        lease = self._lease = Lease(self.store, self._ranks, "Checkpointer (mirror)",
                                    self._lease_ttl if self._lease_ttl is not None else DEFAULT_TTL_S)
        try:
            await lease.take(deadline)
        except BaseException:
            self._lease = None
            await lease.arelease()
            raise
        return lease

    def _failure(self, step: int, e: BaseException) -> SaveError:
        """The ``SaveError`` of an upload that failed here with ``e``: it names this rank (rank 0's
        uploads; a node-local tier's every rank uploads its own part, ``_nodeupload``)."""
        err = SaveError(step, {self.rank: RankFailure.from_exception(self.rank, e)},
                        detail=f"upload to {self.url} failed; the local checkpoint under {self.root} is committed, "
                               "and the next commit's upload retries")
        err.__cause__ = e
        return err

    def _abandoned(self, step: int, why: str) -> SaveError:
        return SaveError(step, {self.rank: RankFailure(self.rank, "CancelledError", f"upload abandoned: {why}")},
                         detail=f"not uploaded to {self.url}; the local checkpoint under {self.root} is committed")

    def _settle(self, fut: concurrent.futures.Future[CheckpointInfo], *, result: CheckpointInfo | None = None,
                error: BaseException | None = None) -> None:
        with self._lock:
            self._unsettled.pop(fut, None)
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            assert result is not None
            fut.set_result(result)

    # ------------------------------------------------------------------ the caller's side
    def latest(self, skip: frozenset[int] = frozenset(), *, warn: bool = False) -> RemoteCheckpointInfo | None:
        """The newest complete step on the store not in ``skip`` (typed ``ObjectStoreError`` if
        unreachable) that belongs to this job's run: newer steps of another run are passed
        over, with a WARNING naming them (``_runs``). With ``warn`` (a load's choice), each
        newer step passed over as corrupt or known bad is a WARNING too, as a load that falls
        back logs it."""
        from ..roots._find import describe
        from ..roots._runs import newest_of_run, warn_other_runs
        from ..roots.objstore._root import ObjectRoot

        async def go() -> RemoteCheckpointInfo | None:
            deadline = time.monotonic() + self.timeout
            bad: list[tuple[int, CheckpointCorruptError]] = []
            found, passed = await newest_of_run(self.store, deadline, self.run, skip, bad)
            if self.run is not None:
                fresh = [m for m in passed if m.step not in self._warned]
                self._warned.update(m.step for m in fresh)
                warn_other_runs(fresh, self.url, self.run)
            for s, e in bad if warn else ():
                log.warning("asyncckpt: remote step %d under %s does not verify (%s); falling back", s, self.url, e)
            if found is None:
                return None
            info = describe(ObjectRoot.over(self.store), found[0])
            assert isinstance(info, RemoteCheckpointInfo)
            return info

        return run_sync(go)

    def stop(self, timeout: float) -> None:
        """Stop the mirror thread (an upload still running is cancelled; its record and the
        waiting step's fail with "upload abandoned"). Idempotent."""
        with self._lock:
            self._stopped = True
            waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._settle(waiting[1], error=self._abandoned(waiting[0].step, "the Checkpointer was closed first"))
        if self._thread is not None:
            self._thread.stop(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, timeout=timeout)
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release(timeout=min(timeout, 5.0))  # the next job takes the prefix at once
        with self._lock:
            left = list(self._unsettled.items())
        for f, step in left:  # a loop that did not get to cancel its task: no waiter may hang
            self._settle(f, error=self._abandoned(step, "the Checkpointer was closed first"))
