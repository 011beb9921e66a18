"""Resume survives a bad newest checkpoint (issue 9, E): load(step=None) falls back, and agrees.

Real files, a real flipped byte; with two ranks real gloo processes on localhost.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _ranks import free_port, log_tail, run_ranks

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, CheckpointNotFoundError
from asyncckpt.format._manifest import MANIFEST, decode
from asyncckpt.roots._badmarks import bad_mark

WORKER = str(Path(__file__).parent / "support" / "_fallback_worker.py")


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step)), "b": torch.arange(8) + step, "step": step}


def flip(path: Path, offset: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ck"
    with Checkpointer(r) as ck:
        for s in (1, 2, 3):
            ck.save(s, state(s)).result(timeout=60)
    return r


def attempt_of(root: Path, step: int) -> str:
    d = root / f"step_{step:08d}"
    return decode((d / MANIFEST).read_bytes(), "").attempt


@pytest.mark.parametrize("name", ["rank00000.safetensors", "rank00000.json"])
def test_load_latest_falls_back_past_a_corrupt_newest(root: Path, name: str, caplog: pytest.LogCaptureFixture) -> None:
    bad = root / "step_00000003" / name
    flip(bad, -5 if name.endswith("safetensors") else 3)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        got = asyncckpt.load(root)
    assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    mark = bad_mark(root, 3, attempt_of(root, 3))
    assert mark is not None and mark["path"] == str(bad)
    with pytest.raises(CheckpointCorruptError) as ei:  # an explicit step still raises
        asyncckpt.load(root, 3)
    assert ei.value.path == str(bad)


def test_checkpointer_load_falls_back_and_restores_only_a_verified_state(root: Path) -> None:
    flip(root / "step_00000003" / "rank00000.safetensors")
    with Checkpointer(root) as ck:
        assert ck.latest().step == 3  # type: ignore[union-attr]  # discovery does not read data
        target = {"w": torch.zeros(4096), "b": torch.zeros(8, dtype=torch.int64), "step": -1}
        got = ck.load(into=target)
        assert got["step"] == 2 and target["step"] == 2 and torch.equal(target["w"], state(2)["w"])
        untouched = {"w": torch.zeros(4096), "b": torch.zeros(8, dtype=torch.int64), "step": -1}
        with pytest.raises(CheckpointCorruptError):
            ck.load(3, into=untouched, verify_first=True)
        assert untouched["step"] == -1 and not untouched["w"].any() and not untouched["b"].any()


def test_module_load_into_falls_back(root: Path) -> None:
    flip(root / "step_00000003" / "rank00000.safetensors")
    target = {"w": torch.zeros(4096), "b": torch.zeros(8, dtype=torch.int64), "step": -1}
    asyncckpt.load(root, into=target)
    assert target["step"] == 2 and torch.equal(target["b"], state(2)["b"])


def test_corrupt_manifest_of_the_newest_is_warned_and_skipped(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    flip(root / "step_00000003" / MANIFEST, 30)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        assert asyncckpt.load(root)["step"] == 2
    assert any(str(root / "step_00000003" / MANIFEST) in r.getMessage() for r in caplog.records)


def test_every_checkpoint_corrupt_raises_corrupt_naming_the_newest(root: Path) -> None:
    for s in (1, 2, 3):
        flip(root / f"step_{s:08d}" / "rank00000.safetensors")
    with pytest.raises(CheckpointCorruptError) as ei:
        asyncckpt.load(root)
    assert ei.value.path == str(root / "step_00000003" / "rank00000.safetensors")


def test_empty_root_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        asyncckpt.load(tmp_path)


def test_unwritable_root_still_falls_back(root: Path) -> None:
    """Recording the verdict is best effort: a read-only reader falls back all the same."""
    flip(root / "step_00000003" / "rank00000.safetensors")
    meta = root / ".asyncckpt"
    meta.mkdir(exist_ok=True)
    (meta / "bad").write_text("not a directory")  # the mark cannot be written
    assert asyncckpt.load(root)["step"] == 2


def _two_ranks(tmp_path: Path, bad_rank: int) -> dict[int, dict[str, Any]]:
    root, out = tmp_path / "ck", tmp_path / "result"
    port = free_port()
    hung = run_ranks(
        lambda r: [WORKER, str(r), "2", str(port), str(root), str(out)],
        2, tmp_path, 90, extra_env={"BAD_RANK": str(bad_rank)}, warm=True,
    )  # fmt: skip
    assert not hung, f"ranks {hung} hung"
    res = {}
    for r in range(2):
        f = Path(f"{out}.{r}.json")
        assert f.exists(), log_tail(tmp_path, r)
        res[r] = json.loads(f.read_text())
        assert "crash" not in res[r], res[r]["crash"]
    return res


@pytest.mark.timeout(150)
@pytest.mark.parametrize("bad_rank", [1, 0])
def test_two_ranks_agree_to_fall_back_when_one_shard_is_corrupt(tmp_path: Path, bad_rank: int) -> None:
    res = _two_ranks(tmp_path, bad_rank)
    for r, got in res.items():
        assert got["latest"] == 2
        assert got["loaded"] == [1, r, 10.0 + r], got  # every rank on step 1, each its own shard
        assert got["into"] == [1, 10.0 + r]
        assert got["explicit"] == "CheckpointCorruptError", got
        assert f"rank{bad_rank:05d}.safetensors" in got["explicit_msg"]
        assert got["untouched"] == [-1, 0.0]
    assert bad_mark(tmp_path / "ck", 2, attempt_of(tmp_path / "ck", 2)) is not None
