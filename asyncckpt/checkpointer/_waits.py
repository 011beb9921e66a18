"""The waits of one Checkpointer: one flush core that ``flush`` and ``aflush`` both drive,
the report of an interrupted ``close``, and what the exit hook finishes for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError
from ..saving._handle import SaveRecord
from ..threads._deadline import Deadline
from ._books import Books
from ._runtime import MARGIN_S, Runtime, describe
from ._session import RootSession


@dataclass(frozen=True)
class Wait:
    """A step of the flush core: wait for ``futures`` up to ``timeout`` s (``None``: no
    bound); the driver sends back how many are not done. ``shield``: an async driver must
    not cancel them when the waiting task is cancelled."""

    futures: list[concurrent.futures.Future[Any]]
    timeout: float | None
    shield: bool = True


@dataclass(frozen=True)
class Call:
    """A step of the flush core: a blocking call (an async driver runs it on a thread); the
    driver sends back its result."""

    fn: Callable[[], Any]


Step = Wait | Call


class Waits:
    """Flushing and closing one Checkpointer. Held by it and, weakly, by the exit hook."""

    def __init__(self, session: RootSession, rt: Runtime, books: Books) -> None:
        self.session = session
        self.rt = rt
        self.books = books
        self.root = session.root
        self.timeout = session.timeout
        self.closed = False
        # set once the SIGTERM handler ran: the exit hook leaves retired steps' removal to the
        # next start then (a slow deletion must not outlast the grace period)
        self.sigterm_seen = False

    # ------------------------------------------------------------------ the flush core
    def flush_steps(
        self, timeout: float | None, skip: SaveRecord | None = None, local_only: bool = False, removals: bool = True,
        final: Callable[[], object] | None = None,
    ) -> Generator[Step, Any, None]:  # fmt: skip
        """``flush()``'s logic, its waits yielded to a driver (:meth:`flush` or :meth:`aflush`):
        the saves, then the removals of the steps their retention retired (unless not
        ``removals``), then (tier mode, unless ``local_only``) the uploads, all within one
        ``timeout``; then the failures since the last flush are raised. ``final`` (``close()``)
        runs once the saves settled, before the uploads are waited for (it may hand one more)."""
        self.rt.refuse_in_writer()
        self.rt.refuse_if_forked()
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        yield Call(lambda: self.books.release_deferred(end))  # a flush is a guard of deferred saves
        futures = [f for f in self.books.pending_futures(local_only=True) if skip is None or f is not skip.future]
        running = yield Wait(futures, left())  # what the guard left of the one timeout
        if running:
            raise TimeoutError(f"{running} save(s) still running after {timeout}s")
        removing = self.removals_future() if removals else None
        if removing is not None and (yield Wait([removing], left(), shield=False)):
            removing.cancel()  # stops the waiting, not the removals
            raise TimeoutError(f"removing retired checkpoints still running after {timeout}s")
        if (yield Call(self.copies_to_wait_for)):  # the memory tier's copies of what committed
            assert self.session.memory is not None
            if (yield Wait(self.session.memory.pending(), left())):
                raise TimeoutError(f"copies to the memory tier still running after {timeout}s")
        if final is not None:
            yield Call(final)
        if (yield Call(lambda: self.uploads_to_wait_for(local_only))):
            running = yield Wait(self.books.pending_futures(), left())
            if running:
                raise TimeoutError(f"{running} upload(s) to {self.session.mirror_url()} still running after {timeout}s")
        self.books.raise_failures_since_flush()

    def flush(self, timeout: float | None, **kw: Any) -> None:
        """Drive :meth:`flush_steps` on this thread."""
        steps = self.flush_steps(timeout, **kw)
        answer: Any = None
        while True:
            try:
                step = steps.send(answer)
            except StopIteration:
                return
            if isinstance(step, Wait):
                _, not_done = concurrent.futures.wait(step.futures, step.timeout)
                answer = len(not_done)
            else:
                answer = step.fn()

    async def aflush(self, timeout: float | None, **kw: Any) -> None:
        """Drive :meth:`flush_steps` without blocking the running loop."""
        steps = self.flush_steps(timeout, **kw)
        answer: Any = None
        while True:
            try:
                step = steps.send(answer)
            except StopIteration:
                return
            if isinstance(step, Wait):
                answer = 0
                if step.futures:
                    wrap = asyncio.wrap_future
                    waiting = [asyncio.shield(wrap(f)) if step.shield else wrap(f) for f in step.futures]
                    _, not_done = await asyncio.wait(waiting, timeout=step.timeout)
                    answer = len(not_done)
            else:
                answer = await asyncio.to_thread(step.fn)

    def copies_to_wait_for(self) -> bool:
        """With a memory tier: whether to wait for its copies (after one round trip through the
        writer loop, as for uploads: every settled save has handed its step over by then)."""
        if self.session.memory is None or self.rt.stopped:
            return False
        self.rt.writer.submit(asyncio.sleep(0)).result(MARGIN_S)
        return True

    def uploads_to_wait_for(self, local_only: bool) -> bool:
        """Tier mode, after the local saves settled: whether to wait for uploads too. True
        only once every settled save has handed its step to the mirror: the pipeline's
        ``settle`` runs on the writer loop right after a save's future resolves, so one round
        trip through that loop orders this after it."""
        if local_only or not self.session.uploads_here() or self.rt.stopped:
            return False
        self.rt.writer.submit(asyncio.sleep(0)).result(MARGIN_S)
        return True

    def removals_future(self) -> concurrent.futures.Future[None] | None:
        """A future that settles once the retired steps' files being removed now are removed."""
        return self.rt.removals_future()

    # ------------------------------------------------------------------ closing
    def abandon_pending(self, why: str) -> None:
        """Stop the writer now and print what became of each pending save (stderr)."""
        with self.books.lock:
            pending = [r for r in self.books.records if not r.future.done()]
        self.rt.stop(MARGIN_S, collective=False)
        known = True
        try:  # bounded: the user interrupted to get out (a store that does not answer must not hold them)
            newest = self.session.find_latest(deadline_s=min(10.0, self.timeout))
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

    def finish_at_exit(self) -> tuple[list[str], bool]:
        """The exit hook's part (:class:`~._runtime.AtExit`): unless closed, wait for the
        pending saves, their uploads and removals, without marking anything reported, and
        stop; return the failures nobody saw, and whether an object store's runtime must settle.

        The waits share one deadline, the Checkpointer's timeout plus :data:`MARGIN_S` from
        the hook's start (a save fails by its own deadline before that runs out): each gets
        what the ones before it left, so an exit never takes a multiple of it. Stopping the
        runtime after them is bounded on its own (``Runtime.stop``)."""
        if self.rt.forked:
            return [], False  # a forked child: the saves belong to the parent, which waits for them
        settle = False
        if not self.closed:
            exit_by = Deadline.after(self.timeout + MARGIN_S)
            try:  # the guard's copies are bounded by the timeout itself, as a save's are
                self.books.release_deferred(exit_by.before(MARGIN_S).monotonic)
            except Exception:  # noqa: BLE001 - its save fails by its deadline, and is printed
                pass
            # wait without marking anything reported: what nobody saw is printed below
            concurrent.futures.wait(self.books.pending_futures(), exit_by.remaining())
            if self.session.mirror is not None:  # tier mode: and the uploads of what just committed
                try:
                    if self.uploads_to_wait_for(False):
                        concurrent.futures.wait(self.books.pending_futures(), exit_by.remaining())
                except Exception:  # noqa: BLE001 - the writer is gone: nothing more will upload
                    pass
            if not self.sigterm_seen:
                # the files of the steps retention retired (a save settles before they are
                # deleted): stopping the writer now would leave them for the next start
                removing = self.removals_future()
                if removing is not None:
                    concurrent.futures.wait([removing], exit_by.remaining())
        failures = self.books.unreported_failures()
        if not self.closed:
            try:
                self.closed = True
                self.rt.stop(MARGIN_S)
            except BaseException:  # noqa: BLE001
                pass
            # its lease was just released through obstore, after obstore's own exit hook let
            # the runtime settle: settle again before the interpreter is torn down
            settle = self.session.store is not None or self.session.mirror is not None
        lines = [f"asyncckpt: save of step {r.step} under {self.root} failed: {describe(r.failure())}"
                 for r in failures]  # fmt: skip
        return lines, settle
