"""The Lightning plugin with a real ``lightning.Trainer`` on the CPU: non-blocking saves,
ModelCheckpoint top-k and last, removal ordered after pending saves, a SIGKILL mid-training
and a resume with ``ckpt_path="last"`` that reproduces the uninterrupted run's losses."""

from __future__ import annotations

import copy
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import lightning  # noqa: F401
except ImportError as e:  # CI refuses this skip ("needs lightning/")
    pytest.skip(f"needs lightning/: pip install 'asyncckpt[lightning]' ({e})", allow_module_level=True)

import _lightning_worker as w
from lightning.fabric.utilities.data import AttributeDict

from asyncckpt import SaveError
from asyncckpt._errors import CheckpointError
from asyncckpt.integrations.lightning import ROOT_NAME, AsyncckptCheckpointIO, load_checkpoint, read_pointer
from asyncckpt.roots.posix._osops import OsOps

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's advice (num_workers, ...)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(90),
]

WORKER = str(Path(__file__).parent / "support" / "_lightning_worker.py")


def same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


class Spy(AsyncckptCheckpointIO):
    """Keeps a copy of what Lightning handed over, to compare with what comes back."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seen: dict[str, Any] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.seen[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def pointers(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.suffix == ".ckpt"}


def test_fit_keeps_top_k_and_last_and_every_value_roundtrips(tmp_path: Path) -> None:
    spy = Spy()
    t, cb = w.trainer(str(tmp_path), epochs=4, top_k=2, plugin=spy)
    t.fit(w.model(), train_dataloaders=w.data())  # teardown flushed: everything is on disk
    assert pointers(tmp_path) == {"epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"}
    assert {Path(p).name for p in cb.best_k_models} == {"epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt"}
    # the root holds exactly the steps the pointers name: nothing removed early, nothing left over
    named = {read_pointer(str(tmp_path / p))[1] for p in pointers(tmp_path)}
    steps = {int(n.removeprefix("step_")) for n in os.listdir(tmp_path / ROOT_NAME) if n.startswith("step_")}
    assert steps == named
    for p in pointers(tmp_path):
        path = str(tmp_path / p)
        same(load_checkpoint(path), spy.seen[path], p)
    last = load_checkpoint(tmp_path / "last.ckpt")
    assert last["global_step"] == 16 and last["hyper_parameters"] == {"lr": 0.05, "width": 16, "name": "tiny"}
    assert type(last["state_dict"]).__name__ == "OrderedDict" and hasattr(last["state_dict"], "_metadata")


def test_kill_mid_training_then_resume_last_gives_identical_losses(tmp_path: Path) -> None:
    epochs = 6
    ref_model = w.model()
    ref, _ = w.trainer(str(tmp_path / "ref"), epochs)
    ref.fit(ref_model, train_dataloaders=w.data())
    reference = dict(ref_model.losses)
    assert len(reference) == epochs * w.BATCHES_PER_EPOCH

    ckdir, losses = tmp_path / "run", tmp_path / "losses.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(tmp_path / "worker.log", "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, WORKER, str(ckdir), str(losses), str(epochs)], env=env, stdout=logf, stderr=logf
        )
        try:
            deadline = time.monotonic() + 60
            # kill once the epoch-1 checkpoint is published, while training goes on
            while not (ckdir / "epoch=1-step=8.ckpt").exists():
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "worker published no checkpoint in time"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "losses.txt.done").exists(), "the run finished before the kill"
    before = [line.split() for line in losses.read_text().splitlines()]
    assert all(reference[int(s)] == float(v) for s, v in before)
    # every checkpoint Lightning can see after the kill is complete
    for p in pointers(ckdir):
        load_checkpoint(ckdir / p)

    resumed_model = w.model()
    t, _ = w.trainer(str(ckdir), epochs)
    t.fit(resumed_model, train_dataloaders=w.data(), ckpt_path="last")
    start = resumed_model.losses[0][0]
    # last.ckpt of epoch 1 may still have been in flight: then the resume is from epoch 0
    assert start in (4, 8, 12), start
    assert dict(resumed_model.losses) == {s: v for s, v in reference.items() if s >= start}


def big_state(n: int = 4_000_000) -> dict[str, Any]:
    return {"state_dict": {"w": torch.randn(n)}, "global_step": 1}


def test_removal_of_a_pending_save_waits_for_it(tmp_path: Path) -> None:
    io = AsyncckptCheckpointIO()
    a = tmp_path / "a.ckpt"
    io.save_checkpoint(big_state(), a)
    io.remove_checkpoint(a)  # while its save is (very likely) still in flight
    io.teardown()
    assert not a.exists()
    assert not any(n.startswith("step_") for n in os.listdir(tmp_path / ROOT_NAME))


class FailStep(OsOps):
    """Fails every file creation inside one step's directory (EIO), as a dying disk would."""

    def __init__(self, step: int) -> None:
        self.marker = f"step_{step:08d}"

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self.marker in path and flags & os.O_CREAT:
            raise OSError(errno.EIO, "injected", path)
        return super().open(path, flags, mode)


