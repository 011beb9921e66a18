"""Deferred staging through the integrations, each opting in with one argument: the Hugging
Face Trainer (``asyncckpt_deferred=True``) writes checkpoints bit-identical to today's mode,
Lightning (``AsyncckptCheckpointIO(deferred=True)``) writes exactly what it handed over."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import _hf_worker as hf
import _lightning_worker as lw
from test_lightning import Spy, pointers, same
from transformers import TrainingArguments

import asyncckpt
from asyncckpt.integrations import _hf_folders as folders
from asyncckpt.integrations.lightning import load_checkpoint
from asyncckpt.integrations.transformers import AsyncckptTrainer
from asyncckpt.saving import _deferred

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(120),
]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts deferred copies started (the saves really were deferred)."""
    n: list[int] = []
    real = _deferred.DeferredCopy.start

    def start(self: Any, *a: Any) -> None:
        n.append(1)
        real(self, *a)

    monkeypatch.setattr(_deferred.DeferredCopy, "start", start)
    return n


def hf_run(out: Path, deferred: bool) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-identical runs
    try:
        args = TrainingArguments(
            str(out), max_steps=10, per_device_train_batch_size=hf.BATCH, save_steps=5, save_total_limit=None,
            logging_steps=1, report_to=[], use_cpu=True, seed=1, learning_rate=1e-3, disable_tqdm=True,
            dataloader_num_workers=0,
        )  # fmt: skip
        t = AsyncckptTrainer(model=hf.model(), args=args, train_dataset=hf.Tokens(), asyncckpt_deferred=deferred)
        t.train()
    finally:
        torch.set_num_threads(threads)


def test_hf_trainer(tmp_path: Path, started: list[int]) -> None:
    hf_run(tmp_path / "copy", False)
    assert started == []
    hf_run(tmp_path / "deferred", True)
    assert len(started) == 2
    for step in (5, 10):
        a = asyncckpt.load(tmp_path / "copy" / folders.ROOT_NAME, step=step)
        b = asyncckpt.load(tmp_path / "deferred" / folders.ROOT_NAME, step=step)
        for part in ("model", "optimizer", "scheduler"):
            same(b[part], a[part], part)
    with pytest.raises(TypeError, match="asyncckpt_deferred"):
        AsyncckptTrainer(model=hf.model(), args=TrainingArguments(str(tmp_path / "x"), use_cpu=True, report_to=[]),
                         asyncckpt_deferred="yes")  # fmt: skip


def test_lightning(tmp_path: Path, started: list[int]) -> None:
    spy = Spy(deferred=True)
    t, _ = lw.trainer(str(tmp_path), epochs=3, top_k=2, plugin=spy)
    t.fit(lw.model(), train_dataloaders=lw.data())
    assert len(started) >= 2  # the first save may come before any step: then it copies in save()
    for p in pointers(tmp_path):
        path = os.fspath(tmp_path / p)
        same(load_checkpoint(path), spy.seen[path], p)
