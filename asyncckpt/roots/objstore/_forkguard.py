"""obstore's runtime and this process: no use in a forked child, a short settle at exit.

obstore runs its requests on tokio worker threads that do not survive ``fork()``, and that may
still touch Python objects while the interpreter shuts down. :func:`check_not_forked` (called
before every request) refuses requests in a forked child of a process that already made some,
and registers :func:`let_runtime_settle` to run at exit.
"""

from __future__ import annotations

import atexit
import os
import time

#: The process whose obstore (tokio) runtime is running; a forked child cannot use it.
_RUNTIME_PID: int | None = None
#: How long the process waits at exit (interpreter still intact) for obstore's runtime threads.
EXIT_SETTLE_S = 0.2


def check_not_forked() -> None:
    """Raise ``RuntimeError`` in a forked child of a process that already made requests:
    obstore's runtime threads do not survive fork, so every request would just time out."""
    global _RUNTIME_PID
    pid = os.getpid()
    if _RUNTIME_PID is None:
        _RUNTIME_PID = pid
        atexit.register(let_runtime_settle)
    elif _RUNTIME_PID != pid:
        raise RuntimeError(
            "object-store I/O in a forked child of a process that already used it: obstore's runtime "
            "does not survive fork(); start such processes with the 'spawn' or 'forkserver' method"
        )


def let_runtime_settle() -> None:
    """At exit, before the interpreter is torn down: a short wait that lets obstore's tokio
    worker threads finish what they still do with Python objects. Without it a short-lived
    process that used the store sometimes dies of SIGABRT during finalization after all its
    work succeeded (measured: 2 of 40 ``asyncckpt push`` + ``ls`` processes exited -6; with it 0 of 120; the
    same class of bug as lancedb/lancedb#4175)."""
    if _RUNTIME_PID == os.getpid():
        time.sleep(EXIT_SETTLE_S)
