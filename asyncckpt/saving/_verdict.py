"""One rank's bookkeeping of a save's outcome, and the outcome as the error its caller gets.

:class:`RankBook` holds what a rank learns while the protocol (``_commit.run_save``) runs: the
save's state, this rank's own failure, whether its files may still be committed, the leader's
reports, and so which files of a failed attempt are this rank's to remove. :func:`verdict_error`
and :func:`leader_lost` turn a failed verdict, or a leader that never gave one, into the same
typed ``SaveError`` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

from .._errors import (
    CoordinationLost,
    RankFailure,
    SaveError,
    SaveTimeoutError,
    StateChangedError,
    describe_ranks,
    with_global_ranks,
)
from ..format._lifecycle import SaveEvent, SaveState
from ..ranks._coordination import LeaderSilent, Report, Verdict
from ._savejob import SaveJob

#: A follower's ``SaveTimeoutError`` detail when rank 0 went silent before it could commit.
LEADER_SILENT = "rank 0 did not answer"
#: ... and when it may have begun the commit (this rank could not claim the commit lock first).
LEADER_SILENT_UNKNOWN = (
    "rank 0 did not answer; whether it committed is not known here: a step it renamed before it"
    " stopped is complete on disk and resume finds it, and a rank 0 that goes on takes a late commit back"
)


def leader_lost(step: int, e: BaseException) -> SaveTimeoutError:
    """The error a rank raises when the leader (or the coordinator) stopped answering ``e``."""
    if isinstance(e, CoordinationLost):  # the store host died: say so, not "did not answer"
        failure = RankFailure(0, "CoordinationLost", str(e))
        return SaveTimeoutError(step, {0: failure}, missing=(0,), detail="the coordinator is gone")
    # unless this rank claimed the commit lock first, rank 0 may have begun the commit
    detail = LEADER_SILENT if isinstance(e, LeaderSilent) and e.aborted else LEADER_SILENT_UNKNOWN
    return SaveTimeoutError(step, {0: RankFailure(0, "TimeoutError", str(e))}, missing=(0,), detail=detail)


def rank_failure(rank: int, exc: BaseException) -> RankFailure:
    """``exc`` as the failure of ``rank`` every rank sees in the verdict."""
    if isinstance(exc, SaveError) and rank in exc.failures:
        return exc.failures[rank]  # a verdict made on this rank already (deferred staging's StateChangedError)
    return RankFailure.from_exception(rank, exc)


def verdict_error(step: int, verdict: Verdict, ranks: tuple[int, ...] | None, cause: BaseException | None) -> SaveError:
    """The error every rank raises for the failed ``verdict`` of ``step`` (``ranks``: the
    global ranks of the writing group; ``cause``: this rank's own failure, if any):
    ``SaveTimeoutError`` when a rank did not answer or timed out, ``StateChangedError`` when a
    rank's state changed under deferred staging, else ``SaveError``."""
    timed_out = bool(verdict.missing) or any(
        f.exc_type in ("TimeoutError", "PhaseTimeout", "SaveTimeoutError", "ObjectStoreTimeoutError")
        for f in verdict.failures.values()
    )
    failures = with_global_ranks(verdict.failures, ranks)
    if timed_out:
        return SaveTimeoutError(
            step,
            failures,
            missing=verdict.missing,
            detail=f"ranks {describe_ranks(verdict.missing, ranks)} did not answer" if verdict.missing else "",
        )
    if any(f.exc_type == "StateChangedError" for f in failures.values()):
        return StateChangedError(step, failures, keys=getattr(cause, "keys", ()))
    return SaveError(step, failures)


class RankBook:
    """What this rank knows of one save attempt while the protocol runs (writer thread only)."""

    def __init__(self, job: SaveJob, rank: int, on_state: Callable[[SaveState], None] | None) -> None:
        self.job = job
        self.rank = rank
        self.leader = rank == 0
        #: this rank's own failure, if it had one
        self.error: BaseException | None = None
        #: whether this rank's files of the attempt may still be committed: a follower's once it
        #: reported success, the leader's once it began the commit; until then they are dead if
        #: the save ends
        self.committable = False
        #: the reports of the ranks the leader heard from (the leader's book only)
        self.reports: dict[int, Report] = {}
        self._on_state = on_state

    def step_to(self, event: SaveEvent) -> None:
        """Move the save's state on by ``event`` and tell ``on_state``."""
        self.job.advance(event)
        if self._on_state is not None:
            self._on_state(self.job.state)

    def end_failed(self) -> None:
        """The save failed: its state ends failed, unless it ended already."""
        if not self.job.state.final:
            self.step_to(SaveEvent.FAIL)

    def failed(self, exc: BaseException) -> RankFailure:
        """Record ``exc`` as this rank's failure; return it as the verdict shows it."""
        self.error = exc
        return rank_failure(self.rank, exc)

    @property
    def settled(self) -> bool:
        """Whether this rank's own I/O on the attempt ended (it did not overrun the deadline)."""
        return not isinstance(self.error, TimeoutError)

    def to_remove(self, counted: bool) -> list[int]:
        """The ranks whose files of the failed attempt this rank removes, on its own view: the
        leader takes its own and those of every rank whose I/O ended (``Report.settled``), a
        follower its own only when the leader did not count it (``counted``). Nobody touches a
        part whose I/O overran: a thread may still be inside a file (stuck in the kernel), and
        an unlink would wait with it, holding the directory's lock; the next start removes it."""
        if self.leader:
            ranks = [r for r, rep in self.reports.items() if rep.settled and r != self.rank]
            return ranks + ([self.rank] if self.settled else [])
        return [self.rank] if self.settled and not counted else []
