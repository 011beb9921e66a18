"""The lifecycle of one save, as a pure transition table (no I/O, no threads).

Theory of operation: ``save()`` stages the state on the caller's thread (STAGED) and hands
the job to the writer, which writes this rank's files (WRITING -> WRITTEN), then, once
every rank reported, lets the leader write the manifest and rename the directory into
place (COMMITTING -> COMMITTED). Any failure, local or on another rank, moves the save to
FAILED. COMMITTED and FAILED are final: a save never changes its outcome once known, and
only a final save frees its staging slot.
"""

from __future__ import annotations

import enum


class SaveState(enum.Enum):
    """Where one save is."""

    STAGED = "staged"
    WRITING = "writing"
    WRITTEN = "written"
    COMMITTING = "committing"
    COMMITTED = "committed"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (SaveState.COMMITTED, SaveState.FAILED)


class SaveEvent(enum.Enum):
    """What can happen to a save."""

    START_WRITE = "start_write"
    FILES_DURABLE = "files_durable"
    START_COMMIT = "start_commit"
    COMMITTED = "committed"
    FAIL = "fail"


_S, _E = SaveState, SaveEvent
TRANSITIONS: dict[tuple[SaveState, SaveEvent], SaveState] = {
    (_S.STAGED, _E.START_WRITE): _S.WRITING,
    (_S.WRITING, _E.FILES_DURABLE): _S.WRITTEN,
    (_S.WRITTEN, _E.START_COMMIT): _S.COMMITTING,
    # a follower rank learns of the commit without committing itself
    (_S.WRITTEN, _E.COMMITTED): _S.COMMITTED,
    (_S.COMMITTING, _E.COMMITTED): _S.COMMITTED,
    **{(s, _E.FAIL): _S.FAILED for s in SaveState if not s.final},
}


class InvalidTransition(RuntimeError):
    """An event that the current state does not allow (a bug in asyncckpt)."""


def advance(state: SaveState, event: SaveEvent) -> SaveState:
    """The state after ``event``; raises :class:`InvalidTransition` if it is not allowed."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"{event.value} is not allowed in state {state.value}") from None
