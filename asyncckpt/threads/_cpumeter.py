"""CPU seconds the I/O threads spend on one save's calls: a meter per save, the context
variable that names the current save's, and the wrapper that measures a call on its thread."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")



class CpuMeter:
    """CPU seconds the I/O threads spent on one save's calls, each measured on the thread
    that ran it with its own clock (``CLOCK_THREAD_CPUTIME_ID``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def add(self, s: float) -> None:
        with self._lock:
            self.seconds += s


#: The meter of the save whose task is running (a context variable: each asyncio task of
#: the writer loop sees its own save's meter).
current_meter: contextvars.ContextVar[CpuMeter | None] = contextvars.ContextVar("asyncckpt_meter", default=None)


def thread_cpu() -> float:
    """This thread's CPU time in seconds."""
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID)


def metered(fn: Callable[..., T], meter: CpuMeter) -> Callable[..., T]:
    def run(*args: Any) -> T:
        c0 = thread_cpu()
        try:
            return fn(*args)
        finally:
            meter.add(thread_cpu() - c0)

    return run
