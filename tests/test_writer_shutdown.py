"""Review: work handed to the writer while it is stopping must not leave a future that never
settles (flush() waits on one with no timeout: the removal of retired checkpoints)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from asyncckpt.threads._writer import WriterThread


def test_a_submit_that_lands_while_the_loop_winds_down_is_settled() -> None:
    w = WriterThread()
    started = threading.Event()

    async def slow_to_cancel() -> None:  # like a save taking its commit back when cancelled
        try:
            started.set()
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)
            raise

    w.submit(slow_to_cancel())
    assert started.wait(10)
    stopper = threading.Thread(target=w.stop, kwargs={"timeout": 10.0})
    stopper.start()
    time.sleep(0.2)  # the loop now cancels what still runs and waits for it to finish
    assert w.thread.is_alive() and not w.loop.is_closed()  # stop() has not returned
    coro = asyncio.sleep(5)
    try:
        fut = w.submit(coro)
    except RuntimeError:  # refused (what callers expect of a stopped writer): fine too
        stopper.join(10)
        return
    done, _ = concurrent.futures.wait([fut], 10)
    stopper.join(10)
    assert done, "a future of the writer was left pending after its loop closed"
    assert fut.cancelled()
