"""The Lightning plugin under ``strategy="ddp"`` with 2 gloo ranks on the CPU (real processes,
launched by Lightning itself): rank 0 saves, both ranks resume from the same checkpoint, and a
SIGKILL of the whole job mid-training followed by ``ckpt_path="last"`` reaches exactly the
weights and losses of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

try:
    import lightning  # noqa: F401
except ImportError as e:  # CI refuses this skip ("needs lightning/")
    pytest.skip(f"needs lightning/: pip install 'asyncckpt[lightning]' ({e})", allow_module_level=True)

from asyncckpt.integrations.lightning import ROOT_NAME, load_checkpoint, read_pointer

pytestmark = [pytest.mark.timeout(240)]

WORKER = str(Path(__file__).parent / "support" / "_lightning_worker.py")
EPOCHS = 5  # 2 steps per epoch and rank (each rank gets half of the 4 batches)


def launch(d: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONWARNINGS="ignore")
    args = [sys.executable, WORKER, str(d / "ck"), str(d / "losses.txt"), str(EPOCHS), "2", str(d / "final.pt")]
    with open(log, "ab") as f:
        # its own session: Lightning starts rank 1 as a child, and a kill of the group takes both
        return subprocess.Popen(args, env=env, stdout=f, stderr=f, start_new_session=True)


def finish(p: subprocess.Popen[bytes], log: Path, timeout: float = 150) -> None:
    try:
        assert p.wait(timeout) == 0, log.read_text()[-4000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def losses(d: Path) -> dict[int, float]:
    return {int(s): float(v) for s, v in (line.split() for line in (d / "losses.txt").read_text().splitlines())}


@pytest.mark.slow  # 3 Lightning DDP runs; test_lightning.py kills and resumes in one process
def test_ddp_two_ranks_killed_then_resumed_reach_the_uninterrupted_run(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir(), run.mkdir()
    ref_proc = launch(ref, tmp_path / "ref.log")  # the uninterrupted run, alongside
    proc = launch(run, tmp_path / "run.log")
    try:
        deadline = time.monotonic() + 150
        while not (run / "ck" / "epoch=1-step=4.ckpt").exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no epoch-1 checkpoint in time"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)  # both ranks, mid-training
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (run / "losses.txt.done").exists(), "the run finished before the kill"
    # only rank 0 wrote: one root, and every pointer Lightning can see loads
    assert sorted(p.name for p in (run / "ck").iterdir() if p.is_dir()) == [ROOT_NAME]
    for p in (run / "ck").glob("*.ckpt"):
        assert read_pointer(str(p))[0] == str(run / "ck" / ROOT_NAME)
        load_checkpoint(p)
    before = losses(run)
    (run / "losses.txt").unlink()

    finish(launch(run, tmp_path / "run.log"), tmp_path / "run.log")  # ckpt_path="last" on both ranks
    finish(ref_proc, tmp_path / "ref.log")
    reference, after = losses(ref), losses(run)
    assert len(reference) == 2 * EPOCHS
    assert all(reference[s] == v for s, v in before.items())
    start = min(after)
    assert start in (2, 4, 6), start  # last.ckpt of epoch 1 may still have been in flight at the kill
    assert after == {s: v for s, v in reference.items() if s >= start}
    got, want = torch.load(run / "final.pt"), torch.load(ref / "final.pt")
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
