"""The Hugging Face Trainer integration with a real ``transformers.Trainer`` on the CPU (a tiny
GPT-2 built from a config, nothing downloaded): a SIGKILL mid-training and a resume that ends
bit-identical to an uninterrupted run, side by side with the Trainer's own save and resume,
``save_total_limit`` and the best checkpoint, a resume from an older checkpoint, a failed save,
a corrupt newest step."""

from __future__ import annotations

import errno
import json
import logging
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
    import accelerate  # noqa: F401 - the Trainer needs it
    import transformers
except ImportError as e:  # CI refuses this skip ("needs transformers/")
    pytest.skip(f"needs transformers/: pip install 'asyncckpt[transformers]' ({e})", allow_module_level=True)

import _hf_worker as w

from asyncckpt import CheckpointCorruptError, CheckpointError, SaveError
from asyncckpt.integrations import _hf_folders as folders
from asyncckpt.integrations.transformers import AsyncckptTrainer
from asyncckpt.roots.posix._osops import OsOps

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(120),
]

WORKER = str(Path(__file__).parent / "support" / "_hf_worker.py")
STEPS = 40


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One intra-op thread: bit-identical results across processes, and no OpenMP spinning
    against other jobs on a small machine (2 threads made these runs 10x slower there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """The uninterrupted run: its final weights and every step's loss."""
    t, rec = w.run(str(tmp_path_factory.mktemp("ref")), "trainer", STEPS, save_steps=1000)
    assert len(rec.losses) == STEPS
    return w.weights(t), rec.losses


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir() if p.name.startswith("checkpoint-")}


def root_steps(d: Path) -> set[int]:
    return {int(p.name.removeprefix("step_")) for p in (d / folders.ROOT_NAME).iterdir() if p.name.startswith("step_")}


def pointed(d: Path) -> set[int]:
    out = set()
    for n in names(d):
        p = folders.read_pointer(str(d / n))
        assert p is not None, n
        out.add(p.step)
    return out


def test_sigkill_mid_training_then_resume_is_bit_identical(tmp_path: Path, reference: Any) -> None:
    ref_weights, ref_losses = reference
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(tmp_path / "worker.log", "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, WORKER, str(out), "async", str(STEPS), "--pace", "0.1"], env=env, stdout=logf, stderr=logf
        )
        try:
            deadline = time.monotonic() + 90
            while not (out / "checkpoint-10").exists():  # kill once step 10 is published, training going on
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint-10 in time"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "done").exists(), "the run finished before the kill"
    before = [line.split() for line in (out / "losses.txt").read_text().splitlines()]
    assert all(ref_losses[int(s)] == float(v) for s, v in before)
    # every folder the Trainer can see after the kill is complete and loads
    for n in names(out):
        assert folders.read_pointer(str(out / n)) is not None
    (out / "losses.txt").unlink()

    t, rec = w.run(str(out), "async", STEPS, resume=True)
    start = min(rec.losses)
    assert start in (11, 16), start  # from checkpoint-10, or -15 if it was published before the kill landed
    assert rec.losses == {s: v for s, v in ref_losses.items() if s >= start}
    same_weights(w.weights(t), ref_weights)
    assert names(out) == {"checkpoint-35", "checkpoint-40"} and root_steps(out) == pointed(out) == {35, 40}


def test_resume_matches_the_trainers_own_save_and_resume(tmp_path: Path, reference: Any) -> None:
    ref_weights, ref_losses = reference
    runs = {}
    for mode in ("trainer", "async"):
        out = tmp_path / mode
        w.run(str(out), mode, STEPS, stop_at=12, limit=None, record=False)
        state_json = (out / "checkpoint-10" / "trainer_state.json").read_text()
        t, rec = w.run(str(out), mode, STEPS, resume=str(out / "checkpoint-10"), limit=None, record=False)
        runs[mode] = (state_json, w.weights(t), rec.losses, names(out))
    (hf_state, hf_weights, hf_losses, hf_names), (state, weights, losses, got_names) = runs["trainer"], runs["async"]
    assert state == hf_state  # the TrainerState is saved exactly as the Trainer saves it
    same_weights(weights, ref_weights)
    same_weights(hf_weights, ref_weights)
    assert losses == hf_losses == {s: v for s, v in ref_losses.items() if s > 10}
    assert got_names == hf_names == {f"checkpoint-{n}" for n in range(5, STEPS + 1, 5)}


def test_switching_from_the_trainers_own_checkpoints(tmp_path: Path, reference: Any) -> None:
    w.run(str(tmp_path), "trainer", STEPS, stop_at=12, record=False)
    t, _ = w.run(str(tmp_path), "async", STEPS, resume=True, record=False)  # newest: the Trainer's checkpoint-10
    same_weights(w.weights(t), reference[0])
    assert names(tmp_path) == {"checkpoint-35", "checkpoint-40"} and pointed(tmp_path) == {35, 40}


def test_save_total_limit_and_best_checkpoint_as_the_trainer_keeps_them(tmp_path: Path) -> None:
    extra = dict(eval_strategy="steps", eval_steps=5, load_best_model_at_end=True,
                 metric_for_best_model="loss", greater_is_better=True)  # fmt: skip
    got = {}
    for mode in ("trainer", "async"):
        out = tmp_path / mode
        t, _ = w.trainer(str(out), mode, 20, limit=2, record=False, evaluate=True, **extra)
        t.train()
        got[mode] = (names(out), t.state.best_model_checkpoint, w.weights(t))
    assert got["async"][0] == got["trainer"][0] == {"checkpoint-5", "checkpoint-20"}  # best (highest loss) kept
    assert got["async"][1] == str(tmp_path / "async" / "checkpoint-5")
    same_weights(got["async"][2], got["trainer"][2])  # load_best_model_at_end loaded step 5's weights in both
    assert root_steps(tmp_path / "async") == pointed(tmp_path / "async") == {5, 20}


