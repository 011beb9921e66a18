"""NeMo Automodel's checkpoint directory as pointers to asyncckpt steps
(``asyncckpt.integrations._nemo_folders``): publication, ``LATEST``/``LOWEST_VAL``, NeMo's
``max_recent_checkpoints`` rule, and recovery after a crash at every point between a save's
commit and its pointer. Real steps of a real Checkpointer; nothing here needs NeMo (the
2-rank recipe test, ``test_nemo_recipe.py``, runs NeMo's own resolution of these folders)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt import CheckpointError
from asyncckpt.integrations import _nemo_folders as folders


def _steps(root: Path) -> list[int]:
    with asyncckpt.Checkpointer(root) as ck:
        return ck.steps()


def _save(root: Path, *steps: int) -> None:
    with asyncckpt.Checkpointer(root) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((4,), float(s))}).result(60)


def _pending(d: Path, step: int, *, val: float | None = None, gstep: int | None = None) -> str:
    losses = {"train_loss": 1.0} if val is None else {"train_loss": 1.0, "val_loss": val}
    return folders.write_pending(
        str(d), str(d / folders.ROOT_NAME), step, 0, step if gstep is None else gstep,
        {"losses.json": json.dumps(losses).encode(), "config.yaml": b"model: {}\n"}, "default", val,
    )  # fmt: skip


def _names(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("epoch_"))


def test_publish_points_latest_and_applies_nemo_retention(tmp_path: Path) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 1, 2, 3, 4)
    vals = {1: 0.5, 2: 0.9, 3: 0.8, 4: 0.7}  # step 1 stays the lowest validation metric
    for s in (1, 2, 3, 4):
        folder = folders.publish(_pending(tmp_path, s, val=vals[s]), str(root), keep=2)
        assert folder == str(tmp_path / f"epoch_0_step_{s}")
        # LATEST as NeMo writes it: a relative symlink to the folder name
        assert os.readlink(tmp_path / "LATEST") == f"epoch_0_step_{s}"
    assert os.readlink(tmp_path / "LOWEST_VAL") == "epoch_0_step_1"
    # keep=2: the two highest steps, plus what a pointer protects; the others go with their steps
    assert _names(tmp_path) == ["epoch_0_step_1", "epoch_0_step_3", "epoch_0_step_4"]
    assert _steps(root) == [1, 3, 4]
    p = folders.read_pointer(str(tmp_path / "epoch_0_step_4"))
    assert p is not None and (p.step, p.epoch, p.global_step, p.val_metric) == (4, 0, 4, 0.7)
    assert Path(p.root) == root
    assert json.loads((tmp_path / "epoch_0_step_4" / "losses.json").read_text()) == {"train_loss": 1.0, "val_loss": 0.7}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")  and n != folders.ROOT_NAME]


def test_republishing_a_name_replaces_the_abandoned_folder_and_its_step(tmp_path: Path) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 6, 7)
    folders.publish(_pending(tmp_path, 6), str(root), keep=None)
    # a run resumed from an older checkpoint saves NeMo step 6 again: asyncckpt step 7
    folders.publish(_pending(tmp_path, 7, gstep=6), str(root), keep=None)
    assert _names(tmp_path) == ["epoch_0_step_6"]
    p = folders.read_pointer(str(tmp_path / "epoch_0_step_6"))
    assert p is not None and p.step == 7 and p.global_step == 6
    assert _steps(root) == [7]


def test_recover_publishes_committed_pending_folders_and_removes_the_rest(tmp_path: Path) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 2, 4)
    folders.publish(_pending(tmp_path, 2), str(root), keep=None)
    committed = _pending(tmp_path, 4)  # killed after step 4 committed, before its folder appeared
    uncommitted = _pending(tmp_path, 6)  # killed while step 6 was being written
    garbage = tmp_path / ".epoch_0_step_8.tmp-0123456789abcdef"
    garbage.mkdir()
    (garbage / folders.POINTER_NAME).write_text("{not json")
    assert os.readlink(tmp_path / "LATEST") == "epoch_0_step_2"
    published = folders.recover(str(tmp_path), str(root), set(_steps(root)), keep=None)
    assert published == [str(tmp_path / "epoch_0_step_4")]
    assert os.readlink(tmp_path / "LATEST") == "epoch_0_step_4"
    assert _names(tmp_path) == ["epoch_0_step_2", "epoch_0_step_4"]
    assert not os.path.exists(uncommitted) and not garbage.exists() and not os.path.exists(committed)
    assert folders.recover(str(tmp_path), str(root), set(_steps(root)), keep=None) == []  # idempotent


def test_recover_moves_latest_left_behind_by_a_crash_after_the_rename(tmp_path: Path) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 2, 4)
    folders.publish(_pending(tmp_path, 2), str(root), keep=None)
    os.rename(_pending(tmp_path, 4), tmp_path / "epoch_0_step_4")  # renamed; LATEST not yet moved
    folders.recover(str(tmp_path), str(root), {2, 4}, keep=None)
    assert os.readlink(tmp_path / "LATEST") == "epoch_0_step_4"


def test_recover_finishes_an_interrupted_removal(tmp_path: Path) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 2, 4)
    for s in (2, 4):
        folders.publish(_pending(tmp_path, s), str(root), keep=None)
    os.rename(tmp_path / "epoch_0_step_2", tmp_path / ".epoch_0_step_2.removing-0123456789abcdef")
    folders.recover(str(tmp_path), str(root), {2, 4}, keep=None)
    assert _names(tmp_path) == ["epoch_0_step_4"] and _steps(root) == [4]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".epoch")]


def test_nemo_written_folders_are_pruned_as_nemo_prunes_them(tmp_path: Path) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 5, 6)
    for s in (1, 2):  # folders NeMo wrote itself before the job switched
        (tmp_path / f"epoch_0_step_{s}" / "model").mkdir(parents=True)
    (tmp_path / "epoch_0_step_3").mkdir()
    (tmp_path / "epoch_0_step_3" / ".incomplete").touch()  # NeMo's marker: never counted as kept
    for s in (5, 6):
        folders.publish(_pending(tmp_path, s), str(root), keep=2)
    assert _names(tmp_path) == ["epoch_0_step_5", "epoch_0_step_6"]


def test_a_pointer_into_another_root_never_removes_there(tmp_path: Path) -> None:
    root, other = tmp_path / folders.ROOT_NAME, tmp_path / "elsewhere"
    _save(root, 1, 2)
    _save(other, 1)
    hostile = tmp_path / "epoch_0_step_1"
    hostile.mkdir()
    doc = {"format": folders.FORMAT, "root": "../elsewhere", "step": 1, "epoch": 0, "global_step": 1,
           "metric_key": "default", "val_metric": None}  # fmt: skip
    (hostile / folders.POINTER_NAME).write_text(json.dumps(doc))
    folders.publish(_pending(tmp_path, 2), str(root), keep=1)
    assert _names(tmp_path) == ["epoch_0_step_2"]
    assert _steps(other) == [1]  # its step is left alone
    assert _steps(root) == [1, 2]  # and ours was never its target


@pytest.mark.parametrize(
    "text",
    ["{", "[]", json.dumps({"format": "other"}), json.dumps({"format": folders.FORMAT, "root": "..", "step": -1}),
     json.dumps({"format": folders.FORMAT, "root": "..", "step": 1, "epoch": 0, "global_step": 1,
                 "metric_key": "default", "val_metric": "nan"}), "x" * (70 * 1024)],
)  # fmt: skip
def test_a_malformed_pointer_is_a_checkpoint_error(tmp_path: Path, text: str) -> None:
    (tmp_path / folders.POINTER_NAME).write_text(text)
    with pytest.raises(CheckpointError, match="not an asyncckpt pointer"):
        folders.read_pointer(str(tmp_path))


def test_latest_falls_back_to_a_text_pointer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / folders.ROOT_NAME
    _save(root, 1)

    def no_symlinks(*_: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_symlinks)  # a file system without symlinks (some FUSE mounts)
    folders.publish(_pending(tmp_path, 1), str(root), keep=None)
    assert (tmp_path / "LATEST.txt").read_text() == "epoch_0_step_1"
    assert folders.read_link(str(tmp_path), "LATEST") == str(tmp_path / "epoch_0_step_1")
