"""Damaged checkpoints are never taken for complete, and loading them names the file."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from conftest import make_state

from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointNotFoundError, find_latest, load
from asyncckpt.format._manifest import MANIFEST


def _two_steps(root: Path) -> Path:
    with Checkpointer(root) as ck:
        ck.save(1, make_state(1)).result(timeout=30)
        return ck.save(2, make_state(2)).result(timeout=30).path


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["rank00000.safetensors", "rank00000.json", MANIFEST])
def test_random_bit_flips_are_always_detected(tmp_path: Path, name: str) -> None:
    rng = random.Random(name)
    root = tmp_path / "ck"
    path = _two_steps(root) / name
    pristine = path.read_bytes()
    for _ in range(34):
        offset, bit = rng.randrange(len(pristine)), rng.randrange(8)
        _flip(path, offset, bit)
        with pytest.raises((CheckpointCorruptError, CheckpointNotFoundError)) as ei:
            load(root, 2)
        if isinstance(ei.value, CheckpointCorruptError):
            assert ei.value.path is not None and os.path.basename(ei.value.path) in (name, "step_00000002")
        path.write_bytes(pristine)
    assert load(root, 2)["extra"]["step"] == 2


def test_truncated_shard_is_not_latest_and_load_names_it(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shard = _two_steps(root) / "rank00000.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    assert find_latest(root).step == 1  # type: ignore[union-attr]
    with pytest.raises(CheckpointCorruptError, match=r"rank00000\.safetensors"):
        load(root, 2)
    assert load(root)["extra"]["step"] == 1  # resume falls back to the newest complete one


def test_missing_files_are_not_latest_and_extra_files_are_ignored(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    step2 = _two_steps(root)
    (step2 / "stray.bin").write_bytes(b"x")  # not in the manifest: ignored (issue 26 attack C)
    assert find_latest(root).step == 2  # type: ignore[union-attr]
    assert load(root, 2)["extra"]["step"] == 2
    (step2 / "stray.bin").unlink()
    assert find_latest(root).step == 2  # type: ignore[union-attr]
    (step2 / "rank00000.json").unlink()
    assert find_latest(root).step == 1  # type: ignore[union-attr]
    with pytest.raises(CheckpointCorruptError, match="missing"):
        load(root, 2)


def test_marker_missing_means_not_found_and_garbage_marker_means_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    step2 = _two_steps(root)
    manifest = (step2 / MANIFEST).read_bytes()
    (step2 / MANIFEST).unlink()
    with pytest.raises(CheckpointNotFoundError):
        load(root, 2)
    assert find_latest(root).step == 1  # type: ignore[union-attr]
    (step2 / MANIFEST).write_bytes(b"{not json")
    with pytest.raises(CheckpointCorruptError, match="manifest"):
        load(root, 2)
    doc = json.loads(manifest)
    doc["step"] = 3  # consistent JSON, wrong content: the seal catches it
    (step2 / MANIFEST).write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        load(root, 2)


def test_manifest_with_path_traversal_is_rejected(tmp_path: Path) -> None:
    from asyncckpt.format._manifest import FileEntry, encode

    root = tmp_path / "ck"
    step2 = _two_steps(root)
    body = encode(2, "x", 1, 0, 0.0, [FileEntry("../../etc/passwd", 1, 0, 0)], {})
    (step2 / MANIFEST).write_bytes(body)
    with pytest.raises(CheckpointCorruptError, match="unsafe file name"):
        load(root, 2)


def test_missing_step_and_empty_root(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        load(tmp_path)
    assert find_latest(tmp_path / "nowhere") is None
    _two_steps(tmp_path / "ck")
    with pytest.raises(CheckpointNotFoundError):
        load(tmp_path / "ck", 7)
    assert isinstance(CheckpointNotFoundError("x"), FileNotFoundError)


def test_symlinked_shard_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    step2 = _two_steps(root)
    shard = step2 / "rank00000.safetensors"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    assert find_latest(root).step == 1  # type: ignore[union-attr]
    with pytest.raises(CheckpointCorruptError):
        load(root, 2)


def test_verify_false_skips_checksums_but_not_structure(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer(root) as ck:
        path = ck.save(1, {"w": torch.zeros(1000)}).result(timeout=30).path
    shard = path / "rank00000.safetensors"
    _flip(shard, shard.stat().st_size - 1)
    assert load(root, 1, verify=False)["w"].count_nonzero() == 1
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        load(root, 1)
