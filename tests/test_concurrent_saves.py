"""Concurrent saves and what a commit checks (issue 9 A): real threads, real files.

* Two threads race to save every step on one Checkpointer (``max_pending=2``): exactly one
  wins each step, the other gets ``ValueError`` at the call, and every committed step holds
  exactly the manifest's files with the recorded sizes and the winner's data.
* The commit checks what it committed: a shard deleted or truncated between the manifest and
  the rename into place fails the save (``SaveError``), takes the commit back and leaves
  ``latest()`` where it was; a stray file joining it changes nothing (every read goes by the
  manifest: it is ignored, issue 26 attack C).
* Clean-up never ignores a vanished entry silently, and removes only provably dead attempts.

``-s`` shows the measured figures.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckcheck import dir_problem

import asyncckpt
from asyncckpt import CheckpointCorruptError, Checkpointer, SaveError, SaveHandle, find_latest
from asyncckpt.format._layout import step_dir_name
from asyncckpt.roots.posix._osops import OsOps
from asyncckpt.roots.posix._remove_tree import remove_tree

STEPS = 200
WAIT_S = 30.0


def _state(step: int, who: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(10 * step + who)
    return {"w": torch.randn(2048, generator=g), "b": torch.randn(64, generator=g), "who": who, "step": step}


# ---------------------------------------------------------------- two threads, one step
@pytest.mark.timeout(120)
def test_two_threads_racing_for_each_step_exactly_one_wins(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    rng = random.Random(9)
    # who waits how long (µs of spinning) after both reached the barrier: a thread blocked in
    # a Barrier wakes later than the last one to arrive, so without this one thread always wins
    delays: list[float] = [0.0, 0.0]

    def draw() -> None:
        delays[:] = [rng.random() * 2e-4, rng.random() * 2e-4]

    barrier = threading.Barrier(2, action=draw, timeout=WAIT_S)
    wins: dict[int, list[int]] = {s: [] for s in range(1, STEPS + 1)}
    refusals: dict[int, list[tuple[int, str]]] = {s: [] for s in range(1, STEPS + 1)}
    problems: list[str] = []
    errors: list[BaseException] = []
    checked = [0]
    lock = threading.Lock()

    def settle(ck: Checkpointer, pending: list[tuple[int, SaveHandle]], who: int, before: int) -> None:
        # the results of this thread's saves of earlier steps: up to two saves are in flight
        while pending and pending[0][0] < before:
            step, h = pending.pop(0)
            info = h.result(timeout=WAIT_S)
            problem = dir_problem(root, step)
            if problem is None:
                loaded = asyncckpt.load(root, step)
                expected = _state(step, who)
                if loaded["who"] != who or not torch.equal(loaded["w"], expected["w"]):
                    problem = f"holds the data of thread {loaded['who']}, thread {who} won"
            with lock:
                checked[0] += 1
                if info.step != step:
                    problems.append(f"step {step}: result() names step {info.step}")
                if problem is not None:
                    problems.append(f"step {step}: {problem}")

    def racer(ck: Checkpointer, who: int) -> None:
        pending: list[tuple[int, SaveHandle]] = []
        try:
            for step in range(1, STEPS + 1):
                state = _state(step, who)
                barrier.wait()  # both call save() at the same moment, give or take a few µs
                go = time.perf_counter() + delays[who]
                while time.perf_counter() < go:
                    pass
                try:
                    h = ck.save(step, state)
                except ValueError as e:
                    refusals[step].append((who, str(e)))
                else:
                    wins[step].append(who)
                    pending.append((step, h))
                settle(ck, pending, who, step)
            settle(ck, pending, who, STEPS + 1)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
            barrier.abort()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # let the GIL change hands inside save(), not only between calls
    t0 = time.monotonic()
    try:
        with Checkpointer(root, max_pending=2, timeout=WAIT_S) as ck:
            threads = [threading.Thread(target=racer, args=(ck, who), name=f"racer{who}") for who in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=100)
            assert not any(t.is_alive() for t in threads), "a racing thread hung"
            assert not errors, errors
            steps = ck.steps()
    finally:
        sys.setswitchinterval(switch)
    elapsed = time.monotonic() - t0

    both = [s for s, w in wins.items() if len(w) != 1]
    assert not both, f"steps not won by exactly one thread: {[(s, wins[s]) for s in both[:5]]}"
    for step, refused in refusals.items():
        assert len(refused) == 1 and refused[0][0] != wins[step][0], (step, wins[step], refused)
        msg = refused[0][1]
        assert f"step {step} is already being saved" in msg or f"step {step} is already committed" in msg, msg
    assert checked[0] == STEPS
    assert not problems, f"{len(problems)} false commits: {problems[:5]}"
    assert steps == list(range(1, STEPS + 1))
    split = sum(1 for w in wins.values() if w == [0])
    print(
        f"\n{STEPS} steps raced by 2 threads: 0 false commits ({checked[0]} committed directories checked); "
        f"thread 0 won {split}, thread 1 won {STEPS - split}; {elapsed:.1f}s"
    )


# ---------------------------------------------------------------- the commit checks what it committed
class MisbehavingRename(OsOps):
    """Stands in for another writer (or a file system) changing the attempt directory just
    before it is renamed into place as ``step_N``: once, for one step."""

    def __init__(self, step: int, how: str) -> None:
        self.step, self.how, self.fired = step, how, False

    def rename(self, src: str, dst: str) -> None:
        if not self.fired and os.path.basename(dst) == step_dir_name(self.step) and ".tmp-" in src:
            self.fired = True
            shard = os.path.join(src, "rank00000.safetensors")
            if self.how == "delete":
                os.unlink(shard)
            elif self.how == "truncate":
                os.truncate(shard, os.path.getsize(shard) // 2)
            else:
                with open(os.path.join(src, "intruder.bin"), "wb") as f:
                    f.write(b"not ours")
        super().rename(src, dst)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["delete", "truncate"])
def test_commit_of_a_directory_that_is_not_what_was_written_fails_and_is_taken_back(tmp_path: Path, how: str) -> None:
    ops = MisbehavingRename(2, how)
    with Checkpointer(tmp_path, timeout=WAIT_S, os_ops=ops) as ck:
        ck.save(1, _state(1, 0)).result(timeout=WAIT_S)
        h = ck.save(2, _state(2, 0))
        with pytest.raises(SaveError) as ei:
            h.result(timeout=WAIT_S)
        assert ops.fired
        assert ei.value.step == 2
        (failure,) = ei.value.failures.values()
        assert failure.exc_type == "CheckpointCorruptError", failure
        assert isinstance(ei.value.__cause__, CheckpointCorruptError)
        # taken back: nothing of step 2 on disk, the previous checkpoint is still the latest
        assert not (tmp_path / step_dir_name(2)).exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [step_dir_name(1)]
        assert ck.steps() == [1]
        latest = ck.latest()
        assert latest is not None and latest.step == 1
        found = find_latest(tmp_path)
        assert found is not None and found.step == 1
        with pytest.raises(SaveError):
            ck.flush()
        # the step is free again: a retry commits what it wrote
        ck.save(2, _state(2, 1)).result(timeout=WAIT_S)
        assert ck.steps() == [1, 2] and dir_problem(tmp_path, 2) is None
        assert asyncckpt.load(tmp_path, 2)["who"] == 1


@pytest.mark.timeout(60)
def test_a_stray_file_joining_the_commit_is_ignored(tmp_path: Path) -> None:
    """A file the manifest does not list proves nothing wrong with the files it does list: the
    commit stands, the step loads, the file stays where it was put (issue 26 attack C)."""
    ops = MisbehavingRename(2, "extra")
    with Checkpointer(tmp_path, timeout=WAIT_S, os_ops=ops) as ck:
        ck.save(1, _state(1, 0)).result(timeout=WAIT_S)
        ck.save(2, _state(2, 0)).result(timeout=WAIT_S)
        assert ops.fired and ck.steps() == [1, 2]
    assert (tmp_path / step_dir_name(2) / "intruder.bin").exists()
    assert asyncckpt.load(tmp_path)["who"] == 0 and find_latest(tmp_path).step == 2  # type: ignore[union-attr]


# ---------------------------------------------------------------- clean-up
class OtherRemover(OsOps):
    """Stands in for another process removing the same tree: right after a directory is
    listed, the first plain file in it is really deleted, before remove_tree gets to it."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def _race(self, names: list[str], unlink: Any) -> list[str]:
        for name in sorted(names):
            if name.endswith(".bin"):
                unlink(name)
                self.removed.append(name)
                break
        return names

    def listdir_fd(self, fd: int) -> list[str]:
        return self._race(os.listdir(fd), lambda n: os.unlink(n, dir_fd=fd))

    def listdir(self, path: str) -> list[str]:  # the path-based walk of earlier versions
        return self._race(os.listdir(path), lambda n: os.unlink(os.path.join(path, n)))


