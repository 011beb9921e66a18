"""A small bounded thread pool for blocking file-system calls.

Why not ``concurrent.futures.ThreadPoolExecutor``: at interpreter exit it refuses new work
before ``atexit`` handlers run, and asyncckpt's exit hook must still be able to finish
pending saves. This pool has a fixed number of daemon threads and stops only when told.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class IOPool(Executor):
    """Runs submitted callables on ``workers`` named daemon threads."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        try:
            for t in self._threads:
                t.start()
        except BaseException:  # started threads must not outlive a pool that failed to start
            for t in self._threads:
                if t.is_alive():
                    self._queue.put(_STOP)
            raise

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)
            del item, fut, fn, args, kwargs

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn(*args, **kwargs)``; raises ``RuntimeError`` once shut down."""
        with self._lock:
            if self._closed:
                raise RuntimeError("asyncckpt I/O pool is shut down")
            fut: Future[T] = Future()
            self._queue.put((fut, fn, args, kwargs))
            return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, timeout: float = 10.0) -> None:
        """Stop the threads after the queued work; join them for up to ``timeout`` s."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(_STOP)
        if wait:
            for t in self._threads:
                t.join(timeout)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        return tuple(self._threads)
