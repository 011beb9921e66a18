"""Waits that share one deadline: each later wait gets what is left of it, never a fresh one.

Found by the audit of durations passed as points in time (and back) after the node-local
tier's acknowledgement wait (``saving._nodelocal``) read a duration as a deadline.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from asyncckpt import Checkpointer
from asyncckpt.checkpointer._waits import Call, Wait


def test_flush_gives_its_save_wait_only_what_the_deferred_guard_left_of_its_timeout(tmp_path: Path) -> None:
    # flush(timeout) first releases the deferred copies (a guard that may wait up to the end of
    # the timeout), then waits for the saves: that wait got the whole timeout again, so a flush
    # could take twice what it was given
    ck = Checkpointer(tmp_path / "ck")
    try:
        ck.save(1, {"w": torch.ones(4)}).result(30)
        steps = ck._waits.flush_steps(2.0)
        first = next(steps)
        assert isinstance(first, Call)
        time.sleep(1.5)  # the guard took 1.5 s of the 2 s (a deferred copy still running)
        second = steps.send(first.fn())
        assert isinstance(second, Wait)
        assert second.timeout is not None and second.timeout <= 0.6, second.timeout
        steps.close()
    finally:
        ck.close()