@pytest.mark.timeout(30)
def test_remove_tree_warns_naming_an_entry_that_vanished(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tree = tmp_path / "step_00000003.tmp-00ff"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.bin").write_bytes(b"a")
    (tree / "sub" / "b.bin").write_bytes(b"b")
    (tree / "sub" / "keep.txt").write_bytes(b"k")
    ops = OtherRemover()
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    assert remove_tree(str(tree), ops) is True
    assert not tree.exists()
    assert ops.removed == ["a.bin", "b.bin"]
    warned = [r.getMessage() for r in caplog.records if r.name == "asyncckpt" and r.levelno == logging.WARNING]
    for vanished in (tree / "a.bin", tree / "sub" / "b.bin"):
        assert any(str(vanished) in m and "vanished" in m for m in warned), (vanished, warned)
    assert len(warned) == 2, warned
    caplog.clear()
    assert remove_tree(str(tree)) is False  # the whole tree absent: nothing vanished under us
    assert not caplog.records


@pytest.mark.timeout(60)
def test_cleanup_removes_only_provably_dead_attempts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    dead = root / f"step_00000002.tmp-{uuid.uuid4().hex[:16]}"
    dead.mkdir()
    (dead / "rank00000.safetensors").write_bytes(b"crashed")
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with Checkpointer(root, timeout=WAIT_S) as ck:
        assert not dead.exists()  # there before the root was ours: a crashed attempt, removed
        ck.save(1, _state(1, 0)).result(timeout=WAIT_S)
        # created after this Checkpointer took the root: not provably dead (another writer's
        # live attempt, say), so the save of its step must leave it alone
        foreign = root / f"step_00000002.tmp-{uuid.uuid4().hex[:16]}"
        (foreign / "sub").mkdir(parents=True)
        (foreign / "rank00000.safetensors").write_bytes(b"live")
        (foreign / "sub" / "x").write_bytes(b"also live")
        ck.save(2, _state(2, 0)).result(timeout=WAIT_S)
        assert ck.steps() == [1, 2] and dir_problem(root, 2) is None
        assert (foreign / "rank00000.safetensors").read_bytes() == b"live"
        assert (foreign / "sub" / "x").read_bytes() == b"also live"
        warned = [r.getMessage() for r in caplog.records if r.name == "asyncckpt" and r.levelno == logging.WARNING]
        assert any(str(foreign) in m and "alone" in m for m in warned), warned
        # and a save of another step does not touch it either
        ck.save(3, _state(3, 0)).result(timeout=WAIT_S)
        assert (foreign / "rank00000.safetensors").read_bytes() == b"live"
    # the next owner finds it present when it takes the root: dead now, removed
    with Checkpointer(root, timeout=WAIT_S) as ck:
        assert not foreign.exists()
        assert ck.steps() == [1, 2, 3]
