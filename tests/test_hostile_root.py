"""Hostile and odd roots, and the corners an outsider found around ownership and commits:
planted lock files, a symlinked metadata directory, a repointed root, a squatting step
directory, a clock that ran ahead, a deadline that lands after the commit rename, and a
commit callback that raises SystemExit."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncckpt
from asyncckpt import Checkpointer, RootInUseError, RootNotWritableError, SaveError
from asyncckpt.format._layout import META_DIR
from asyncckpt.loading._verify import verify_opened
from asyncckpt.roots import open_root
from asyncckpt.roots.posix._osops import OsOps


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((16,), v), "v": v}


@pytest.mark.timeout(30)
def test_a_fifo_planted_as_the_owner_lock_fails_at_once_not_hangs(tmp_path: Path) -> None:
    (tmp_path / META_DIR).mkdir()
    os.mkfifo(tmp_path / META_DIR / "owner.lock")
    t0 = time.monotonic()
    with pytest.raises(RootNotWritableError, match="not a regular file"):
        Checkpointer(tmp_path, timeout=5)
    assert time.monotonic() - t0 < 5


def test_a_symlinked_owner_lock_or_metadata_dir_is_refused_and_nothing_is_written_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ck"
    root.mkdir()
    (root / META_DIR).symlink_to(outside)
    with pytest.raises(RootNotWritableError, match="not a directory"):
        Checkpointer(root)
    assert list(outside.iterdir()) == []
    (root / META_DIR).unlink()
    (root / META_DIR).mkdir()
    (root / META_DIR / "owner.lock").symlink_to(outside / "lock")
    with pytest.raises(RootNotWritableError, match="symbolic link") as ei:
        Checkpointer(root)
    assert ei.value.errno == errno.ELOOP
    assert list(outside.iterdir()) == []


def test_a_hostile_owner_record_still_gives_root_in_use(tmp_path: Path) -> None:
    with Checkpointer(tmp_path):
        (tmp_path / META_DIR / "owner.json").write_text("[" * 100_000 + "]" * 100_000)
        with pytest.raises(RootInUseError, match=f"pid {os.getpid()}"):  # named from /proc/locks
            Checkpointer(tmp_path)


def test_a_repointed_symlinked_root_does_not_move_a_running_checkpointer(tmp_path: Path) -> None:
    a, b, link = tmp_path / "a", tmp_path / "b", tmp_path / "current"
    a.mkdir()
    b.mkdir()
    link.symlink_to(a)
    with Checkpointer(b, keep_last=1) as other:
        other.save(10, _state(10.0)).result(timeout=30)
        with Checkpointer(link, keep_last=1) as ck:
            assert ck.root == str(a)
            link.unlink()
            link.symlink_to(b)  # runs/current -> the other job's root
            ck.save(20, _state(20.0)).result(timeout=30)
        assert other.steps() == [10]  # untouched: no write, no retention in the other root
    assert asyncckpt.load(a)["v"] == 20.0


def test_a_directory_squatting_on_a_step_name_is_never_removed(tmp_path: Path) -> None:
    squat = tmp_path / "step_00000003"
    squat.mkdir(parents=True)
    (squat / "important_notes.txt").write_text("mine")
    with Checkpointer(tmp_path) as ck:
        h = ck.save(3, _state(3.0))
        with pytest.raises(SaveError) as ei:
            h.result(timeout=30)
        f = next(iter(ei.value.failures.values()))
        assert f.exc_type == "FileExistsError" and f.errno == errno.EEXIST, f
        assert "not a complete checkpoint" in f.message
        with pytest.raises(SaveError):
            ck.flush()  # flush reports the failures since the last flush, seen or not
        ck.save(4, _state(4.0)).result(timeout=30)
    assert (squat / "important_notes.txt").read_text() == "mine"


def test_the_checkpoint_just_committed_survives_retention_by_commit_order_when_clocks_disagree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncckpt.saving._leadercommit as commit

    real = time.time
    monkeypatch.setattr(commit.time, "time", lambda: real() + 3600)  # stands in for a clock an hour ahead
    with Checkpointer(tmp_path, keep_last=2, allow_earlier_steps=True) as ck:
        ck.save(10, _state(10.0)).result(timeout=30)
        ck.save(20, _state(20.0)).result(timeout=30)
    monkeypatch.setattr(commit.time, "time", real)
    with Checkpointer(tmp_path, keep_last=2, allow_earlier_steps=True) as ck:
        info = ck.save(30, _state(30.0)).result(timeout=30)
        assert info.path.exists()
        assert 30 in ck.steps() and len(ck.steps()) == 2, ck.steps()


def test_a_deadline_after_the_commit_rename_takes_the_commit_back(tmp_path: Path) -> None:
    class SlowRootFsync(OsOps):  # stands in for a file system whose fsync stalls
        armed = False

        def fsync_dir(self, path: str) -> None:
            super().fsync_dir(path)
            if self.armed and os.path.abspath(path) == str(tmp_path) and (tmp_path / "step_00000002").exists():
                time.sleep(3.0)  # the commit rename happened; the save's deadline passes here

    ops = SlowRootFsync()
    with Checkpointer(tmp_path, timeout=2.0, os_ops=ops) as ck:
        ck.save(1, _state(1.0)).result(timeout=30)
        ops.armed = True
        with pytest.raises(SaveError):
            ck.save(2, _state(2.0)).result(timeout=30)
        ops.armed = False
        with pytest.raises(SaveError):
            ck.flush()
        # failure means not on disk: the take-back removed it, the previous stays the latest
        assert not (tmp_path / "step_00000002").exists()
        assert ck.latest() is not None and ck.latest().step == 1  # type: ignore[union-attr]
        ck.save(2, _state(2.0)).result(timeout=30)  # and the step can be saved again


def test_an_on_commit_callback_raising_system_exit_does_not_kill_the_writer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def bad(info: Any) -> None:
        raise SystemExit(3)

    with Checkpointer(tmp_path, on_commit=bad) as ck:
        ck.save(1, _state(1.0)).result(timeout=30)
        ck.save(2, _state(2.0)).result(timeout=30)
    assert "on_commit callback raised" in caplog.text
    assert asyncckpt.load(tmp_path)["v"] == 2.0


def test_a_step_retired_while_verified_is_reported_gone_not_corrupt(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _state(1.0)).result(timeout=30)
    root = open_root(str(tmp_path))
    with root.open_reader(1) as reader:
        os.rename(reader.locate(), tmp_path / "step_00000001.deleting-00ff")  # retention renames it away
        problems = verify_opened(root, reader)
    assert problems and all(p.vanished for p in problems), problems
    assert json.dumps([p.reason for p in problems])
