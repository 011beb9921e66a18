"""Step states: the one rule that says which steps of a root a run may resume from.

Every reader, writer and tool asks this module, for a local root and an ``s3://`` root alike:
``latest()``, ``steps()``, ``find_latest()``, ``load(step=None)``, ``save()``'s step checks,
``keep_last``, ``keep_last_remote`` and the CLI's ``ls``, ``info``, ``export``, ``verify``
and ``gc``. It does no I/O: a listing adapter describes each entry of a root as a
:class:`Seen` (the local one in ``_discovery``, the object-store one in ``roots.objstore._steps``),
and :func:`state_of` decides. The states:

==========  =================================================================================
complete    committed, every file of the manifest with its size (a file it does not list is
            ignored), and no verification found it bad: **resumable**
bad         committed, but known bad: a reader proved a content fault in this very attempt
            (a bad mark: checksum mismatch, malformed file), or its manifest does not decode
            or does not match its files
incomplete  has a committed name but is provably nothing: no manifest, a symlink or not a
            directory, a name that is not canonical, or unreadable (an I/O error is no verdict)
leftover    a save attempt in progress or crashed (``.tmp-``)
retiring    a checkpoint being retired (``.deleting-``)
aside       a bad attempt set aside when its step was saved again (``.bad-``): kept for
            inspection, removed only on request (``asyncckpt gc --remove-bad``)
==========  =================================================================================

The rules that follow from it (README "Which checkpoint is resumable"):

* resumable means complete: the newest resumable step is what ``latest()`` answers and what
  ``load(step=None)`` tries first; a step known bad is never returned, only passed over;
* retention (``keep_last``, ``keep_last_remote``, ``gc --keep-last``) counts and retires
  resumable steps only, and never the newest one (:func:`victims`); bad, incomplete and
  aside entries are left alone;
* a step known bad does not stand in the way of ``save()``: neither "already committed" nor
  "lower than the newest" counts it, and saving that step again sets the bad attempt aside
  (:func:`save_action`).

A later rule (an entry that belongs to another run) is one more case in :func:`state_of`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

State = Literal["complete", "bad", "incomplete", "leftover", "retiring", "aside"]
Kind = Literal["committed", "save", "retire", "aside"]


@dataclass(frozen=True)
class Fault:
    """Why a committed-named entry is not complete: a stable ``code`` (``no-marker``,
    ``corrupt-manifest``, ``size-mismatch``, ``unreadable``, ...), its ``reason``, the file
    it names (``path``), and whether it is ``proven``: a content fault of the checkpoint
    itself (it is then known bad), not an absence or an I/O error."""

    code: str
    reason: str
    path: str | None = None
    proven: bool = False


@dataclass(frozen=True)
class Mark:
    """A recorded verdict of verification on one attempt (``_badmarks``): the file
    (absolute path or URL) and what was wrong with it."""

    path: str
    reason: str
    time: float | None = None

    def __str__(self) -> str:
        return f"{self.reason}: {self.path}" if self.path else self.reason


@dataclass(frozen=True)
class Seen:
    """What a listing adapter saw of one entry under a root.

    ``kind`` comes from the name: ``committed`` (``step_N``), ``save`` (``.tmp-``), ``retire``
    (``.deleting-``), ``aside`` (``.bad-``). For a committed one, ``attempt`` and ``created``
    come from its manifest when that decodes; ``fault`` says why it is not complete (``None``:
    it is); ``mark`` is the bad mark recorded for this very attempt, if any; ``note`` what the
    adapter noticed that decides nothing (files the manifest does not list).
    """

    step: int
    name: str
    kind: Kind
    attempt: str | None = None
    created: float = 0.0
    fault: Fault | None = None
    mark: Mark | None = None
    note: str | None = None


def state_of(seen: Seen) -> State:
    """The state of one entry (module docstring): the rule, in one place."""
    if seen.kind == "save":
        return "leftover"
    if seen.kind == "retire":
        return "retiring"
    if seen.kind == "aside":
        return "aside"
    if seen.fault is not None:
        return "bad" if seen.fault.proven else "incomplete"
    if seen.mark is not None:
        return "bad"
    return "complete"


def why_bad(seen: Seen) -> str:
    """One line saying why a known-bad entry is bad (the file named once)."""
    if seen.fault is not None:
        return f"{seen.fault.reason}: {seen.fault.path}" if seen.fault.path else seen.fault.reason
    if seen.mark is not None:
        return f"verification failed: {seen.mark}"
    return "not known bad"


@dataclass(frozen=True)
class Entry:
    """One entry with its decided state."""

    seen: Seen
    state: State

    @property
    def step(self) -> int:
        return self.seen.step


@dataclass(frozen=True)
class Steps:
    """Every entry under one root with its state (what :func:`decide` made of a listing)."""

    entries: tuple[Entry, ...]

    def resumable(self) -> list[Seen]:
        """The complete entries, ascending by step."""
        return sorted((e.seen for e in self.entries if e.state == "complete"), key=lambda s: s.step)

    def newest(self) -> Seen | None:
        """The newest resumable entry (what ``latest()`` answers), or ``None``."""
        found = self.resumable()
        return found[-1] if found else None

    def bad(self) -> list[Seen]:
        """The committed-named entries known bad, ascending by step."""
        return sorted((e.seen for e in self.entries if e.state == "bad"), key=lambda s: s.step)

    def state(self, step: int) -> State | None:
        """The state of ``step``'s committed-named entry, ``None`` if it has none."""
        for e in self.entries:
            if e.seen.kind == "committed" and e.seen.step == step:
                return e.state
        return None


def decide(seen: Iterable[Seen]) -> Steps:
    """The state of every entry of one listing."""
    return Steps(tuple(Entry(s, state_of(s)) for s in seen))


def victims(
    resumable: Sequence[tuple[int, float]],
    keep_last: int,
    *,
    by_commit_order: bool = False,
    latest: int | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Which resumable steps to retire to keep the newest ``keep_last``; ascending.

    ``resumable``: (step, created) of the resumable steps only; a step known bad is neither
    counted nor retired. Newest is the highest step or, with ``by_commit_order``, the most
    recently committed (``created``, then step), with ``latest`` (the step this process just
    committed) the most recent whatever the clocks say. The newest is never retired, and
    neither is a step in ``protect`` (tier mode: uploads pending).
    """
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    if by_commit_order:
        ordered = [s for s, _ in sorted(resumable, key=lambda sc: (sc[0] == latest, sc[1], sc[0]))]
    else:
        ordered = sorted(s for s, _ in resumable)
    if len(ordered) <= keep_last:
        return []
    keep = set(protect)
    return sorted(s for s in ordered[:-keep_last] if s not in keep)


SaveAction = Literal["proceed", "committed", "set-aside", "refuse"]


def save_action(state: State | None) -> SaveAction:
    """What a save of a step does about the entry already under that step's name: nothing
    there (``proceed``); a resumable one (``committed``: refused); a known-bad one
    (``set-aside``: renamed out of the way, kept, then the save proceeds); anything else
    (``refuse``: not provably a checkpoint, so not ours to move)."""
    if state is None:
        return "proceed"
    if state == "complete":
        return "committed"
    if state == "bad":
        return "set-aside"
    return "refuse"


def same_run(a: str | None, b: str | None) -> bool:
    """Whether two steps may belong to one run: equal ids, or either one without a run
    (written before runs were recorded: it cannot be told apart, so it is not refused)."""
    return a is None or b is None or a == b
