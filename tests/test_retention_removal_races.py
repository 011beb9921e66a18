"""Review of retention's background removal: what flush() waits for. Deletions are held
through the OsOps seam (a slow unlink on demand is not something a real file system here
produces)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from asyncckpt import Checkpointer
from asyncckpt.testing import OsOps

WAIT_S = 30
SETTLE_S = 1.0  # the time a thread is given to reach a wait it needs no I/O to reach


class HeldPerStep(OsOps):
    """unlinkat inside a retired ``step_N.deleting-`` directory blocks until ``release[N]``."""

    def __init__(self, steps: list[int]) -> None:
        self.release = {s: threading.Event() for s in steps}
        self.entered = {s: threading.Event() for s in steps}

    def unlink_at(self, dir_fd: int, name: str) -> None:
        where = os.path.basename(os.readlink(f"/proc/self/fd/{dir_fd}"))
        for s, ev in self.release.items():
            if where.startswith(f"step_{s:08d}.deleting-"):
                self.entered[s].set()
                if not ev.wait(WAIT_S):
                    raise TimeoutError("test never released the unlink")
        super().unlink_at(dir_fd, name)

    def release_all(self) -> None:
        for ev in self.release.values():
            ev.set()


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(step))}


def test_flush_does_not_wait_for_removals_of_saves_started_after_it(tmp_path: Path) -> None:
    """flush() waits for the saves pending when it is called (and their removals), not for
    the removal of a save another thread started meanwhile: with a thread saving on, the
    removals never all end at once, and flush() would never return."""
    ops = HeldPerStep([1, 2])
    ck = Checkpointer(tmp_path, keep_last=1, timeout=WAIT_S, os_ops=ops)
    try:
        ck.save(1, _state(1)).result(WAIT_S)
        ck.save(2, _state(2)).result(WAIT_S)  # step 1's removal runs on, held
        assert ops.entered[1].wait(WAIT_S)
        outcome: list[BaseException | None] = []

        def flusher() -> None:
            try:
                ck.flush(WAIT_S)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - reported by the assert below
                outcome.append(e)

        t = threading.Thread(target=flusher)
        t.start()
        # flush() has nothing to wait for among the saves: it takes the removals running now
        # (step 1's) at once. Nothing public says when it did; a thread that needs microseconds
        # of CPU gets them in this second, and step 2's removal starts only after save 3 commits
        t.join(SETTLE_S)
        assert t.is_alive() and not outcome, outcome  # step 1's removal is held: flush() waits
        ck.save(3, _state(3)).result(WAIT_S)  # another save: step 2's removal starts, held
        assert ops.entered[2].wait(WAIT_S)
        ops.release[1].set()  # what flush() waits for is done
        t.join(10.0)
        assert not t.is_alive(), "flush() waited for a removal that started after it was called"
        assert outcome == [None]
    finally:
        ops.release_all()
        ck.close()
    assert sorted(os.listdir(tmp_path)) == [".asyncckpt", "step_00000003"]


def _run_job(tmp_path: Path, body: str, limit: float, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), *sys.path]))
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=limit, env=env)


_SLOW_OPS = """
    import os, sys, time, signal, torch
    from asyncckpt import Checkpointer
    from asyncckpt.testing import OsOps

    class SlowUnlink(OsOps):  # a deletion that takes a while (a large shard, a slow file system)
        def __init__(self, seconds):
            self.seconds = seconds
        def unlink_at(self, dir_fd, name):
            time.sleep(self.seconds)
            super().unlink_at(dir_fd, name)
"""


def _old_steps(root: Path, n: int) -> None:
    with Checkpointer(root) as ck:
        for s in range(1, n + 1):
            ck.save(s, _state(s))


def test_the_exit_hook_finishes_the_removal_of_retired_steps(tmp_path: Path) -> None:
    """A job that saves and exits without close(): the exit hook finishes pending saves, and
    the retired steps' files are part of what a save leaves to do (before the background
    removal, the save itself deleted them)."""
    root = tmp_path / "ck"
    _old_steps(root, 4)
    r = _run_job(tmp_path, _SLOW_OPS + """
    ck = Checkpointer(sys.argv[1], keep_last=1, os_ops=SlowUnlink(0.05))
    ck.save(5, {"w": torch.full((1000,), 5.0)}).result(30)  # retires steps 1-4
    """, 120, str(root))
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(root)) == [".asyncckpt", "step_00000005"]


def test_a_garbage_collected_checkpointer_finishes_the_removal_first(tmp_path: Path) -> None:
    import gc
    import time

    root = tmp_path / "ck"
    _old_steps(root, 4)

    class SlowUnlink(OsOps):
        def unlink_at(self, dir_fd: int, name: str) -> None:
            time.sleep(0.05)
            super().unlink_at(dir_fd, name)

    ck = Checkpointer(root, keep_last=1, timeout=WAIT_S, os_ops=SlowUnlink())
    ck.save(5, _state(5)).result(WAIT_S)
    del ck
    gc.collect()
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end and sorted(os.listdir(root)) != [".asyncckpt", "step_00000005"]:
        time.sleep(0.05)
    assert sorted(os.listdir(root)) == [".asyncckpt", "step_00000005"]


@pytest.mark.parametrize("previous", ["default", "sys.exit"])
def test_sigterm_does_not_wait_for_the_removal(tmp_path: Path, previous: str) -> None:
    """The SIGTERM path leaves a slow removal to the next start, whether the signal's default
    action ends the process or a previous handler exits through the exit hook."""
    import time

    root = tmp_path / "ck"
    _old_steps(root, 2)
    t0 = time.monotonic()
    r = _run_job(tmp_path, _SLOW_OPS + """
    if sys.argv[2] == "sys.exit":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    ck = Checkpointer(sys.argv[1], keep_last=1, os_ops=SlowUnlink(60))
    ck.install_sigterm_handler(grace_s=20)
    ck.save(3, {"w": torch.full((1000,), 3.0)}).result(30)  # retires steps 1 and 2: held
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)
    """, 120, str(root), previous)
    assert time.monotonic() - t0 < 40, "the SIGTERM exit waited for the deletion"
    assert r.returncode == (-signal.SIGTERM if previous == "default" else 0), r.stderr[-2000:]
    assert "step_00000003" in os.listdir(root)
