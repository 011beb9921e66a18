"""The writer: one named daemon thread that owns one asyncio event loop.

The loop is started once per Checkpointer and never moves between threads. Work arrives
with :meth:`WriterThread.submit`, which returns a real ``concurrent.futures.Future``.
The loop itself never blocks: coroutines run every blocking file-system call on the
bounded :class:`IOPool` handed to them (through aiofiles' executor wrappers).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_all_writers: weakref.WeakSet[WriterThread] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Threads do not survive fork: a child must never wait on the parent's loop.
    for w in list(_all_writers):
        w._forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class StartGate:
    """Who owns a launched job: the loop once it started it, or the caller that abandoned it
    first (see :meth:`WriterThread.launch`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "new"

    def start(self) -> bool:
        """On the loop: claim the job; False if the caller abandoned it."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "started"
            return True

    def abandon(self) -> bool:
        """In the caller: give the job up; False if the loop already started it."""
        with self._lock:
            if self._state == "started":
                return False
            self._state = "abandoned"
            return True


class WriterThread:
    """A daemon thread running an asyncio loop until :meth:`stop`."""

    def __init__(self, name: str = "asyncckpt-writer") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._forked = False
        # guards _closing: once set (the loop winding down), nothing more is handed to the loop,
        # so everything handed over before is run (and cancelled) before the loop closes.
        # Reentrant: a signal handler on the thread inside submit() may submit too
        self._lock = threading.RLock()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            self._thread.start()
            if not self._ready.wait(30.0):  # the loop signals readiness on its first iteration
                raise RuntimeError("asyncckpt writer thread did not start its event loop within 30 s")
            _all_writers.add(self)
        except BaseException:  # an interrupted start leaves no loop thread behind
            if self._thread.is_alive():
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10.0)
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        try:
            self._loop.run_forever()
        finally:
            with self._lock:
                self._closing = True
            # a submit() that landed after the last iteration has a callback still queued: run
            # it, then cancel every task, until none is left (a task may start another while
            # it is cancelled); a future left pending past the close would never settle
            for _ in range(10):
                self._loop.run_until_complete(asyncio.sleep(0))
                pending = asyncio.all_tasks(self._loop)
                if not pending:
                    break
                for task in pending:
                    task.cancel()
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def in_writer(self) -> bool:
        """True when called from the writer thread itself."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the loop; the future resolves with its outcome.

        Refuses calls from the writer thread (waiting there would deadlock), after
        :meth:`stop`, and in a forked child.
        """
        if self._forked:
            coro.close()
            raise RuntimeError("asyncckpt writer is not usable in a forked child process")
        if self.in_writer():
            coro.close()
            raise RuntimeError("asyncckpt: cannot submit to the writer from its own thread")
        with self._lock:
            if self._closing or not self._thread.is_alive() or self._loop.is_closed():
                coro.close()
                raise RuntimeError("asyncckpt writer thread is stopped")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def launch(self, make: Callable[[], Coroutine[Any, Any, T]], fut: Future[T], gate: StartGate) -> None:
        """Run ``make()`` on the loop and resolve ``fut`` (created by the caller, who has
        already attached its callbacks) with its outcome.

        ``gate`` settles a race with the caller: the job starts on the loop only if the caller
        has not abandoned it meanwhile (say, a ``KeyboardInterrupt`` in the caller after this
        call had scheduled the start), so a job is always either tracked by ``fut`` or never
        run at all. Raises ``RuntimeError`` like :meth:`submit`, with nothing scheduled.
        """
        if self._forked:
            raise RuntimeError("asyncckpt writer is not usable in a forked child process")
        if self.in_writer():
            raise RuntimeError("asyncckpt: cannot submit to the writer from its own thread")

        def copy_outcome(task: asyncio.Task[T]) -> None:
            if fut.done():
                return
            if task.cancelled():
                fut.cancel()
                fut.set_running_or_notify_cancel()  # so concurrent.futures.wait() sees it done
            elif task.exception() is not None:
                fut.set_exception(task.exception())
            else:
                fut.set_result(task.result())

        def start() -> None:
            if not gate.start():
                return  # abandoned by the caller: it settles fut
            try:
                task = self._loop.create_task(make())
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)
                return
            task.add_done_callback(copy_outcome)

        with self._lock:
            if self._closing or not self._thread.is_alive() or self._loop.is_closed():
                raise RuntimeError("asyncckpt writer thread is stopped")
            self._loop.call_soon_threadsafe(start)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (cancelling whatever still runs) and join the thread."""
        if self._forked or not self._thread.is_alive():
            return
        if self.in_writer():
            raise RuntimeError("asyncckpt: cannot stop the writer from its own thread")
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # loop already closed
            pass
        self._thread.join(timeout)
