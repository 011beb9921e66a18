"""Step rules (issue 9 E): steps increase unless allowed otherwise, and go up to 2**63 - 1.

* A step lower than the newest committed one, or than one being saved, raises ``ValueError``
  at the call naming that step; nothing of it reaches the disk.
* ``allow_earlier_steps=True`` allows it; ``keep_last`` then keeps the most recently
  *committed* checkpoints, while ``latest()`` (documented: "the newest complete checkpoint")
  still goes by step.
* ``0 <= step <= 2**63 - 1``: the largest step saves, lists, loads and is retained like any
  other; ``2**63`` and ``-1`` raise ``ValueError``, a bool / float / str ``TypeError``.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli_util import run_cli

import asyncckpt
from asyncckpt import Checkpointer
from asyncckpt.format._layout import step_dir_name
from asyncckpt.roots.posix._osops import OsOps

WAIT_S = 30.0


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step % 2**32)
    return {"w": torch.randn(512, generator=g), "step": step}


def _on_disk(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step_"))


class SlowShardFsync(OsOps):
    """Stands in for a slow disk: fsync of a shard of ``step`` blocks until released."""

    def __init__(self, step: int) -> None:
        self.marker = step_dir_name(step) + ".tmp-"
        self.reached = threading.Event()
        self.release = threading.Event()
        self._paths: dict[int, str] = {}

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        fd = super().open(path, flags, mode)
        self._paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        self._paths.pop(fd, None)
        super().close(fd)

    def fsync(self, fd: int) -> None:
        if self.marker in self._paths.get(fd, ""):
            self.reached.set()
            if not self.release.wait(WAIT_S):
                raise OSError(5, "test gate was never released")
        super().fsync(fd)


@pytest.mark.timeout(60)
def test_step_lower_than_the_newest_committed_is_refused_naming_it(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, timeout=WAIT_S) as ck:
        ck.save(10, _state(10)).result(timeout=WAIT_S)
        for lower in (0, 5, 9):
            with pytest.raises(ValueError, match=rf"step {lower} is lower than step 10, the newest committed") as ei:
                ck.save(lower, _state(lower))
            assert "allow_earlier_steps=True" in str(ei.value)
        with pytest.raises(ValueError, match="step 10 is already committed"):
            ck.save(10, _state(10))
        assert _on_disk(tmp_path) == [step_dir_name(10)]  # nothing of the refused saves was written
        ck.save(11, _state(11)).result(timeout=WAIT_S)
    # a new Checkpointer knows the newest committed step from the disk
    with Checkpointer(tmp_path, timeout=WAIT_S) as ck:
        with pytest.raises(ValueError, match=r"step 7 is lower than step 11, the newest committed"):
            ck.save(7, _state(7))
        assert ck.steps() == [10, 11]


@pytest.mark.timeout(60)
def test_step_lower_than_one_in_flight_is_refused(tmp_path: Path) -> None:
    ops = SlowShardFsync(10)
    with Checkpointer(tmp_path, timeout=WAIT_S, max_pending=2, os_ops=ops) as ck:
        ck.save(3, _state(3)).result(timeout=WAIT_S)
        h = ck.save(10, _state(10))
        try:
            assert ops.reached.wait(WAIT_S), "the save of step 10 never reached its fsync"
            assert not h.done()
            with pytest.raises(ValueError, match=r"step 5 is lower than step 10, which is being saved"):
                ck.save(5, _state(5))
            with pytest.raises(ValueError, match=r"step 10 is already being saved"):
                ck.save(10, _state(10))
        finally:
            ops.release.set()
        assert h.result(timeout=WAIT_S).step == 10
        with pytest.raises(ValueError, match=r"step 5 is lower than step 10, the newest committed"):
            ck.save(5, _state(5))
        assert ck.steps() == [3, 10]
    assert _on_disk(tmp_path) == [step_dir_name(3), step_dir_name(10)]


@pytest.mark.timeout(60)
def test_allow_earlier_steps_keeps_the_most_recently_committed(tmp_path: Path) -> None:
    ops = SlowShardFsync(30)
    with Checkpointer(tmp_path, keep_last=2, allow_earlier_steps=True, max_pending=2, timeout=WAIT_S, os_ops=ops) as ck:
        ck.save(10, _state(10)).result(timeout=WAIT_S)
        ck.save(20, _state(20)).result(timeout=WAIT_S)
        ck.save(5, _state(5)).result(timeout=WAIT_S)  # lower than the newest: allowed
        # keep_last=2 by commit order: 20 and 5 were committed last; 10 is retired although 5 < 10
        assert ck.steps() == [5, 20]
        # latest() is "the newest complete checkpoint": by step, whatever the commit order
        latest = ck.latest()
        assert latest is not None and latest.step == 20
        assert ck.load()["step"] == 20 and asyncckpt.load(tmp_path)["step"] == 20
        ck.save(15, _state(15)).result(timeout=WAIT_S)
        assert ck.steps() == [5, 15]  # 20, the highest step, was committed before 5 and 15
        latest = ck.latest()
        assert latest is not None and latest.step == 15
        # lower than a step in flight: allowed too
        h30 = ck.save(30, _state(30))
        try:
            assert ops.reached.wait(WAIT_S)
            h1 = ck.save(1, _state(1))
            assert h1.result(timeout=WAIT_S).step == 1
            with pytest.raises(ValueError, match="step 30 is already being saved"):
                ck.save(30, _state(30))
        finally:
            ops.release.set()
        assert h30.result(timeout=WAIT_S).step == 30
        assert ck.steps() == [1, 30]  # committed last: 1, then 30
        with pytest.raises(ValueError, match="step 1 is already committed"):
            ck.save(1, _state(1))
    manifests = {n: json.loads((tmp_path / n / "manifest.json").read_bytes()) for n in _on_disk(tmp_path)}
    assert manifests[step_dir_name(1)]["created"] < manifests[step_dir_name(30)]["created"]


@pytest.mark.timeout(60)
def test_the_largest_step_saves_lists_loads_and_is_retained(tmp_path: Path) -> None:
    from asyncckpt.format._layout import MAX_STEP

    assert MAX_STEP == 2**63 - 1
    top = [2**63 - 3, 2**63 - 2, 2**63 - 1]
    with Checkpointer(tmp_path, keep_last=2, timeout=WAIT_S) as ck:
        for s in top:
            info = ck.save(s, _state(s)).result(timeout=WAIT_S)
            assert info.step == s and info.path.name == f"step_{s}"
        assert ck.steps() == top[1:]  # retention went by step at the top of the range too
        latest = ck.latest()
        assert latest is not None and latest.step == 2**63 - 1
        ck.flush()  # the retired step's files are removed in the background until then
        assert _on_disk(tmp_path) == ["step_9223372036854775806", "step_9223372036854775807"]
        with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1"):
            ck.save(2**63, _state(0))
        with pytest.raises(ValueError, match="already committed"):
            ck.save(2**63 - 1, _state(0))
    loaded = asyncckpt.load(tmp_path, 2**63 - 1)
    assert loaded["step"] == 2**63 - 1 and torch.equal(loaded["w"], _state(2**63 - 1)["w"])
    found = asyncckpt.find_latest(tmp_path)
    assert found is not None and found.step == 2**63 - 1
    with Checkpointer(tmp_path, timeout=WAIT_S) as ck:
        assert ck.steps() == top[1:]
        assert ck.load(2**63 - 2)["step"] == 2**63 - 2
    r = run_cli("ls", tmp_path, "--json")
    assert r.code == 0, r.err
    assert str(2**63 - 1) in r.out and str(2**63 - 2) in r.out


@pytest.mark.timeout(60)
def test_bad_steps_raise_at_the_call(tmp_path: Path) -> None:
    bad: list[tuple[Any, type[Exception]]] = [
        (2**63, ValueError),
        (2**64, ValueError),
        (10**30, ValueError),
        (-1, ValueError),
        (True, TypeError),
        (False, TypeError),
        (1.5, TypeError),
        (3.0, TypeError),
        ("3", TypeError),
        (None, TypeError),
    ]
    with Checkpointer(tmp_path, timeout=WAIT_S) as ck:
        for step, exc in bad:
            with pytest.raises(exc) as ei:
                ck.save(step, _state(1))
            assert type(ei.value) is exc, (step, ei.value)
            assert repr(step) in str(ei.value), (step, ei.value)
        assert _on_disk(tmp_path) == []  # refused at the call: nothing reached the disk
        ck.save(1, _state(1)).result(timeout=WAIT_S)  # and the Checkpointer is still usable
        for step, exc in bad:
            if step is None:
                continue  # load(step=None): the newest
            with pytest.raises(exc):
                ck.load(step)
            with pytest.raises(exc):
                asyncckpt.load(tmp_path, step)
        assert ck.steps() == [1]
