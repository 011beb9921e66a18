"""A path that is not a checkpoint root is a clear error at the call, never "no checkpoint":
a run told "none" starts from scratch beside its checkpoints (an outsider's finding:
``find_latest`` of a file or of a step's own directory answered ``None``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncckpt import Checkpointer, CheckpointNotFoundError, find_latest, load


def _root_with_step(tmp_path: Path, step: int = 3) -> Path:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        ck.save(step, {"w": torch.arange(4.0)}).result(timeout=60)
    return root


def test_find_latest_of_a_file_is_not_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    with pytest.raises(NotADirectoryError) as got:
        find_latest(f)
    assert got.value.filename == str(f)
    assert f.read_text() == "x"


def test_find_latest_of_a_step_directory_names_its_root_and_step(tmp_path: Path) -> None:
    root = _root_with_step(tmp_path)
    with pytest.raises(ValueError, match=r"step 3; pass its root, .*ck, and step=3"):
        find_latest(root / "step_00000003")
    with pytest.raises(CheckpointNotFoundError, match=r"pass its root, .*ck, and step=3"):
        load(root / "step_00000003")
    assert find_latest(root).step == 3  # nothing was touched
    assert torch.equal(load(root)["w"], torch.arange(4.0))


def test_a_root_that_does_not_exist_yet_holds_no_checkpoint(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "fresh") is None
    assert not (tmp_path / "fresh").exists()


def test_a_directory_named_like_a_step_without_a_manifest_is_a_root(tmp_path: Path) -> None:
    root = _root_with_step(tmp_path / "step_00000009")  # a root that happens to sit in such a folder
    assert find_latest(root).step == 3
    odd = tmp_path / "step_00000001"
    odd.mkdir()
    assert find_latest(odd) is None


def test_a_checkpointer_on_a_step_directory_is_refused_and_writes_nothing_there(tmp_path: Path) -> None:
    root = _root_with_step(tmp_path)
    step_dir = root / "step_00000003"
    before = sorted(p.name for p in step_dir.iterdir())
    with pytest.raises(ValueError, match=r"pass its root, .*ck, and step=3"):
        Checkpointer(step_dir)
    assert sorted(p.name for p in step_dir.iterdir()) == before
