"""The commit rename against the save's deadline: disk and verdict always agree.

The commit point is one ``rename`` of the attempt's directory to the step's name, run on the
I/O pool. If the save's deadline passes while that rename runs (a slow or stopped file
system), the writer is cancelled while the thread goes on and may complete the rename. The
verdict is then "failed" (every rank hears a timeout), so the commit must be taken back once the
rename landed: a step on disk that every rank was told failed would be resumed from silently,
and a save the caller retries would find its step already there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from asyncckpt import Checkpointer, SaveTimeoutError, find_latest
from asyncckpt.roots.posix._osops import OsOps


class SlowCommitRename(OsOps):
    """The first commit rename of step 2 (``step_N.tmp-*`` -> ``step_N``) takes ``delay`` s,
    then happens: a real rename, late."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.renamed = 0.0

    def rename(self, src: str, dst: str) -> None:
        if os.path.basename(dst) == "step_00000002" and not self.renamed:
            time.sleep(self.delay)
            super().rename(src, dst)
            self.renamed = time.monotonic()
            return
        super().rename(src, dst)


@pytest.mark.timing  # a 1.5 s save deadline
def test_a_commit_rename_that_lands_after_the_deadline_is_taken_back(tmp_path: Path) -> None:
    ops = SlowCommitRename(delay=2.5)
    root = tmp_path / "ck"
    with Checkpointer(str(root), timeout=1.5, os_ops=ops) as ck:
        ck.save(1, {"w": torch.arange(4.0)}).result(timeout=30)
        h = ck.save(2, {"w": torch.arange(4.0) + 1})
        err = h.exception(timeout=30)
        assert isinstance(err, SaveTimeoutError), err
        # the late rename landed after the verdict; wait until it has, then until the writer
        # took it back (bounded)
        end = time.monotonic() + 20
        while time.monotonic() < end and (not ops.renamed or (root / "step_00000002").exists()):
            time.sleep(0.05)
        assert ops.renamed, "the slow rename never ran"
        assert not (root / "step_00000002").exists(), "a step every rank was told failed stays committed"
        assert find_latest(root).step == 1  # type: ignore[union-attr]
        assert ck.steps() == [1]
        with pytest.raises(SaveTimeoutError):  # flush() reports the failure since the last flush
            ck.flush(timeout=10)
        # the same step saves again and commits
        ck.save(2, {"w": torch.arange(4.0) + 2}).result(timeout=30)
    assert find_latest(root).step == 2  # type: ignore[union-attr]
    assert torch.equal(Checkpointer(str(root)).load()["w"], torch.arange(4.0) + 2)
