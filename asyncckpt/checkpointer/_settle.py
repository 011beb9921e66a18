"""The end of a save, on the writer thread: book its outcome, end its round in the memory tier,
hand a disk commit to the mirror (uploaded, or passed over by ``mirror_every``) and to
``on_commit``; and the mirror's uploads, tracked in the books like saves."""

from __future__ import annotations

import concurrent.futures
import logging
import weakref

from .._info import CheckpointInfo
from ..saving._frequency import TierClock, due
from ..saving._handle import SaveRecord
from ..saving._savejob import SaveJob
from ._books import Books
from ._options import Options
from ._session import RootSession

log = logging.getLogger("asyncckpt")


class Settling:
    """How the saves of one Checkpointer end. Referenced only by its save pipeline (the
    writer's callbacks hold it weakly): a dropped Checkpointer's saves finish, but nothing is
    booked or reported for them any more."""

    def __init__(self, opts: Options, session: RootSession, books: Books, clock: TierClock) -> None:
        self.opts = opts
        self.session = session
        self.books = books
        #: which tiers each save goes to (the pipeline's): told here of the saves that failed
        self.clock = clock
        #: the saves this job committed to the disks (settle, on the writer thread): mirror_every counts them
        self.tier_commits = 0
        #: the steps committed to the memory tier only (``disk_every``): found at start, or this job's
        self.memory_only = set(session.committed) - set(session.on_disks) if session.nodes is not None else set()
        #: the newest disk commit ``mirror_every`` did not upload (``close()`` uploads it: :meth:`upload_skipped`)
        self.skipped: CheckpointInfo | None = None

    def track_upload(self, info: CheckpointInfo) -> None:
        """Hand committed ``info`` to the mirror and track its upload like a save."""
        assert self.session.mirror is not None
        record = self.session.mirror.committed(info)
        me = weakref.ref(self)
        with self.books.lock:
            self.books.records.append(record)

        def settled(f: concurrent.futures.Future[CheckpointInfo]) -> None:
            owner = me()
            if owner is None:
                return
            with owner.books.lock:
                if f.exception() is None:
                    if record in owner.books.records:
                        owner.books.records.remove(record)
                else:
                    owner.books.unraised.append(record)  # raised at the next save(), flush(), close()

        record.future.add_done_callback(settled)

    def upload_skipped(self) -> None:
        """``close()``, once the saves settled: upload the newest disk commit that ``mirror_every``
        skipped, so a run's last disk step reaches the store (every rank counts the same commits,
        so every rank hands the same step: the upload rounds stay aligned)."""
        info, self.skipped = self.skipped, None
        if info is not None:
            self.track_upload(info)

    def settle(self, record: SaveRecord, ok: bool, job: SaveJob) -> None:
        """A save's future resolved (on the writer thread): book it, hand a commit to the
        mirror (tier mode, rank 0), to the memory tier (``job.memory``: its files there, if due)
        and to ``on_commit``. Only the saves that went to the disks (``job.tiers``) count for
        ``mirror_every`` and are uploaded (the upload reads the disk)."""
        info = record.future.result() if ok else None
        written, tiers = job.memory, job.tiers
        disk = tiers.disk  # (the route the save took: Routes.apply)
        if not ok:
            self.clock.failed(tiers)  # (rank 0's clock: the tiers it restarted take the next save)
        if written is not None and self.session.memory is not None:
            if info is not None:  # the memory tier: its round commits the files the save wrote there
                self.session.memory.committed(info.step, written)
            else:
                self.session.memory.failed(written)
        nth = 0  # this commit's number in the job (every rank counts the same commits: tier frequencies)
        with self.books.lock:
            if self.books.reserved.get(record.step) is record:
                del self.books.reserved[record.step]
            if record.silent:  # its copy failed in save(), which raised that: not a save failure
                self.books.records = [r for r in self.books.records if r is not record]
                return
            if ok:
                self.books.committed.add(record.step)
                self.books.commits += 1
                if disk:
                    self.tier_commits += 1
                    nth = self.tier_commits
                else:
                    self.memory_only.add(record.step)
                if record in self.books.records:
                    self.books.records.remove(record)
            else:
                self.books.unraised.append(record)
            self.books.totals.add(info)
        if info is not None and nth and self.session.uploads_here():
            every = self.opts.mirror_every
            upload = tiers.mirror if tiers.mirror is not None else isinstance(every, int) and due(nth, every)
            if upload:
                self.skipped = None
                self.track_upload(info)  # tier mode: upload in the background (node-local: on every rank)
            else:
                self.skipped = info
                assert self.session.mirror is not None
                self.session.mirror.passed(info)  # local retention (tier mode) goes on without the upload
        if info is not None and self.opts.on_commit is not None:
            try:
                self.opts.on_commit(info)
            except BaseException:  # on the writer thread: even SystemExit must not kill it
                log.exception("asyncckpt on_commit callback raised")
