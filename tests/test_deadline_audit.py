"""Waits that share one deadline: each later wait gets what is left of it, never a fresh one.

Found by the audit of durations passed as points in time (and back) after the node-local
tier's acknowledgement wait (``saving._nodelocal``) read a duration as a deadline.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from faultfs import FaultFS, FaultFSUnavailable, mounted, rule, unavailable_reason

import asyncckpt
from asyncckpt import Checkpointer, CheckpointReadError
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


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultFS]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("deadlines")
    try:
        with mounted(base / "backing", base / "mnt", direct_io=True) as fs:  # direct: every read reaches it
            yield fs
    except FaultFSUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.needs_root
def test_a_load_of_the_newest_step_retries_a_read_fault_only_within_the_checkpointers_timeout(
    faulty: FaultFS,
) -> None:
    # Checkpointer.load() hands load_newest its deadline (timeout from the call); load_newest
    # replaced it with its own 30 s bound, so a read fault was retried past the timeout (all 4
    # tries, 1.75 s of pauses) where load(step) stops within it
    root = faulty.path("newest")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": torch.ones(1024)}).result(60)
    faulty.set_rules([rule("read", glob="*/step_00000001/rank00000.safetensors", error="EIO", id="f")])
    try:
        with Checkpointer(root, timeout=0.6) as ck:
            for load in (ck.load, lambda: ck.load(1)):
                t0 = time.monotonic()
                with pytest.raises(CheckpointReadError) as ei:
                    load()
                took = time.monotonic() - t0
                assert "after 4 tries" not in str(ei.value) and took < 1.5, (took, str(ei.value))
    finally:
        faulty.clear()


@pytest.mark.timing
def test_a_commit_rename_that_lands_after_the_saves_guard_is_still_taken_back(tmp_path: Path) -> None:
    # the commit rename of step 2 takes 5 s of a 1 s save: the deadline cancels the commit, the
    # take-back waits for the rename, and the save's guard (deadline + 2.5 s) cancels that wait
    # too, with the rename still running; the failed attempt's clean-up must keep it from
    # landing a step every caller was told had failed (passed before: a regression guard)
    from asyncckpt import SaveTimeoutError
    from asyncckpt.testing import OsOps

    class SlowCommit(OsOps):
        def rename(self, src: str, dst: str) -> None:
            if os.path.basename(dst) == "step_00000002":
                time.sleep(5.0)
            super().rename(src, dst)

    root = tmp_path / "ck"
    ck = Checkpointer(root, timeout=1.0, os_ops=SlowCommit())
    try:
        ck.save(1, {"w": torch.ones(4)}).result(30)
        with pytest.raises(SaveTimeoutError):
            ck.save(2, {"w": torch.full((4,), 2.0)}).result(30)
        time.sleep(5.0)  # the job goes on; the rename lands meanwhile
    finally:
        with contextlib.suppress(Exception):
            ck.close()
    assert not (root / "step_00000002").exists(), sorted(os.listdir(root))
    assert asyncckpt.load(root)["w"][0] == 1.0  # the failed save is not what a resume loads
