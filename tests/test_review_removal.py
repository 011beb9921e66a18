"""Review of retention's background removal: what flush() waits for. Deletions are held
through the OsOps seam (a slow unlink on demand is not something a real file system here
produces)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from asyncckpt import Checkpointer
from asyncckpt._storage import OsOps

WAIT_S = 30


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
    ck = Checkpointer(tmp_path, keep_last=1, timeout=WAIT_S, _ops=ops)
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

        waiting = threading.Event()  # flush() has waited for the saves: now on the removals
        real = ck._removals_future

        def spy() -> object:
            fut = real()
            waiting.set()
            return fut

        ck._removals_future = spy  # type: ignore[method-assign]
        t = threading.Thread(target=flusher)
        t.start()
        assert waiting.wait(WAIT_S)
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
