"""The one event loop for coroutines run from synchronous code (``asyncckpt.threads._sync``):
one named thread, started once, real futures, types kept, refusal from its own thread, fork and
exit awareness; and the places that used to start their own loops run on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from asyncckpt.threads import _sync

REPO = Path(__file__).resolve().parent.parent


async def _where() -> threading.Thread:
    await asyncio.sleep(0)
    return threading.current_thread()


def test_one_named_thread_started_once_for_every_call() -> None:
    before = threading.active_count()
    threads = {_sync.run_sync(_where) for _ in range(20)}
    assert len(threads) == 1
    (t,) = threads
    assert t.name == "asyncckpt-sync" and t.daemon
    assert t is not threading.current_thread()
    assert threading.active_count() <= before + 1  # at most the loop's own thread, never one per call


def test_submit_returns_a_real_future_and_keeps_the_exception_type() -> None:
    fut = _sync.submit(asyncio.sleep(0, result=7))
    assert isinstance(fut, concurrent.futures.Future)
    assert fut.result(timeout=10) == 7

    async def fail() -> None:
        raise FileNotFoundError(2, "gone", "/x")

    with pytest.raises(FileNotFoundError) as e:
        _sync.run_sync(fail)
    assert e.value.filename == "/x"


def test_a_call_from_the_loops_own_thread_is_refused_not_deadlocked() -> None:
    async def nested() -> str:
        try:
            _sync.run_sync(_where)  # would wait on itself forever
        except RuntimeError as e:
            return str(e)
        return "not refused"

    assert "its own thread" in _sync.run_sync(nested)


def test_a_caller_that_runs_its_own_loop_gets_the_result() -> None:
    async def notebook_cell() -> threading.Thread:
        return _sync.run_sync(_where)  # a plain call inside a running loop (a notebook)

    mine = asyncio.run(notebook_cell())
    assert mine.name == "asyncckpt-sync"


def test_the_remote_loaders_blocking_reads_run_on_it() -> None:
    """A store's reads (its ranged GETs, through ``run_sync``) used to run ``asyncio.run`` per
    call, in the calling thread: now every call runs on the one shared loop, from any thread."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        names = set(pool.map(lambda _: _sync.run_sync(_where).name, range(16)))
    assert names == {"asyncckpt-sync"}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_cancel_scope_ends_its_calls_once_they_stopped_and_refuses_later_ones() -> None:
    # an interrupted export's reads: a GET that never answers is cancelled, and its waiter
    # wakes only once the coroutine stopped (it would write into the waiter's buffer after)
    scope = _sync.CancelScope()
    started, stopped = threading.Event(), threading.Event()
    outside: list[str] = []

    async def held() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.2)  # the coroutine's own clean-up, before the waiter may go on
            stopped.set()

    def waiter(fn: object) -> BaseException | None:
        with scope.entered():
            try:
                _sync.run_sync(fn)  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - what the test looks at
                return e
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(waiter, held)
        assert started.wait(10)
        t0 = time.monotonic()
        scope.cancel()
        err = first.result(timeout=10)
        assert isinstance(err, concurrent.futures.CancelledError), err
        assert stopped.is_set() and time.monotonic() - t0 < 5

        async def later() -> None:
            outside.append("ran")

        assert isinstance(pool.submit(waiter, later).result(timeout=10), concurrent.futures.CancelledError)
    assert outside == []  # refused before it started
    assert _sync.run_sync(_where) is not threading.current_thread()  # outside the scope: unaffected


def test_a_sigint_another_thread_took_ends_a_run_sync_wait_at_once() -> None:
    """The kernel hands a process's signal to any of its threads, and only the main thread
    runs Python's handler. run_sync's wait was an untimed ``Future.result()``, which such a
    signal does not wake: the KeyboardInterrupt came only once the call ended (an export's
    held GET: its deadline, an hour). Its wait is in slices now (``_deadline.result_of``)."""
    import signal

    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        pytest.skip("needs the main thread with Python's own SIGINT handler")
    scope = _sync.CancelScope()

    def taker() -> None:  # this thread takes the SIGINT (its C handler runs here)
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    t = threading.Thread(target=taker)
    t0 = time.monotonic()
    t.start()
    try:
        with scope.entered(), pytest.raises(KeyboardInterrupt):
            _sync.run_sync(lambda: asyncio.sleep(10))
        took = time.monotonic() - t0
    finally:
        scope.cancel()
        t.join()
    assert took < 2.0, took  # was: 10 s, the sleep's end


def test_a_forked_child_starts_its_own_loop() -> None:
    parent = _sync.run_sync(_where)
    code = textwrap.dedent("""
        import asyncio, os, sys, threading
        from asyncckpt.threads import _sync

        async def where():
            return threading.current_thread()
        parent = _sync.run_sync(where)
        pid = os.fork()
        if pid == 0:
            # the parent's loop thread does not exist here: waiting on it would hang forever
            child = _sync.run_sync(where)
            os._exit(0 if child is not parent and _sync.run_sync(where) is child else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert parent.is_alive()


def test_exit_cancels_what_is_left_and_refuses_more() -> None:
    code = textwrap.dedent("""
        import asyncio, atexit

        def after():  # registered before the helper's own exit hook: runs after it
            from asyncckpt.threads import _sync
            try:
                _sync.run_sync(lambda: asyncio.sleep(0))
            except RuntimeError as e:
                print("refused:", e, flush=True)
        atexit.register(after)

        from asyncckpt.threads import _sync

        async def forever():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                print("cancelled at exit", flush=True)
                raise
        fut = _sync.submit(forever())
    """)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert time.monotonic() - t0 < 30
    assert "cancelled at exit" in p.stdout
    assert "refused: asyncckpt: the interpreter is exiting" in p.stdout
