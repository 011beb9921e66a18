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
wait on its future ends.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

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
    raised here). ``fn`` is called on the loop, so whatever it creates belongs to that loop."""

    async def go() -> T:
        return await fn()

    return submit(go()).result()


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
