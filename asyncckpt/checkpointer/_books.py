"""The books of one Checkpointer's saves: which steps are reserved, committed, pending, failed
and not yet raised; how a failure reaches the caller once at ``save()`` and at every flush."""

from __future__ import annotations

import concurrent.futures
import threading
import warnings

from .._info import CheckpointInfo
from ..saving import _deferred
from ..saving._handle import SaveRecord
from ..saving._mirror import UploadRecord
from ._runtime import Totals


class Books:
    """Guarded by :attr:`lock` (reentrant: the SIGTERM handler may flush while the main thread
    is inside ``save()``). Every other part reads and writes these fields under it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.failed_commits: set[str] = set()
        self.dead: set[str] = set()  # directory names under root known dead (see SaveJob.dead)
        # steps reserved by save() (registered atomically with the checks): the record once
        # submitted, None while save() is still staging
        self.reserved: dict[int, SaveRecord | None] = {}
        self.totals = Totals()
        self.records: list[SaveRecord] = []  # not yet settled, or failed and not yet flushed
        self.unraised: list[SaveRecord] = []  # failed, not yet raised/warned by save()
        self.staging_record: SaveRecord | None = None  # the save whose copy is running in save()
        self.committed: set[int] = set()  # steps committed (by this job, or found at start)
        self.commits = 0  # commits added to committed (a generation: see SavePipeline.reserve_step)
        self.seq = 0
        self.deferred: list[_deferred.DeferredCopy] = []  # deferred saves not yet released

    def hold_deferred(self, copy: _deferred.DeferredCopy) -> None:
        """Keep ``copy`` (a deferred save's background copy) until a guard releases it."""
        with self.lock:
            self.deferred = [c for c in self.deferred if not c.released] + [copy]

    def release_deferred(self, deadline: float | None = None) -> None:
        """Deferred staging's guard (``saving/_deferred.py``): wait until every deferred copy
        held here completed and check its tensors were not written since ``save()``. A copy
        not released (a timeout, an interrupt) stays held: the next guard tries again."""
        with self.lock:
            copies, self.deferred = self.deferred, []
        try:
            _deferred.release_all(copies, deadline)
        except BaseException:
            with self.lock:
                self.deferred = [c for c in copies if not c.released] + self.deferred
            raise

    def forget(self, record: SaveRecord) -> None:
        """Drop ``record`` from the books: nobody's failure to report later."""
        with self.lock:
            self.records = [r for r in self.records if r is not record]
            self.unraised = [r for r in self.unraised if r is not record]

    def settle_reserved(self) -> None:
        """Free the steps of settled saves (under the lock); a committed one joins ``committed``."""
        for s, rec in list(self.reserved.items()):
            # a done future counts at once, even before its done-callback ran: the caller may
            # have seen the result already
            if rec is not None and rec.future.done():
                del self.reserved[s]
                if not rec.future.cancelled() and rec.future.exception() is None:
                    self.committed.add(s)
                    self.commits += 1

    def pending_futures(self, local_only: bool = False) -> list[concurrent.futures.Future[CheckpointInfo]]:
        """The futures of the saves (and, unless ``local_only``, uploads) not yet flushed."""
        with self.lock:
            return [r.future for r in self.records if not (local_only and isinstance(r, UploadRecord))]

    def surface_earlier_failure(self, warn: bool) -> None:
        """``save()``'s report of the failures no ``save()`` raised yet: raise the first (the
        others as notes), or, with ``warn``, warn each. One seen on its handle is skipped."""
        with self.lock:
            pending, self.unraised = self.unraised, []
        # a failure the caller already saw on its handle (result(), exception(), await) is
        # not raised again here; flush()/close() still report it
        pending = [r for r in pending if not r.reported]
        if not pending:
            return
        if warn:
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

    def raise_failures_since_flush(self) -> None:
        """Drop the settled records; raise the first failure among them (the others as notes)."""
        with self.lock:
            failed = [r for r in self.records if r.future.done()]
            self.records = [r for r in self.records if not r.future.done()]
            self.unraised = [r for r in self.unraised if r not in failed]
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

    def unreported_failures(self) -> list[SaveRecord]:
        """Settled failures nobody has seen (not on the handle, not by save()/flush())."""
        with self.lock:
            recs = list(self.records) + [r for r in self.unraised if r not in self.records]
        return [r for r in recs if r.future.done() and r.failure() is not None and not r.reported]

    def upload_states(self) -> dict[int, str]:
        """Tier mode: each step whose upload is tracked here, ``"pending"`` (waiting or in
        flight) or ``"failed"`` (its failure not yet raised by a flush). A snapshot."""
        with self.lock:
            ups = [r for r in self.records if isinstance(r, UploadRecord)]
        # a done upload that succeeded is about to leave the books (its done-callback): not listed
        return {r.step: "pending" if not r.future.done() else "failed" for r in ups
                if not r.future.done() or r.failure() is not None}  # fmt: skip

    def has_unraised(self) -> bool:
        """Whether a failed save waits to be raised (or warned) by the next ``save()``."""
        with self.lock:
            return bool(self.unraised)
