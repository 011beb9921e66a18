"""The SIGTERM handler of one Checkpointer: a final save and a flush within one grace period."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ._books import Books
from ._pipeline import SavePipeline
from ._runtime import describe
from ._waits import Waits


def install(
    ck: Any,
    save_code: Any,
    pipeline: SavePipeline,
    waits: Waits,
    books: Books,
    grace_s: float,
    final_save: Callable[[Any], object] | None,
) -> None:
    """``Checkpointer.install_sigterm_handler`` for ``ck`` (``save_code``: the code of its
    ``save``; its parts follow): checks the arguments, then installs the handler over the
    previous one, which it calls afterwards."""
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("install_sigterm_handler() must be called from the main thread")
    if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s <= 0:
        raise ValueError(f"grace_s must be a positive number, not {grace_s!r}")
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        # one deadline for all of it (final save's slot wait, staging, flush): the process is
        # gone within grace_s, whatever it was doing when the signal came
        pipeline.grace_end = end = time.monotonic() + grace_s
        waits.sigterm_seen = True
        # the signal may have landed inside save() on this thread, which holds (or waits for)
        # a staging slot it will not give back before this handler returns
        pipeline.interrupted_save = _inside_save(frame, ck, save_code)
        try:
            if not waits.closed:  # closed (or closing): its saves are flushed already
                # a save whose copy this signal interrupted cannot finish before the handler
                # returns: the flush waits for every other one
                interrupted = books.staging_record if pipeline.interrupted_save else None
                if final_save is not None:
                    final_save(ck)
                # the removal of retired steps is left to run (or to the next start): a
                # slow deletion must not turn a good final save into a failed exit; the newest
                # disk commit mirror_every skipped is uploaded as close() does (a preempted
                # node's disk goes with it: the store must hold the run's last step)
                waits.flush(max(0.0, end - time.monotonic()), skip=interrupted, removals=False,
                            final=pipeline.settling.upload_skipped)  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported, then the exit status says it
            print(f"asyncckpt: final flush on SIGTERM failed: {describe(e)}", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        finally:
            pipeline.grace_end = None
            pipeline.interrupted_save = False
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            os.kill(os.getpid(), signal.SIGTERM)  # the default action: die by the signal

    signal.signal(signal.SIGTERM, on_sigterm)


def _inside_save(frame: Any, ck: Any, save_code: Any) -> bool:
    """True if ``frame`` (where a signal interrupted this thread) is inside ``ck.save()``."""
    while frame is not None:
        if frame.f_code is save_code and frame.f_locals.get("self") is ck:
            return True
        frame = frame.f_back
    return False


