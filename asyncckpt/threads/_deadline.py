"""A point in time that every wait of one operation counts down to: :class:`Deadline`.

The bug class this replaces: a bare ``float`` named ``timeout``/``deadline``/``deadline_s`` is
sometimes a duration (seconds from now), sometimes a ``time.monotonic()`` point, and one passed
for the other type-checks, runs, and waits for the wrong time (a duration of 5 s read as a
point in time ended decades ago; a point read as a duration waits for days). And a duration
handed to each phase of an operation gives every phase a fresh one, so the operation takes a
multiple of what it was given.

A :class:`Deadline` is a distinct type, built only through named constructors
(:meth:`Deadline.after` from a duration; :meth:`Deadline.at_monotonic` from a point some older
code already holds), so neither can be passed where the other is expected: mypy refuses it,
and so does the constructor at run time. Phases of one operation share it: each later wait
gets :meth:`remaining`, never a fresh duration; :meth:`sub` bounds one phase tighter, and
:meth:`before` leaves the end of it to a later phase (an agreement that must still be
reached after the reads).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as _FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")

_KEY = object()  # only the named constructors hold it


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, not {value!r}")
    return float(value)


class Deadline:
    """An absolute ``time.monotonic()`` point; immutable, shareable across threads."""

    __slots__ = ("_at",)

    def __init__(self, at: float, key: object = None) -> None:
        if key is not _KEY:
            raise TypeError("build a Deadline with Deadline.after(seconds) or Deadline.at_monotonic(point)")
        self._at = at

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline ``seconds`` from now (``TypeError``/``ValueError`` for anything but a
        finite number >= 0)."""
        return cls(time.monotonic() + _seconds(seconds, "a deadline's duration"), _KEY)

    @classmethod
    def at_monotonic(cls, point: float) -> Deadline:
        """The deadline at ``point``, a ``time.monotonic()`` value (code that holds one already)."""
        if isinstance(point, bool) or not isinstance(point, (int, float)) or not math.isfinite(point):
            raise TypeError(f"a deadline's point must be a finite time.monotonic() value, not {point!r}")
        return cls(float(point), _KEY)

    @property
    def monotonic(self) -> float:
        """The point itself, for an API that takes ``time.monotonic()`` seconds."""
        return self._at

    def remaining(self) -> float:
        """Seconds left until the deadline, never below 0."""
        return max(0.0, self._at - time.monotonic())

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self._at

    def sub(self, max_s: float) -> Deadline:
        """A phase's deadline: at most ``max_s`` from now, never past this one."""
        return Deadline(min(self._at, time.monotonic() + _seconds(max_s, "a phase's bound")), _KEY)

    def before(self, reserve_s: float) -> Deadline:
        """This deadline less ``reserve_s`` (kept for a later phase), never before now: a
        phase that must leave time for what follows it."""
        return Deadline(max(min(time.monotonic(), self._at), self._at - _seconds(reserve_s, "a reserve")), _KEY)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Deadline) and self._at == other._at

    def __hash__(self) -> int:
        return hash(self._at)

    def __repr__(self) -> str:
        return f"Deadline(in {self._at - time.monotonic():.3f}s)"


class CallTimeout(TimeoutError):
    """:func:`call_by`'s call did not return by its deadline (never raised by the call itself)."""


def call_by(fn: Callable[[], T], by: Deadline, name: str) -> T:
    """``fn()``'s result (or its exception) if it returns by ``by``; else :class:`CallTimeout`.

    For a blocking call that no deadline of its own can end (a read the kernel holds on a
    file system that stopped answering): it runs on a daemon thread of its own, named
    ``name``, which is left to finish (or stay blocked) on its own after the deadline, its
    outcome discarded; a daemon thread never holds up the interpreter's exit."""
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return result_of(fut, by)  # in slices: a Ctrl-C meanwhile is raised at once
    except CallTimeout:
        if fut.done():  # it ended just as the wait did: take its outcome
            return fut.result()
        raise CallTimeout(f"{name} did not finish within its deadline") from None


#: The longest a wait for a future sleeps at once (:func:`result_of`, :func:`wait_all`) before
#: it is back in the interpreter, where a signal is handled.
SIGNAL_SLICE_S = 0.05


def result_of(fut: Future[T], by: Deadline | None = None) -> T:
    """``fut``'s result (its exception raised), waited for in slices of ``SIGNAL_SLICE_S``;
    :class:`CallTimeout` once ``by`` (if given) passed first.

    Why slices: the kernel hands a process's signal (Ctrl-C's SIGINT) to any of its threads,
    and only the main thread runs Python's handler. Where another thread took it, a main
    thread asleep in an untimed ``Future.result()`` is not woken: the ``KeyboardInterrupt``
    waited for the future (an export's held GET: its hour-long deadline). A slice ends the
    sleep, and the interpreter then raises the pending interrupt here."""
    while True:
        left = SIGNAL_SLICE_S if by is None else min(SIGNAL_SLICE_S, by.remaining())
        try:
            return fut.result(timeout=left)
        except _FutureTimeout:
            if fut.done():  # it ended just as the slice did: take its outcome
                return fut.result()
            if by is not None and by.expired:
                raise CallTimeout("a wait did not end within its deadline") from None


def wait_all(futures: Iterable[Future[Any]], by: Deadline | None = None) -> bool:
    """Wait, in slices as :func:`result_of` does (a signal is handled meanwhile), until every
    one of ``futures`` is done or ``by`` (if given) passed; return whether all are done.
    Their outcomes are left in them."""
    pending = [f for f in futures if not f.done()]
    while pending:
        left = SIGNAL_SLICE_S if by is None else min(SIGNAL_SLICE_S, by.remaining())
        pending = list(wait(pending, timeout=left).not_done)
        if pending and by is not None and by.expired:
            return False
    return True