def test_resume_from_an_older_checkpoint_replaces_the_newer_folders(tmp_path: Path, reference: Any) -> None:
    w.run(str(tmp_path), "async", STEPS, limit=None, record=False)
    before = {n: folders.read_pointer(str(tmp_path / n)) for n in names(tmp_path)}
    t, _ = w.run(str(tmp_path), "async", STEPS, limit=None, resume=str(tmp_path / "checkpoint-10"), record=False)
    same_weights(w.weights(t), reference[0])
    after = {n: folders.read_pointer(str(tmp_path / n)) for n in names(tmp_path)}
    assert set(after) == set(before)
    for n in after:  # folders 15..40 point at the new run's steps; the old steps are gone
        old, new = before[n], after[n]
        assert old is not None and new is not None
        assert (new.step == old.step) == (new.global_step <= 10), n
    assert root_steps(tmp_path) == pointed(tmp_path)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".checkpoint-")]


class FailStep(OsOps):
    """Fails every file creation inside one step's directory (EIO), as a dying disk would."""

    def __init__(self, step: int) -> None:
        self.marker = f"step_{step:08d}"

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if self.marker in path and flags & os.O_CREAT:
            raise OSError(errno.EIO, "injected", path)
        return super().open(path, flags, mode)


def test_a_failed_save_stops_training_and_keeps_the_older_checkpoints(tmp_path: Path) -> None:
    t, _ = w.trainer(str(tmp_path), "async", STEPS, limit=1, record=False, save_steps=5)
    t._asyncckpt_options["os_ops"] = FailStep(15)
    with pytest.raises(SaveError) as e:
        t.train()
    assert e.value.__cause__ is None or isinstance(e.value.__cause__, OSError)
    # raised at the next save (step 20), or, when step 15 was still being written then, at the one
    # after (max_pending=1: save 20 waited for 15's outcome); no checkpoint was removed for a
    # save that did not commit
    assert t.state.global_step in (20, 25)
    kept = 10 if t.state.global_step == 20 else 20
    assert names(tmp_path) == {f"checkpoint-{kept}"} and root_steps(tmp_path) == {kept}
    t2, _ = w.trainer(str(tmp_path), "async", STEPS, limit=1, record=False)
    t2.train(resume_from_checkpoint=True)
    assert names(tmp_path) == {"checkpoint-40"}


def flip_a_byte(step_dir: Path) -> None:
    shard = next(step_dir.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_resume_true_skips_a_corrupt_newest_checkpoint(
    tmp_path: Path, reference: Any, caplog: pytest.LogCaptureFixture
) -> None:
    w.run(str(tmp_path), "async", STEPS, stop_at=30, record=False)  # keeps checkpoint-25 and -30
    flip_a_byte(tmp_path / folders.ROOT_NAME / "step_00000030")
    with pytest.raises(CheckpointCorruptError):
        w.run(str(tmp_path), "async", STEPS, resume=str(tmp_path / "checkpoint-30"), record=False)
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        t, rec = w.run(str(tmp_path), "async", STEPS, resume=True)
    assert "not resuming from" in caplog.text and "checkpoint-30" in caplog.text
    assert min(rec.losses) == 26
    same_weights(w.weights(t), reference[0])


def test_bad_options_are_refused_at_construction(tmp_path: Path) -> None:
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match="save_total_limit"):
        AsyncckptTrainer(model=w.model(), args=args, asyncckpt_options={"keep_last": 2})
    with pytest.raises(ValueError, match="local directory"):
        AsyncckptTrainer(model=w.model(), args=args, asyncckpt_root="s3://bucket/run")
    hub = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], push_to_hub=True)
    with pytest.raises(ValueError, match="push_to_hub"):
        AsyncckptTrainer(model=w.model(), args=hub)


def test_leftovers_of_a_crash_are_cleaned_and_hostile_pointers_refused(tmp_path: Path) -> None:
    w.run(str(tmp_path), "async", 10, record=False)
    (tmp_path / ".checkpoint-15.tmp-0123456789abcdef").mkdir()  # killed while publishing
    os.rename(tmp_path / "checkpoint-5", tmp_path / ".checkpoint-5.removing-0123456789abcdef")  # ... while removing
    done = folders.remove_leftovers(str(tmp_path), str(tmp_path / folders.ROOT_NAME))
    assert sorted(os.path.basename(p) for p in done) == [
        ".checkpoint-15.tmp-0123456789abcdef", ".checkpoint-5.removing-0123456789abcdef"
    ]
    assert root_steps(tmp_path) == {10}
    (tmp_path / "checkpoint-10" / folders.POINTER_NAME).write_text(json.dumps({"format": folders.FORMAT, "step": -1}))
    with pytest.raises(CheckpointError, match="not an asyncckpt pointer"):
        folders.read_pointer(str(tmp_path / "checkpoint-10"))


def test_a_pointer_into_another_directory_never_removes_anything_there(tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere"
    w.run(str(victim), "async", 5, record=False)  # another run's root with its step 5
    out = tmp_path / "run"
    out.mkdir()
    hostile = out / "checkpoint-1"
    hostile.mkdir()
    rel = os.path.relpath(victim / folders.ROOT_NAME, hostile)
    doc = {"format": folders.FORMAT, "root": rel, "step": 5, "global_step": 1}
    (hostile / folders.POINTER_NAME).write_text(json.dumps(doc))
    w.run(str(out), "async", 15, limit=1, record=False)  # rotation removes checkpoint-1 first
    assert names(out) == {"checkpoint-15"}
    assert root_steps(victim) == {5}
