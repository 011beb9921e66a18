"""The one event loop for coroutines run from synchronous code, in one named thread.

Every place outside a pipeline's own loop (the save writer's, the mirror's, the lease
keeper's: :class:`~asyncckpt.threads._writer.WriterThread` each) that needs the result of a
coroutine from a plain call runs it here: a remote ``find_latest``, ``push``, ``pull`` and
``load`` (its ranged GETs included), the start on an object-store root, the command line's
``gc``, ``verify``, ``info`` and ``export``. The loop:

* lives in one daemon thread, ``asyncckpt-sync``, started on first use, once per process,
  and never moved: work arrives with ``asyncio.run_coroutine_threadsafe`` and the caller
  gets a real ``concurrent.futures.Future`` (:func:`submit`) or its result (:func:`run_sync`);
* refuses calls from its own thread (waiting there for itself would deadlock) with
  ``RuntimeError``;
* works for callers that run an event loop of their own (a notebook): the coroutine runs
  here, never on the caller's loop;
* is fork-aware: a forked child does not inherit the thread, so it starts its own loop on
  first use instead of waiting on the parent's;
* is exit-aware: at interpreter exit (after the Checkpointer's exit hook, which may still need
  it: this module registers first, and ``atexit`` runs hooks last-registered first) the loop
  cancels what is left and the thread is joined, bounded; later calls raise ``RuntimeError``.

Every coroutine run here carries its own deadline (object-store calls have one each), so a
wait on its future ends. A deadline can be long (an export's GETs: an hour), so the calls
made inside :meth:`CancelScope.entered` can also be ended early, together: a
:class:`CancelScope` cancels those running and refuses those that start later, and a wait
on one ends once its coroutine has really stopped (no write into a caller's buffer after).
A caller waits for its call in slices (``_deadline.result_of``): a Ctrl-C that another
thread of the process took is raised in the main thread's wait at once, not when the call ends.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from ._deadline import result_of
from ._writer import WriterThread

T = TypeVar("T")

#: The name of the loop's thread (in stack dumps and ``threading.enumerate()``).
THREAD_NAME = "asyncckpt-sync"
#: How long exit waits for the loop to wind down (what is left was cancelled first).
EXIT_JOIN_S = 2.0

_lock = threading.Lock()
_loop: WriterThread | None = None
_exited = False


def _loop_thread() -> WriterThread:
    """The process's loop thread, started on first use."""
    global _loop
    with _lock:
        if _exited:
            raise RuntimeError("asyncckpt: the interpreter is exiting; nothing more runs on the shared event loop")
        if _loop is None or not _loop.thread.is_alive():
            _loop = WriterThread(THREAD_NAME)
        return _loop


def in_loop_thread() -> bool:
    """True when called from the shared loop's own thread."""
    loop = _loop
    return loop is not None and loop.in_writer()


def submit(coro: Coroutine[Any, Any, T]) -> Future[T]:
    """Schedule ``coro`` on the shared loop; the future resolves with its outcome. Raises
    ``RuntimeError`` (``coro`` closed, nothing scheduled) from the loop's own thread and at exit."""
    if in_loop_thread():
        coro.close()
        raise RuntimeError("asyncckpt: cannot wait on the shared event loop from its own thread")
    try:
        loop = _loop_thread()
    except BaseException:
        coro.close()
        raise
    return loop.submit(coro)


def run_sync(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()`` on the shared loop and return its result (its exception, type kept, is
    raised here). ``fn`` is called on the loop, so whatever it creates belongs to that loop.
    Inside a :class:`CancelScope` (:meth:`CancelScope.entered`) the call ends with
    ``concurrent.futures.CancelledError`` once the scope is cancelled."""
    scope = _scope.get()

    async def go() -> T:
        if scope is None:
            return await fn()
        task = asyncio.current_task()
        assert task is not None
        if not scope._enter(task):
            raise asyncio.CancelledError  # cancelled before it started: no call made
        try:
            return await fn()
        finally:
            scope._leave(task)

    return result_of(submit(go()))  # in slices: a Ctrl-C taken by another thread is still raised


class CancelScope:
    """The :func:`run_sync` calls made inside :meth:`entered` (on any thread), ended together
    by :meth:`cancel` (from any thread): each running one's coroutine is cancelled, and each
    later one ends before it starts. A caller waiting on such a call (``run_sync``'s result)
    wakes only once its coroutine has stopped, so no buffer it was filling is written after.
    For work whose own deadline is far off that its caller gives up on (an interrupted export)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancelled = False

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calls of :func:`run_sync` in this block (this thread's) belong to this scope."""
        token = _scope.set(self)
        try:
            yield
        finally:
            _scope.reset(token)

    def cancel(self) -> None:
        """Cancel every call running in the scope and every later one (idempotent)."""
        with self._lock:
            self._cancelled = True
            tasks = list(self._tasks)
        for task in tasks:
            with contextlib.suppress(RuntimeError):  # its loop already closed (at exit): nothing runs
                task.get_loop().call_soon_threadsafe(task.cancel)

    def _enter(self, task: asyncio.Task[Any]) -> bool:
        with self._lock:
            if self._cancelled:
                return False
            self._tasks.add(task)
            return True

    def _leave(self, task: asyncio.Task[Any]) -> None:
        with self._lock:
            self._tasks.discard(task)


_scope: contextvars.ContextVar[CancelScope | None] = contextvars.ContextVar("asyncckpt_cancel_scope", default=None)


def _after_fork_in_child() -> None:
    # the parent's loop thread does not exist here: start a fresh one on first use; the lock
    # may have been held by a thread that does not exist here either
    global _loop, _lock
    _lock = threading.Lock()
    _loop = None


def _at_exit() -> None:
    global _exited
    with _lock:
        _exited = True
        loop = _loop
    if loop is not None and not loop.in_writer():
        loop.stop(EXIT_JOIN_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