def test_failed_save_never_lets_a_removal_take_the_good_checkpoint(tmp_path: Path) -> None:
    io = AsyncckptCheckpointIO(os_ops=FailStep(1))
    old, new = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt"
    io.save_checkpoint(big_state(10), old)
    io.save_checkpoint(big_state(10), new)  # step 1: fails in the background
    io.remove_checkpoint(old)  # what ModelCheckpoint does after saving a better one
    with pytest.raises(SaveError):
        io.teardown()
    assert not new.exists()
    assert load_checkpoint(old)["global_step"] == 1


def test_attribute_dicts_come_back_and_unsupported_hparams_are_refused(tmp_path: Path) -> None:
    import argparse

    io = AsyncckptCheckpointIO()
    hp = AttributeDict(lr=0.1, sub=AttributeDict(depth=3), names=["a"])
    io.save_checkpoint({"hyper_parameters": hp, "epoch": 0}, tmp_path / "x.ckpt")
    with pytest.raises(TypeError, match=r"vars\(x\)"):
        io.save_checkpoint({"hyper_parameters": {"args": argparse.Namespace(a=1)}}, tmp_path / "y.ckpt")
    io.teardown()
    got = load_checkpoint(tmp_path / "x.ckpt")
    same(got, {"hyper_parameters": hp, "epoch": 0})
    assert not (tmp_path / "y.ckpt").exists()


def test_load_checkpoint_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.ckpt")
    (tmp_path / "torch.ckpt").write_bytes(b"PK\x03\x04 not a pointer")
    with pytest.raises(CheckpointError, match="not an asyncckpt"):
        AsyncckptCheckpointIO().load_checkpoint(tmp_path / "torch.ckpt")
    with pytest.raises(TypeError, match="storage_options"):
        AsyncckptCheckpointIO().save_checkpoint({}, tmp_path / "z.ckpt", storage_options={"x": 1})


def test_the_old_import_path_is_the_same_plugin() -> None:
    import asyncckpt.integrations.lightning as new
    import asyncckpt.lightning as old

    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name), name
    assert set(old.__all__) == set(new.__all__)


def test_a_pointer_into_another_directory_never_removes_anything_there(tmp_path: Path) -> None:
    io = AsyncckptCheckpointIO()
    io.save_checkpoint(big_state(10), tmp_path / "victim" / "x.ckpt")
    io.teardown()
    (tmp_path / "run").mkdir()
    copied = tmp_path / "run" / "copied.ckpt"  # e.g. copied over from another run's directory
    root, step = read_pointer(str(tmp_path / "victim" / "x.ckpt"))
    copied.write_text(json.dumps({"format": "asyncckpt-lightning/1", "root": os.path.relpath(root, copied.parent),
                                  "step": step}))  # fmt: skip
    io.remove_checkpoint(copied)
    io.teardown()
    assert not copied.exists()
    assert load_checkpoint(tmp_path / "victim" / "x.ckpt")["global_step"] == 1
