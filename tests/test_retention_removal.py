"""Retention renames the retired steps away and the save settles; their files are removed
afterwards on the writer loop, and flush()/close() wait for that. The unlink is held (or made
to fail) through the OsOps seam: a deletion slow or failing on demand is not something a real
file system here produces."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.roots.posix._osops import OsOps

WAIT_S = 60


class HeldUnlink(OsOps):
    """unlinkat blocks until ``release`` is set (``fail``: then raises EIO instead)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def unlink_at(self, dir_fd: int, name: str) -> None:
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("test never released the unlink")
        if self.fail:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().unlink_at(dir_fd, name)


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(step))}


def _entries(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def test_result_does_not_wait_for_the_deletion_flush_does(tmp_path: Path) -> None:
    ops = HeldUnlink()
    ck = Checkpointer(tmp_path, keep_last=1, timeout=WAIT_S, os_ops=ops)
    try:
        ck.save(1, _state(1)).result(WAIT_S)
        info = ck.save(2, _state(2)).result(WAIT_S)  # returns while step 1's unlink is held
        assert ops.entered.wait(WAIT_S)
        assert ck.steps() == [2] and asyncckpt.find_latest(tmp_path).step == 2  # retired at once
        assert [n for n in _entries(tmp_path) if n.startswith("step_00000001")] != []  # files still there
        with pytest.raises(TimeoutError, match="removing retired checkpoints"):
            ck.flush(timeout=0.2)
        ops.release.set()
        ck.flush(WAIT_S)
        assert _entries(tmp_path) == [info.path.name]
        assert torch.equal(asyncckpt.load(tmp_path)["w"], _state(2)["w"])
    finally:
        ops.release.set()
        ck.close()


def test_close_waits_for_the_deletion(tmp_path: Path) -> None:
    ops = HeldUnlink()
    ck = Checkpointer(tmp_path, keep_last=1, timeout=WAIT_S, os_ops=ops)
    ck.save(1, _state(1)).result(WAIT_S)
    ck.save(2, _state(2)).result(WAIT_S)
    assert ops.entered.wait(WAIT_S)
    threading.Timer(0.3, ops.release.set).start()
    ck.close()
    assert _entries(tmp_path) == ["step_00000002"]


def test_a_failed_deletion_is_logged_the_save_stands_and_the_next_start_removes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ops = HeldUnlink()
    ops.fail = True
    ops.release.set()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), Checkpointer(
        tmp_path, keep_last=1, timeout=WAIT_S, os_ops=ops
    ) as ck:
        ck.save(1, _state(1)).result(WAIT_S)
        assert ck.save(2, _state(2)).result(WAIT_S).step == 2
        ck.flush(WAIT_S)  # the removal failed: nothing to raise, the save committed
        assert ck.steps() == [2]
    assert any("removing retired checkpoints" in r.getMessage() for r in caplog.records)
    left = [n for n in _entries(tmp_path) if n != "step_00000002"]
    assert len(left) == 1 and ".deleting-" in left[0]  # a leftover, never a complete step
    assert asyncckpt.find_latest(tmp_path).step == 2
    with Checkpointer(tmp_path, keep_last=1, timeout=WAIT_S):
        pass  # takes the root: leftovers are dead and removed
    assert _entries(tmp_path) == ["step_00000002"]


async def _asave_then_aflush(ck: Checkpointer, ops: HeldUnlink) -> None:
    await ck.save(1, _state(1))
    await ck.save(2, _state(2))
    assert ops.entered.wait(WAIT_S)
    with pytest.raises(TimeoutError, match="removing retired checkpoints"):
        await ck.aflush(timeout=0.2)
    ops.release.set()
    await ck.aflush(WAIT_S)


def test_aflush_waits_for_the_deletion_too(tmp_path: Path) -> None:
    import asyncio

    ops = HeldUnlink()
    with Checkpointer(tmp_path, keep_last=1, timeout=WAIT_S, os_ops=ops) as ck:
        try:
            asyncio.run(_asave_then_aflush(ck, ops))
        finally:
            ops.release.set()
        assert _entries(tmp_path) == ["step_00000002"]
